"""The service on a real store in tmp_path, without a kernel; every test ends with fsck clean."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio

from helpers.spool import WHO, Q, content, copies, entries_read, running, upload  # noqa: E402
from helpers.waiting import patience, wait_until
from spoolfs.blobs import running as running_module
from spoolfs.blobs.files import CHUNK, BlobDir, StagingDir
from spoolfs.blobs.running import STEP as HASH_STEP
from spoolfs.core.errors import Exists, NotEmpty, NotFound, NotPermitted, StoreFailure
from spoolfs.core.rules import State
from spoolfs.service import batches, gc, recovery
from spoolfs.service import content as content_module
from spoolfs.service.content import INLINE_MAX, OVERLAP_MIN
from spoolfs.service.fsck import Fsck
from spoolfs.service.recovery import orphan_blob_files, orphan_staging_files, recover
from spoolfs.service.spool import RENAME_NOREPLACE, Spool
from spoolfs.store.base import StoreBusy
from spoolfs.store.registry import open_store as open_any
from spoolfs.store.site import Place
from spoolfs.store.sqlite import SqliteRead, open_store
from spoolfs.store.sqlite_maint import SqliteGcTx


@pytest.mark.parametrize("size", [10, INLINE_MAX + 1, OVERLAP_MIN + 1])
async def test_cycle(env: tuple[Spool, Q], size: int) -> None:
    spool, q = env
    data = os.urandom(size)
    mid = await upload(spool, q[State.PARTIAL], b"f", data)
    await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    w1 = await spool.mkdir(q[State.WORKING], b"w1", 0o755, WHO)
    await spool.rename(q[State.READY], b"f", w1.id, b"f", 0, WHO)
    e = spool.get(mid)
    assert e.state is State.WORKING and e.attempts == 1 and e.consumer == "w1"
    assert content(spool, mid) == data
    await spool.rename(w1.id, b"f", q[State.SUCCESS], b"f", 0, WHO)
    assert [h[1] for h in spool.r.history(mid)] == ["publish", "claim", "finish"]


async def test_a_large_upload_that_cannot_be_synced_is_not_published(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync of a large upload runs beside its hashing; its failure still fails the
    publish, and the upload stays in partial/ as it was. The kernel reports a failed
    writeback to one fsync only: a second try, whose sync succeeds, fails as well (the
    content may have lost a part); written again, the upload is published."""
    spool, q = env
    data = os.urandom(OVERLAP_MIN * 2)
    mid = await upload(spool, q[State.PARTIAL], b"f", data)
    synced = []

    def broken(fd: int) -> None:
        synced.append(fd)
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(content_module.os, "fsync", broken)
    with pytest.raises(StoreFailure, match="sync of staging file .* I/O error"):
        await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    monkeypatch.undo()
    assert synced
    e = spool.get(mid)
    assert e.state is State.PARTIAL and e.staged and content(spool, mid) == data
    with pytest.raises(StoreFailure, match="may not be on disk"):
        await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    assert spool.get(mid).state is State.PARTIAL
    await spool.unlink(q[State.PARTIAL], b"f", WHO)
    mid = await upload(spool, q[State.PARTIAL], b"f", data)
    await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    assert spool.get(mid).state is State.READY and content(spool, mid) == data


async def test_claim_race_one_winner(env: tuple[Spool, Q]) -> None:
    spool, q = env
    await upload(spool, q[State.READY], b"m", b"x")
    views = [await spool.mkdir(q[State.WORKING], b"c%d" % i, 0o755, WHO) for i in range(8)]
    wins: list[int] = []

    async def claim(v: int) -> None:
        try:
            await spool.rename(q[State.READY], b"m", v, b"m", 0, WHO)
            wins.append(v)
        except NotFound:
            pass

    async with trio.open_nursery() as n:
        for v in views:
            n.start_soon(claim, v.id)
    assert len(wins) == 1


async def test_refusals_change_nothing(env: tuple[Spool, Q]) -> None:
    spool, q = env
    await upload(spool, q[State.READY], b"a", b"1")
    await upload(spool, q[State.READY], b"b", b"2")
    with pytest.raises(Exists):
        await spool.rename(q[State.READY], b"a", q[State.READY], b"b", 0, WHO)
    with pytest.raises(NotPermitted):
        await spool.rename(q[State.READY], b"a", q[State.SUCCESS], b"a", 0, WHO)
    with pytest.raises(NotPermitted):
        await spool.create(q[State.SUCCESS], b"n", 0o644, WHO)
    with pytest.raises(NotPermitted):
        await spool.open(spool.lookup(q[State.READY], b"a").id, True, False, WHO)
    assert {e.name for e in spool.listdir(q[State.READY])} == {b"a", b"b"}


async def test_removing_a_queue_removes_its_empty_views_and_reads_no_message(
        env: tuple[Spool, Q]) -> None:
    """``rmdir QUEUE``: refused while a message or an upload being written is in it, found
    without reading the rest (a mistaken rmdir beside a million messages read them all into
    memory), and a refusal found after the views were removed puts them back; a queue with
    only empty consumer views goes, views and all."""
    spool, q = env
    view = await spool.mkdir(q[State.WORKING], b"v", 0o755, WHO)
    messages = await copies(spool, q[State.READY], 200)
    with entries_read() as read, pytest.raises(NotEmpty):
        await spool.rmdir(1, b"q", WHO)
    assert read[0] < 20, f"{read[0]} entries read to refuse a queue of 200 messages"
    assert spool.lookup(q[State.WORKING], b"v").id == view.id
    assert len(spool.listdir(q[State.READY])) == 200

    done, *rest = messages
    await spool.rename(q[State.READY], done, q[State.WORKING], done, 0, WHO)
    await spool.rename(q[State.WORKING], done, q[State.SUCCESS], done, 0, WHO)
    for name in rest:
        await spool.unlink(q[State.READY], name, WHO)
    with pytest.raises(NotEmpty):  # success/ comes after working/: its view was removed
        await spool.rmdir(1, b"q", WHO)
    assert spool.lookup(q[State.WORKING], b"v").id == view.id
    await spool.unlink(q[State.SUCCESS], done, WHO)
    for d in (State.READY, State.PARTIAL):  # an upload being written: hidden in ready/
        e, h = await spool.create(q[d], b"up", 0o644, WHO)
        with pytest.raises(NotEmpty):
            await spool.rmdir(1, b"q", WHO)
        await spool.close(h, WHO)
        await spool.unlink(q[d], b"up", WHO)
        assert spool.lookup(q[State.WORKING], b"v").id == view.id
    await spool.rmdir(1, b"q", WHO)
    with pytest.raises(NotFound):
        spool.get(view.id)
    with pytest.raises(NotFound):
        spool.lookup(1, b"q")


