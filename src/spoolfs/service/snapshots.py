"""The status snapshot as the daemon serves it (``MOUNT/.spool/``, ``--metrics-listen``).

Its cost grows with the number of messages (seconds at a million), so it never runs on the
event loop, whose every request it would stall meanwhile (DESIGN §10): a worker thread computes
it on the store's own scan connection. Readers share it: one is computed at a time, readers
that come while it is under way wait for it, and it is reused while nothing was committed
through this daemon and it is younger than ``MAX_AGE_S`` (changes made by other daemons on
the same store show within that). A reader never gets one that began before its own earlier
writes were committed. Between two computations the thread rests at least as long as the last
one took, so a reader in a loop keeps it busy half the time at most.

Each caller sees only the queues whose directory it may search (DESIGN §8).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from spoolfs.service.roles import SEARCH, Caller, allowed

#: seconds a snapshot may be reused when nothing was committed through this daemon since
MAX_AGE_S = 1.0


@dataclass(frozen=True, slots=True)
class Full:
    """A snapshot of every queue, and who may see each: name -> (id, mode, uid, gid)."""

    data: dict[str, Any]
    access: dict[str, tuple[int, int, int, int]]


class _Round:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.started = -math.inf  # trio clock
        self.commits = -1  # commits through this daemon before it started
        self.value: Full | None = None

    def serves(self, asked: float, seen: int) -> bool:
        """Whether it may answer a reader that asked at ``asked`` after ``seen`` commits."""
        return self.value is not None and self.commits >= seen and \
            self.started >= asked - MAX_AGE_S


class Snapshots:
    """``compute`` makes a ``Full`` snapshot (it runs in a worker thread); ``commits`` counts
    the commits made through this daemon so far."""

    def __init__(self, compute: Callable[[], Full], commits: Callable[[], int]) -> None:
        self._compute = compute
        self._commits = commits
        self._last: _Round | None = None  # the latest computed
        self._next: _Round | None = None  # the one under way (or resting before it starts)
        self._not_before = -math.inf
        self.computed = 0

    async def get(self) -> Full:
        asked, seen = trio.current_time(), self._commits()
        while True:
            last = self._last
            if last is not None and last.serves(asked, seen):
                assert last.value is not None
                return last.value
            if self._next is None:
                return await self._run()
            await self._next.done.wait()  # then it serves, or it began too early: one more

    async def _run(self) -> Full:
        r = self._next = _Round()
        try:
            await trio.sleep_until(self._not_before)
            r.commits, r.started = self._commits(), trio.current_time()
            value = await trio.to_thread.run_sync(self._compute)
            r.value = value
            self._last = r
            self.computed += 1
            return value
        finally:  # a failed or cancelled round lets the next reader start another
            if r.started > -math.inf:
                end = trio.current_time()
                self._not_before = end + (end - r.started)
            self._next = None
            r.done.set()


def shown_to(full: Full, caller: Caller | None, only_queue: int | None = None
             ) -> dict[str, Any]:
    """The snapshot as ``caller`` may see it: the queues whose directory it may search (root
    sees all; ``None`` is the daemon's own HTTP endpoint, which shows all too), and only
    queue ``only_queue`` when given (a mount of one queue)."""

    def shown(name: str) -> bool:
        qid, mode, uid, gid = full.access[name]
        if only_queue is not None and qid != only_queue:
            return False
        return caller is None or caller.uid == 0 or allowed(mode, uid, gid, caller, SEARCH)

    return {**full.data,
            "queues": {n: q for n, q in full.data["queues"].items() if shown(n)}}
