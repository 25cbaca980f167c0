"""This daemon's part in the writers' lock of each upload (blobs/writelock.py): shared while
it holds writable handles on the upload, exclusive while a publish or a link of its own
seals it. One descriptor per upload, made by the first of them and closed by the last.

An upload made hidden in ``ready/`` (``cp x ready/``) needs none: no other daemon can
reach a name that has not appeared, so its handle takes no part (``Handle.private``).

A rename that leaves an upload's publish to its writers marks its staging file first
(``leave``), so that a writer's close reads the upload's row only where it may have
(``may_be_left``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from spoolfs.blobs import freeing, writelock
from spoolfs.blobs.files import StagingDir
from spoolfs.core.errors import StoreFailure

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Held:
    fd: int  # -1: the upload had no staging file to lock (counted all the same)
    handles: int = 0  # writable handles here that share it
    seals: int = 0  # seals here that hold it exclusive


class WriterLocks:
    def __init__(self, staging: StagingDir) -> None:
        self.staging = staging
        self.enabled = writelock.supported(staging.root)
        if not self.enabled:
            log.warning("the staging directory %s takes no record locks: a publish through "
                        "this mount cannot see writers through another mount of the store",
                        staging.root)
        self._held: dict[int, _Held] = {}
        #: whether staging files keep the mark of ``leave`` (else every close looks)
        self.marks = writelock.keeps_left_marks(staging.root)

    def leave(self, entry_id: int) -> None:
        """A rename leaves the upload's publish to its writers: mark its staging file so,
        before the rename's transaction commits."""
        if not self.marks:
            return
        try:
            writelock.leave_to_writers(self.staging.path(entry_id))
        except FileNotFoundError:
            pass  # no writer to tell here (another host's upload, or already gone)
        except OSError as e:
            raise StoreFailure(f"staging file of {entry_id}: {e}") from e

    def may_be_left(self, fd: int | None) -> bool:
        """Whether a rename may have left the publish of the upload staged on ``fd`` to its
        writers (False: no rename did, before this call)."""
        if not self.marks or fd is None:
            return True
        try:
            return writelock.left_to_writers(fd)
        except OSError:
            return True

    def _open(self, entry_id: int, fd: int | None) -> int | None:
        try:
            if fd is not None:
                return os.dup(fd)
            return os.open(self.staging.path(entry_id), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            # published and removed meanwhile (the caller reads the row next), or never
            # made: nothing writes it, and no file is made here that no row would name
            return None
        except OSError as e:
            raise StoreFailure(f"staging file of {entry_id}: {e}") from e

    def _first(self, entry_id: int, fd: int | None, exclusive: bool) -> bool:
        found = self._open(entry_id, fd)
        own = -1 if found is None else found
        try:
            ok = own < 0 or (writelock.take(own) if exclusive else writelock.share(own))
        except OSError as e:
            os.close(own)
            raise StoreFailure(f"staging file of {entry_id}: {e}") from e
        if not ok:
            os.close(own)
            return False
        self._held[entry_id] = _Held(own, handles=0 if exclusive else 1,
                                     seals=1 if exclusive else 0)
        return True

    def try_share(self, entry_id: int, fd: int | None = None) -> bool:
        """One more writable handle here on the upload; the lock is held shared from the
        first (on a copy of ``fd``, a new upload's descriptor, or on one of its own). False,
        holding nothing more, while another daemon seals it."""
        if not self.enabled:
            return True
        held = self._held.get(entry_id)
        if held is None:
            return self._first(entry_id, fd, exclusive=False)
        held.handles += 1
        return True

    def unshare(self, entry_id: int) -> None:
        held = self._held.get(entry_id)
        if held is not None:
            held.handles -= 1
            self._drop_unused(entry_id, held)

    def try_take(self, entry_id: int) -> bool:
        """Before a seal: the lock held exclusive, until ``untake``. False while another
        daemon holds writable handles on the upload (this one's are converted)."""
        if not self.enabled:
            return True
        held = self._held.get(entry_id)
        if held is None:
            return self._first(entry_id, None, exclusive=True)
        if held.seals == 0 and held.fd >= 0:
            try:
                if not writelock.take(held.fd):
                    return False
            except OSError as e:
                raise StoreFailure(f"staging file of {entry_id}: {e}") from e
        held.seals += 1
        return True

    def untake(self, entry_id: int) -> None:
        held = self._held.get(entry_id)
        if held is None:
            return
        held.seals -= 1
        if held.seals == 0 and held.handles > 0 and held.fd >= 0:
            writelock.share(held.fd)  # converted back: nothing can be in the way
        self._drop_unused(entry_id, held)

    def _drop_unused(self, entry_id: int, held: _Held) -> None:
        if held.handles <= 0 and held.seals <= 0:
            del self._held[entry_id]
            if held.fd < 0:
                return
            try:  # a copy of a handle's descriptor: the lock is theirs too, until undone
                writelock.let_go(held.fd)
            finally:
                if freeing.holds_space(held.fd):  # its upload's file removed meanwhile
                    freeing.close_later(held.fd)
                else:
                    os.close(held.fd)

    def holding(self) -> int:
        """Uploads this daemon holds the lock of (what the tests look at)."""
        return len(self._held)
