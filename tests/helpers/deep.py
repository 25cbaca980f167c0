"""Deep stores made quickly, and the memory a function holds: what the tests of paged walks
and checks measure, without a clock."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from spoolfs.service.spool import Spool


def file_messages(store: Path, spool: Spool, ready: int, first: int, n: int,
                  inline: bool = False, size: int = 0) -> None:
    """``n`` messages in ``ready``, each with its own content: in a blob file, or in the
    store's row when ``inline`` (``size`` bytes at least). Inserted directly: uploading each
    would take a minute; the rows are what a publish commits."""
    conn = sqlite3.connect(store / "meta.db", isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        queue = conn.execute("SELECT queue FROM entries WHERE id=?", (ready,)).fetchone()[0]
        for i in range(first, first + n):
            data = (b"message %d " % i).ljust(size, b".")
            sha = hashlib.sha256(data).digest()
            bid = conn.execute("INSERT INTO blobs (sha256, size, refcount, data) "
                               "VALUES (?, ?, 1, ?)",
                               (sha, len(data), data if inline else None)).lastrowid
            assert bid is not None
            conn.execute("INSERT INTO entries (parent, name, kind, queue, state, blob, size, "
                         "mode, mtime_ns, ctime_ns, created_ns, enqueued_ns) "
                         "VALUES (?, ?, 'message', ?, 'ready', ?, ?, 33188, 0, 0, 0, ?)",
                         (ready, b"m%d" % i, queue, bid, len(data), i))
            if not inline:
                path = spool.content.blobs.path(sha, bid)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                Path(path).write_bytes(data)
        conn.execute("COMMIT")
    finally:
        conn.close()


def peak_bytes(fn: Callable[[], object]) -> int:
    """The most memory Python held at once while ``fn`` ran, above what it held before."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
