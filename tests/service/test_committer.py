"""Group commit (DESIGN §6): concurrent requests share one commit; failures stay their own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from spoolfs.core.errors import NotFound
from spoolfs.service.committer import Committer
from spoolfs.store.sqlite import open_store


def _touch(entry_id: int):  # type: ignore[no-untyped-def]
    def fn(tx):  # type: ignore[no-untyped-def]
        if not tx.update(entry_id, mtime_ns=1):
            raise NotFound(f"no entry {entry_id}")
        return entry_id
    return fn


async def test_concurrent_requests_share_one_commit(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    committer = Committer(store)
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            results[i] = await committer.submit(_touch(1 if i % 3 else 999))
        except NotFound as e:
            results[i] = e

    async with trio.open_nursery() as n:
        await n.start(committer.run)
        async with trio.open_nursery() as clients:
            for i in range(12):
                clients.start_soon(one, i)
        committer.close()
    assert committer.requests == 12
    assert committer.batches < 12, "no two concurrent requests shared a commit"
    for i in range(12):
        if i % 3:
            assert results[i] == 1
        else:
            assert isinstance(results[i], NotFound), "a failed request must fail alone"
    with pytest.raises(Exception, match="shutting down"):
        await committer.submit(_touch(1))
    store.close()


class _Recording:
    """A store that records its commits and syncs, in order, and takes a while to sync
    (``delay`` seconds), noting the thread each sync ran on."""

    def __init__(self, store, events: list[str],  # type: ignore[no-untyped-def]
                 delay: float = 0.05, disk: bool = True) -> None:
        self._store = store
        self.events = events
        self.delay = delay
        self.disk = disk  # False: the sync does not reach the disk (quick whatever the disk)
        self.threads: list[int] = []
        self.deferred_sync = store.deferred_sync
        self.blocking = False

    def run_batch(self, fns, durable, wait=True):  # type: ignore[no-untyped-def]
        assert not durable, "a deferred-sync store commits without waiting for the disk"
        results = self._store.run_batch(fns, durable, wait)
        self.events.append(f"commit {len(fns)}")  # once committed
        return results

    def sync(self) -> None:
        import threading
        import time
        self.events.append("sync start")
        self.threads.append(threading.get_ident())
        if self.delay:
            time.sleep(self.delay)
        if self.disk:
            self._store.sync()
        self.events.append("sync end")


async def test_durable_requests_return_after_a_sync_that_covers_them(tmp_path: Path) -> None:
    """A durable request is answered only once a sync that began after its commit ended; one
    sync serves every request committed before it; a request that need not be durable is
    answered at its commit, while a sync is still on disk."""
    store = open_store(str(tmp_path))
    events: list[str] = []
    rec = _Recording(store, events)
    committer = Committer(rec)  # type: ignore[arg-type]

    async def one(tag: str, durable: bool) -> None:
        touch = _touch(1)

        def fn(tx):  # type: ignore[no-untyped-def]
            events.append(f"in {tag}")
            return touch(tx)
        await committer.submit(fn, durable)
        events.append(f"answered {tag}")

    async with trio.open_nursery() as n:
        await n.start(committer.run)
        async with trio.open_nursery() as clients:
            for i in range(6):
                clients.start_soon(one, f"d{i}", True)
            await trio.sleep(0.01)  # the first sync is on disk now
            clients.start_soon(one, "upload", False)
            await trio.sleep(0.01)
            for i in range(6, 9):
                clients.start_soon(one, f"d{i}", True)
        committer.close()
    assert store.deferred_sync
    for i in range(9):
        answered = events.index(f"answered d{i}")
        inside = events.index(f"in d{i}")
        committed = next(k for k, e in enumerate(events) if k > inside and e.startswith("commit"))
        ended = [k for k, e in enumerate(events[:answered]) if e == "sync end"]
        started = [k for k, e in enumerate(events[:answered]) if e == "sync start"]
        assert ended and any(committed < s < ended[-1] for s in started), \
            f"d{i} was answered before a sync covering its commit: {events}"
    upload = events.index("answered upload")
    assert events[upload - 1].startswith("commit") or "sync end" not in events[:upload], \
        f"a request that need not be durable waited for a sync: {events}"
    assert events.count("sync start") < 9, f"every durable request synced alone: {events}"
    store.close()


def test_sync_follows_a_log_that_was_replaced(tmp_path: Path) -> None:
    """``sync`` fsyncs the write-ahead log it opened; once that file is gone (the last
    connection of another daemon removed it), the next sync syncs the database file and opens
    the log again if there is one, rather than syncing a dead file."""
    store = open_store(str(tmp_path))
    store.run_batch([_touch(1)], durable=False)
    store.sync()
    wal = Path(store.path + "-wal")
    assert wal.exists()
    os.unlink(wal)
    store.sync()  # the database file is synced; no log to open
    fresh = os.open(wal, os.O_WRONLY | os.O_CREAT, 0o600)  # a new, empty log appears
    os.close(fresh)
    store.sync()
    assert os.stat(wal).st_nlink == 1
    store.close()


class _Slow:
    """A store whose commits wait on something else (a database server: ``blocking``), 50 ms
    each, in a worker thread."""

    def __init__(self, store) -> None:  # type: ignore[no-untyped-def]
        self._store = store
        self.deferred_sync = False
        self.blocking = True

    def run_batch(self, fns, durable, wait=True):  # type: ignore[no-untyped-def]
        import time
        time.sleep(0.05)
        return self._store.run_batch(fns, durable, wait)


async def test_a_leader_cancelled_while_others_wait_still_commits_for_them(tmp_path: Path) -> None:
    """The first request of a batch commits everyone's, batch after batch: cancelled while
    others wait for it (at unmount, its task is cancelled like any other), it goes on until
    the queue is empty; nobody is left waiting for a commit that never comes."""
    store = open_store(str(tmp_path))
    committer = Committer(_Slow(store))  # type: ignore[arg-type]
    results: list[object] = []
    leader_scope = trio.CancelScope()

    async def leader() -> None:
        with leader_scope:
            results.append(await committer.submit(_touch(1)))

    async def follower() -> None:
        while committer.started < 1:  # the leader's batch is in its worker thread now
            await trio.sleep(0.001)
        leader_scope.cancel()
        results.append(await committer.submit(_touch(1)))  # the leader's next batch

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(committer.run)
            async with trio.open_nursery() as clients:
                clients.start_soon(leader)
                clients.start_soon(follower)
            committer.close()
    assert results == [1, 1]
    assert committer.requests == 2 and committer.batches == 2
    store.close()


async def test_a_slow_disks_sync_leaves_the_loop_answering(tmp_path: Path) -> None:
    """Where a sync takes milliseconds, even a lone durable request's sync runs in a worker
    thread: while it is on disk, another request commits and is answered."""
    store = open_store(str(tmp_path))
    events: list[str] = []
    committer = Committer(_Recording(store, events, delay=0.05))  # type: ignore[arg-type]

    async def durable() -> None:
        await committer.submit(_touch(1))
        events.append("answered durable")

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(committer.run)
            await committer.submit(_touch(1))  # the disk's speed, measured
            events.clear()
            async with trio.open_nursery() as clients:
                clients.start_soon(durable)
                while "sync start" not in events:
                    await trio.sleep(0.001)
                await committer.submit(_touch(1), durable=False)
                events.append("answered upload")
            committer.close()
    assert committer.sync_ns is not None and committer.sync_ns > 0.04e9
    assert events.index("answered upload") < events.index("sync end") \
        < events.index("answered durable"), events
    store.close()


async def test_a_fast_disks_lone_sync_runs_on_the_loop(tmp_path: Path) -> None:
    """Where a sync is quick, a lone durable request syncs on the loop's own thread: the
    hand-off to a worker thread would cost more than the sync. (Quick by construction: a
    loaded machine's disk can take longer than ``SYNC_ON_LOOP_NS``.)"""
    import threading

    store = open_store(str(tmp_path))
    rec = _Recording(store, [], delay=0, disk=False)
    committer = Committer(rec)  # type: ignore[arg-type]
    async with trio.open_nursery() as n:
        await n.start(committer.run)
        for _ in range(5):
            await committer.submit(_touch(1))
        committer.close()
    assert committer.syncs == 5
    assert rec.threads[1:] == [threading.get_ident()] * 4, "a quick lone sync left the loop"
    store.close()
