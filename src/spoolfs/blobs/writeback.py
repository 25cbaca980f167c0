"""Early writeback of large uploads: their pages go to disk while they are still written.

Publishing a large upload fsyncs it; with nothing written back before, that fsync writes the
whole file then (the kernel starts background writeback only at its dirty thresholds,
gigabytes on a large machine), and the ``mv`` into ``ready/`` waits for all of it. Asking the
kernel to start writing each stretch as it completes (``sync_file_range`` with
``SYNC_FILE_RANGE_WRITE``: a hint, never a durability promise) leaves the fsync at publish
only the tail. The call can block while the device's queue is full, so one thread of its
own makes the calls; the event loop only hands it a duplicate of the descriptor.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: an upload is asked to be written back each time this much more of it has been written
STEP = 8 << 20
SYNC_FILE_RANGE_WRITE = 2
#: kicks waiting for the thread; more are dropped (each is only a hint)
BACKLOG = 64


def _libc_sync_file_range() -> Callable[[int, int, int], None] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start(fd: int, off: int, length: int) -> None:
        if fn(fd, off, length, SYNC_FILE_RANGE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return start


class Writeback:
    """Starts the writeback of files handed to ``kick`` in a thread of its own."""

    def __init__(self, start: Callable[[int, int, int], None] | None = None) -> None:
        self._start = start if start is not None else _libc_sync_file_range()
        self._queue: queue.Queue[tuple[int, int, int]] = queue.Queue(BACKLOG)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def kick(self, fd: int, off: int, length: int) -> None:
        """Have ``length`` bytes from ``off`` of the file open on ``fd`` written back soon
        (the descriptor stays the caller's: the thread works on a duplicate)."""
        if self._start is None:
            return
        try:
            dup = os.dup(fd)
        except OSError:
            return
        try:
            self._queue.put_nowait((dup, off, length))
        except queue.Full:
            os.close(dup)
            return
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="spoolfs-writeback")
                    self._thread.start()

    def _run(self) -> None:
        assert self._start is not None
        while True:
            fd, off, length = self._queue.get()
            try:
                self._start(fd, off, length)
            except OSError as e:  # a hint that could not be given: the fsync does it all
                log.debug("writeback hint failed: %s", e)
            finally:
                os.close(fd)
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every kick so far was handed to the kernel (tests)."""
        self._queue.join()


WRITEBACK = Writeback()
