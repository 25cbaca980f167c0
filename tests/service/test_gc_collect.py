"""``service.gc``: collection of what crashes leave behind, on a real store without a kernel."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from helpers.deep import file_messages, peak_bytes
from helpers.spool import WHO, running, upload
from helpers.spool import content as read
from helpers.waiting import patience
from spoolfs.blobs import files as files_module
from spoolfs.blobs.files import StagingDir
from spoolfs.core.rules import State
from spoolfs.service import gc
from spoolfs.service.content import INLINE_MAX, Handle
from spoolfs.service.recovery import orphan_blob_files
from spoolfs.service.spool import Spool
from spoolfs.store.sqlite_maint import SqliteGcTx

BIG = INLINE_MAX + 1000
LATER = 3600 * gc.NS  # an hour on: every file made by the test is past the grace period


Env = tuple[Spool, dict[State, int], Path]


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with running(tmp_path) as spool:
        qe = await spool.mkdir(1, b"q", 0o755, WHO)
        dirs = {st: spool.lookup(qe.id, st.value.encode()).id for st in State}
        yield spool, dirs, tmp_path


def orphan_file(spool: Spool, bid: int, data: bytes = b"orphan") -> str:
    path = spool.content.blobs.path(hashlib.sha256(data).digest(), bid)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Path(path).write_bytes(data)
    return path


def leaked_row(store: Path, spool: Spool, data: bytes) -> tuple[int, str]:
    """A blob row (content in a file) that no message references."""
    sha = hashlib.sha256(data).digest()
    conn = sqlite3.connect(store / "meta.db", isolation_level=None)
    try:
        bid = conn.execute("INSERT INTO blobs (sha256, size, refcount, data) "
                           "VALUES (?, ?, 0, NULL)", (sha, len(data))).lastrowid
    finally:
        conn.close()
    assert bid is not None
    path = spool.content.blobs.path(sha, bid)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Path(path).write_bytes(data)
    return bid, path


async def test_collect_removes_each_kind_and_nothing_live(env: Env) -> None:
    spool, d, store = env
    big = os.urandom(BIG)
    a = await upload(spool, d[State.READY], b"a", big)
    s = await upload(spool, d[State.READY], b"s", b"small")
    e, h = await spool.create(d[State.PARTIAL], b"uploading", 0o644, WHO)
    spool.write(h, 0, b"in progress")
    bid, row_file = leaked_row(store, spool, os.urandom(BIG))
    loose = orphan_file(spool, 5000)
    os.makedirs(os.path.dirname(spool.content.staging.path(88888)), exist_ok=True)
    Path(spool.content.staging.path(88888)).write_bytes(b"left over")

    # now: the row goes (rows have no age), the fresh files stay
    r = gc.collect(str(store))
    assert (r.blob_rows, r.blob_files, r.staging_files, r.young) == (1, 0, 0, 2)
    assert not os.path.exists(row_file) and os.path.exists(loose)
    # an hour later the files go too
    r = gc.collect(str(store), now_ns=time.time_ns() + LATER)
    assert (r.blob_rows, r.blob_files, r.staging_files, r.young) == (0, 1, 1, 0)
    assert not os.path.exists(loose) and list(spool.content.staging.ids()) == [e.id]
    assert "removed 0 unreferenced blob row(s), 1 orphan blob file(s)" in r.summary()
    # nothing live was touched
    r = gc.collect(str(store), grace_ns=0)
    assert r.removed == 0 and r.young == 0
    assert read(spool, a) == big and read(spool, s) == b"small"
    await spool.close(h, WHO)
    assert read(spool, e.id) == b"in progress"
    assert bid not in {b.id for b in spool.r.all_blobs()}


async def test_a_file_whose_row_commits_while_gc_waits_for_the_lock_is_kept(
        env: Env) -> None:
    """The mark phase sees a blob file placed by a transaction that has not committed yet;
    the sweep, under the write lock, sees the committed row and keeps the file."""
    spool, d, store = env
    data = os.urandom(BIG)
    sha = hashlib.sha256(data).digest()
    conn = sqlite3.connect(store / "meta.db", isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")  # a daemon's publish, mid-transaction
    bid = conn.execute("INSERT INTO blobs (sha256, size, refcount, data) VALUES (?, ?, 1, NULL)",
                       (sha, len(data))).lastrowid
    assert bid is not None
    path = spool.content.blobs.path(sha, bid)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Path(path).write_bytes(data)

    marked = threading.Event()
    sweep = gc.sweep_blob_files

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        marked.set()
        return sweep(*args, **kw)

    result: list[gc.Report] = []
    orig, gc.sweep_blob_files = gc.sweep_blob_files, spy
    try:
        t = threading.Thread(target=lambda: result.append(gc.collect(str(store), grace_ns=0)))
        t.start()
        assert marked.wait(patience(10))  # the file is a candidate...
        time.sleep(0.2)  # ...and the sweep waits for the write lock
        msg = conn.execute(
            "INSERT INTO entries (parent, name, kind, queue, state, blob, size, mode, mtime_ns, "
            "ctime_ns, created_ns, enqueued_ns) SELECT ?, X'6d', 'message', queue, 'ready', ?, ?, "
            "33188, 0, 0, 0, 0 FROM entries WHERE id=?",
            (d[State.READY], bid, len(data), d[State.READY])).lastrowid
        conn.execute("COMMIT")
        t.join(patience(30))
    finally:
        gc.sweep_blob_files = orig
        conn.close()
    assert result and result[0].blob_files == 0
    assert os.path.exists(path) and read(spool, msg) == data  # type: ignore[arg-type]


async def test_periodic_collects_in_the_background(env: Env) -> None:
    spool, d, store = env
    loose = orphan_file(spool, 6000)
    with trio.move_on_after(patience(10)):
        async with trio.open_nursery() as n:
            n.start_soon(gc.periodic, str(store), 0.01, 0)
            while os.path.exists(loose):
                await trio.sleep(0.01)
            n.cancel_scope.cancel()
    assert not os.path.exists(loose)


async def test_the_walk_of_the_blob_files_holds_a_page_at_a_time(env: Env) -> None:
    """A deep queue of large messages has a blob file for each: at a million, a mark that
    held every file's name and every row's hash at once would take the daemon (recovery at
    mount, its periodic collection) past what the rest of it needs many times over. The walk
    and its lookups go a page at a time, so what they hold does not grow with the files."""
    spool, d, store = env
    place = spool.place
    first = 3 * gc.PAGE  # more than a page: the figure includes what a page costs
    file_messages(store, spool, d[State.READY], 0, first)
    loose = orphan_file(spool, 900_000)
    small = (peak_bytes(lambda: gc.crash_leftovers(place)),
             peak_bytes(lambda: gc.collect(place, now_ns=time.time_ns() + LATER)))
    assert not os.path.exists(loose)  # the walk still finds what a crash left
    more = 6000
    file_messages(store, spool, d[State.READY], first, more)
    loose = orphan_file(spool, 900_001)
    objects: list[int] = []
    large = (peak_bytes(lambda: objects.append(gc.crash_leftovers(place)[0])),
             peak_bytes(lambda: gc.collect(place, now_ns=time.time_ns() + LATER)))
    assert objects == [first + more + 1] and not os.path.exists(loose)
    for before, after in zip(small, large):
        assert after - before < 10 * more, (before, after)  # bytes held per added file


async def test_a_stopped_walk_ends_at_its_next_page_and_the_next_walk_finishes(
        env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """An unmount that will not wait for recovery's walk of a deep store stops it: the walk
    ends at its next page, says so, and the next mount's walk finds what it did not reach."""
    spool, d, store = env
    file_messages(store, spool, d[State.READY], 0, 3 * gc.PAGE)
    stop = threading.Event()
    walk = spool.content.blobs.walk
    seen = []

    def stopped_midway() -> Iterator[tuple[str, bytes, int]]:
        for obj in walk():
            seen.append(obj)
            if len(seen) == gc.PAGE + 1:
                stop.set()  # the unmount, while the second page is read
            yield obj
    loose = [orphan_file(spool, 900_000 + i) for i in range(3)]
    spool.content.blobs.walk = stopped_midway  # type: ignore[method-assign]
    assert gc.crash_leftovers(spool.place, stop)[0] is None
    assert len(seen) <= 2 * gc.PAGE + 1  # no page after the one it was reading
    spool.content.blobs.walk = walk  # type: ignore[method-assign]
    caplog.set_level(logging.INFO, "spoolfs")
    assert await orphan_blob_files(spool, stop) == 0
    assert "the walk of the blob files stopped by the unmount" in caplog.text
    assert "the next mount walks them again" in caplog.text
    left = [p for p in loose if os.path.exists(p)]
    assert await orphan_blob_files(spool) == len(left)
    assert not any(os.path.exists(p) for p in loose)
    assert f"{3 * gc.PAGE + len(left)} blob file(s) looked at" in caplog.text