async def test_finished_entries_are_replaced_and_content_freed(env: tuple[Spool, Q]) -> None:
    spool, q = env
    big = os.urandom(INLINE_MAX * 2)
    w = await spool.mkdir(q[State.WORKING], b"w", 0o755, WHO)
    for data in (big, b"small"):
        await upload(spool, q[State.READY], b"a", data)
        await spool.rename(q[State.READY], b"a", w.id, b"a", 0, WHO)
        await spool.rename(w.id, b"a", q[State.SUCCESS], b"a", 0, WHO)
    assert content(spool, spool.lookup(q[State.SUCCESS], b"a").id) == b"small"
    assert list(spool.content.blobs.walk()) == []  # the big blob's file went with its last reference
    with pytest.raises(Exists):
        await upload(spool, q[State.READY], b"z", b"1")
        await spool.rename(q[State.READY], b"z", w.id, b"z", 0, WHO)
        await spool.rename(w.id, b"z", q[State.SUCCESS], b"a", RENAME_NOREPLACE, WHO)


async def test_links_share_content(env: tuple[Spool, Q]) -> None:
    spool, q = env
    data = os.urandom(INLINE_MAX * 3)
    a = await upload(spool, q[State.READY], b"a", data)
    b = await spool.link(a, q[State.READY], b"b", WHO)
    assert spool.get(a).blob == b.blob and spool.nlink_of(b) == 2
    await spool.unlink(q[State.READY], b"a", WHO)
    assert content(spool, b.id) == data and spool.nlink_of(spool.get(b.id)) == 1


async def test_upload_into_ready_is_hidden_until_closed(env: tuple[Spool, Q]) -> None:
    spool, q = env
    e, h = await spool.create(q[State.READY], b"x", 0o644, WHO)
    spool.write(h, 0, b"data")
    with pytest.raises(NotFound):
        spool.lookup(q[State.READY], b"x")
    assert spool.listdir(q[State.READY]) == []
    await spool.close(h, WHO)
    assert spool.lookup(q[State.READY], b"x").size == 4


async def test_an_upload_reads_its_row_once_per_step(env: tuple[Spool, Q]) -> None:
    """``cp x ready/``, as fuse/ops.py drives it: create, a write, the close that publishes,
    the release. Each step reads the row it needs once: the directory and the new row at
    create, the upload at the close and again in the publishing transaction; the first
    write reads no mode (no other opener can reach an upload into ready/ before it appears).
    The publish reads no row it just changed; the release after a publish reads nothing
    (each such read is a query, and the hot path of every producer)."""
    spool, q = env
    await upload(spool, q[State.READY], b"first", b"1")  # (the metrics learn the queue's name)
    with entries_read() as read:
        e, h = await spool.create(q[State.READY], b"x", 0o644, WHO)
        if h.checks_setid:
            await spool.drop_setid(h)
        spool.write(h, 0, b"data")
        pending = spool.pending_upload(h)
        await spool.publish_at_close(h, WHO, None, pending)
        await spool.close(h, WHO)
    assert read[0] <= 4, f"{read[0]} rows read to upload one file"
    got = spool.lookup(q[State.READY], b"x")
    assert (got.id, got.size, got.hidden) == (e.id, 4, False)
    assert content(spool, e.id) == b"data"


async def test_closing_an_upload_in_partial_reads_none_of_its_row(env: tuple[Spool, Q]) -> None:
    """``cp x partial/``, as fuse/ops.py drives it: its flush and its release read none of
    the upload's row (each read is a query, a round trip on a database server). Only a
    rename into ``ready/`` while it is written leaves its publish to its writer's close, and
    such a rename, through this daemon or another of the store's, marks its staging file
    first; an upload made hidden here is known so."""
    spool, q = env
    with entries_read() as read:
        e, h = await spool.create(q[State.PARTIAL], b"x", 0o644, WHO)
        if h.checks_setid:
            await spool.drop_setid(h)
        spool.write(h, 0, b"data")
        made = read[0]
        assert spool.pending_upload(h) is None
        await spool.close(h, WHO)
    assert read[0] == made, f"{read[0] - made} rows read at the close"
    assert spool.lookup(q[State.PARTIAL], b"x").id == e.id
    # a rename into ready/ while it is written: its close publishes it
    e, h = await spool.create(q[State.PARTIAL], b"y", 0o644, WHO)
    spool.write(h, 0, b"data")
    assert await spool.rename(q[State.PARTIAL], b"y", q[State.READY], b"y", 0, WHO)
    pending = spool.pending_upload(h)
    assert pending is not None and pending.id == e.id
    await spool.publish_at_close(h, WHO, None, pending)
    await spool.close(h, WHO)
    got = spool.lookup(q[State.READY], b"y")
    assert (got.id, got.hidden, got.staged) == (e.id, False, False)
    assert content(spool, e.id) == b"data"


