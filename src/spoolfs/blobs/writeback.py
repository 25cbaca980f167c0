"""Early writeback of large uploads: their pages go to disk while they are still written, and
the data of very large ones is made durable as it goes.

Publishing a large upload fsyncs it; with nothing written back before, that fsync writes the
whole file then (the kernel starts background writeback only at its dirty thresholds,
gigabytes on a large machine), and the ``mv`` into ``ready/`` waits for all of it. Asking the
kernel to start writing each stretch as it completes (``sync_file_range`` with
``SYNC_FILE_RANGE_WRITE``: a hint, never a durability promise) leaves the fsync at publish
only the tail. The call can block while the device's queue is full, so one thread of its
own makes the calls; the event loop only hands it a duplicate of the descriptor.

Written back is not yet durable: the fsync at publish still has the disk flush its cache,
and on a virtual disk the host write out what it holds of the file, which takes as long as
writing it (0.3-0.45 s for 256 MiB on this kind of virtual machine, whether the pages were
written back before or not). So every ``SYNC_STEP`` of an upload, the thread also fdatasyncs
it: the fsync at publish then has at most that much left to make durable. The kicks of an
upload removed while they wait write nothing (its file has no name left).

An fsync reports a writeback error once: a later fsync through a descriptor opened after
it (the seal opens the staging file at publish) no longer sees it. An early sync that fails
is therefore kept under the key its kick gave, as is a failed sync of the seal itself
(``sync_failed``), and the seal asks for it once the syncs of that upload still queued or
under way are done: that publish, and every later one of the same upload, fails; nothing is
published that the disk did not take. The key goes when the upload does (``forget``).

That memory ends with the daemon, and a daemon started again is told nothing by the kernel:
so the file itself is marked too (``SYNC_FAILED``, by whichever sync failed: an early one, the
seal's, or the writer's own ``fsync``), and the seal of a marked file fails as well.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import queue
import stat
import threading
from collections.abc import Callable, Hashable

from spoolfs.blobs.threads import started

log = logging.getLogger(__name__)

#: an upload is asked to be written back each time this much more of it has been written
STEP = 8 << 20
#: and its data made durable each time this much more (a multiple of STEP)
SYNC_STEP = 64 << 20
SYNC_FILE_RANGE_WRITE = 2
#: kicks waiting for the thread; more are dropped (each is only a hint)
BACKLOG = 64
#: The mark of a staging file a sync of which failed: set-group-ID without group execute,
#: which means nothing for a file nobody runs and which no write clears (the kernel clears
#: set-user-ID at an unprivileged writer's every write, set-group-ID only with group execute
#: or, since Linux 6.2, for a writer outside the file's group: the daemon owns its files).
#: A cut to nothing clears it (``cut_to_nothing``).
SYNC_FAILED = stat.S_ISGID


def mark_failed(fd: int) -> None:
    """Mark the file open on ``fd``: a sync of it failed (``SYNC_FAILED``). A mark that cannot
    be set is logged; this daemon's memory still refuses the upload until it ends."""
    try:
        os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | SYNC_FAILED)
        if not failed_before(os.fstat(fd).st_mode):  # (a file not of its owner's group)
            raise OSError(errno.EPERM, "the file system dropped the set-group-ID bit")
    except OSError as e:
        log.error("a file whose sync failed could not be marked so (%s): a daemon started "
                  "again would not know of the failure", e)


def failed_before(mode: int) -> bool:
    """Whether a file of this ``st_mode`` was marked by ``mark_failed``."""
    return bool(mode & SYNC_FAILED)


