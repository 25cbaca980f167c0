"""New uploads' staging files made ahead (service/staging_pool.py): a create takes one and
makes no file on the event loop; a file made ahead is held, so recovery, gc and fsck never take
it for a crash's leftover; the ids a daemon hands out only grow; unmount removes what is left,
and recovery what a crash left."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from helpers.spool import WHO, Q, content, running, upload
from spoolfs.blobs.files import StagingDir
from spoolfs.core.errors import Exists
from spoolfs.core.rules import State
from spoolfs.service import gc
from spoolfs.service.fsck import Fsck
from spoolfs.service.recovery import orphan_staging_files, recover
from spoolfs.service.spool import Spool
from spoolfs.service.staging_pool import StagingPool
from spoolfs.store.registry import open_store


async def filled(pool: StagingPool, n: int) -> None:
    with trio.fail_after(10):
        while pool.made < n:
            await trio.sleep(0.01)


@pytest.fixture
async def pooled(tmp_path: Path) -> AsyncIterator[tuple[Spool, Q]]:
    """A spool (the embedded store) whose pool runs, as the daemon's does; its files stay
    fresh for a minute here (a test sleeps)."""
    async with running(tmp_path) as spool:
        qe = await spool.mkdir(1, b"q", 0o755, WHO)
        spool.staging_pool = StagingPool(spool.content.staging, spool._reserve_ids, max_age=60)
        async with trio.open_nursery() as n:
            n.start_soon(spool.staging_pool.run)
            await filled(spool.staging_pool, 2)
            yield spool, Q(spool, qe.id)
            n.cancel_scope.cancel()
        spool.staging_pool.close()


def files(staging: StagingDir) -> set[int]:
    return set(staging.ids())


async def test_a_create_takes_a_file_made_ahead_and_gives_it_the_time_of_now(
        pooled: tuple[Spool, Q]) -> None:
    spool, q = pooled
    pool, staging = spool.staging_pool, spool.content.staging
    ahead = sorted(files(staging))
    assert len(ahead) == 2 and all(staging.held(i) for i in ahead)
    await trio.sleep(1.1)  # the files are older than the upload that takes one
    before = time.time_ns()
    e, h = await spool.create(q[State.PARTIAL], b"a", 0o644, WHO)
    assert e.id == ahead[0] and pool.taken == 1
    st = os.stat(staging.path(e.id))
    assert st.st_mtime_ns >= before - 10_000_000 and spool.times(e)[2] == st.st_mtime_ns
    spool.write(h, 0, b"made ahead\n")
    await spool.close(h, WHO)
    assert content(spool, e.id) == b"made ahead\n"


async def test_creates_take_growing_ids_and_the_pool_grows_with_them(
        pooled: tuple[Spool, Q]) -> None:
    spool, q = pooled
    ids = []
    for i in range(200):
        ids.append(await upload(spool, q[State.READY], b"r%03d" % i, b"x"))
        await trio.sleep(0)  # (the pool's thread gets its turn, as between requests)
    assert ids == sorted(ids) and len(set(ids)) == 200
    assert [m.name for m in spool.r.children(q[State.READY])] == [b"r%03d" % i
                                                                 for i in range(200)]
    assert spool.staging_pool.taken > 100, "creates in a row should find files made ahead"


async def test_a_file_made_too_long_ago_is_not_used(tmp_path: Path) -> None:
    """Another daemon of the store may have created since its id was reserved: listings
    would show the new upload before older ones."""
    now = [0.0]
    staging = StagingDir(str(tmp_path / "staging"))
    batches = [[5, 6], [7, 8], [9, 10]]

    async def reserve(n: int) -> list[int]:
        return batches.pop(0)[:n]

    pool = StagingPool(staging, reserve, clock=lambda: now[0])
    async with trio.open_nursery() as n:
        n.start_soon(pool.run)
        await filled(pool, 2)
        now[0] = 1.5
        assert pool.take() is None  # 5 and 6 are stale
        await filled(pool, 4)
        assert files(staging) == {7, 8}  # removed as the next were made
        taken = pool.take()
        assert taken is not None and taken[0] == 7
        n.cancel_scope.cancel()
    os.close(taken[1])
    pool.close()
    assert files(staging) == {7}  # the one taken stays: its upload's


async def test_a_refused_create_leaves_no_file_behind(pooled: tuple[Spool, Q]) -> None:
    spool, q = pooled
    staging = spool.content.staging
    await upload(spool, q[State.PARTIAL], b"a", b"1")
    with pytest.raises(Exists):
        await spool.create(q[State.PARTIAL], b"a", 0o644, WHO)
    staged = spool.r.staged_among(sorted(files(staging)))
    assert all(i in staged or staging.held(i) for i in files(staging))
    spool.staging_pool.close()
    assert files(staging) == staged


async def test_files_made_ahead_are_left_alone_by_gc_fsck_and_another_daemons_recovery(
        pooled: tuple[Spool, Q], tmp_path: Path) -> None:
    spool, _ = pooled
    staging = spool.content.staging
    ahead = files(staging)
    report = gc.collect(str(tmp_path), grace_ns=0)
    assert report.staging_files == 0 and files(staging) == ahead
    assert Fsck(str(tmp_path)).run() == []
    other = open_store(str(tmp_path))
    try:
        others = Spool(other, str(tmp_path))
        recovered = recover(others)
        assert recovered.counts["staging_orphans"] == 0
        assert await orphan_staging_files(others, recovered) == 0
    finally:
        other.close()
    assert files(staging) == ahead


async def test_unmount_removes_the_files_and_recovery_those_a_crash_left(
        tmp_path: Path) -> None:
    async with running(tmp_path) as spool:
        staging = spool.content.staging
        async with trio.open_nursery() as n:
            n.start_soon(spool.staging_pool.run)
            await filled(spool.staging_pool, 2)
            n.cancel_scope.cancel()
        spool.staging_pool.close()
        assert files(staging) == set()

        crashed = StagingPool(staging, spool._reserve_ids)
        async with trio.open_nursery() as n:
            n.start_soon(crashed.run)
            await filled(crashed, 2)
            n.cancel_scope.cancel()
        for _, fd, _ in crashed._ready:  # what a kill -9 does: the locks go, the files stay
            os.close(fd)
        if crashed._dir is not None:
            os.close(crashed._dir[1])
        assert len(files(staging)) == 2
        recovered = recover(spool)  # their ids were reserved: walked once the mount serves
        assert recovered.counts["staging_orphans"] == 0 and len(files(staging)) == 2
        assert await orphan_staging_files(spool, recovered) == 2
        assert files(staging) == set()


async def test_ids_handed_out_only_grow(tmp_path: Path) -> None:
    """A file made under an id lower than one a create already used (it found the pool
    empty) is never used: listings keep the order the uploads were created in."""
    staging = StagingDir(str(tmp_path / "staging"))
    batches = [[5, 6], [20, 21], [22, 23]]

    async def reserve(n: int) -> list[int]:
        return batches.pop(0)[:n]

    pool = StagingPool(staging, reserve)
    pool.used(10)  # a create took id 10 while the pool was empty
    async with trio.open_nursery() as n:
        n.start_soon(pool.run)
        await filled(pool, 2)
        assert pool.take() is None  # 5 and 6 are below 10
        await filled(pool, 4)
        taken = pool.take()
        assert taken is not None and taken[0] == 20 and staging.held(20)
        n.cancel_scope.cancel()
    os.close(taken[1])
    assert files(staging) == {20, 21}
    pool.close()
    assert files(staging) == {20}  # the one taken stays: its upload's


async def test_files_go_into_their_ids_buckets(tmp_path: Path) -> None:
    staging = StagingDir(str(tmp_path / "staging"))
    ids = [4094, 4095, 4096, 4097]

    async def reserve(n: int) -> list[int]:
        return ids

    pool = StagingPool(staging, reserve, size=4)
    pool.target = lambda: 4  # type: ignore[method-assign]
    async with trio.open_nursery() as n:
        n.start_soon(pool.run)
        await filled(pool, 4)
        n.cancel_scope.cancel()
    assert files(staging) == set(ids) and all(staging.held(i) for i in ids)
    assert os.path.exists(staging.path(4095)) and os.path.exists(staging.path(4096))
    assert os.path.dirname(staging.path(4095)) != os.path.dirname(staging.path(4096))
    pool.close()
    assert files(staging) == set()


def test_staging_ids_are_read_a_bucket_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc and fsck page through the staging files' ids: the names of a million uploads left
    in ``partial/`` are never held at once, only a bucket's (and a flat-layout file or a
    bucket gone meanwhile is passed over)."""
    staging = StagingDir(str(tmp_path / "staging"))
    per_bucket = 1 << StagingDir.BUCKET_BITS
    ids = [1, 2, per_bucket + 1, 2 * per_bucket + 5]
    for i in ids:
        os.close(staging.open(i, create=True))
    (tmp_path / "staging" / "7").write_bytes(b"")  # a file among the buckets
    listed: list[str] = []
    real_listdir = os.listdir

    def listdir(path: str) -> list[str]:
        listed.append(os.path.relpath(path, tmp_path / "staging"))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    it = staging.ids()
    first = next(it)
    assert len(listed) == 2  # the buckets, and the first bucket's names only
    assert sorted([first, *it]) == ids


