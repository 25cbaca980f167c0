"""What an embedded store's commits write to its log: the b-trees (tables and indexes) whose
pages a commit puts there, read back from the write-ahead log's frame headers."""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from spoolfs.store.sqlite import PAGE_SIZE


@contextmanager
def trees_written(db: Path) -> Iterator[Counter[str]]:
    """The b-trees written to ``db``'s log by what runs inside the block: how many of each
    one's pages, in the counter given (filled when the block ends). The log is checkpointed
    and emptied first, so that it holds only the block's commits. Page 1 (the file's
    header, written whenever the file grows) is left out."""
    conn = sqlite3.connect(db)
    try:
        busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        assert busy == 0, "a reader kept the log from being emptied"
        out: Counter[str] = Counter()
        yield out
        log = Path(f"{db}-wal").read_bytes()
        frame = 24 + PAGE_SIZE
        pages = {int.from_bytes(log[at:at + 4], "big") for at in range(32, len(log), frame)}
        tree = dict(conn.execute("SELECT pageno, name FROM dbstat"))
        out.update(tree.get(p, "?") for p in pages if p != 1)
    finally:
        conn.close()
