"""pyfuse3's request loop without a second task woken for every request.

pyfuse3 runs its loop in several trio tasks, so that a request that waits (for a sync, for a
writer's close) does not stop the others: each task takes a lock, waits until ``/dev/fuse``
has a request, lets the lock go, reads the request and runs its handler. With a plain
``trio.Lock`` every release hands the lock to the next task at once, which wakes up only to
wait on ``/dev/fuse`` again, while the first, its handler done without ever blocking (most
requests), comes back and waits for the lock: one task switch more per request.

Here the lock goes to a waiting task only when its releaser's step ends somewhere other than
back in the loop: when the handler blocks (a commit, a sync, a thread), as before; a handler
that finishes without blocking finds the lock free and keeps it. pyfuse3 takes its lock and
the rest of trio from its module's ``trio`` name, as its own asyncio mode does (pyfuse3.asyncio
replaces it): ``install`` puts there a module that is trio but for ``Lock``, and the
instrument that ``trio.run`` must be given does the deferred hand-over. Without it (another
``trio.run``, or an instrument trio dropped because it raised) the first release with a task
waiting would leave every request unread: the lock serves pyfuse3's loop and nothing else.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pyfuse3
import trio

log = logging.getLogger(__name__)


class ReaderLock:
    """The lock pyfuse3 holds while it waits for a request (``async with`` only)."""

    def __init__(self) -> None:
        self._owner: trio.lowlevel.Task | None = None
        self._waiting = trio.lowlevel.ParkingLot()
        #: released while others wait, its step not yet ended: they are woken at its end
        #: unless it took the lock back first
        self._released_by: trio.lowlevel.Task | None = None

    async def __aenter__(self) -> None:
        task = trio.lowlevel.current_task()
        if self._owner is None:
            self._owner = task
            self._released_by = None
            return  # no checkpoint here: wait_readable, right after, is one
        await self._waiting.park()  # the task that wakes this one made it the owner
        assert self._owner is task

    async def __aexit__(self, *exc: object) -> None:
        self._owner = None
        if self._waiting:
            self._released_by = trio.lowlevel.current_task()

    def step_ended(self, task: trio.lowlevel.Task) -> None:
        if task is self._released_by:
            self._released_by = None
            if self._owner is None and self._waiting:
                (self._owner,) = self._waiting.unpark()


class _Handover(trio.abc.Instrument):
    def __init__(self, lock: ReaderLock) -> None:
        self.lock = lock

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.lock.step_ended(task)


class _TrioForPyfuse3(types.ModuleType):
    """trio, but for ``Lock``. trio's names are copied in, so that the loop's lookups of
    ``trio.lowlevel`` at each request find them without a call to ``__getattr__``."""

    def __init__(self, lock: ReaderLock) -> None:
        super().__init__("trio")
        vars(self).update((k, v) for k, v in vars(trio).items()
                          if not k.startswith("__") and k != "Lock")
        self.lock = lock

    def Lock(self) -> ReaderLock:  # noqa: N802 (trio's name)
        return self.lock

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)


def install() -> list[trio.abc.Instrument]:
    """Give pyfuse3 the lock; return the instruments for the ``trio.run`` of ``pyfuse3.main``
    (none, leaving pyfuse3 as it is, where its ``trio`` is not trio: its asyncio mode).
    pyfuse3 asks for its lock at each ``init``, when its loop first runs: always this one."""
    current = getattr(pyfuse3, "trio", None)
    if isinstance(current, _TrioForPyfuse3):  # a session before this one made its lock
        return [_Handover(current.lock)]
    if current is not trio:
        log.info("pyfuse3 does not run on trio here: its own request loop is kept")
        return []
    lock = ReaderLock()
    pyfuse3.trio = _TrioForPyfuse3(lock)  # type: ignore[attr-defined]
    return [_Handover(lock)]
