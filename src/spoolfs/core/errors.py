"""Errors that carry the errno a caller sees, and a hint for the log line.

One class per kind of refusal; the FUSE layer maps ``SpoolError.errno`` to ``FUSEError`` and
the command line maps ``UserError`` to one printed line and an exit code.
"""

from __future__ import annotations

import errno as _errno


class SpoolError(Exception):
    """A refused operation. Nothing was changed when this is raised."""

    errno: int = _errno.EIO

    def __init__(self, hint: str = "") -> None:
        super().__init__(hint)
        self.hint = hint


class NotFound(SpoolError):
    errno = _errno.ENOENT


class Exists(SpoolError):
    errno = _errno.EEXIST


class NotPermitted(SpoolError):
    errno = _errno.EPERM


class Invalid(SpoolError):
    errno = _errno.EINVAL


class NotEmpty(SpoolError):
    errno = _errno.ENOTEMPTY


class NameTooLong(SpoolError):
    errno = _errno.ENAMETOOLONG


class NoSpace(SpoolError):
    errno = _errno.ENOSPC


class AccessDenied(SpoolError):
    errno = _errno.EACCES


class NotSupported(SpoolError):
    errno = _errno.EOPNOTSUPP


class IsADirectory(SpoolError):
    errno = _errno.EISDIR


class NotADirectory(SpoolError):
    errno = _errno.ENOTDIR


class NoSubscriber(SpoolError):
    """A queue's ``fanout`` names a queue that does not exist: the publish is refused whole."""

    errno = _errno.ENXIO


class TooLarge(SpoolError):
    """A size or offset beyond what the store's disk can hold in one file."""

    errno = _errno.EFBIG


class NoAttribute(SpoolError):
    errno = _errno.ENODATA


class Remote(SpoolError):
    """An upload being written on another host of a shared store: its bytes are there, so
    only that host reads, writes, resizes, publishes or links it."""

    errno = _errno.EREMOTE


class StoreFailure(SpoolError):
    """The store failed (I/O error, database down): EIO, and the transaction rolled back."""

    errno = _errno.EIO


class SyncFailed(StoreFailure):
    """A sync of an upload's content failed: the disk may not hold all of it (EIO). Such an
    upload is never published; removed and written again, the new one is."""


class StoreFull(StoreFailure):
    """The store's disk is full even for metadata (its reserve spent): ENOSPC, rolled back."""

    errno = _errno.ENOSPC


class UserError(Exception):
    """A command-line failure: one line for the user and the process exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