def test_the_staging_clock_orders_files_by_their_change(tmp_path: Path) -> None:
    """Recovery's walk after serving removes only files changed before the mount began, by
    the file system's own stamps: whatever its tick, a file changed just before the clock is
    read is older, one changed just after is not."""
    staging = StagingDir(str(tmp_path / "staging"))
    for _ in range(20):
        os.close(staging.create(1))
        now = staging.clock_ns()
        os.close(staging.create(2))
        assert os.stat(staging.path(1)).st_ctime_ns < now <= os.stat(staging.path(2)).st_ctime_ns
    stamps = iter([5, 5, 5])
    staging_root = staging.root

    def frozen(path: str) -> Any:  # a clock that does not tick within the wait
        assert path == staging_root
        return SimpleNamespace(st_ctime_ns=next(stamps, 5))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "stat", frozen)
        start = time.monotonic()
        assert staging.clock_ns(wait_s=0.003) == 5  # that tick's files count as changed after
        assert time.monotonic() - start >= 0.003  # it waited for a tick that never came


def test_staging_sizes_open_each_bucket_once_in_id_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The status snapshot sizes every upload: a million, in id order, are looked up in their
    bucket's open directory, each bucket opened once; a file or a bucket that is missing
    has no size."""
    staging = StagingDir(str(tmp_path / "staging"))
    per_bucket = 1 << StagingDir.BUCKET_BITS
    for i, size in ((1, 3), (2, 0), (per_bucket + 1, 7)):
        fd = staging.create(i)
        os.write(fd, b"x" * size)
        os.close(fd)
    opened: list[str] = []
    real_open = os.open

    def counted(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", counted)
    items = [(1, "a"), (2, "b"), (3, "c"), (per_bucket + 1, "d"), (5 * per_bucket, "e")]
    got = list(staging.sizes(items, key=lambda item: item[0]))
    assert got == [((1, "a"), 3), ((2, "b"), 0), ((3, "c"), None),
                   ((per_bucket + 1, "d"), 7), ((5 * per_bucket, "e"), None)]
    assert len(opened) == 3  # one per bucket, the missing one included


def test_a_staging_file_removed_before_its_lock_is_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remover unlinks a file under its lock (``remove_unheld``): a new upload whose file
    went between its ``open`` and its lock finds it unlinked once locked, and makes it
    again; the file it holds is the one its id names."""
    staging = StagingDir(str(tmp_path / "staging"))
    real_flock = fcntl.flock
    removed: list[int] = []

    def flock(fd: int, op: int) -> None:
        if not removed:  # the sweep's unlink, just before this lock
            removed.append(fd)
            os.unlink(staging.path(7))
        real_flock(fd, op)
    monkeypatch.setattr(fcntl, "flock", flock)
    fd = staging.create_locked(7)
    monkeypatch.undo()
    try:
        assert removed and os.fstat(fd).st_ino == os.lstat(staging.path(7)).st_ino
        assert os.fstat(fd).st_nlink == 1 and staging.held(7)
        assert staging.remove_unheld(7, lambda st: True) is None  # held: kept
    finally:
        os.close(fd)
    assert staging.remove_unheld(7, lambda st: False) is None  # not orphaned: kept
    assert staging.remove_unheld(7, lambda st: True) is not None
    assert not os.path.exists(staging.path(7))
