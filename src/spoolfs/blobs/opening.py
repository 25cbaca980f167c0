"""Opening a content file on the event loop only when the kernel needs no disk to find it.

An ``open`` looks its path up, and a path not in the kernel's dentry cache reads directory
blocks (``blobs/ab/cd/`` and the file's inode): milliseconds each on a slow or cold disk,
while every request of the mount waits. In a store of many contents most paths fall out of
the cache between reads. ``openat2`` with ``RESOLVE_CACHED`` (Linux 5.12) opens only a path
the cache holds whole, and says EAGAIN otherwise: the caller then opens it in a worker
thread. Where the kernel lacks it (ENOSYS; EINVAL for the flag) or a sandbox refuses the
call (EPERM), files are opened as before, on the caller's thread, and the log says so once.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os

log = logging.getLogger(__name__)

SYS_OPENAT2 = 437  # x86-64, arm64 and the other generic tables (elsewhere: ENOSYS, below)
RESOLVE_CACHED = 0x20
AT_FDCWD = -100


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_supported = True
#: (O_CLOEXEC: not inherited by children, as os.open's descriptors)
_EXTRA = os.O_CLOEXEC | getattr(os, "O_LARGEFILE", 0)  # (0 on 64-bit: glibc's open adds it)
_READ = ctypes.byref(_OpenHow(os.O_RDONLY | _EXTRA, 0, RESOLVE_CACHED))
_HOW_SIZE = ctypes.sizeof(_OpenHow)


def open_cached(path: str, flags: int = os.O_RDONLY) -> int | None:
    """``os.open(path, flags)`` if every part of ``path`` is in the kernel's cache; None when
    the disk would have to be read to find it (a missing file too, unless the cache knows it
    is missing: then FileNotFoundError, as ``os.open`` raises). ``flags`` must create and
    truncate nothing (``RESOLVE_CACHED`` refuses them)."""
    global _supported
    if not _supported:
        return os.open(path, flags)
    how = _READ if flags == os.O_RDONLY else \
        ctypes.byref(_OpenHow(flags | _EXTRA, 0, RESOLVE_CACHED))
    fd: int = _syscall(SYS_OPENAT2, AT_FDCWD, os.fsencode(path), how, _HOW_SIZE)
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err == errno.EAGAIN:
        return None
    if err in (errno.ENOSYS, errno.EINVAL, errno.EPERM):  # no openat2, or no such flag
        _supported = False
        log.info("openat2 with RESOLVE_CACHED is not available (%s): content files are "
                 "opened on the event loop", errno.errorcode.get(err, err))
        return os.open(path, flags)
    raise OSError(err, os.strerror(err), path)
