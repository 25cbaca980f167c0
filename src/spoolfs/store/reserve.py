"""The metadata reserve (DESIGN §6): space set aside in the store directory, as one
preallocated file, for the day the disk fills up.

A full disk must not stop a queue from draining, yet every claim and finish needs a little
space: log frames appended to the WAL, pages added to the database when a checkpoint copies
them back, the shared-memory index a connection maps when it opens the store. So when the
space left falls under a low-water mark, the first writer to notice empties the reserve file
(``release``): its blocks go back to the file system, and metadata commits go on in them. The
disk guard refuses uploads and publishes while the reserve is not in place, so that content
never eats the space meant for metadata; a daemon makes the reserve again (``restore``) once
the disk has room for it and some to spare.

Several daemons on one store share the one file. Every step is idempotent on it: releasing is
a truncation to zero (one of them frees the space, the others find nothing left to free) and
restoring is a ``posix_fallocate`` of the whole size (two daemons restoring at once allocate
the same blocks once). Whether the reserve is in place is read from the file each time, never
remembered, so a daemon sees another's release at once.
"""

from __future__ import annotations

import errno
import logging
import os

log = logging.getLogger(__name__)

FILE = "reserve"
#: The reserve's size: this much, but never more than ``1/SHARE`` of the file system. 64 MiB
#: holds a few hundred thousand claims and finishes with their history.
MAX_SIZE = 64 << 20
SHARE = 8
#: Released when less than this is left (at most a quarter of the reserve): enough for a
#: commit of a large batch and the checkpoint after it to find space.
LOW_WATER = 4 << 20

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class Reserve:
    def __init__(self, store_dir: str) -> None:
        self.store_dir = store_dir
        self.path = os.path.join(store_dir, FILE)
        #: why this file system cannot hold a reserve (read-only, say), once that is known
        self.unusable: str | None = None
        self._size: int | None = None

    def _statvfs(self) -> tuple[int, int]:
        """(bytes this process may still write, bytes of the file system). Root may use the
        blocks a file system keeps back for root, and the daemon's store writes are root's
        when it runs as root."""
        st = os.statvfs(self.store_dir)
        avail = st.f_bfree if os.geteuid() == 0 else st.f_bavail
        return avail * st.f_frsize, st.f_blocks * st.f_frsize

    def size(self) -> int:
        if self._size is None:  # the file system's size, read once: commits need one statvfs
            self._size = min(MAX_SIZE, self._statvfs()[1] // SHARE) // 4096 * 4096
        return self._size

    def low_water(self) -> int:
        return min(LOW_WATER, self.size() // 4)

    def held(self) -> int:
        """Bytes the reserve file holds on disk (0 when released or missing)."""
        try:
            return os.stat(self.path).st_blocks * 512
        except FileNotFoundError:
            return 0

    def in_place(self) -> bool:
        return self.held() >= self.size()

    def nearly_full(self) -> bool:
        """Less than the low-water mark left: one statvfs (a few µs), cheap enough for every
        commit."""
        return self._statvfs()[0] < self.low_water()

    def release_if_low(self) -> bool:
        """Free the reserve when the disk is nearly full. True if this call freed space."""
        return self.nearly_full() and self.release("the store's disk is nearly full")

    def release(self, why: str) -> bool:
        """Give the reserve's blocks back to the file system. True if this call freed any."""
        held = self.held()
        if held == 0:
            return False
        try:
            os.truncate(self.path, 0)
        except FileNotFoundError:
            return False
        log.warning("%s: released the metadata reserve (%d MiB) so that claims and finishes "
                    "still commit; uploads and publishes are refused until it is made again",
                    why, held >> 20)
        return True

    def restore(self) -> bool:
        """Make the reserve when the disk has room for it and twice the low-water mark to
        spare (so that a commit right after does not release it again). True if it is in
        place afterwards."""
        size, held = self.size(), self.held()
        if held >= size:
            return True
        if self._statvfs()[0] - (size - held) < 2 * self.low_water():
            return False
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno not in FULL_ERRNOS and self.unusable is None:  # else: space went elsewhere
                self.unusable = str(e)
                log.warning("cannot keep a metadata reserve in %s (%s): a disk filled to the "
                            "last byte may stop claims and finishes", self.store_dir, e)
            return False
        self.unusable = None
        log.info("metadata reserve of %d MiB in place in %s", size >> 20, self.store_dir)
        return True

    def allows_uploads(self) -> bool:
        """Whether the disk guard may let new content in, as far as the reserve goes: it is in
        place (made now if there is room), or this file system cannot hold one at all (then
        ``min_free`` is the only headroom)."""
        return self.restore() or self.unusable is not None
