"""Names this daemon saw leave, answered absent without asking the store (a shared store).

On a database server a lookup is a round trip, and the kernel sends one directory's lookups
one at a time. The names consumers look up most are those just claimed: in the seed-004
pattern every consumer tests every name, and nearly all of them are gone. A shared store
logs every name a transaction makes or frees, and the daemon learns of each: its own at
its commit, other hosts' through the change log (service/follower.py). So a name seen to
leave, and not seen made since, is absent, as far as this daemon can know: as current as
any other of its caches (other hosts' changes are seen within about a second). A change
whose commit may or may not have happened forgets every name it touched.

A claim's rename looks its new name up first (the kernel does, holding its rename lock, which
every claim through the mount waits for), in a consumer's own directory in ``working/``,
which holds the few messages it works on. Such a directory, once a lookup in it found a
name free, is read whole (``learn``) and kept current by the same changes: a name not in it
is free with no read. A listing read while a change touched the directory is not kept.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from spoolfs.store.base import ChangeRow

#: names remembered at most (the oldest forgotten first): about 150 bytes each
LIMIT = 50_000
#: directories known whole at most (the least recently learned forgotten first), and the
#: names one may hold (one holding more is forgotten)
DIRS = 1000
DIR_NAMES = 1000
#: seconds before a view is read whole again after a listing not kept: changed meanwhile
#: (a view others claim into), or holding more than DIR_NAMES
AGAIN_S, AGAIN_BIG_S = 1.0, 60.0


class LeftNames:
    """Called from the committer's thread and the event loop: each operation is one call
    on an ``OrderedDict`` (atomic under the GIL), never an iteration."""

    def __init__(self, limit: int = LIMIT, dirs: int = DIRS, dir_names: int = DIR_NAMES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.clock = clock
        self.dirs = dirs
        self.dir_names = dir_names
        self._left: OrderedDict[tuple[int, bytes], None] = OrderedDict()
        #: directories known whole: their names
        self._whole: OrderedDict[int, set[bytes]] = OrderedDict()
        #: directories worth knowing whole (consumers' views seen in lookups), and when
        #: each may be read whole next (a listing not kept waits: each costs a round trip)
        self._views: OrderedDict[int, float] = OrderedDict()
        #: each change's number (``next`` is one call), and each directory's last one
        self._count = itertools.count(1)
        self._touched: dict[int, int] = {}
        self._floor = 0  # what a directory not in ``_touched`` counts as (its last clear)

    def __contains__(self, place: tuple[int, bytes]) -> bool:
        """Whether the name is free, as far as this daemon knows."""
        if place in self._left:
            return True
        names = self._whole.get(place[0])
        return names is not None and place[1] not in names

    def __len__(self) -> int:
        return len(self._left)

    def made(self, parent: int, name: bytes) -> None:
        """The name may exist now."""
        self._touch(parent)
        self._left.pop((parent, bytes(name)), None)
        names = self._whole.get(parent)
        if names is not None:
            names.add(bytes(name))

    def changes(self, changes: Iterable[ChangeRow], committed: bool = True) -> None:
        """A transaction's changes, in order: where an entry was is free, where it is now is
        taken. Not ``committed`` (its outcome unknown): every name it touched may exist, and
        the directories it touched are no longer known whole."""
        for entry, parent, name, old_parent, old_name in changes:
            if old_parent is not None and (old_parent, old_name) != (parent, name):
                self._whole.pop(entry, None)  # (a directory moved or removed)
            if old_parent is not None and old_name is not None:
                old = (old_parent, bytes(old_name))
                self._touch(old_parent)
                if committed and old != (parent, name):
                    self._left[old] = None
                    self._left.move_to_end(old)
                    if len(self._left) > self.limit:
                        self._left.popitem(last=False)
                    names = self._whole.get(old_parent)
                    if names is not None:
                        names.discard(old[1])
                else:
                    self._left.pop(old, None)
                    self._whole.pop(old_parent, None)
            if parent is not None and name is not None:
                self._touch(parent)
                self._left.pop((parent, bytes(name)), None)
                names = self._whole.get(parent)
                if names is not None:
                    if committed:
                        names.add(bytes(name))
                        if len(names) > self.dir_names:
                            self._whole.pop(parent, None)
                    else:
                        self._whole.pop(parent, None)

    def _touch(self, parent: int) -> None:
        """A change touches ``parent``: a listing of it read before is not to be kept (done
        before the change is applied to what is known of it: see ``learn``)."""
        self._touched[parent] = next(self._count)
        if len(self._touched) > 4 * self.dirs:  # every directory counts as touched now
            self._floor = next(self._count)
            self._touched.clear()

    # ---- directories known whole ------------------------------------------------------

    def view(self, directory: int) -> None:
        """``directory`` is a consumer's view: worth knowing whole."""
        self._views.setdefault(directory, 0.0)
        if len(self._views) > self.dirs:
            self._views.popitem(last=False)

    def wanted(self, directory: int) -> bool:
        """Whether to read ``directory`` whole (a view not known whole yet)."""
        return directory not in self._whole and self._views.get(directory, math.inf) <= self.clock()

    def mark(self) -> int:
        """Taken before a listing is read, for ``learn``."""
        return next(self._count)

    def learn(self, directory: int, names: list[bytes], mark: int) -> None:
        """Every name in ``directory``, as read after ``mark``; kept unless a change touched
        the directory since (kept first, then checked: a change applied meanwhile either
        finds it kept, or is seen by the check)."""
        if len(names) > self.dir_names:
            self._not_kept(directory, AGAIN_BIG_S)
            return
        self._whole[directory] = set(names)
        if len(self._whole) > self.dirs:
            self._whole.popitem(last=False)
        if self._touched.get(directory, self._floor) >= mark:
            self._whole.pop(directory, None)
            self._not_kept(directory, AGAIN_S)

    def _not_kept(self, directory: int, wait_s: float) -> None:
        if directory in self._views:
            self._views[directory] = self.clock() + wait_s