def cut_to_nothing(fd: int, key: Hashable, wb: Writeback) -> None:
    """The file open on ``fd`` (kept under ``key``) may just have been cut: if it holds nothing
    now, a sync that failed before concerns bytes it no longer has (a producer's retry writes
    it whole again, and its seal syncs what it writes), so its mark and ``wb``'s memory of the
    failure go. A mark that cannot be cleared stays (logged): the upload stays refused, the
    cut itself is made."""
    try:
        st = os.fstat(fd)
        if st.st_size == 0 and failed_before(st.st_mode):
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~SYNC_FAILED)
    except OSError as e:
        log.error("the mark of a failed sync could not be cleared from a file cut to nothing "
                  "(%s): remove it to publish it", e)
        return
    if st.st_size == 0:
        wb.forget(key)


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
    """Starts the writeback of files handed to ``kick`` in a thread of its own, and makes
    them durable where a kick asks for it."""

    def __init__(self, start: Callable[[int, int, int], None] | None = None,
                 sync: Callable[[int], None] = os.fdatasync) -> None:
        self._start = start if start is not None else _libc_sync_file_range()
        self._sync = sync
        self._queue: queue.Queue[tuple[int, int, int, Hashable | None]] = queue.Queue(BACKLOG)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: early syncs queued or under way, by key; the keys whose early sync failed
        self._syncs = threading.Condition(threading.Lock())
        self._pending: dict[Hashable, int] = {}
        self._failed: set[Hashable] = set()
        #: keys forgotten while syncs of theirs were queued or under way: how many of those
        #: are left (the thread takes kicks in order: they are the key's next to end)
        self._gone: dict[Hashable, int] = {}

    def kick(self, fd: int, off: int, length: int, sync_key: Hashable | None = None) -> None:
        """Have ``length`` bytes from ``off`` of the file open on ``fd`` written back soon
        (the descriptor stays the caller's: the thread works on a duplicate); with
        ``sync_key``, then fdatasync it, a failure kept under that key (``sync_failed``)."""
        if self._start is None or self._thread is None and not self._started():
            return  # (no thread to be had: the fsync at publish does it all)
        try:
            dup = os.dup(fd)
        except OSError:
            return
        with self._syncs:
            try:
                self._queue.put_nowait((dup, off, length, sync_key))
            except queue.Full:
                os.close(dup)
                return
            if sync_key is not None:
                self._pending[sync_key] = self._pending.get(sync_key, 0) + 1

    def _started(self) -> bool:
        """Start the thread; False when none is to be had (it is asked again at the next
        kick): a kick queued with no thread to run it would leave its publish waiting."""
        with self._lock:
            if self._thread is None:
                self._thread = started(self._run, "spoolfs-writeback")
                if self._thread is None:
                    log.warning("no thread for early writeback: publishes sync it all")
            return self._thread is not None

    def sync_failed(self, key: Hashable) -> bool:
        """Whether a sync of the file under ``key`` failed (an early one, once those still
        queued or under way are done: blocking, a worker thread; or one ``failed`` told)."""
        with self._syncs:
            while key in self._pending:
                self._syncs.wait()
            return key in self._failed

    def failed(self, key: Hashable) -> None:
        """A sync of the file under ``key`` failed elsewhere (the seal's)."""
        with self._syncs:
            self._failed.add(key)

    def any_failed(self) -> bool:
        """Whether any sync failure is kept (read without the lock: a hint)."""
        return bool(self._failed)

    def any_pending(self) -> bool:
        """Whether any early sync is queued or under way (read without the lock: a hint)."""
        return bool(self._pending)

    def forget(self, key: Hashable) -> None:
        """The upload under ``key`` is gone: no sync of it is asked about any more, and a
        failure of one still queued or under way is not kept."""
        with self._syncs:
            self._failed.discard(key)
            if key in self._pending:
                self._gone[key] = self._pending[key]

    def _run(self) -> None:
        assert self._start is not None
        while True:
            fd, off, length, key = self._queue.get()
            failed = key is not None  # until its sync returned
            try:
                if os.fstat(fd).st_nlink == 0:  # removed meanwhile: nothing to write for
                    failed = False
                    continue
                try:
                    self._start(fd, off, length)
                except OSError as e:  # a hint that could not be given: the fsync does it all
                    log.debug("writeback hint failed: %s", e)
                if key is not None:
                    self._sync(fd)
                    failed = False
            except Exception as e:  # never the end of the thread: the next kicks wait for it
                if failed:  # marked first: another daemon's seal may look at any moment
                    mark_failed(fd)
                    log.warning("an early sync of %s failed (%s): its publish will fail",
                                key, e)
                else:
                    log.warning("writeback hint failed: %s", e)
            finally:
                os.close(fd)
                if key is not None:
                    self._synced(key, failed)
                self._queue.task_done()

    def _synced(self, key: Hashable, failed: bool) -> None:
        with self._syncs:
            left = self._pending.pop(key) - 1
            if left:
                self._pending[key] = left
            before = self._gone.pop(key, 0)  # a sync of what was there before ``forget``
            if before > 1:
                self._gone[key] = before - 1
            if failed and not before:
                self._failed.add(key)
            self._syncs.notify_all()

    def drain(self) -> None:
        """Wait until every kick so far was handed to the kernel (tests)."""
        self._queue.join()


WRITEBACK = Writeback()
