"""Group commit: concurrent requests share one transaction, and durable ones one sync.

Each request is a function of a ``WriteTx``. The first request to arrive while no commit is
under way leads: it yields once, so that requests the kernel has already passed can join, then
commits everything queued as one batch (each request in its own savepoint), and keeps going
while more arrived meanwhile. The others wait for their batch. A request returns only after its
batch committed and, if durable, is on disk.

On a store with ``deferred_sync`` (SQLite in WAL mode) a batch commits on the event loop's
thread without waiting for the disk (no fsync: about 50-100 µs), and durable requests then wait
for a sync of the log, which runs in a worker thread and covers every batch committed before it
started. (A fast disk's sync runs on the loop when no other request waits for a commit or a
sync: the kernel serializes renames across directories, so a lone claim or writer would only
pay the hand-off to a thread and back, which costs more than the sync. Whether the disk is
fast is measured, sync by sync.) While one sync is on disk, the loop keeps answering lookups,
reads and writes and committing the next batches, whose durable requests share the next sync:
producers and
consumers queue behind one fsync between them, not one each, and a request that needs no
fsync (an upload's create) never waits for one. When another daemon holds the store's write
lock the batch goes to a worker thread to wait for it, so a slow neighbour never stalls this
mount's reads. A store whose commits wait on the network (``Store.blocking``: a database
server) always commits in a worker thread, durably. Any other store (in memory) commits on the
loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any, TypeVar, cast

import trio

from spoolfs.core.errors import StoreFailure
from spoolfs.service.moves import MOVED, NAMED
from spoolfs.service.timings import TIMINGS
from spoolfs.store.base import Store, StoreBusy, WriteTx

log = logging.getLogger(__name__)
T = TypeVar("T")

#: A sync that takes less than this (on average, lately) runs on the loop when nobody would
#: share it: the hand-off to a worker thread and back costs 100-200 µs of the loop's time.
#: A slower disk's sync goes to a thread, so that no request waits behind it that need not.
SYNC_ON_LOOP_NS = 500_000
_SYNC_WEIGHT = 0.2  # of the latest sync in the running average


class _Request:
    __slots__ = ("fn", "durable", "done", "ok", "value", "batch")

    def __init__(self, fn: Callable[[WriteTx], Any], durable: bool) -> None:
        self.fn = fn
        self.durable = durable
        self.done = trio.Event()
        self.ok = False
        self.value: Any = None
        self.batch = 0  # the number of the batch it committed in


class _Moved:
    """A function's result, the transitions it applied (``moves.MOVED``) and the names it
    made unasked (``moves.NAMED``)."""

    __slots__ = ("value", "moved", "named")

    def __init__(self, value: Any, moved: list[tuple[str, int | None]],
                 named: list[tuple[int, bytes]]) -> None:
        self.value = value
        self.moved = moved
        self.named = named


def _recording(fn: Callable[[WriteTx], Any]) -> Callable[[WriteTx], _Moved]:
    def run(tx: WriteTx) -> _Moved:
        moved: list[tuple[str, int | None]] = []
        named: list[tuple[int, bytes]] = []
        token, named_token = MOVED.set(moved), NAMED.set(named)
        try:
            return _Moved(fn(tx), moved, named)
        finally:
            NAMED.reset(named_token)
            MOVED.reset(token)

    return run


class Committer:
    def __init__(self, store: Store, limiter: trio.CapacityLimiter | None = None) -> None:
        #: a queue's name for the transition counters (the spool sets it)
        self.queue_name: Callable[[int | None], str] = lambda queue: str(queue)
        #: told of each name a committed function made unasked (``moves.NAMED``)
        self.on_named: Callable[[int, bytes], None] = lambda parent, name: None
        self.store = store
        #: the worker threads a networked store's calls may take at once (its pool's size)
        self.limiter = limiter
        self._queue: list[_Request] = []
        self._leading = False
        self._closed = False
        self._running = False
        self._idle = trio.Event()
        self._stop = trio.Event()
        self.batches = 0
        #: batches whose commit began: more than ``batches`` while one is under way (in a
        #: worker thread, the loop answering meanwhile)
        self.started = 0
        self.requests = 0
        self.syncs = 0
        self._committed = 0  # batches committed so far (deferred sync: a log position)
        self._synced = 0  # every batch up to this one is on disk
        self._syncing = False
        self._synced_event = trio.Event()
        self._want_sync = 0  # durable requests waiting for a sync
        #: how long the store's sync takes lately (ns, a running average; None: not yet known)
        self.sync_ns: float | None = None

    async def submit(self, fn: Callable[[WriteTx], T], durable: bool = True) -> T:
        """Run ``fn`` in a transaction; return its result once committed (and fsynced if
        ``durable``), or raise what it raised (its changes rolled back)."""
        if self._closed:
            raise StoreFailure("the spool is shutting down")
        if not self._running:
            # Before the loop runs (recovery, tests): commit directly.
            ok, value = self.store.run_batch([_recording(fn)], durable)[0]
            if not ok:
                raise value
            return cast(T, self._counted(value))
        req = _Request(fn, durable)
        self._queue.append(req)
        if self._leading:
            await req.done.wait()
        else:
            await self._lead()
        if not req.ok:
            raise req.value
        if durable and self.store.deferred_sync:
            await self._sync_to(req.batch)
        return cast(T, req.value)

    async def _sync_to(self, batch: int) -> None:
        """Return once batch number ``batch`` is on disk: start a sync if none is running (it
        covers every batch committed so far), else wait for the running one and look again.
        A request told its transition is durable must be so: where it waits, it waits in a
        shielded scope; a lone request syncs on the loop at once, with no wait to shield."""
        self._want_sync += 1
        try:
            if self._synced < batch and self._alone():
                await self._sync_once(on_loop=True)  # awaits nothing: no cancel point
            if self._synced < batch:
                with trio.CancelScope(shield=True):
                    await self._sync_waiting(batch)
        finally:
            self._want_sync -= 1

    def _alone(self) -> bool:
        """No sync running, nobody to share one with, and the disk fast (``SYNC_ON_LOOP_NS``):
        the kernel serializes renames across directories, so a lone claim or writer would only
        pay the hand-off to a thread and back, which costs more than such a sync."""
        return not self._syncing and self._want_sync == 1 and not self._queue \
            and not self._leading and self.sync_ns is not None \
            and self.sync_ns < SYNC_ON_LOOP_NS

    async def _sync_waiting(self, batch: int) -> None:
        while self._synced < batch:
            if self._syncing:
                await self._synced_event.wait()
            else:
                await self._sync_once(on_loop=self._alone())

    async def _sync_once(self, on_loop: bool) -> None:
        """One sync of every batch committed so far: on the loop's thread, or in a worker
        thread while the loop goes on. How long the disk took is timed where it ran."""
        target, start = self._committed, perf_counter_ns()
        self._syncing = True
        try:
            took = self._timed_sync() if on_loop \
                else await trio.to_thread.run_sync(self._timed_sync)
            self._synced = max(self._synced, target)
            self.syncs += 1
            self.sync_ns = took if self.sync_ns is None \
                else self.sync_ns + _SYNC_WEIGHT * (took - self.sync_ns)
            TIMINGS.sync(perf_counter_ns() - start)
        finally:
            self._syncing = False
            self._synced_event.set()
            self._synced_event = trio.Event()

    def _timed_sync(self) -> int:
        """The store's sync; how long the disk took (ns)."""
        start = perf_counter_ns()
        self.store.sync()
        return perf_counter_ns() - start

    async def _lead(self) -> None:
        """Commit batches until the queue is empty. Never cancelled, for others wait on this
        task: its schedule point raises no ``Cancelled``, and a batch handed to a worker thread
        waits in a shielded scope (``_commit``). (A shielded scope around the whole costs
        7-8 µs per batch, at every commit.)"""
        self._leading = True
        self._idle = trio.Event()
        try:
            while self._queue:
                await trio.lowlevel.cancel_shielded_checkpoint()  # let requests already passed join
                batch, self._queue = self._queue, []
                await self._commit(batch)
        finally:
            self._leading = False
            self._idle.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept requests from the event loop until ``close``; then wait for the last batch."""
        self._running = True
        task_status.started()
        try:
            await self._stop.wait()
        finally:
            with trio.CancelScope(shield=True):
                if self._leading:
                    await self._idle.wait()
            self._running = False

    async def _commit(self, batch: list[_Request]) -> None:
        durable = any(r.durable for r in batch) and not self.store.deferred_sync
        fns = [_recording(r.fn) for r in batch]
        self.started += 1
        start = perf_counter_ns()
        try:
            if self.store.blocking:  # a database server: the loop keeps answering meanwhile
                with trio.CancelScope(shield=True):
                    results = await trio.to_thread.run_sync(self.store.run_batch, fns, durable,
                                                            limiter=self.limiter)
            else:
                try:
                    results = self.store.run_batch(fns, durable, wait=False)
                except StoreBusy:
                    with trio.CancelScope(shield=True):
                        results = await trio.to_thread.run_sync(self.store.run_batch, fns,
                                                                durable)
        except StoreFailure as e:
            results = [(False, e)] * len(batch)
        except Exception as e:  # never leave a request unanswered
            log.exception("commit failed")
            results = [(False, StoreFailure(str(e)))] * len(batch)
        self.batches += 1
        self.requests += len(batch)
        self._committed = self.batches
        TIMINGS.commit(perf_counter_ns() - start, len(batch))
        for req, (ok, value) in zip(batch, results, strict=False):
            req.ok, req.value, req.batch = ok, self._counted(value) if ok else value, \
                self.batches
            req.done.set()

    def _counted(self, result: _Moved) -> Any:
        """Count a committed function's transitions, and have the names it made unasked
        dropped from the kernel's cache (``on_named``); its own result."""
        for action, queue in result.moved:
            TIMINGS.moved(action, self.queue_name(queue))
        for parent, name in result.named:
            self.on_named(parent, name)
        return result.value

    def close(self) -> None:
        """No new requests; the batch under way still commits and answers."""
        self._closed = True
        self._stop.set()
