"""The embedded engine's file: small pages for new stores, older stores opened as they are."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers.sqlite_log import trees_written
from spoolfs.core.rules import State
from spoolfs.store.base import Entry, ReadTx, Store, WriteTx
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


def vm_steps(store: Store, check: Callable[[ReadTx], None]) -> int:
    """The virtual machine instructions SQLite runs for ``check``'s queries: the work done,
    without a clock."""
    r = store.reader()
    conns = [store._rconn, store._wconn]  # type: ignore[attr-defined]  # reads take either
    count = [0]

    def tick() -> int:
        count[0] += 1
        return 0
    for conn in conns:
        conn.set_progress_handler(tick, 1)
    try:
        check(r)
    finally:
        for conn in conns:
            conn.set_progress_handler(None, 1)
    return count[0]


def mkdir(parent: int, name: bytes) -> Callable[[WriteTx], Entry]:
    return lambda tx: tx.insert(parent=parent, name=name, kind="consumer", mode=0o40755,
                                mtime_ns=1, ctime_ns=1, created_ns=1)


def fill(store: Store, parent: int, n: int, state: State, **fields: Any) -> None:
    store.run_batch([lambda tx, i=i: tx.insert(
        parent=parent, name=b"m%05d" % i, kind="message", state=state, mode=0o100644,
        mtime_ns=1, ctime_ns=1, created_ns=1, **fields) for i in range(n)], True)


def subdirectories(store: Store, n: int) -> Callable[[ReadTx], None]:
    """``stat working/`` asks for its link count after every claim (the kernel's attributes
    of the directory are dropped when its mtime changes), and the idle-view sweep reads its
    views: beside ``n`` claims."""
    d = store.run_batch([mkdir(1, b"working")], True)[0][1].id
    store.run_batch([mkdir(d, b"view")], True)
    fill(store, d, n, State.WORKING)

    def check(r: ReadTx) -> None:
        assert r.subdirs(d) == 1
        assert [e.name for e in r.subdirectories(d)] == [b"view"]
    return check


def duplicates(store: Store, n: int) -> Callable[[ReadTx], None]:
    """A publish into a queue with ``duplicates`` on looks for an earlier message with the
    same content within the window: beside ``n`` older ones (``skip`` keeps every copy)."""
    d = store.run_batch([mkdir(1, b"q")], True)[0][1].id
    b = store.run_batch([lambda tx: tx.blob_insert(b"\1" * 32, 1, b"x")], True)[0][1]
    fill(store, d, n, State.SUCCESS, queue=d, blob=b, enqueued_ns=1)

    def check(r: ReadTx) -> None:
        assert r.published_with(d, b, 1000, 0) is None
    return check


def retention(store: Store, n: int) -> Callable[[ReadTx], None]:
    """The retention sweep (every 5 s) looks for finished messages past their time: beside
    ``n`` in error/ that wait for a retry, which it must leave."""
    d = store.run_batch([mkdir(1, b"q")], True)[0][1].id
    fill(store, d, n, State.ERROR, queue=d, finished_ns=1, retry_ns=1 << 62)

    def check(r: ReadTx) -> None:
        assert r.finished_before(d, State.ERROR, 1000, 500) == []
    return check


@pytest.mark.parametrize("case", [subdirectories, duplicates, retention])
def test_a_query_on_the_hot_path_reads_no_row_it_does_not_return(
        tmp_path: Path, case: Callable[[Store, int], Callable[[ReadTx], None]]) -> None:
    """Each query runs beside 10 and beside 2,000 rows it must not return: SQLite does the
    same work both times (an index names exactly what it wants)."""
    work = []
    for n in (10, 2000):
        store = open_store(str(tmp_path / f"s{n}"))
        try:
            work.append(vm_steps(store, case(store, n)))
        finally:
            store.close()
    assert work[0] == work[1], work


# ---- the event loop's queries through the writer's connection ------------------------------

def traced(conn: sqlite3.Connection) -> list[str]:
    seen: list[str] = []
    conn.set_trace_callback(seen.append)
    return seen


def test_the_committing_thread_queries_through_the_writers_connection(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "s"))
    try:
        made = store.run_batch([mkdir(1, b"a")], durable=False, wait=False)[0][1]
        on_writer = traced(store._wconn)  # type: ignore[attr-defined]
        on_reader = traced(store._rconn)  # type: ignore[attr-defined]
        found = store.reader().lookup(1, b"a")
        assert found is not None and found.id == made.id
        assert store.reader().get(10**9) is None
        assert [q for q in on_writer if q.startswith("SELECT")] and not on_reader
    finally:
        store.close()


def test_a_query_inside_a_batch_sees_only_what_is_committed(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "s"))
    try:
        store.run_batch([mkdir(1, b"a")], durable=False, wait=False)
        seen: list[Entry | None] = []

        def fn(tx: WriteTx) -> None:
            tx.insert(parent=1, name=b"b", kind="consumer", mode=0o40755, mtime_ns=1,
                      ctime_ns=1, created_ns=1)
            seen.append(store.reader().lookup(1, b"b"))  # the batch's own row: not yet
            seen.append(store.reader().lookup(1, b"a"))
        assert store.run_batch([fn], durable=False, wait=False)[0][0]
        assert seen[0] is None and seen[1] is not None
        assert store.reader().lookup(1, b"b") is not None
    finally:
        store.close()


def test_a_query_while_a_worker_thread_holds_a_batch_open(tmp_path: Path) -> None:
    """A batch in a worker thread (another daemon held the write lock) owns the writer's
    connection: the loop's queries meanwhile go to the readers' connection, see only what
    is committed, and never wait for the batch."""
    import threading

    store = open_store(str(tmp_path / "s"))
    try:
        store.run_batch([mkdir(1, b"a")], durable=False, wait=False)  # this thread commits
        inside, finish = threading.Event(), threading.Event()

        def fn(tx: WriteTx) -> None:
            tx.insert(parent=1, name=b"b", kind="consumer", mode=0o40755, mtime_ns=1,
                      ctime_ns=1, created_ns=1)
            inside.set()
            assert finish.wait(10)
        worker = threading.Thread(target=store.run_batch, args=([fn], False))
        worker.start()
        try:
            assert inside.wait(10)
            assert store.reader().lookup(1, b"b") is None
            assert store.reader().lookup(1, b"a") is not None
        finally:
            finish.set()
            worker.join(10)
        assert store.reader().lookup(1, b"b") is not None
    finally:
        store.close()


# ---- what a transition writes to the log ---------------------------------------------------

def test_a_claim_writes_no_index_that_no_query_reads(tmp_path: Path) -> None:
    """A claim changes a message's directory, state, lease and owner, and adds its history
    row: its commit writes the pages of those and of nothing else. An index by queue and state
    (made by earlier versions, read by no query: the status scan is quicker without it) cost
    every claim, finish and publish two more pages in the log; an older store loses it."""
    store = open_store(str(tmp_path / "s"))
    q = store.run_batch([mkdir(1, b"q")], True)[0][1].id
    ready = store.run_batch([mkdir(q, b"ready")], True)[0][1].id
    view = store.run_batch([mkdir(q, b"c")], True)[0][1].id
    b = store.run_batch([lambda tx: tx.blob_insert(b"\1" * 32, 1, b"x", refs=300)], True)[0][1]
    fill(store, ready, 300, State.READY, queue=q, enqueued_ns=1, blob=b)
    store.close()
    conn = sqlite3.connect(tmp_path / "s" / "meta.db")  # as an earlier version left it
    conn.execute("CREATE INDEX IF NOT EXISTS entries_queue_state "
                 "ON entries(queue, state, enqueued_ns)")
    conn.commit()
    conn.close()
    store = open_store(str(tmp_path / "s"))
    try:
        m = store.reader().lookup(ready, b"m00150")
        assert m is not None

        def claim(tx: WriteTx) -> None:
            assert tx.move(m.id, ready, m.name, view, m.name, state=State.WORKING,
                           claimed_ns=2, attempts=1, lease_ns=3, consumer="c", uid=0, gid=0,
                           ctime_ns=2)
            tx.add_history(m.id, 2, "claim", "ready", "working/c", 0, 1, None)
        with trees_written(Path(store.path)) as trees:  # type: ignore[attr-defined]
            store.run_batch([claim], True)
        counts = {row[1]: row[3] for row in store.reader().stats()}
    finally:
        store.close()
    # the row, its name and directory, its lease, its history; entries_sharing because a
    # row's parent is a foreign key into its own table, which makes SQLite rewrite every index
    assert sorted(trees) == ["entries", "entries_lease", "entries_parent", "entries_sharing",
                     "history", "history_entry", "sqlite_autoindex_entries_1",
                     "sqlite_sequence"], trees
    assert counts == {"ready": 299, "working": 1}
