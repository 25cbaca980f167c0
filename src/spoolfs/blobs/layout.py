"""Where a store directory keeps each of its parts: the one place that names them."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoreLayout:
    root: str

    @property
    def meta_db(self) -> str:
        """The embedded engine's database file."""
        return os.path.join(self.root, "meta.db")

    @property
    def blobs(self) -> str:
        return os.path.join(self.root, "blobs")

    @property
    def staging(self) -> str:
        return os.path.join(self.root, "staging")

    @property
    def lost_found(self) -> str:
        """Where ``fsck --repair`` keeps damaged content for a human to look at."""
        return os.path.join(self.root, "lost+found")

    def is_store(self) -> bool:
        return os.path.isfile(self.meta_db)
