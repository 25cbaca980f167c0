"""Where an upload's writes run: on the event loop while they take memory's time, in worker
threads for a while once one has waited on the disk.

A write into a staging file is a copy into the page cache: a 1 MiB write takes about 1 ms
here. When a writer's dirty pages outrun the disk, the kernel holds the writing thread back
(dirty-page throttling: pauses of milliseconds each, up to 200 ms, until the disk catches
up); on the loop's thread such a pause holds every request of the mount. Nothing tells
beforehand (ext4 refuses ``RWF_NOWAIT`` for buffered writes), so each write is timed: one
that took longer than ``WAITED_NS`` (and 1 ns per byte, memory's pace) and slept meanwhile
(a voluntary context switch of its thread, ``getrusage``) waited on the disk, and the writes
of the next ``OFF_LOOP_NS`` run in worker threads, each slow one there extending it. The
first pause still falls on the loop; the hand-off to a thread and back (100-200 µs of the
loop's time, and a write's wait for the interpreter lock after it) is paid only while the
disk lags. A write that took as long without sleeping lost its CPU instead: to another
thread, or, on a virtual machine, to the host taking the machine's CPU away for a few ms
(on a 2-core virtual machine, 10 of 14 such writes while 4 GiB were written; each had sent
the next second's writes to threads, 1.46 ms for 1 MiB on average instead of 1.13). A thread
would not have made it faster: writes stay on the loop. A wait for the interpreter lock
after the write is a sleep too, and still counts.

Only the ``pwrite`` runs in the thread: a write is checked (not published yet) and accounted
(the running hash, the early writeback) on the loop, in the order the writes end. Writes
under way in threads are counted per upload: a publish waits for its upload's writes to
land (``landed``) before it looks whether one failed and seals what was written, so a write
that passed its check before a publish is in the content it hashes, or the publish is
refused as for any failed write. A truncation is counted the same way from its first wait to
the end of its cut (one that frees much of the disk runs in a worker thread: freeing a file's
blocks takes as long as removing it): a publish or a link seals what it left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from resource import RUSAGE_THREAD, getrusage
from time import monotonic_ns, perf_counter_ns
from typing import Any, TypeVar

import trio

from spoolfs.service.content import Handle

log = logging.getLogger(__name__)

T = TypeVar("T")

#: a write that took longer than this (plus 1 ns per byte) waited on the disk
WAITED_NS = 2_000_000
#: after such a write, writes run in worker threads for this long
OFF_LOOP_NS = 1_000_000_000


class WritePace:
    __slots__ = ("off_loop_until", "_under_way", "_landed")

    def __init__(self) -> None:
        #: ``monotonic_ns`` until which writes run in worker threads
        self.off_loop_until = 0
        #: upload id -> its changes under way (writes in threads, truncations)
        self._under_way: dict[int, int] = {}
        self._landed = trio.Event()

    async def pwrite(self, h: Handle, off: int, buf: bytes) -> int:
        """``h.pwrite(off, buf)``, timed, on the loop's thread or in a worker thread (the
        checks before it and the accounting after it are the caller's, on the loop)."""
        if monotonic_ns() >= self.off_loop_until:
            return self._timed(h, off, buf)
        return await self.changing(h.entry_id, self._timed, h, off, buf)

    async def changing(self, upload: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, ``under_way`` until it returns (a write, a
        truncation that frees much)."""
        with self.under_way(upload):  # (not abandoned when cancelled: it lands first)
            return await trio.to_thread.run_sync(fn, *args)

    @contextmanager
    def under_way(self, upload: int) -> Iterator[None]:
        """``upload`` counted as changing while the body runs: ``landed`` waits for it."""
        self._under_way[upload] = self._under_way.get(upload, 0) + 1
        try:
            yield
        finally:
            left = self._under_way.pop(upload) - 1
            if left:
                self._under_way[upload] = left
            else:
                self._landed.set()
                self._landed = trio.Event()

    async def landed(self, upload: int) -> None:
        """Once no change of ``upload`` is under way."""
        while upload in self._under_way:
            await self._landed.wait()

    def _timed(self, h: Handle, off: int, buf: bytes) -> int:
        sleeps = getrusage(RUSAGE_THREAD).ru_nvcsw  # (1 µs)
        start = perf_counter_ns()
        try:
            return h.pwrite(off, buf)
        finally:
            took = perf_counter_ns() - start
            if took > WAITED_NS + len(buf) and getrusage(RUSAGE_THREAD).ru_nvcsw != sleeps:
                now = monotonic_ns()
                if now >= self.off_loop_until:
                    log.debug("a write of %d bytes waited %.1f ms on the disk: writes run in "
                              "worker threads for now", len(buf), took / 1e6)
                self.off_loop_until = now + OFF_LOOP_NS
