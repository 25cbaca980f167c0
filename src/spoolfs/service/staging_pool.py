"""New uploads' staging files, made ahead in a worker thread.

Creating a file is a change to a directory of the store's disk: 40-80 µs on an idle ext4, and
several times that while the log is being synced, on the event loop's thread and inside the
transaction that inserts the upload's row (the file must exist, held, before the row commits:
service/recovery.py). A pool keeps a few empty staging files ready instead, each under an
entry id reserved in the store for it (``WriteTx.reserve_entry_ids``: no other row takes it)
and held (a shared lock, as an upload's file is), so a create on the loop only takes one:
the row is inserted with that id, and no file system call remains but setting its times.

Ids are the order listings show (oldest first), so a file made ahead is used only while its
id is fresh: within ``MAX_AGE`` of its reservation (another daemon of the store creates
meanwhile) and above every id this daemon already handed out; otherwise it is removed unused.
A create that finds no file made takes the next id reserved and makes its own file (as without
a pool: a burst never outruns the order), or, with none reserved, a new id. The pool keeps
twice the creates of the last second (at least 2, at most ``SIZE``), so a lone create now and
then wastes little.
Every file of the pool is held: recovery, fsck and gc leave held files alone
(``StagingDir.held``); a pool's files are removed at unmount, and after a crash, held by
nobody and named by no row, by recovery at the next mount.

Only where commits run on the event loop (the embedded store): a database server's commits
run in a worker thread, and the file made in the transaction with them (daemon.py).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from spoolfs.blobs.files import StagingDir
from spoolfs.core.errors import StoreFailure

log = logging.getLogger(__name__)

#: files kept ready at most: more than the writers that usually create at once
SIZE = 32
#: a file made ahead is used within this many seconds of its id's reservation, or not at all:
#: ids are the order listings show, and another daemon of the store creates meanwhile
MAX_AGE = 1.0
#: what a file system without unnamed files (``O_TMPFILE``) answers
UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL})


class StagingPool:
    def __init__(self, staging: StagingDir,
                 reserve: Callable[[int], Awaitable[list[int]]], size: int = SIZE,
                 max_age: float = MAX_AGE, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        """``reserve(n)``: ``n`` entry ids reserved in the store (a transaction)."""
        self.staging = staging
        self.reserve = reserve
        self.size = size
        self.max_age = max_age
        self.clock = clock
        # shared with the worker thread that makes the files, under the lock
        self._lock = threading.Lock()
        self._pending: deque[tuple[int, float]] = deque()  # (id, reserved when): no file yet
        self._ready: deque[tuple[int, int, float]] = deque()  # (id, held descriptor, when)
        self._spare: list[tuple[int, int]] = []  # not to be used: removed by the thread
        self._closed = False
        self._dir: tuple[int, int] | None = None  # the thread's: (bucket, its descriptor)
        self._last = 0  # the highest entry id handed out here
        self._creates: deque[float] = deque()  # when the creates of the last max_age came
        self._wanted = trio.Event()
        self._running = False  # ``run`` keeps it filled (else ``take`` has nothing to do)
        self.made = 0
        self.taken = 0

    def target(self) -> int:
        """How many ids to keep reserved: twice the creates of the last ``max_age`` (a file
        made for a create that does not come in time is made for nothing), at least 2."""
        return min(self.size, max(2, 2 * len(self._creates)))

    def take(self) -> tuple[int, int | None] | None:
        """For a new upload's row: an entry id and its empty staging file, open for reading
        and writing and held; or an id reserved whose file is not made yet (None: the caller
        makes it, as without a pool); or None when no fresh id is reserved."""
        if not self._running:
            return None
        now = self.clock()
        self._creates.append(now)
        while self._creates[0] < now - self.max_age:
            self._creates.popleft()
        found: tuple[int, int | None] | None = None
        with self._lock:
            while self._ready and found is None:
                eid, fd, when = self._ready.popleft()
                if self._usable(eid, when, now):
                    found = (eid, fd)
                else:
                    self._spare.append((eid, fd))
            while self._pending and found is None:
                eid, when = self._pending.popleft()
                if self._usable(eid, when, now):
                    found = (eid, None)
            left = len(self._ready) + len(self._pending)
        if found is not None:
            self._last = found[0]
            self.taken += found[1] is not None
        if left < self.target() // 2 or self._spare:
            self._wanted.set()
        return found

    def _usable(self, eid: int, when: float, now: float) -> bool:
        return eid > self._last and now - when <= self.max_age

    def unused(self, entry_id: int, fd: int, remove: bool) -> None:
        """A file taken for a row that was not written: removed (by the thread), or, when
        ``remove`` is false (a commit failed: the row may exist), only let go."""
        if remove:
            with self._lock:
                self._spare.append((entry_id, fd))
            self._wanted.set()
        else:
            os.close(fd)

    def used(self, entry_id: int) -> None:
        """A row took ``entry_id`` without the pool (none was reserved): later ones only
        grow."""
        self._last = max(self._last, entry_id)

    async def run(self) -> None:
        """Keep ids reserved and their files made until cancelled (at unmount; ``close``
        then removes what is left). Where files cannot be made ahead, creates make their
        own, as without a pool."""
        self._running = True
        try:
            await self._keep_filled()
        finally:
            self._running = False

    async def _keep_filled(self) -> None:
        pause = 0.0
        while True:
            want = self.target() - len(self._ready) - len(self._pending)
            if want > 0 or self._spare:
                try:
                    if want > 0:
                        ids = await self.reserve(want)
                        when = self.clock()
                        with self._lock:
                            self._pending.extend((eid, when) for eid in ids)
                    await trio.to_thread.run_sync(self._make)
                except (OSError, StoreFailure) as e:
                    if isinstance(e, OSError) and e.errno in UNSUPPORTED:
                        log.info("staging files are made at each create: %s", e)
                        return
                    if not pause:  # once per spell (a full disk): creates make their own
                        log.warning("staging files not made ahead: %s", e)
                    pause = min(max(2 * pause, 0.5), 30.0)
                    await trio.sleep(pause)
                    continue
                pause = 0.0
            await self._wanted.wait()
            self._wanted = trio.Event()

    def _make(self) -> None:
        """(The worker thread.) Remove the spare files, then make the pending ones, each
        ready as soon as it is made: a create on the loop meanwhile takes a made one, or
        the next id not being made, for a file it makes itself."""
        with self._lock:
            spare, self._spare = self._spare, []
        self._drop(spare)
        while True:
            with self._lock:
                if self._closed or not self._pending:
                    return
                eid, when = self._pending.popleft()  # no longer the loop's to take
            fd = self.staging.create_held(eid, self._bucket(eid))
            with self._lock:
                if not self._closed:
                    self._ready.append((eid, fd, when))
                    self.made += 1
                    continue
            self._drop([(eid, fd)])

    def _bucket(self, eid: int) -> int:
        """(The worker thread.) The directory descriptor of ``eid``'s bucket, kept while ids
        stay in it (two system calls less per file)."""
        bucket = self.staging.bucket_of(eid)
        if self._dir is None or self._dir[0] != bucket:
            if self._dir is not None:
                os.close(self._dir[1])
            self._dir = (bucket, self.staging.open_bucket(eid))
        return self._dir[1]

    def _drop(self, files: list[tuple[int, int]]) -> None:
        for eid, fd in files:
            self.staging.remove(eid)  # removed while held: no recovery judges it first
            os.close(fd)

    def close(self) -> None:
        """Remove the files not handed out (at unmount, after the last create, and after
        ``run`` returned: its thread no longer uses the bucket's descriptor)."""
        with self._lock:
            self._closed = True
            left = [(eid, fd) for eid, fd, _ in self._ready] + self._spare
            self._ready.clear()
            self._pending.clear()
            self._spare = []
            if self._dir is not None:
                os.close(self._dir[1])
                self._dir = None
        self._drop(left)
