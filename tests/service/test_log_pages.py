"""What a transition writes to the embedded store's log: the pages of what it changes, and
of nothing else. Every page is 1 KiB written and synced at each durable commit."""

from __future__ import annotations

from pathlib import Path

from helpers.spool import WHO, Q, running, upload
from helpers.sqlite_log import trees_written
from spoolfs.core.rules import State

#: b-trees a move writes two pages of: the row's (and its directories' times), and the two
#: indexes by directory, where the name leaves one place and arrives at another
MOVED = {"entries", "entries_parent", "sqlite_autoindex_entries_1"}


async def test_an_upload_and_its_publish_write_one_page_of_each_index_they_change(
        tmp_path: Path) -> None:
    """An upload is no content yet: it is in no index of contents. Its publish adds it to
    that index once (it wrote three pages of it: the upload's place, then the content's twice,
    as the content and then the time in ready/ were set) and inserts a new content with its
    reference (it was inserted unreferenced and then counted: a page of the index of
    unreferenced contents)."""
    async with running(tmp_path) as spool:
        q = Q(spool, (await spool.mkdir(1, b"q", 0o755, WHO)).id)
        for i in range(100):
            await upload(spool, q[State.PARTIAL], b"u%03d" % i, b"other %d" % i)
        with trees_written(tmp_path / "meta.db") as made:
            await upload(spool, q[State.PARTIAL], b"f", b"the content")
        with trees_written(tmp_path / "meta.db") as published:
            await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    assert not {name for name in made if "blob" in name}, made
    assert "blobs_unreferenced" not in published, published
    assert all(n == 1 for name, n in published.items() if name not in MOVED), published
