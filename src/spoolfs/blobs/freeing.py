"""Removing a file now and freeing its space where waiting for it holds nobody else up.

Removing a file's last name frees its blocks before ``unlink(2)`` returns, and where the file
system is mounted with ``discard`` (usual on virtual disks) it first tells the device of
every freed extent: on this kind of machine 0.14 ms for a file of one 4 KiB block, 1.1 ms
for 8 KiB, 1.7-2 ms for 16-64 KiB, 6 ms for 1 MiB, 0.4 s for 256 MiB, 1.8 s for 1 GiB. On
the event loop's thread that holds every request of the mount. A file still open keeps its
blocks until its last descriptor closes, whatever became of its names: ``detach`` opens a
file that takes more than ``SMALL`` (``O_PATH``: nothing is read), unlinks its name (tens
of µs: the name is gone when it returns, as gc and fsck expect) and returns the descriptor,
whose close frees the blocks: the caller closes it in a worker thread, and its request
waits there for the space as ``rm`` on a plain file system does, while the mount's other
requests go on. A crash in between loses nothing: the kernel frees such a file when the
process exits, or at the next mount after a power cut (the file system's list of orphans).

A file of one block is freed the same way, but by a thread that nobody waits for
(``close_soon``): 0.2-0.4 ms (with ``discard``) is as long as a whole request, a hand-off to a
worker thread and back would cost about as much, and the last close of every small upload's
staging file (removed at its publish) would otherwise pay it on the event loop. It holds at
most ``Closer.LIMIT`` descriptors: on a disk slower at freeing than files are removed, the
caller closes the next one itself, so the removals go at the disk's pace rather than piling up
descriptors against the open-files limit and space the disk guard cannot see freed.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from spoolfs.blobs.threads import started

log = logging.getLogger(__name__)

#: a file that takes up to this much of the disk (one block: the staging file of most uploads)
#: is freed where nobody waits for it (``CLOSER``); a larger one where its request waits
SMALL = 4 << 10


def is_large(st: os.stat_result) -> bool:
    """Whether freeing the file of ``st`` may take long: it takes more than ``SMALL``."""
    return st.st_blocks * 512 > SMALL


def frees_much(st: os.stat_result, size: int) -> bool:
    """Whether cutting the file of ``st`` to ``size`` bytes may take long: it may free more
    than ``SMALL`` (a truncation frees as a removal does)."""
    return st.st_blocks * 512 - size > SMALL


def detach(path: str) -> int | None:
    """Unlink ``path`` (missing: nothing to do). When that leaves a file taking more than
    ``SMALL`` with no name, a descriptor that holds its blocks until it is closed (in a
    worker thread: ``close_all``); else None (a smaller one is freed by ``CLOSER``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    fd = None
    if st.st_nlink == 1 and st.st_blocks:
        try:
            fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError:  # (out of descriptors: removed the plain way)
            fd = None
    try:
        os.unlink(path)
    except FileNotFoundError:  # removed meanwhile (gc, another daemon): maybe this holds it
        if fd is not None and not holds_space(fd):
            os.close(fd)
            fd = None
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    if fd is not None and not is_large(st):
        CLOSER.close_soon(fd)
        return None
    return fd


def holds_space(fd: int) -> bool:
    """Whether closing ``fd`` may free a removed file that takes more than ``SMALL``."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return st.st_nlink == 0 and is_large(st)


def close_later(fd: int) -> None:
    """Close ``fd`` in a thread of its own, waited for by nobody: where no request waits for
    the space (a writers' lock given up after a publish whose content was stored apart)."""
    if started(close_all, "spoolfs-freeing", [fd]) is None:  # no thread to be had: here
        close_all([fd])


class Closer:
    """Closes descriptors of removed small files in a thread of its own, waited for by
    nobody (``close_soon``), holding at most ``limit`` at once; ``drain`` waits for those
    handed to it so far."""

    #: 256 files of a block: 0.05-0.1 s of this kind of disk's discards
    LIMIT = 256

    def __init__(self, limit: int = LIMIT) -> None:
        self._queue: queue.SimpleQueue[int | threading.Event] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.limit = limit
        self._held = 0  # handed over and not yet closed
        self._behind = False  # said so in the log

    def close_soon(self, fd: int) -> None:
        if self._thread is None and not self._start():
            close_all([fd])  # no thread to be had: here, then
            return
        with self._lock:
            full = self._held >= self.limit
            if not full:
                self._held += 1
        if full:  # the disk frees slower than files are removed: at its pace, then
            if not self._behind:
                self._behind = True
                log.info("freeing removed files falls behind the disk (%d waiting): the "
                         "requests that remove them wait for it from now on", self.limit)
            close_all([fd])
            return
        self._queue.put(fd)

    def _start(self) -> bool:
        with self._lock:
            if self._thread is None:
                self._thread = started(self._run, "spoolfs-closer")
            return self._thread is not None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
            else:
                try:
                    close_all([item])
                finally:
                    with self._lock:
                        self._held -= 1

    def drain(self) -> None:
        """Wait until every descriptor handed over so far is closed."""
        if self._thread is not None:
            done = threading.Event()
            self._queue.put(done)
            done.wait()


CLOSER = Closer()


def close_small(fd: int) -> int | None:
    """Close ``fd``: at once unless it holds a removed file. One of a block is closed by
    ``CLOSER``, waited for by nobody; a larger one is returned, to be closed in a worker
    thread that its request waits for (``close_all``)."""
    try:
        st = os.fstat(fd)
    except OSError:
        st = None
    if st is None or st.st_nlink or not st.st_blocks:
        close_all([fd])
        return None
    if is_large(st):
        return fd
    CLOSER.close_soon(fd)
    return None


@dataclass(slots=True)
class Held:
    """What holds the space of files a request removed: descriptors from ``detach``, and
    threads that still read some of those files (a running hash, to the end of its step)
    and close them when they end. ``free`` (blocking) waits for both."""

    fds: list[int] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.fds or self.readers)

    def free(self) -> None:
        try:
            for thread in self.readers:
                thread.join()
        finally:
            close_all(self.fds)


def close_all(fds: Iterable[int]) -> None:
    """Close descriptors from ``detach`` or ``holds_space``, freeing what they held
    (blocking)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError as e:  # (the space is freed all the same)
            log.warning("closing a removed file: %s", e)
