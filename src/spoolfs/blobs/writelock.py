"""Who writes an upload, across the daemons of one store: a lock on its staging file.

Several daemons may mount one embedded store (DESIGN §6). Each counts its own writers of an
upload, but a publish or a link through one seals the staging file (hashes it; its bytes
become the message's, immutable), so a writer through another must be known too. The
staging file carries it: a record lock on one byte far past any content (``AT``), held by
open file description (``F_OFD_SETLK``: no other descriptor of the process drops it, and a
killed daemon's go with its descriptors):

- shared (``share``) by each daemon that holds writable handles on the upload, on a
  descriptor of its own, from before its first handle is made until its last is closed;
- exclusive (``take``) while a publish or a link seals it, until its transaction ended.
  Taken on a descriptor that holds it shared, it is converted: it fails only for another
  daemon's shared lock.

Nothing blocks: each call answers at once (the caller waits, polling, on its event loop).
A file system without such locks (``supported``) leaves each daemon to its own writers.

A rename into ``ready/`` while writers hold the upload leaves its publish to them (it is
hidden until the last closes), and marks the staging file so (``leave_to_writers``) before
its transaction commits. A writer whose share is let go finds no mark (``left_to_writers``)
unless such a rename may have happened: it then has no need to read the upload's row. A
rename that hides it after the writer let go finds the lock free, and publishes it itself.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import tempfile

#: the byte locked: past any file's content, so no lock on content ever meets it
AT = 1 << 62
#: ``struct flock`` (LP64): type, whence, start, length, pid (0 for OFD locks), padding
_FLOCK = "@hhqqi4x"


def _lock(fd: int, kind: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, AT, 1, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def share(fd: int) -> bool:
    """Hold the lock shared on ``fd`` (a writer); False while a seal holds it."""
    return _lock(fd, fcntl.F_RDLCK)


def take(fd: int) -> bool:
    """Hold the lock exclusive on ``fd`` (a seal: open for writing); False while another
    holds it."""
    return _lock(fd, fcntl.F_WRLCK)


def let_go(fd: int) -> None:
    _lock(fd, fcntl.F_UNLCK)


#: The mark of an upload whose publish a rename left to its writers: group read, which no
#: write clears and which gives nothing away in the staging directory (its owner's alone).
LEFT = stat.S_IRGRP


def leave_to_writers(path: str) -> None:
    """Mark the upload staged at ``path``: its publish is left to its writers (OSError: it
    could not be marked)."""
    mode = os.stat(path).st_mode
    if not mode & LEFT:
        os.chmod(path, stat.S_IMODE(mode) | LEFT)


def left_to_writers(fd: int) -> bool:
    """Whether the staging file open on ``fd`` was marked by ``leave_to_writers``."""
    return bool(os.fstat(fd).st_mode & LEFT)


def keeps_left_marks(directory: str) -> bool:
    """Whether files in ``directory`` keep the mark once it is set (where one would not, a
    writer must read the upload's row)."""
    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".left-")
    except OSError:
        return False
    try:
        leave_to_writers(path)
        return left_to_writers(fd)
    except OSError:
        return False
    finally:
        os.unlink(path)
        os.close(fd)


def supported(directory: str) -> bool:
    """Whether files in ``directory`` take these locks, and two descriptors of one file
    exclude each other by them."""
    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".lock-")
    except OSError:
        return False
    try:
        other = os.open(path, os.O_RDWR)
    except OSError:
        os.close(fd)
        return False
    try:
        return share(fd) and not take(other)
    except OSError:
        return False
    finally:
        os.unlink(path)
        os.close(other)
        os.close(fd)
