"""The spool's shared part: its state, the one transaction helper (``tx``), reading
the tree and leases. The use cases build on it, one module each (service/spool.py).
"""


from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from spoolfs.blobs import freeing
from spoolfs.core import lifecycle as L
from spoolfs.core import names, rules
from spoolfs.core.errors import (
    NotADirectory,
    NotFound,
    NotPermitted,
)
from spoolfs.core.names import check_message_name
from spoolfs.core.rules import Action, DirKind, Kind, State
from spoolfs.core.transitions import Context
from spoolfs.service import batches, status
from spoolfs.service.batches import MEMBER, is_batch, is_dir
from spoolfs.service.committer import Committer
from spoolfs.service.content import INLINE_MAX, Content, Handle
from spoolfs.service.guard import DiskGuard
from spoolfs.service.left_names import LeftNames
from spoolfs.service.moves import DAEMON, apply
from spoolfs.service.policies import Policies
from spoolfs.service.roles import Caller
from spoolfs.service.snapshots import Full, Snapshots, shown_to
from spoolfs.service.staging_pool import StagingPool
from spoolfs.service.steps import waited
from spoolfs.service.writepace import WritePace
from spoolfs.service.writers import WriterLocks
from spoolfs.store.base import ChangeRow, Entry, ReadTx, Store, WriteTx
from spoolfs.store.site import Place, embedded

log = logging.getLogger(__name__)
T = TypeVar("T")

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
RENAME_WHITEOUT = 4

SPOOL_XATTR = b"user.spool."

@dataclass(slots=True, frozen=True)
class Who:
    """The caller of a request, recorded in history."""

    uid: int = 0
    gid: int = 0
    pid: int = 0
    #: the request came from the NFS server that exports the mount (``-o nfs_export``): it
    #: acts for its clients, who have no descriptors of their own here (docs/design.md,
    #: "Serving NFS clients")
    nfs: bool = False


def free_name(tx: WriteTx, parent: int, name: bytes) -> bytes:
    """``name``, or ``name.~N~`` when it is taken: an automatic move never replaces anything."""
    return names.free_name(name, lambda n: tx.lookup(parent, n) is not None)



STORE_THREADS = 4
#: the kinds of directory that make a spool's structure: queues, their state directories,
#: consumers' views (created and removed by hand, rarely)
STRUCTURE = frozenset(("queue", "state", "consumer"))
#: seconds a shared store's structure row read for a create is used again (as the kernel
#: keeps attributes), unless a change of it is seen first
STRUCTURE_ROW_S = 1.0
#: structure rows kept at most (more are read again: a spool has far fewer directories)
STRUCTURE_ROWS = 10_000


def _shown(e: Entry | None) -> Entry:
    """A row a lookup found, if it is a name: an unpublished upload is none (NotFound)."""
    if e is None or e.hidden:
        raise NotFound()
    return e


async def free_off_loop(held: freeing.Held) -> None:
    """Free what holds removed files' space (blobs/freeing.py) in a worker thread, and wait
    for it; cancelled meanwhile, it is freed all the same."""
    if not held:
        return
    began = False

    def free() -> None:
        nonlocal began
        began = True
        held.free()

    try:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(free)
    finally:
        if not began:  # no thread to be had: here, then (never twice: a number is reused)
            held.free()


