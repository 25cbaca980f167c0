"""The disk guard (DESIGN §6-7): below a queue's ``min_free``, new uploads and publishes get
ENOSPC at ``create``/``write``/``rename``, while claims, finishes, deletes and GC keep going:
the space left is the metadata's headroom, so a full queue can still drain."""

from __future__ import annotations

import logging
import os

from spoolfs.core.errors import NoSpace
from spoolfs.core.policy import Policy

log = logging.getLogger(__name__)


class DiskGuard:
    def __init__(self, store_dir: str) -> None:
        self.store_dir = store_dir
        self._refusing = False

    def space(self) -> tuple[int, int]:
        """(free bytes for unprivileged writers, total bytes) of the store's file system.
        A statvfs each time: a few µs, and a cache would let a fast writer run past the floor."""
        st = os.statvfs(self.store_dir)
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def check(self, policy: Policy, incoming: int = 0) -> None:
        """Refuse new content (``incoming`` bytes more) when it would leave less than the
        queue's ``min_free``."""
        free, total = self.space()
        floor = policy.min_free_bytes(total)
        if free - incoming < floor:
            if not self._refusing:
                log.warning("disk guard: %d MiB free, below min_free %d MiB: refusing new "
                            "uploads and publishes until space is freed", free >> 20, floor >> 20)
            self._refusing = True
            raise NoSpace(f"the store's disk is below min_free ({free >> 20} MiB free)")
        if self._refusing:
            log.warning("disk guard: %d MiB free again: uploads accepted", free >> 20)
        self._refusing = False
