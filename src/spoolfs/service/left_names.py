"""Names this daemon saw leave, answered absent without asking the store (a shared store).

On a database server a lookup is a round trip, and the kernel sends one directory's lookups
one at a time. The names consumers look up most are those just claimed: in the seed-004
pattern every consumer tests every name, and nearly all of them are gone. A shared store
logs every name a transaction makes or frees, and the daemon learns of each: its own at
its commit, other hosts' through the change log (service/follower.py). So a name seen to
leave, and not seen made since, is absent, as far as this daemon can know: as current as
any other of its caches (other hosts' changes are seen within about a second). A change
whose commit may or may not have happened forgets every name it touched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from spoolfs.store.base import ChangeRow

#: names remembered at most (the oldest forgotten first): about 150 bytes each
LIMIT = 50_000


class LeftNames:
    """Called from the committer's thread and the event loop: each operation is one call
    on an ``OrderedDict`` (atomic under the GIL), never an iteration."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._left: OrderedDict[tuple[int, bytes], None] = OrderedDict()

    def __contains__(self, place: tuple[int, bytes]) -> bool:
        return place in self._left

    def __len__(self) -> int:
        return len(self._left)

    def made(self, parent: int, name: bytes) -> None:
        """The name may exist now."""
        self._left.pop((parent, bytes(name)), None)

    def changes(self, changes: Iterable[ChangeRow], committed: bool = True) -> None:
        """A transaction's changes, in order: where an entry was is free, where it is now is
        taken. Not ``committed`` (its outcome unknown): every name it touched may exist."""
        for _entry, parent, name, old_parent, old_name in changes:
            if old_parent is not None and old_name is not None:
                old = (old_parent, bytes(old_name))
                if committed and old != (parent, name):
                    self._left[old] = None
                    self._left.move_to_end(old)
                    if len(self._left) > self.limit:
                        self._left.popitem(last=False)
                else:
                    self._left.pop(old, None)
            if parent is not None and name is not None:
                self._left.pop((parent, bytes(name)), None)
