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
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

#: a file that takes up to this much of the disk (one block) is removed at once: freeing it
#: is quick (a message of up to 4 KiB: the staging file of most uploads)
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
    worker thread: ``close_all``); else None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    fd = None
    if st.st_nlink == 1 and is_large(st):
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
    try:
        threading.Thread(target=close_all, args=([fd],), name="spoolfs-freeing",
                         daemon=True).start()
    except RuntimeError:  # no thread to be had: here, then
        close_all([fd])


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