async def test_an_unmount_ends_a_collection_at_its_next_page(env: Env) -> None:
    """A daemon's collection runs in a worker thread, which cannot be cancelled: with a million
    blob files it would hold an unmount for the whole walk. The unmount sets ``stop``; the
    collection ends at its next page and says it stopped, and the next one goes on."""
    spool, d, store = env
    file_messages(store, spool, d[State.READY], 0, 2 * gc.PAGE)
    loose = orphan_file(spool, 900_000)
    stop = threading.Event()
    walk = spool.content.blobs.walk

    def stopping() -> Iterator[tuple[str, bytes, int]]:
        for i, obj in enumerate(walk()):
            if i == 0:
                stop.set()  # the unmount, while the first page is read
            yield obj
    spool.content.blobs.walk = stopping  # type: ignore[method-assign]
    r = gc.collect(spool.place, now_ns=time.time_ns() + LATER, stop=stop)
    spool.content.blobs.walk = walk  # type: ignore[method-assign]
    assert r.stopped
    first_page_had_it = not os.path.exists(loose)
    with trio.fail_after(patience(10)):
        async with trio.open_nursery() as n:  # stopped: the round ends at once, quietly
            n.start_soon(gc.periodic, spool.place, 0.01, 0, stop)
            await trio.sleep(0.2)
            n.cancel_scope.cancel()
    assert os.path.exists(loose) != first_page_had_it
    r = gc.collect(spool.place, now_ns=time.time_ns() + LATER)
    assert not r.stopped and not os.path.exists(loose)
    assert r.blob_files == (0 if first_page_had_it else 1)


