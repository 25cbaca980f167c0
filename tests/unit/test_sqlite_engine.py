"""The embedded engine's file: small pages for new stores, older stores opened as they are."""

from __future__ import annotations

import sqlite3
from pathlib import Path

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
