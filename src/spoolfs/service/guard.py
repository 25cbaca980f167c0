"""The disk guard (DESIGN §6-7): below a queue's ``min_free``, new uploads and publishes get
ENOSPC at ``create``/``write``/``rename``, while claims, finishes, deletes and GC keep going:
the space left is the metadata's headroom, so a full queue can still drain.

The store's metadata reserve (store/reserve.py) is that headroom when the disk is full to the
last byte. While it is released, uploads and publishes get ENOSPC whatever ``min_free`` says:
the space it gave back is for metadata only. The reserve is made again once there is room: by
the first upload after that, or by ``keep_reserve`` in the background.
"""

from __future__ import annotations

import logging
import os

import trio

from spoolfs.core.errors import NoSpace
from spoolfs.core.policy import Policy
from spoolfs.store.reserve import Reserve

log = logging.getLogger(__name__)

#: seconds between two looks at a released reserve
RESTORE_EVERY = 2.0


class DiskGuard:
    def __init__(self, store_dir: str, reserve: Reserve | None = None) -> None:
        self.store_dir = store_dir
        self.reserve = reserve
        self._refusing = False

    def space(self) -> tuple[int, int]:
        """(free bytes for unprivileged writers, total bytes) of the store's file system.
        A statvfs each time: a few µs, and a cache would let a fast writer run past the floor."""
        st = os.statvfs(self.store_dir)
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def check(self, policy: Policy, incoming: int = 0) -> None:
        """Refuse new content (``incoming`` bytes more) when it would leave less than the
        queue's ``min_free``, or while the metadata reserve is released."""
        if self.reserve is not None and not self.reserve.allows_uploads():
            self._refuse("the store's metadata reserve is not in place (the disk was full, or "
                         "has no room for it)")
        free, total = self.space()
        floor = policy.min_free_bytes(total)
        if free - incoming < floor:
            self._refuse(f"the store's disk is below min_free ({free >> 20} MiB free, "
                         f"min_free {floor >> 20} MiB)")
        if self._refusing:
            log.warning("disk guard: %d MiB free again: uploads accepted", free >> 20)
        self._refusing = False

    def _refuse(self, why: str) -> None:
        if not self._refusing:
            log.warning("disk guard: %s: refusing new uploads and publishes until space is "
                        "freed", why)
        self._refusing = True
        raise NoSpace(why)

    def make_reserve(self) -> None:
        """At mount, before the first request: the reserve is there from the start whenever
        the disk has room for it."""
        if self.reserve is not None:
            self.reserve.restore()

    async def keep_reserve(self) -> None:
        """Make the metadata reserve again whenever it is released and the disk has room for
        it (a worker thread: on a file system without fallocate it is written out)."""
        if self.reserve is None:
            return
        while True:
            await trio.sleep(RESTORE_EVERY)
            try:
                if not self.reserve.in_place():
                    await trio.to_thread.run_sync(self.reserve.restore)
            except OSError as e:  # the store directory unreadable, say: never end the mount
                log.warning("cannot check the metadata reserve: %s", e)