class SpoolCore:
    #: at most this many sharers are told of a new link count; the rest see it within TIMEOUT.
    #: Identical content is shared however many messages carry it (thousands of one-line
    #: markers): an ``rm`` among 2,000 of them took 4.6 ms with 1,000 told, 0.9 ms for others
    STALE_MAX = 64

    def __init__(self, store: Store, where: str | Place,
                 clock: Callable[[], int] = time.time_ns) -> None:
        """``where``: the store directory of an embedded store, or the ``Place`` of any."""
        self.store = store
        self.r: ReadTx = store.reader()
        self.place = where if isinstance(where, Place) else embedded(where)
        self.store_dir = self.place.local  # this host's part: the disk the guard watches
        self.content = Content(self.place.blobs, self.place.staging, INLINE_MAX,
                               local_uploads=not self.place.embedded)
        #: writers of an upload through other daemons of the store, as a seal must know them
        self.writer_locks = WriterLocks(self.place.staging)
        #: uploads to and downloads from a remote blob store run in worker threads, at most
        #: this many at once; commits to a networked store have a thread of their own, so a
        #: large upload never holds up a claim
        self.limiter = trio.CapacityLimiter(STORE_THREADS)
        self.committer = Committer(store, trio.CapacityLimiter(1))
        #: new uploads' staging files made ahead, once its ``run`` is started (daemon.py)
        self.staging_pool = StagingPool(self.place.staging, self._reserve_ids)
        self.committer.queue_name = self._queue_name
        self.committer.on_named = lambda parent, name: self.on_gone(parent, name)
        self._queue_names: dict[int, str] = {}
        self.clock = clock
        self._writers: dict[int, int] = {}  # entry id -> open writable handles here
        self._open: dict[int, int] = {}  # entry id -> open handles here (they hold a lease)
        #: entry id -> handles an NFS server holds open on its clients' behalf: they hold no
        #: lease and do not keep an upload unpublished (service/uploads.py)
        self._nfs: dict[int, list[Handle]] = {}
        self.policies = Policies(self.r)
        self.guard = DiskGuard(self.place.local, store.reserve)
        #: where uploads' writes run: on the loop, or in threads while the disk lags
        self.write_pace = WritePace()
        self._failed: set[int] = set()  # uploads a write failed on: never published as they are
        #: names seen to leave and not made since, on a shared store (service/left_names.py)
        self.left_names: LeftNames | None = None
        #: a shared store's structure rows, as creates read them: row and when read
        self._structure: dict[int, tuple[Entry, float]] = {}
        if store.shared:
            self.left_names = LeftNames()
            store.on_commit = self._committed
        #: uploads whose writer did not finish (killed, exited non-zero) -> why: never published
        self._unfinished: dict[int, str] = {}
        #: called with (parent, name) when the lifecycle moves or purges a message, so that the
        #: kernel drops a name it may have cached
        self.on_gone: Callable[[int, bytes], None] = lambda parent, name: None
        #: in a transaction, an entry is deleted (the FUSE layer keeps its attributes for the
        #: descriptors still open on it)
        self.on_deleted: Callable[[Entry], None] = lambda e: None
        #: called with entry ids whose attributes changed without a request naming them (the
        #: link count of every message sharing content that was linked or released, set-ID
        #: bits a write cleared)
        self.on_stale: Callable[[list[int]], None] = lambda ids: None
        #: counts the times a mode may have changed (a chmod here, any change by another
        #: host): a writer that saw no set-ID bits since need not look again (uploads.py)
        self.mode_changes = 0
        #: dir id -> (name, done) of the uploads being published into it
        self._settling: dict[int, list[tuple[bytes, trio.Event]]] = {}
        self._publishing: set[int] = set()  # hidden uploads whose publish is under way
        #: uploads (and batches) a publish or a link is sealing, until its transaction ends:
        #: a writer opening one meanwhile waits (``Publishing.unsealed``)
        self._sealing: dict[int, list[trio.Event]] = {}
        self.snapshots = Snapshots(self._full_snapshot, lambda: self.committer.batches)

    def changes_seen(self) -> int | None:
        """Grows with each commit of this daemon and each change of another host seen: what
        was read from the store before it grew may be stale. None while a commit of this
        daemon is under way: a read meanwhile may or may not see it."""
        c = self.committer
        return None if c.started != c.batches else c.batches + self.mode_changes

    def changed_elsewhere(self, ids: list[int]) -> None:
        """Entries another host changed (service/follower.py): the kernel must ask again."""
        self.mode_changes += 1
        for i in ids:
            self._structure.pop(i, None)
        self.on_stale(ids)

    def _committed(self, changes: list[ChangeRow], committed: bool) -> None:
        """A shared store's transaction of this daemon ended (``committed``: or may have):
        from the committer's thread."""
        assert self.left_names is not None
        self.left_names.changes(changes, committed)
        for entry, parent, _name, old_parent, _old in changes:
            if parent is not None or old_parent is not None or not committed:
                self._structure.pop(entry, None)  # (not for its times alone)

    async def directory(self, entry_id: int) -> Entry:
        """The directory a create makes its entry in. A shared store's queue, state
        directory or view is read at most once a second (what a create uses of it, its kind
        and its mode, changes rarely: a change of it seen here reads it again)."""
        kept = self._structure.get(entry_id)
        if kept is not None and time.monotonic() - kept[1] < STRUCTURE_ROW_S:
            return kept[0]
        read = time.monotonic()
        e = await self.row(entry_id)
        if e is None:
            raise NotFound(f"no entry {entry_id}")
        if self.left_names is not None and e.kind in STRUCTURE:
            self._structure[entry_id] = (e, read)
            if len(self._structure) > STRUCTURE_ROWS:
                self._structure.clear()
        return e

    async def tx(self, fn: Callable[[WriteTx], T], durable: bool = True) -> T:
        return await self.committer.submit(fn, durable)

    async def removed(self, cleanup: list[tuple[str, object]], open_here: bool = False) -> None:
        """The files of what a committed transaction deleted are gone; large ones' space is
        freed in a worker thread, the caller waiting for it there (blobs/freeing.py).
        ``open_here``: see ``Content.cleanup``."""
        await free_off_loop(self.content.cleanup(cleanup, open_here))

    async def _reserve_ids(self, n: int) -> list[int]:
        return await self.tx(lambda tx: tx.reserve_entry_ids(n), durable=False)

    def _queue_name(self, queue: int | None) -> str:
        """A queue's name for the metrics (looked up once per queue; "" for none)."""
        if queue is None:
            return ""
        name = self._queue_names.get(queue)
        if name is None:
            e = self.r.get(queue)
            name = e.name.decode(errors="replace") if e is not None else str(queue)
            if len(self._queue_names) < 10_000:
                self._queue_names[queue] = name
        return name

    def get(self, entry_id: int) -> Entry:
        e = self.r.get(entry_id)
        if e is None:
            raise NotFound(f"no entry {entry_id}")
        return e

    async def row(self, entry_id: int) -> Entry | None:
        """The entry's row (None when it is gone): on a database server far enough away, the
        loop answers other requests meanwhile (``steps``)."""
        return await waited(self.r.get_steps(entry_id))

    def lookup(self, parent: int, name: bytes) -> Entry:
        if len(name) > 255:
            check_message_name(name)
        return _shown(self.r.lookup(parent, name))

    async def rename_reads(self, parent: int, name: bytes, new_parent: int, new_name: bytes
                           ) -> tuple[Entry, Entry | None, Entry | None]:
        """``lookup(parent, name)``, the entry ``new_parent`` (None when it is gone) and
        the row named ``new_parent/new_name`` (None when the name is free), read together:
        a rename's reads before its transaction, one round trip on a database server, which
        the loop does not wait for (``steps``)."""
        if len(name) > 255:
            check_message_name(name)
        e, d, there = await waited(self.r.rename_reads_steps(parent, name, new_parent,
                                                             new_name))
        if self.left_names is not None and d is not None and d.kind == "consumer":
            self.left_names.view(d.id)  # (the next claim into it looks its new name up)
        return _shown(e), d, there

    async def find(self, parent: int, name: bytes, who: Who | None = None) -> Entry | None:
        """The visible entry ``parent/name``, or None when the name is free; NotFound (never
        None) when an unpublished upload holds the name, which may appear at any close. An
        NFS server finds the uploads it writes itself (it looks up what it just created).
        On a database server far enough away, the loop answers other requests meanwhile
        (``steps``); a name this daemon saw leave, or one not in a consumer's view it knows
        whole, is None with no read (``left_names``)."""
        if len(name) > 255:
            check_message_name(name)
        known = self.left_names
        if known is not None and (parent, name) in known:
            return None
        e = await waited(self.r.lookup_steps(parent, name))
        if known is not None:
            if e is None and known.wanted(parent):  # a claim's new name: read it whole
                mark = known.mark()
                known.learn(parent, await waited(self.r.names_steps(parent, known.dir_names
                                                                    + 1)), mark)
            elif e is not None and e.kind == "consumer":
                known.view(e.id)
        if e is not None and e.hidden and not (who is not None and who.nfs
                                               and self.nfs_writes(e.id)):
            raise NotFound()
        return e

    def nfs_writes(self, entry_id: int) -> bool:
        """Whether the NFS server holds the entry open for writing."""
        return any(h.writable for h in self._nfs.get(entry_id, ()))

    def path_of(self, entry_id: int, root: int = 1) -> str | None:
        """Where an entry is below ``root`` (``q/ready/a``; ``""`` for ``root`` itself), or
        None when it is gone: for log lines."""
        parts: list[str] = []
        while entry_id != root:
            e = self.r.get(entry_id)
            if e is None or e.parent is None:
                return None
            parts.append(e.name.decode(errors="backslashreplace"))
            entry_id = e.parent
        return "/".join(reversed(parts))

    def listdir(self, parent: int) -> list[Entry]:
        self.check_dir(parent)
        return [e for e in self.r.children(parent) if not e.hidden]

    def check_dir(self, entry_id: int) -> None:
        """NotFound or NotADirectory unless the entry is a directory."""
        if not is_dir(self.get(entry_id)):
            raise NotADirectory()

    async def snapshot(self, caller: Caller | None = None, only_queue: int | None = None
                       ) -> dict[str, Any]:
        """What ``spoolfs status`` shows (DESIGN §7), as ``caller`` may see it (``None``: all
        queues); computed off the event loop (service/snapshots.py)."""
        return shown_to(await self.snapshots.get(), caller, only_queue)

    def _full_snapshot(self) -> Full:
        """Every queue's figures, in a worker thread on the store's scan connection."""
        with self.store.scan() as r:
            return Full(status.snapshot(r, self.place, self.policies.of, self.clock()),
                        status.access(r))

    def being_written(self, entry_id: int) -> bool:
        """Whether a writable handle on the entry is open through this daemon."""
        return entry_id in self._writers

    def size_of(self, e: Entry) -> int:
        return self.times(e)[0]

    def times(self, e: Entry) -> tuple[int, int, int, int]:
        """(size, atime, mtime, ctime). An upload's are its staging file's, whose change time
        moves on every write and truncate; a rename or chmod moves the row's."""
        if e.staged:
            try:
                st = os.stat(self.content.staging.path(e.id))
            except OSError:
                pass
            else:
                return st.st_size, st.st_atime_ns, st.st_mtime_ns, max(e.ctime_ns,
                                                                        st.st_ctime_ns)
        atime = e.atime_ns if e.atime_ns is not None else e.mtime_ns
        return e.size, atime, e.mtime_ns, e.ctime_ns

    def nlink_of(self, e: Entry) -> int:
        """A file's link count is the number of messages sharing its content; a directory's
        is 2 + its subdirectories, as on ext4. A queue always holds its five states. Other
        state directories than working/ may hold millions of messages: they report 1, the
        usual "not counted" (find and fts then look inside every directory)."""
        counted = self._uncounted(e)
        return counted if counted is not None else 2 + self.r.subdirs(e.id)

    async def nlink(self, e: Entry) -> int:
        """``nlink_of``; a count of subdirectories on a database server far enough away
        with the loop answering other requests meanwhile (``steps``)."""
        counted = self._uncounted(e)
        return counted if counted is not None else 2 + await waited(self.r.subdirs_steps(e.id))

    def _uncounted(self, e: Entry) -> int | None:
        """A link count that needs no count of subdirectories (None: it needs one)."""
        if not is_dir(e):
            return e.refs or 1
        if e.kind == "queue":
            return 2 + len(rules.STATES)
        if e.kind == "state" and e.state is not State.WORKING:
            return 1
        return None

    @staticmethod
    def dir_kind(e: Entry) -> DirKind:
        if e.kind in ("message", MEMBER):
            raise NotADirectory()
        return DirKind(e.kind)

    def _message_dir(self, d: Entry) -> State:
        """The state a message placed in directory ``d`` would have."""
        if d.kind in ("state", "consumer") and d.state is not None:
            return d.state
        if not is_dir(d):
            raise NotADirectory()
        if d.kind in ("message", MEMBER):
            raise NotPermitted("a batch's files are made inside it in partial/, not moved in")
        raise NotPermitted(f"messages live in state directories, not in a {d.kind}")

    def kind(self, e: Entry) -> Kind:
        assert e.state is not None
        return rules.kind_of(e.state, e.name)

    def holds(self, entry_id: int) -> bool:
        """Whether a handle on the entry is open through this daemon (it holds the lease)."""
        return entry_id in self._open

    async def _lease_from_now(self, entry_id: int, only_if_due: bool = False,
                              seen: tuple[int | None, int] | None = None) -> None:
        """Extend a claimed message's lease to a full timeout from now (a touch, the last
        close, or a read or open handle once half of the lease is gone). ``seen``: the
        queue and the lease's end as an open read them: a lease only grows while it is
        claimed, so when even that one needs no renewal, the row is not read again."""
        now = self.clock()
        if seen is not None and self._renewal(seen[0], seen[1], now, only_if_due) is None:
            return
        e = self.r.get(entry_id)
        if e is None or e.state is not State.WORKING or e.lease_ns is None:
            return
        until = self._renewal(e.queue, e.lease_ns, now, only_if_due)
        if until is None:
            return

        def fn(tx: WriteTx) -> None:
            cur = tx.get(entry_id)
            if cur is not None and cur.state is State.WORKING and cur.lease_ns is not None:
                apply(tx, cur, Action.RENEW, State.WORKING,
                      Context(now, lease_end=max(until, cur.lease_ns)), DAEMON, history=False)

        await self.tx(fn, durable=False)

    def _renewal(self, queue: int | None, lease_ns: int, now: int, only_if_due: bool
                 ) -> int | None:
        """The lease's new end, or None when it needs none (not yet due, or a negligible
        extension: a close right after the claim)."""
        policy = self.policies.of(queue)
        if only_if_due and not L.renewal_due(policy, lease_ns, now):
            return None
        until = L.lease_end(policy, now)
        return None if until - lease_ns < min(L.NS, policy.lease_timeout // 10) else until

    async def reading(self, h: Handle) -> None:
        """A read keeps the lease of a claimed message (checked at most once a second)."""
        now = time.monotonic()
        if now - h.lease_checked >= 1.0:
            h.lease_checked = now
            await self._lease_from_now(h.lease_id, only_if_due=True, seen=h.lease_seen)

    async def renew_held(self) -> None:
        """Extend the leases of claimed messages held open here, once half is gone."""
        for entry_id in list(self._open):
            await self._lease_from_now(entry_id, only_if_due=True)

    def link_counts_changed(self, blob_id: int | None) -> None:
        """A message sharing this content came or went: the others' counts changed (the
        kernel is told of those it may hold, ``on_stale``)."""
        if blob_id is not None:
            self.on_stale(self.r.sharing(blob_id, self.STALE_MAX))

    def delete_message(self, tx: WriteTx, e: Entry, cleanup: list[tuple[str, object]]) -> None:
        """In a transaction: delete a message (a batch with all its files) or a file of a
        batch, and drop its hold on content; files go in ``cleanup`` after the commit."""
        if is_batch(e):
            batches.delete_tree(tx, e, lambda tx, m: self.content.release(tx, m, cleanup))
        self.on_deleted(e)
        tx.delete(e.id)  # the row first: the last reference may delete its blob row
        self.content.release(tx, e, cleanup)

    def statfs(self) -> os.statvfs_result:
        return os.statvfs(self.store_dir)
