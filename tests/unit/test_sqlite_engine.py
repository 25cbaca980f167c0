"""The embedded engine's file: small pages for new stores, older stores opened as they are."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from spoolfs.core.rules import State
from spoolfs.store.registry import open_store
from spoolfs.store.sqlite import PAGE_SIZE


def pragma(db: Path, name: str) -> object:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(f"PRAGMA {name}").fetchone()[0]
    finally:
        conn.close()


def test_a_new_store_writes_small_pages_to_its_log(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "s"))
    store.close()
    db = tmp_path / "s" / "meta.db"
    assert PAGE_SIZE == 1024
    assert pragma(db, "page_size") == PAGE_SIZE
    assert pragma(db, "journal_mode") == "wal"


def test_a_store_made_with_larger_pages_keeps_them_and_its_messages(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "s"))
    store.close()
    db = tmp_path / "s" / "meta.db"
    conn = sqlite3.connect(db, isolation_level=None)  # as an older spoolfs made it
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("PRAGMA page_size=4096")
    conn.execute("VACUUM")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()
    assert pragma(db, "page_size") == 4096
    store = open_store(str(tmp_path / "s"))
    try:
        root = store.reader().get(1)
        assert root is not None and root.kind == "root"
    finally:
        store.close()
    assert pragma(db, "page_size") == 4096
    assert pragma(db, "integrity_check") == "ok"


def test_subdirectories_are_read_without_the_messages(tmp_path: Path) -> None:
    """``stat working/`` asks for its link count after every claim (the kernel's attributes of
    the directory are dropped when its mtime changes), and the idle-view sweep reads its
    views. Neither reads the messages beside them: the work SQLite does is the same for 10
    messages in the directory as for 2,000."""
    store = open_store(str(tmp_path / "s"))
    try:
        def mkdir(parent: int, name: bytes):  # type: ignore[no-untyped-def]
            return lambda tx: tx.insert(parent=parent, name=name, kind="consumer", mode=0o40755,
                                        mtime_ns=1, ctime_ns=1, created_ns=1)
        d = store.run_batch([mkdir(1, b"working")], True)[0][1].id
        store.run_batch([mkdir(d, b"view")], True)

        def fill(n: int) -> None:
            store.run_batch([lambda tx, i=i: tx.insert(
                parent=d, name=b"m%05d" % i, kind="message", state=State.WORKING,
                mode=0o100644, mtime_ns=1, ctime_ns=1, created_ns=1) for i in range(n)], True)

        def steps() -> int:
            r = store.reader()
            count = [0]

            def tick() -> int:
                count[0] += 1
                return 0
            r.conn.set_progress_handler(tick, 1)  # type: ignore[attr-defined]
            try:
                assert r.subdirs(d) == 1
                assert [e.name for e in r.subdirectories(d)] == [b"view"]
            finally:
                r.conn.set_progress_handler(None, 1)  # type: ignore[attr-defined]
            return count[0]

        fill(10)
        few = steps()
        store.run_batch([lambda tx: [tx.delete(e.id) for e in store.reader().children(d)
                                     if e.kind == "message"]], True)
        fill(2000)
        assert steps() == few
    finally:
        store.close()