def sweep_staging(spool: Spool, sid: int) -> gc.Report:
    """gc's sweep of one staging file, with no grace period."""
    report = gc.Report()
    maint = spool.place.maintenance()
    try:
        gc.sweep_staging(maint, spool.content.staging, [sid], 0, None, report)
    finally:
        maint.close()
    return report


async def test_a_staging_file_let_go_as_its_row_commits_is_kept(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a shared store a transaction locks no other host's commits: between the sweep's two
    looks at a staging file, its upload's row can commit and its writer let go of it. The
    lock is asked first: held then, the file stays; let go, its row is committed and seen."""
    spool, _, _ = env
    staging = spool.content.staging
    sid = 99_999
    held = staging.create(sid)
    fcntl.flock(held, fcntl.LOCK_SH)  # an upload being created: its row not yet committed

    def row_then_let_go(tx: SqliteGcTx, entry_id: int) -> bool:
        os.close(held)  # the row commits after this look, and the writer lets go
        return False
    monkeypatch.setattr(SqliteGcTx, "is_staged", row_then_let_go)
    report = sweep_staging(spool, sid)
    assert os.path.exists(staging.path(sid)) and report.staging_files == 0
    os.close(held)
    staging.remove(sid)  # no row was ever to come: the test's alone


async def test_an_upload_made_under_a_leftovers_id_as_it_is_swept_keeps_its_file(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """An id given again (a database server's crash takes its sequence back) can name a
    leftover the sweep is removing: the upload opens that file and locks it while the sweep
    looks at it. The sweep holds the file's lock until it is unlinked; the upload, once it
    gets its lock, finds it unlinked and makes it again."""
    spool, _, _ = env
    staging = spool.content.staging
    sid = 99_998
    os.close(staging.create(sid))  # left by a crash
    threads: list[threading.Thread] = []
    handles: list[Handle] = []

    def upload_meanwhile(tx: SqliteGcTx, entry_id: int) -> bool:
        t = threading.Thread(target=lambda: handles.append(spool.content.new_upload(entry_id)))
        t.start()  # its create opens the leftover; its lock waits while the sweep holds one
        t.join(0.3)
        threads.append(t)
        return False  # its row is not committed yet
    monkeypatch.setattr(SqliteGcTx, "is_staged", upload_meanwhile)
    report = sweep_staging(spool, sid)
    threads[0].join()
    h = handles[0]
    assert report.staging_files == 1  # the leftover
    assert os.path.exists(staging.path(sid)), "the upload's file was removed"
    assert os.fstat(h.fd).st_ino == os.lstat(staging.path(sid)).st_ino
    assert staging.held(sid)
    h.close()
    staging.remove(sid)


def test_staging_ids_are_read_from_the_buckets_of_their_range(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovery lists only the buckets above the highest id given before serving: one or two
    of a million uploads' 245."""
    staging = StagingDir(str(tmp_path / "staging"))
    edge = 1 << StagingDir.BUCKET_BITS
    made = [1, edge - 1, edge, edge + 1, 3 * edge + 5]
    for sid in made:
        os.close(staging.create(sid))
    listed: list[str] = []
    listdir = os.listdir

    def listing(path: str) -> list[str]:
        listed.append(os.path.basename(path))
        return listdir(path)
    monkeypatch.setattr(files_module.os, "listdir", listing)
    assert sorted(staging.ids()) == made
    assert sorted(staging.ids(lo=edge)) == [edge, edge + 1, 3 * edge + 5]
    listed.clear()
    assert sorted(staging.ids(lo=edge - 1, hi=edge)) == [edge - 1, edge]
    assert sorted(listed) == ["0", "1", "staging"]
    listed.clear()
    assert list(staging.ids(lo=3 * edge + 6)) == []
    assert sorted(listed) == ["3", "staging"]
