"""Group commit: concurrent requests share one transaction and one fsync.

Each request is a function of a ``WriteTx``; the committer runs every request queued while the
previous commit was on disk in one batch (each in its own savepoint), in a worker thread so the
event loop keeps taking requests. A request returns only after its batch committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from spoolfs.core.errors import StoreFailure
from spoolfs.store.base import Store, WriteTx

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
    def __init__(self, store: Store) -> None:
        self.store = store
        self._queue: list[_Request] = []
        self._wakeup = trio.Event()
        self._closed = False
        self._running = False
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
            return value  # type: ignore[no-any-return]
        req = _Request(fn, durable)
        self._queue.append(req)
        self._wakeup.set()
        await req.done.wait()
        if not req.ok:
            raise req.value
        return req.value  # type: ignore[no-any-return]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Commit batches until ``close`` is called and the queue is drained."""
        self._running = True
        task_status.started()
        try:
            while True:
                if not self._queue:
                    if self._closed:
                        return
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    continue
                batch, self._queue = self._queue, []
                await self._commit(batch)
        finally:
            self._running = False

    async def _commit(self, batch: list[_Request]) -> None:
        durable = any(r.durable for r in batch)
        fns = [r.fn for r in batch]
        try:
            results = await trio.to_thread.run_sync(self.store.run_batch, fns, durable)
        except StoreFailure as e:
            results = [(False, e)] * len(batch)
        except Exception as e:  # never leave a request unanswered
            log.exception("commit failed")
            results = [(False, StoreFailure(str(e)))] * len(batch)
        self.batches += 1
        self.requests += len(batch)
        for req, (ok, value) in zip(batch, results):
            req.ok, req.value = ok, value
            req.done.set()

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()