async def test_a_publish_at_close_frees_nothing_the_writer_still_holds(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload of a few blocks inlined at its publish (``cp`` of an 8 KiB message into
    ``ready/``): the writer's handle still holds the staging file when its close publishes,
    so only the name goes then, with no hand-off to a worker thread; the handle's last
    close frees the file, in a worker thread (blobs/freeing.py)."""
    from spoolfs.blobs import freeing

    spool, q = env
    freed: list[tuple[bool, int]] = []
    real_close_all = freeing.close_all

    def close_all(fds: list[int]) -> None:
        freed.append((threading.current_thread() is threading.main_thread(), len(fds)))
        real_close_all(fds)
    monkeypatch.setattr(freeing, "close_all", close_all)
    data = os.urandom(8 * 1024)
    assert len(data) <= INLINE_MAX
    e, h = await spool.create(q[State.READY], b"m", 0o644, WHO)
    spool.write(h, 0, data)
    await spool.publish_at_close(h, WHO)
    assert freed == [] and spool.lookup(q[State.READY], b"m").id == e.id
    await spool.close(h, WHO)
    assert freed == [(False, 1)]  # the handle's last close, off the loop
    assert content(spool, e.id) == data


async def test_recovery_moves_unclosed_ready_upload_to_partial(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    qe = await spool.mkdir(1, b"q", 0o755, WHO)
    q = Q(spool, qe.id)
    e, h = await spool.create(q[State.READY], b"x", 0o644, WHO)
    spool.write(h, 0, b"half")
    h.close()  # the daemon dies: no release
    open(os.path.join(tmp_path, "staging", "99999"), "w").close()  # a crash leftover
    store.close()
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    counts = recover(spool).counts  # 99999: above every id given, removed before serving
    assert counts["uploads_to_partial"] == 1 and counts["staging_orphans"] == 1
    assert spool.lookup(q[State.PARTIAL], b"x").staged  # still an upload, in partial/
    assert spool.listdir(q[State.READY]) == []
    store.close()
    assert Fsck(str(tmp_path)).run() == []


async def test_recovery_walks_the_staging_files_of_ids_given_once_the_mount_serves(
        tmp_path: Path) -> None:
    """A staging file per upload under way or left in ``partial/``: at a million, their walk
    would hold up the mount for seconds. Before serving, recovery reads only the files above
    the highest id the store has given (a power cut took their ids back: the mount's uploads
    take them again); the rest are walked once the mount serves, up to that id, and a file
    made since (an upload of the mount, its row maybe still to commit) is never taken for a
    leftover, held or not."""
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    qe = await spool.mkdir(1, b"q", 0o755, WHO)
    q = Q(spool, qe.id)
    kept = spool.get(await upload(spool, q[State.PARTIAL], b"kept", b"half"))
    staging = spool.content.staging
    ok, given = store.run_batch([lambda tx: tx.reserve_entry_ids(3)], True)[0]
    for sid in given:  # a daemon killed with files made ahead: their ids were given
        os.close(staging.create(sid))
    os.close(staging.create(given[-1] + 5000))  # its id taken back by a power cut
    store.close()

    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    staging = spool.content.staging
    ids = staging.ids
    read: list[tuple[int, int | None]] = []

    def ids_read(lo: int = 0, hi: int | None = None) -> Iterator[int]:
        read.append((lo, hi))
        return ids(lo, hi)
    staging.ids = ids_read  # type: ignore[method-assign]
    recovered = recover(spool)
    staging.ids = ids  # type: ignore[method-assign]
    assert recovered.staging_upto == given[-1]
    assert read == [(given[-1] + 1, None)], "the mount waited for the walk of every file"
    assert recovered.counts["staging_orphans"] == 1
    assert sorted(staging.ids()) == [kept.id, *given]

    async with trio.open_nursery() as n:
        await n.start(spool.committer.run)
        e, h = await spool.create(q[State.READY], b"new", 0o644, WHO)  # the mount's upload
        assert e.id > recovered.staging_upto
        os.close(staging.create(e.id + 1))  # ... and one not yet held, its row to come
        held = os.open(staging.path(given[0]), os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_SH)  # a file another daemon holds
        try:
            assert await orphan_staging_files(spool, recovered) == 2
        finally:
            os.close(held)
        assert sorted(staging.ids()) == [kept.id, given[0], e.id, e.id + 1]
        assert await orphan_staging_files(spool, recovered) == 1  # held by none
        assert sorted(staging.ids()) == [kept.id, e.id, e.id + 1]
        staging.remove(e.id + 1)
        spool.write(h, 0, b"whole")
        await spool.close(h, WHO)
        spool.committer.close()
    assert content(spool, spool.lookup(q[State.READY], b"new").id) == b"whole"
    assert content(spool, kept.id) == b"half"
    store.close()
    assert Fsck(str(tmp_path)).run() == []


async def test_the_walk_after_serving_keeps_a_file_changed_since_the_mount_began(
        tmp_path: Path) -> None:
    """A database server that crashes during the mount can take the ids given back below
    recovery's bound (uploads commit without waiting for its disk): an upload of the mount
    then takes an id the walk reads, and its staging file may be unheld for a moment between
    its making and its lock. The walk removes only files last changed before the mount
    began; gc judges the rest by its grace period."""
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    staging = spool.content.staging
    ok, given = store.run_batch([lambda tx: tx.reserve_entry_ids(3)], True)[0]
    os.close(staging.create(given[0]))  # left by a daemon killed before this mount
    time.sleep(0.05)  # (a mount starts well after a kill: the clock's tick is a few ms)
    recovered = recover(spool)
    assert recovered.staging_upto == given[-1]
    os.close(staging.create(given[1]))  # the mount's upload, its id given again, not yet held
    assert await orphan_staging_files(spool, recovered) == 1
    assert sorted(staging.ids()) == [given[1]]
    report = gc.collect(str(tmp_path), grace_ns=0)  # no upload came for it: gc's
    assert report.staging_files == 1 and sorted(staging.ids()) == []
    store.close()


async def test_recovery_asks_a_staging_files_lock_before_its_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared store's transaction locks no other daemon's commits: between recovery's two
    looks at a staging file, an upload's row can commit and its writer let go of the file.
    Held when asked first, it stays."""
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    staging = spool.content.staging
    sid = spool.r.highest_entry_id() + 1
    held = staging.create(sid)
    fcntl.flock(held, fcntl.LOCK_SH)  # another daemon's new upload, its row to come
    staged_among = SqliteRead.staged_among

    def row_then_let_go(tx: SqliteRead, ids: Sequence[int]) -> set[int]:
        if sid in ids:
            os.close(held)  # the row commits after this look, and the writer lets go
            return set()
        return staged_among(tx, ids)
    monkeypatch.setattr(SqliteRead, "staged_among", row_then_let_go)
    assert recover(spool).counts["staging_orphans"] == 0
    assert os.path.exists(staging.path(sid))
    os.close(held)
    staging.remove(sid)  # no row was ever to come: the test's alone
    store.close()


async def test_recovery_holds_a_page_of_what_it_judges(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A store with a million uploads left in ``partial/`` (each a staged row and a staging
    file) mounts holding a page of them: the staged rows, the staged ids among the staging
    files, and the unreferenced blob rows are each read a page at a time."""
    monkeypatch.setattr(recovery, "PAGE", 3)
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    qe = await spool.mkdir(1, b"q", 0o755, WHO)
    q = Q(spool, qe.id)
    for i in range(7):  # uploads into ready/ whose daemon died: no release
        _, h = await spool.create(q[State.READY], b"x%d" % i, 0o644, WHO)
        spool.write(h, 0, b"half")
        h.close()
    for i in range(2):  # uploads left in partial/: staged, and not recovery's to move
        await upload(spool, q[State.PARTIAL], b"p%d" % i, b"kept")
    for i in range(5):  # staging files no row names
        open(os.path.join(tmp_path, "staging", str(99_990 + i)), "w").close()
    for i in range(4):  # blob rows no message holds
        spool.store.run_batch([lambda tx, i=i: tx.blob_insert(bytes([i]) * 32, 1, b"%d" % i)], True)
    store.close()

    read: list[int] = []

    def counted(method: Callable[..., Any], sizes: Callable[[Any, Any], int]) -> Any:
        def call(self: Any, *args: Any) -> Any:
            got = method(self, *args)
            read.append(sizes(args, got))
            return got
        return call
    for method in ("unclosed_uploads", "unreferenced_blobs"):
        monkeypatch.setattr(SqliteRead, method, counted(getattr(SqliteRead, method),
                                                        lambda args, got: len(got)))
    monkeypatch.setattr(SqliteRead, "staged_among", counted(SqliteRead.staged_among,
                                                            lambda args, got: len(args[0])))
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    counts = recover(spool).counts
    assert counts == {"uploads_to_partial": 7, "staging_orphans": 5, "blobs_freed": 4}
    assert read and max(read) <= 3
    assert sorted(e.name for e in spool.listdir(q[State.PARTIAL])) == \
        [b"p0", b"p1"] + [b"x%d" % i for i in range(7)]
    store.close()
    assert Fsck(str(tmp_path)).run() == []


async def test_recovery_looks_for_orphan_blob_files_once_the_mount_serves(
        tmp_path: Path) -> None:
    """Recovery walks every blob file (one per content kept in a file: a deep queue of large
    messages has a million, a minute's walk) to find those a crash left without a row. Not
    before the mount serves, and without the store's write lock (another daemon on the store
    commits meanwhile); only the files found orphaned are looked at again under it, and a
    file whose row committed meanwhile stays."""
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    qe = await spool.mkdir(1, b"q", 0o755, WHO)
    q = Q(spool, qe.id)
    kept = spool.get(await upload(spool, q[State.READY], b"big", os.urandom(INLINE_MAX * 2)))
    late = spool.get(await upload(spool, q[State.READY], b"late", os.urandom(INLINE_MAX * 2)))
    assert kept.blob is not None and late.blob is not None
    late_blob = spool.r.blob(late.blob)
    assert late_blob is not None
    orphan = spool.content.blobs.path(b"\7" * 32, 999_999)  # a crash between file and row
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    with open(orphan, "wb") as f:
        f.write(b"lost")
    store.close()

    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    other = open_store(str(tmp_path))  # another daemon on the store
    walk = spool.content.blobs.walk

    def no_walk() -> Iterator[tuple[str, bytes, int]]:
        raise AssertionError("the mount waited for the walk of the blob files")
    spool.content.blobs.walk = no_walk  # type: ignore[method-assign]
    recover(spool)

    committed: list[bool] = []

    def walking() -> Iterator[tuple[str, bytes, int]]:
        for i, obj in enumerate(walk()):
            if i == 1:  # in the middle of the walk
                try:
                    ok, _ = other.run_batch([lambda tx: tx.set_meta("probe", "1")], True,
                                            wait=False)[0]
                except StoreBusy:
                    ok = False
                committed.append(ok)
            yield obj
    spool.content.blobs.walk = walking  # type: ignore[method-assign]
    files_of = SqliteGcTx.files_named

    def late_row(tx: SqliteGcTx, ids: Sequence[int]) -> dict[int, bytes]:
        # the row commits right after the lookups
        return {bid: sha for bid, sha in files_of(tx, ids).items() if bid != late_blob.id}
    SqliteGcTx.files_named = late_row  # type: ignore[method-assign]
    try:
        async with trio.open_nursery() as n:
            await n.start(spool.committer.run)
            assert await orphan_blob_files(spool) == 1
            spool.committer.close()
    finally:
        SqliteGcTx.files_named = files_of  # type: ignore[method-assign]
    assert committed == [True], "another daemon's commit waited for the walk"
    assert not os.path.exists(orphan)
    assert os.path.exists(spool.content.blobs.path(late_blob.sha256, late_blob.id)), \
        "a file whose row is there when the lock is held is no orphan"
    assert content(spool, late.id) and content(spool, kept.id)
    other.close()
    store.close()
    assert Fsck(str(tmp_path)).run() == []


async def test_recovery_by_another_daemon_never_takes_an_upload_being_created(
        tmp_path: Path) -> None:
    """A second daemon's recovery may run the moment a new upload's row commits: the upload's
    staging file must already be held then, or a live ``cp`` into ready/ lands in partial/."""
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    qe = await spool.mkdir(1, b"q", 0o755, WHO)
    q = Q(spool, qe.id)
    other_store = open_store(str(tmp_path))
    other = Spool(other_store, str(tmp_path))
    submit = spool.committer.submit
    recovered: list[dict[str, int]] = []

    async def then_recover(fn, durable=True):  # type: ignore[no-untyped-def]
        value = await submit(fn, durable)
        recovered.append(recover(other).counts)  # right after the commit, before create() returns
        return value

    spool.committer.submit = then_recover  # type: ignore[method-assign]
    e, h = await spool.create(q[State.READY], b"x", 0o644, WHO)
    spool.committer.submit = submit  # type: ignore[method-assign]
    assert recovered and recovered[0]["uploads_to_partial"] == 0
    spool.write(h, 0, b"whole")
    await spool.close(h, WHO)
    assert spool.lookup(q[State.READY], b"x").size == 5
    other_store.close()
    store.close()
    assert Fsck(str(tmp_path)).run() == []


async def test_recovery_never_takes_an_upload_published_since_it_looked(tmp_path: Path) -> None:
    """Another daemon's recovery lists the hidden uploads, then checks each: one whose writer
    closed it meanwhile is published, not a crash leftover."""
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    qe = await spool.mkdir(1, b"q", 0o755, WHO)
    q = Q(spool, qe.id)
    other_store = open_store(str(tmp_path))
    other = Spool(other_store, str(tmp_path))
    e, h = await spool.create(q[State.READY], b"x", 0o644, WHO)
    spool.write(h, 0, b"whole")
    listed = other.r.unclosed_uploads(0, 500)  # recovery's page: x is a hidden upload here
    await spool.close(h, WHO)  # ... and its writer closes it: published
    other.r.unclosed_uploads = (  # type: ignore[method-assign]
        lambda after, limit: [e for e in listed if e.id > after][:limit])
    counts = recover(other).counts
    assert counts["uploads_to_partial"] == 0
    assert spool.lookup(q[State.READY], b"x").size == 5
    assert spool.listdir(q[State.PARTIAL]) == []
    other_store.close()
    store.close()
    assert Fsck(str(tmp_path)).run() == []


async def test_an_upload_is_held_until_its_close_has_published_it(tmp_path: Path) -> None:
    """Another daemon's recovery running while the last writer's close publishes the upload
    finds it still held: the handle's file is closed only once the upload is published."""
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    qe = await spool.mkdir(1, b"q", 0o755, WHO)
    q = Q(spool, qe.id)
    other_store = open_store(str(tmp_path))
    other = Spool(other_store, str(tmp_path))
    e, h = await spool.create(q[State.READY], b"x", 0o644, WHO)
    spool.write(h, 0, b"whole")
    publish = spool._publish_settled
    seen: list[dict[str, int]] = []

    async def recovery_first(*args, **kw):  # type: ignore[no-untyped-def]
        seen.append(recover(other).counts)  # in the middle of the close
        return await publish(*args, **kw)

    spool._publish_settled = recovery_first  # type: ignore[method-assign]
    await spool.close(h, WHO)
    assert seen and seen[0]["uploads_to_partial"] == 0
    assert spool.lookup(q[State.READY], b"x").size == 5
    other_store.close()
    store.close()
    assert Fsck(str(tmp_path)).run() == []


async def written(spool: Spool, d: int, name: bytes, data: bytes, piece: int = CHUNK) -> int:
    """An upload written front to back in pieces, as ``cp`` writes (its writer closed it)."""
    e, h = await spool.create(d, name, 0o644, WHO)
    for at in range(0, len(data), piece):
        spool.write(h, at, data[at:at + piece])
    await spool.close(h, WHO)
    return e.id


def sha256_of(spool: Spool, entry_id: int) -> bytes:
    blob = spool.r.blob(spool.get(entry_id).blob)  # type: ignore[arg-type]
    assert blob is not None
    return blob.sha256


@pytest.fixture
def hashed_from(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Where publishing began to hash each upload (0: the whole file; more: the running hash
    had the rest, blobs/running.py)."""
    starts: list[int] = []

    def spy(hash_file: Any) -> Any:
        def hashing(fd: int, h: Any = None, off: int = 0) -> tuple[bytes, int]:
            starts.append(off)
            return hash_file(fd, h, off)  # type: ignore[no-any-return]
        return hashing

    monkeypatch.setattr(content_module, "hash_file", spy(content_module.hash_file))
    monkeypatch.setattr(running_module, "hash_file", spy(running_module.hash_file))
    return starts


async def test_a_large_upload_is_hashed_while_it_is_written(
        env: tuple[Spool, Q], hashed_from: list[int]) -> None:
    spool, q = env
    data = os.urandom(6 * HASH_STEP + 5)
    mid = await written(spool, q[State.PARTIAL], b"f", data)
    running = spool.content._running[mid]
    wait_until(lambda: running._hashed == 6 * HASH_STEP, what="the upload hashed ahead")
    await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    assert hashed_from == [6 * HASH_STEP]
    assert sha256_of(spool, mid) == hashlib.sha256(data).digest()
    assert content(spool, mid) == data and spool.content._running == {}


async def test_removing_an_upload_waits_for_its_hashing_off_the_loop(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """``rm`` of a large upload while it is hashed ahead: the hashing thread reads it, and so
    holds its space, to the end of its chunk; the request waits for it in the worker thread
    that frees the file (its space is free once ``rm`` returns), not on the event loop."""
    spool, q = env
    joined: list[bool] = []  # for each join of a hashing thread: whether on the loop's thread
    real_join = threading.Thread.join

    def join(self: threading.Thread, timeout: float | None = None) -> None:
        if self.name == "spoolfs-hash":
            joined.append(threading.current_thread() is threading.main_thread())
        real_join(self, timeout)
    monkeypatch.setattr(threading.Thread, "join", join)
    mid = await written(spool, q[State.PARTIAL], b"f", os.urandom(6 * HASH_STEP + 5))
    thread = spool.content._running[mid]._thread
    assert thread is not None and thread.is_alive()  # (it ends after 1 s without writes)
    await spool.unlink(q[State.PARTIAL], b"f", WHO)
    assert joined == [False] and not thread.is_alive()
    assert spool.content._running == {}
    assert not os.path.exists(spool.content.staging.path(mid))


@pytest.mark.parametrize("change", ["rewrite", "resize"])
async def test_an_upload_changed_by_another_daemon_is_hashed_as_it_stands(
        tmp_path: Path, hashed_from: list[int], change: str) -> None:
    """Two daemons of one embedded store: the second opens the first one's upload and
    rewrites a part it had hashed, or cuts it, behind its running hash's back. Publishing
    through the first hashes what the file holds."""
    async with running(tmp_path) as spool, running(tmp_path) as other:
        q = Q(spool, (await spool.mkdir(1, b"q", 0o755, WHO)).id)
        data = bytearray(os.urandom(4 * HASH_STEP))
        mid = await written(spool, q[State.PARTIAL], b"f", bytes(data))
        running_hash = spool.content._running[mid]
        wait_until(lambda: running_hash._hashed == 4 * HASH_STEP, what="the upload hashed ahead")
        if change == "rewrite":
            h = await other.open(mid, writable=True, truncate=False, who=WHO)
            other.write(h, HASH_STEP, b"changed")
            await other.close(h, WHO)
            data[HASH_STEP:HASH_STEP + 7] = b"changed"
        else:
            await other.setattr(mid, size=3 * HASH_STEP, who=WHO)
            del data[3 * HASH_STEP:]
        await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
        assert hashed_from == [0]  # the whole file, not the head start
        assert sha256_of(spool, mid) == hashlib.sha256(data).digest()
        assert content(spool, mid) == data


@pytest.mark.parametrize("change", ["rewrite", "resize", "reopen"])
async def test_an_upload_changed_here_is_hashed_as_it_stands(
        env: tuple[Spool, Q], hashed_from: list[int], change: str) -> None:
    spool, q = env
    data = bytearray(os.urandom(3 * HASH_STEP))
    mid = await written(spool, q[State.PARTIAL], b"f", bytes(data))
    running_hash = spool.content._running[mid]
    wait_until(lambda: running_hash._hashed == 3 * HASH_STEP, what="the upload hashed ahead")
    h = await spool.open(mid, writable=True, truncate=False, who=WHO)
    if change == "rewrite":  # a write not at the end
        spool.write(h, 10, b"changed")
        data[10:17] = b"changed"
    elif change == "resize":
        await spool.setattr(mid, size=2 * HASH_STEP + 1, who=WHO)
        del data[2 * HASH_STEP + 1:]
    else:  # reopened here and written at the end: the running hash goes on
        spool.write(h, len(data), b"more")
        data += b"more"
    await spool.close(h, WHO)
    await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    assert sha256_of(spool, mid) == hashlib.sha256(data).digest()
    assert content(spool, mid) == data
    assert (hashed_from[0] > 0) == (change == "reopen")


async def test_a_removed_upload_leaves_no_running_hash(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """Nor a thread that holds its file: the space of a removed upload is free once ``rm``
    returns (a full disk's way out)."""
    monkeypatch.setattr(running_module, "IDLE_S", 3600.0)  # the thread waits for more writes
    spool, q = env
    mid = await written(spool, q[State.PARTIAL], b"f", os.urandom(3 * HASH_STEP))
    thread = spool.content._running[mid]._thread
    assert thread is not None
    await spool.unlink(q[State.PARTIAL], b"f", WHO)
    assert spool.content._running == {}
    assert not thread.is_alive()


async def while_sealing(spool: Spool, monkeypatch: pytest.MonkeyPatch,
                        seal_it: Callable[[], Awaitable[object]],
                        meanwhile: Callable[[], Awaitable[object]]) -> list[NotPermitted]:
    """Run ``seal_it`` (a publish or link) with its seal held in the worker thread, and
    ``meanwhile`` while it is held; ``meanwhile`` must wait for the sealing to end, not be
    refused before. Its refusals, once the sealing ended."""
    started, release = threading.Event(), threading.Event()
    seal = spool.content.seal

    def slow_seal(entry_id: int) -> Any:
        started.set()
        release.wait(patience(10))
        return seal(entry_id)

    monkeypatch.setattr(spool.content, "seal", slow_seal)
    refused: list[NotPermitted] = []

    async def refusing() -> None:
        try:
            await meanwhile()
        except NotPermitted as e:
            refused.append(e)

    async with trio.open_nursery() as n:
        n.start_soon(seal_it)
        while not started.is_set():
            await trio.sleep(0.001)
        n.start_soon(refusing)
        await trio.sleep(0.05)  # it runs while the seal is under way
        assert not refused  # waiting, not refused before the publish
        release.set()
    return refused


@pytest.mark.parametrize("how", ["write", "truncate"])
@pytest.mark.parametrize("seals", ["mv", "ln"])
async def test_an_upload_opened_while_its_publish_seals_it_is_not_written_after(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch, how: str, seals: str) -> None:
    """``mv partial/f ready/`` (or ``ln partial/f ready/g``) seals f in a worker thread, then
    commits; another process opening f for writing (or truncating it) meanwhile waits for it
    and is refused as for any published message. It must not write into the sealed bytes,
    which become the message's blob file. (The kernel's rename locks partial/ against a
    lookup of f meanwhile; its link does not, and an NFS server opens by handle.)"""
    spool, q = env
    data = os.urandom(2 * CHUNK)
    mid = await written(spool, q[State.PARTIAL], b"f", data)

    async def seal_it() -> object:
        if seals == "mv":
            return await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
        return await spool.link(mid, q[State.READY], b"g", WHO)

    async def writer() -> None:
        if how == "write":
            h = await spool.open(mid, writable=True, truncate=False, who=WHO)
            spool.write(h, 0, b"late")
            await spool.close(h, WHO)
        else:
            await spool.setattr(mid, size=10, who=WHO)

    refused = await while_sealing(spool, monkeypatch, seal_it, writer)
    assert refused, "a writer opened the upload while its publish sealed it"
    assert spool.get(mid).state is (State.READY if seals == "mv" else State.PARTIAL)
    assert content(spool, mid) == data
    assert sha256_of(spool, mid) == hashlib.sha256(data).digest()


@pytest.mark.parametrize("made", ["file", "directory"])
async def test_nothing_is_made_in_a_batch_while_its_publish_seals_it(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch, made: str) -> None:
    """``mv partial/b1 ready/`` seals every file of b1, then commits; a file or directory
    made in b1 meanwhile waits, then is refused (the batch is published, immutable): made
    after the walk, it would be published unsealed."""
    spool, q = env
    b1 = await spool.mkdir(q[State.PARTIAL], b"b1", 0o755, WHO)
    data = os.urandom(2 * CHUNK)
    await written(spool, b1.id, b"f", data)

    async def maker() -> None:
        if made == "file":
            e, h = await spool.create(b1.id, b"late", 0o644, WHO)
            await spool.close(h, WHO)
        else:
            await spool.mkdir(b1.id, b"late", 0o755, WHO)

    refused = await while_sealing(
        spool, monkeypatch,
        lambda: spool.rename(q[State.PARTIAL], b"b1", q[State.READY], b"b1", 0, WHO), maker)
    assert refused, "something was made in a batch while its publish sealed it"
    assert [m.name for m in spool.listdir(b1.id)] == [b"f"]
    assert not any(m.staged for m in batches.walk(spool.r, spool.get(b1.id)))


async def test_two_sealings_of_one_upload_each_hold_writers_back(env: tuple[Spool, Q]) -> None:
    """A link and a publish may seal one upload at once: the one that ends first leaves the
    other's hold in place."""
    spool, q = env
    mid = await upload(spool, q[State.PARTIAL], b"f", b"x")
    first = spool.sealing(mid)
    first.__enter__()
    with spool.sealing(mid):
        pass
    assert mid in spool._sealing
    first.__exit__(None, None, None)
    assert mid not in spool._sealing


@asynccontextmanager
async def published(spool: Spool, data: bytes) -> AsyncIterator[tuple[Q, int]]:
    """``spool`` with its committer running, and ``data`` published as ``q/ready/f``: the
    queue and the message's id."""
    async with trio.open_nursery() as n:
        await n.start(spool.committer.run)
        qe = await spool.mkdir(1, b"q", 0o755, WHO)
        q = Q(spool, qe.id)
        mid = await upload(spool, q[State.PARTIAL], b"f", data)
        await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
        yield q, mid
        spool.committer.close()


def counted_queries(spool: Spool, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The queries ``spool``'s reader sends from now on, waited for or as steps."""
    asked: list[str] = []
    run = spool.r._run  # type: ignore[attr-defined]
    steps = spool.r._steps  # type: ignore[attr-defined]

    def counting(query: str, params: Any) -> Any:
        asked.append(query)
        return run(query, params)

    def counting_steps(query: str, params: Any) -> Any:
        asked.append(query)
        return (yield from steps(query, params))
    monkeypatch.setattr(spool.r, "_run", counting)
    monkeypatch.setattr(spool.r, "_steps", counting_steps)
    return asked


@pytest.mark.parametrize("remote", [True, False])
async def test_an_open_of_published_content_is_one_query(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str, remote: bool) -> None:
    """Each read of a row is a round trip to a database server: an open of published
    content reads the message's row and its content's blob row in one query, also where it
    makes a remote blob readable here first."""
    store = open_any(pg_url)
    place = Place(pg_url, BlobDir(str(tmp_path / "blobs"), remote=remote),
                  StagingDir(str(tmp_path / "staging")), str(tmp_path), False,
                  str(tmp_path / "blobs"))
    spool = Spool(store, place)
    async with published(spool, b"published bytes") as (q, mid):
        asked = counted_queries(spool, monkeypatch)
        h = await spool.open(mid, False, False, WHO)
        opened = list(asked)
        try:
            assert h.read(0, 100) == b"published bytes"
        finally:
            await spool.close(h, WHO)
        assert len(opened) == 1, opened
    store.close()


async def test_a_rename_reads_its_row_and_target_directory_in_one_query(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str) -> None:
    """On a database server each query is a round trip: before its transaction, a rename
    reads the row it moves and the directory it moves it into together (as steps, the loop
    going on meanwhile). A name gone, or a target directory gone, is still ENOENT."""
    store = open_any(pg_url)
    spool = Spool(store, str(tmp_path))
    async with published(spool, b"bytes") as (q, mid):
        w1 = await spool.mkdir(q[State.WORKING], b"w1", 0o755, WHO)
        gone = await spool.mkdir(q[State.WORKING], b"gone", 0o755, WHO)
        await spool.rmdir(q[State.WORKING], b"gone", WHO)
        asked = counted_queries(spool, monkeypatch)
        with pytest.raises(NotFound):
            await spool.rename(q[State.READY], b"f", gone.id, b"f", 0, WHO)
        with pytest.raises(NotFound):
            await spool.rename(q[State.READY], b"nothing", w1.id, b"f", 0, WHO)
        asked.clear()
        await spool.rename(q[State.READY], b"f", w1.id, b"f", 0, WHO)
        assert len(asked) == 1, asked
        assert spool.get(mid).parent == w1.id
    store.close()


class RoundTrips:
    """What libpq sends on every connection of a store, in a trace file: one wait for the
    server per Query or Sync (a prepare's Parse has a Sync of its own)."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from spoolfs.store.postgres import PostgresStore
        self.trace = open(tmp_path / "trace", "w")  # noqa: SIM115 (closed by close)
        configure, connect = PostgresStore._configure, PostgresStore.connect
        fd = self.trace.fileno()

        def traced(conn: Any) -> Any:
            conn.pgconn.trace(fd)
            conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
            return conn
        monkeypatch.setattr(PostgresStore, "_configure",
                            staticmethod(lambda conn: traced(conn) and configure(conn)))
        monkeypatch.setattr(PostgresStore, "connect",
                            lambda self, autocommit=False: traced(connect(self, autocommit)))

    async def of(self, request: Awaitable[Any]) -> int:
        """The round trips ``request`` waits for, once each statement is prepared."""
        start = os.path.getsize(self.trace.name)
        await request
        with open(self.trace.name) as f:
            f.seek(start)
            sent = f.read()
        sends = [line.split("\t")[2:4] for line in sent.splitlines()
                 if line.startswith("F\t") and "spoolfs_prepare" not in line]
        return sum(1 for s in sends if s[0].strip() in ("Query", "Sync")) - sum(
            1 for s in sends if s[0].strip() == "Parse" and not s[1].startswith(' ""'))

    def close(self) -> None:
        self.trace.close()


async def test_a_claim_on_a_database_server_is_three_round_trips_and_a_publish_four(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str) -> None:
    """Each round trip is a wait on a server that may be on another machine, and a claim's
    rename holds the kernel's rename lock through all of them: its reads (the message, the
    directory it goes into, what has its name there), then its transaction, begun with the
    move (which takes the name only if it is still free: no lookup first), and the commit.
    A publish takes and attaches its content in one more. Counted in what libpq sends on
    every connection of the store, once each statement is prepared. A name taken there is
    still replaced or refused as the rules say."""
    from spoolfs.store.postgres import PostgresStore
    trips = RoundTrips(tmp_path, monkeypatch)
    waits = trips.of
    store = PostgresStore(pg_url, pool_max=1)
    spool = Spool(store, str(tmp_path))
    try:
        async with published(spool, b"bytes") as (q, mid):
            w1 = await spool.mkdir(q[State.WORKING], b"w1", 0o755, WHO)
            second = await upload(spool, q[State.PARTIAL], b"g", b"more")
            await spool.rename(q[State.PARTIAL], b"g", q[State.READY], b"g", 0, WHO)
            await spool.rename(q[State.READY], b"f", w1.id, b"f", 0, WHO)  # all prepared
            assert await waits(spool.rename(q[State.READY], b"g", w1.id, b"g", 0, WHO)) == 3
            assert spool.get(second).parent == w1.id
            # a publish: its reads, the move (with the begin), the content taken and
            # attached, the commit
            await upload(spool, q[State.PARTIAL], b"p", b"published")
            assert await waits(spool.rename(q[State.PARTIAL], b"p", q[State.READY], b"p", 0,
                                            WHO)) == 4
            # a name taken there: NOREPLACE refuses, a plain rename replaces (finished work)
            third = await upload(spool, q[State.PARTIAL], b"h", b"third")
            await spool.rename(q[State.PARTIAL], b"h", q[State.READY], b"h", 0, WHO)
            await spool.rename(w1.id, b"g", q[State.SUCCESS], b"g", 0, WHO)
            await spool.rename(q[State.READY], b"h", w1.id, b"h", 0, WHO)
            with pytest.raises(Exists):
                await spool.rename(w1.id, b"h", q[State.SUCCESS], b"g", RENAME_NOREPLACE, WHO)
            await spool.rename(w1.id, b"h", q[State.SUCCESS], b"g", 0, WHO)
            assert spool.get(third).parent == q[State.SUCCESS]
            with pytest.raises(NotFound):
                spool.get(second)
    finally:
        store.close()
        trips.close()


@pytest.mark.parametrize("blobs", ["dir", "s3"])
async def test_a_shared_store_keeps_small_content_in_its_database(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str, blobs: str,
        request: pytest.FixtureRequest) -> None:
    """Content of at most ``INLINE_MAX`` bytes goes into its blob row in the transaction
    that publishes it, on a store shared by several hosts too: no object stored first (an
    upload to S3, or a file placed and synced in a shared directory), no reads or id
    reserved for one, and nothing to fetch on another host before reading it. A publish
    is then four round trips, as with the embedded store's layout. Larger content is still
    stored in the blob store first, under an id reserved for it."""
    from spoolfs.blobs.s3 import S3Blobs
    from spoolfs.store.postgres import PostgresStore
    trips = RoundTrips(tmp_path, monkeypatch)
    store = PostgresStore(pg_url, pool_max=1)
    if blobs == "s3":
        bucket = request.getfixturevalue("s3_url")
        where: Any = S3Blobs(bucket, str(tmp_path / "cache"))
    else:
        where = BlobDir(str(tmp_path / "blobs"), remote=True)
    stored: list[bytes] = []
    put = where.upload
    monkeypatch.setattr(where, "upload", lambda src, sha, bid: (stored.append(sha),
                                                              put(src, sha, bid))[1])
    place = Place(pg_url, where, StagingDir(str(tmp_path / "staging")), str(tmp_path), False,
                  bucket if blobs == "s3" else str(tmp_path / "blobs"))
    spool = Spool(store, place)
    small, large = b"s" * INLINE_MAX, os.urandom(INLINE_MAX + 1)
    try:
        async with published(spool, b"bytes") as (q, mid):
            await upload(spool, q[State.PARTIAL], b"warm", b"warm")  # statements prepared
            await spool.rename(q[State.PARTIAL], b"warm", q[State.READY], b"warm", 0, WHO)
            stored.clear()
            sid = await upload(spool, q[State.PARTIAL], b"small", small)
            assert await trips.of(spool.rename(q[State.PARTIAL], b"small", q[State.READY],
                                               b"small", 0, WHO)) == 4
            assert stored == []
            blob = spool.r.blob(spool.get(sid).blob)  # type: ignore[arg-type]
            assert blob is not None and blob.data == small
            lid = await upload(spool, q[State.PARTIAL], b"large", large)
            await spool.rename(q[State.PARTIAL], b"large", q[State.READY], b"large", 0, WHO)
            assert stored == [hashlib.sha256(large).digest()]
            blob = spool.r.blob(spool.get(lid).blob)  # type: ignore[arg-type]
            assert blob is not None and blob.data is None
            for name, data in ((b"small", small), (b"large", large)):
                e = await spool.find(q[State.READY], name, WHO)
                assert e is not None
                h = await spool.open(e.id, False, False, WHO)
                try:
                    assert h.read(0, len(data) + 1) == data
                finally:
                    await spool.close(h, WHO)
    finally:
        spool.committer.close()
        store.close()
        trips.close()


async def test_a_staging_directory_whose_clock_cannot_be_read_leaves_leftovers_to_gc(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovery reads the staging directory's clock by setting its times: where that fails,
    the mount goes on, and the walk after serving removes nothing (gc does, later)."""
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path))
    staging = spool.content.staging
    ok, given = store.run_batch([lambda tx: tx.reserve_entry_ids(1)], True)[0]
    os.close(staging.create(given[0]))  # left by a crash

    def refused(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "utime", refused)
    recovered = recover(spool)
    monkeypatch.undo()
    assert recovered.staging_before_ns == 0
    assert await orphan_staging_files(spool, recovered) == 0
    assert sorted(staging.ids()) == [given[0]]
    assert gc.collect(str(tmp_path), grace_ns=0).staging_files == 1
    store.close()
