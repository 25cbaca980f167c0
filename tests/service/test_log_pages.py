"""What a transition writes to the embedded store's log: the pages of what it changes, and
of nothing else. Every page is 1 KiB written and synced at each durable commit."""

from __future__ import annotations

from pathlib import Path

from helpers.spool import WHO, Q, copies, running, upload
from helpers.sqlite_log import trees_written
from spoolfs.core.rules import State


async def test_an_upload_is_in_no_index_of_contents_and_its_publish_counts_a_new_one_at_once(
        tmp_path: Path) -> None:
    """An upload is no content yet: it is in no index of contents, so its create writes no
    page of it, and its publish none where it leaves (only where the message arrives: 2,000
    messages sharing one content spread that index over many pages, so the two places were
    two pages). A new content is inserted with its reference: it was inserted unreferenced
    and then counted, a page of the index of unreferenced contents. (How many pages a b-tree
    takes also depends on whether a page splits: only names are asserted.)"""
    async with running(tmp_path) as spool:
        q = Q(spool, (await spool.mkdir(1, b"q", 0o755, WHO)).id)
        await copies(spool, q[State.READY], 2000)
        for i in range(20):
            await upload(spool, q[State.PARTIAL], b"u%03d" % i, b"other %d" % i)
        with trees_written(tmp_path / "meta.db") as made:
            await upload(spool, q[State.PARTIAL], b"f", b"the content")
        with trees_written(tmp_path / "meta.db") as published:
            await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    assert not {name for name in made if "blob" in name or "sharing" in name}, made
    assert published["entries_sharing"] >= 1, published  # where it arrives
    assert "blobs_unreferenced" not in published, published
