"""Group commit: concurrent requests share one transaction and one fsync.

Each request is a function of a ``WriteTx``. The first request to arrive while no commit is
under way leads: it yields once, so that requests the kernel has already passed can join, then
commits everything queued as one batch (each request in its own savepoint), and keeps going
while more arrived meanwhile. The others wait for their batch. A request returns only after its
batch committed.

The batch runs on the event loop's thread: handing it to a worker thread and back costs more
(about 175 µs on a 2-core machine) than the fsync it would overlap, and on one mount the kernel
already serializes cross-directory renames, so there is little to overlap. Requests that arrive
while a commit is on disk wait in the kernel and form the next batch. Only when another daemon
holds the store's write lock does the batch go to a worker thread to wait for it, so a slow
neighbour never stalls this mount's reads. A store whose commits wait on the network
(``Store.blocking``: a database server) always commits in a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import trio

from spoolfs.core.errors import StoreFailure
from spoolfs.store.base import Store, StoreBusy, WriteTx

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Request:
    __slots__ = ("fn", "durable", "done", "ok", "value")

    def __init__(self, fn: Callable[[WriteTx], Any], durable: bool) -> None:
        self.fn = fn
        self.durable = durable
        self.done = trio.Event()
        self.ok = False
        self.value: Any = None


class Committer:
    def __init__(self, store: Store, limiter: trio.CapacityLimiter | None = None) -> None:
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
        self.requests = 0

    async def submit(self, fn: Callable[[WriteTx], T], durable: bool = True) -> T:
        """Run ``fn`` in a transaction; return its result once committed (and fsynced if
        ``durable``), or raise what it raised (its changes rolled back)."""
        if self._closed:
            raise StoreFailure("the spool is shutting down")
        if not self._running:
            # Before the loop runs (recovery, tests): commit directly.
            ok, value = self.store.run_batch([fn], durable)[0]
            if not ok:
                raise value
            return cast(T, value)
        req = _Request(fn, durable)
        self._queue.append(req)
        if self._leading:
            await req.done.wait()
        else:
            await self._lead()
        if not req.ok:
            raise req.value
        return cast(T, req.value)

    async def _lead(self) -> None:
        """Commit batches until the queue is empty. Shielded: others wait on this task."""
        self._leading = True
        self._idle = trio.Event()
        try:
            with trio.CancelScope(shield=True):
                while self._queue:
                    await trio.lowlevel.checkpoint()  # let requests already passed join
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
        durable = any(r.durable for r in batch)
        fns = [r.fn for r in batch]
        try:
            if self.store.blocking:  # a database server: the loop keeps answering meanwhile
                results = await trio.to_thread.run_sync(self.store.run_batch, fns, durable,
                                                        limiter=self.limiter)
            else:
                try:
                    results = self.store.run_batch(fns, durable, wait=False)
                except StoreBusy:
                    results = await trio.to_thread.run_sync(self.store.run_batch, fns, durable)
        except StoreFailure as e:
            results = [(False, e)] * len(batch)
        except Exception as e:  # never leave a request unanswered
            log.exception("commit failed")
            results = [(False, StoreFailure(str(e)))] * len(batch)
        self.batches += 1
        self.requests += len(batch)
        for req, (ok, value) in zip(batch, results, strict=False):
            req.ok, req.value = ok, value
            req.done.set()

    def close(self) -> None:
        """No new requests; the batch under way still commits and answers."""
        self._closed = True
        self._stop.set()
