"""Other hosts' changes, seen here within about a second (DESIGN §6 "Coherence").

A shared store writes a change log in the same transaction as every change and notifies once
per commit. Each daemon tails it: woken by the notification, or every ``POLL`` seconds since
notifications are lossy, and after a reconnect from the last sequence it saw. For each change
made by another daemon it drops what the kernel may have cached of the entry (its names, old
and new, and its attributes), with the asynchronous invalidation calls only: never the
synchronous ones from a handler, which would deadlock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import trio

from spoolfs.core.errors import SpoolError
from spoolfs.service.left_names import LeftNames

log = logging.getLogger(__name__)

POLL = 1.0  # seconds: the longest a change of another host waits to be seen here
PAGE = 1000  # changes read at once
RETRY = 1.0  # seconds between attempts while the store is unreachable


class Change(Protocol):
    seq: int
    entry_id: int
    origin: str


@runtime_checkable
class ChangeFeed(Protocol):
    origin: str

    def last_change(self) -> int: ...

    def changes_since(self, seq: int, limit: int = ...) -> Sequence[Any]: ...

    def wait_changes(self, timeout: float) -> bool: ...


def places(change: Any) -> list[tuple[int, bytes]]:
    """The (parent, name) pairs a change may have made stale: where the entry was and where
    it is now (a change row carries whichever it knows)."""
    out = []
    for p, n in (("old_parent", "old_name"), ("parent", "name")):
        parent, name = getattr(change, p, None), getattr(change, n, None)
        if parent is not None and name is not None:
            out.append((int(parent), bytes(name)))
    return out


class Follower:
    def __init__(self, feed: ChangeFeed, on_gone: Callable[[int, bytes], None],
                 on_stale: Callable[[list[int]], None],
                 limiter: trio.CapacityLimiter | None = None,
                 left_names: LeftNames | None = None) -> None:
        self.feed = feed
        self.on_gone = on_gone
        self.on_stale = on_stale
        self.limiter = limiter
        #: told of the names other hosts' changes free and take, once the kernel is told
        self.left_names = left_names
        self.seq: int | None = None
        self.seen = 0  # changes of other daemons applied here

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        started = False
        while True:
            try:
                if self.seq is None:
                    self.seq = await self._call(self.feed.last_change)
                if not started:
                    task_status.started()
                    started = True
                await self.catch_up()
                await self._call(self.feed.wait_changes, POLL)
            except SpoolError as e:  # the store is away: keep the last sequence, try again
                log.warning("following changes of other hosts: %s", e)
                if not started:
                    task_status.started()
                    started = True
                await trio.sleep(RETRY)

    async def catch_up(self) -> int:
        """Apply every change after the last one seen; returns how many were others'."""
        n = 0
        assert self.seq is not None
        while True:
            batch = await self._call(self.feed.changes_since, self.seq, PAGE)
            if not batch:
                return n
            gone: list[tuple[int, bytes]] = []
            stale: list[int] = []
            others = []
            for ch in batch:
                self.seq = max(self.seq, int(ch.seq))
                if ch.origin == self.feed.origin:
                    continue  # this daemon's own: the kernel was told as it happened
                others.append(ch)
                gone.extend(places(ch))
                stale.append(int(ch.entry_id))
            for parent, name in dict.fromkeys(gone):
                self.on_gone(parent, name)
            if self.left_names is not None:
                self.left_names.changes((int(ch.entry_id), ch.parent, ch.name, ch.old_parent,
                                         ch.old_name) for ch in others)
            if stale:
                self.on_stale(list(dict.fromkeys(stale)))
            n += len(stale)
            self.seen += len(stale)
            if len(batch) < PAGE:  # the end (a commit after it notifies again)
                return n
