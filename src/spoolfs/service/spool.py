"""The use cases: every operation of DESIGN §3, each one store transaction.

Callers pass store ids (the FUSE layer maps inode 1 to the mount's root). Each method either
completes its transition (durable first, when the rules say so) or raises a ``SpoolError`` and
changes nothing.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from spoolfs.core import lifecycle as L
from spoolfs.core import rules
from spoolfs.core.errors import (
    Exists,
    Invalid,
    IsADirectory,
    NoAttribute,
    NoSpace,
    NoSubscriber,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    NotSupported,
    SpoolError,
    StoreFailure,
)
from spoolfs.core.names import NAME_MAX, check_ident, check_message_name, is_staging_name
from spoolfs.core.rules import Action, DirKind, Kind, State
from spoolfs.core.transitions import Context, fields_of, transition
from spoolfs.service import batches, status
from spoolfs.service.batches import MEMBER, is_batch, is_dir
from spoolfs.service.committer import Committer
from spoolfs.service.content import INLINE_MAX, Content, Handle, Sealed, staging_error
from spoolfs.service.guard import DiskGuard
from spoolfs.service.moves import apply, make, place
from spoolfs.service.policies import Policies, check_fanout
from spoolfs.service.roles import Caller, inherit
from spoolfs.service.snapshots import Full, Snapshots, shown_to
from spoolfs.store.base import Entry, ReadTx, Store, WriteTx
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


def free_name(tx: WriteTx, parent: int, name: bytes) -> bytes:
    """``name``, or ``name.~N~`` when it is taken: an automatic move never replaces anything."""
    if tx.lookup(parent, name) is None:
        return name
    n = 1
    while True:
        suffix = b".~%d~" % n
        candidate = name[:NAME_MAX - len(suffix)] + suffix
        if tx.lookup(parent, candidate) is None:
            return candidate
        n += 1


class Spool:
    def __init__(self, store: Store, where: str | Place,
                 clock: Callable[[], int] = time.time_ns) -> None:
        """``where``: the store directory of an embedded store, or the ``Place`` of any."""
        self.store = store
        self.r: ReadTx = store.reader()
        self.place = where if isinstance(where, Place) else embedded(where)
        self.store_dir = self.place.local  # this host's part: the disk the guard watches
        self.content = Content(self.place.blobs, self.place.staging,
                               INLINE_MAX if self.place.embedded else 0)
        self.committer = Committer(store)
        self.clock = clock
        self._writers: dict[int, int] = {}  # entry id -> open writable handles here
        self._open: dict[int, int] = {}  # entry id -> open handles here (they hold a lease)
        self.policies = Policies(self.r)
        self.guard = DiskGuard(self.place.local, store.reserve)
        self._failed: set[int] = set()  # uploads a write failed on: never published as they are
        #: uploads whose writer did not finish (killed, exited non-zero) -> why: never published
        self._unfinished: dict[int, str] = {}
        #: called with (parent, name) when the lifecycle moves or purges a message, so that the
        #: kernel drops a name it may have cached
        self.on_gone: Callable[[int, bytes], None] = lambda parent, name: None
        #: called with entry ids whose attributes changed without a request naming them (the
        #: link count of every message sharing content that was linked or released)
        self.on_stale: Callable[[list[int]], None] = lambda ids: None
        self._settling: dict[int, list[trio.Event]] = {}  # dir id -> uploads being published
        self.snapshots = Snapshots(self._full_snapshot, lambda: self.committer.batches)

    async def tx(self, fn: Callable[[WriteTx], T], durable: bool = True) -> T:
        return await self.committer.submit(fn, durable)

    # ---- reading the tree -----------------------------------------------------------------

    def get(self, entry_id: int) -> Entry:
        e = self.r.get(entry_id)
        if e is None:
            raise NotFound(f"no entry {entry_id}")
        return e

    def lookup(self, parent: int, name: bytes) -> Entry:
        if len(name) > 255:
            check_message_name(name)
        e = self.r.lookup(parent, name)
        if e is None or e.hidden:
            raise NotFound()
        return e

    def listdir(self, parent: int) -> list[Entry]:
        d = self.get(parent)
        if not is_dir(d):
            raise NotADirectory()
        return [e for e in self.r.children(parent) if not e.hidden]

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
        if not is_dir(e):
            return e.refs or 1
        if e.kind == "queue":
            return 2 + len(rules.STATES)
        if e.kind == "state" and e.state is not State.WORKING:
            return 1
        return 2 + self.r.subdirs(e.id)

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

    # ---- directories ----------------------------------------------------------------------

    async def mkdir(self, parent: int, name: bytes, mode: int, who: Who) -> Entry:
        p = self.get(parent)
        if p.kind in ("message", MEMBER) or (p.kind == "state" and p.state is State.PARTIAL):
            return await self._mkdir_batch(p, name, mode, who)
        new = rules.decide_mkdir(self.dir_kind(p), p.state)
        ident = check_ident(name, new.value)
        now = self.clock()
        gid, perm = inherit(p, who.gid, mode, is_dir=True)  # a setgid parent's group
        dmode = stat.S_IFDIR | perm

        def fn(tx: WriteTx) -> Entry:
            if tx.lookup(parent, name) is not None:
                raise Exists(f"{ident} exists")
            common = dict(mode=dmode, uid=who.uid, gid=gid, mtime_ns=now, ctime_ns=now,
                          created_ns=now)
            if new is DirKind.QUEUE:
                q = tx.insert(parent=parent, name=name, kind="queue", **common)
                tx.update(q.id, queue=q.id)
                for st in rules.STATES:
                    tx.insert(parent=q.id, name=st.value.encode(), kind="state", queue=q.id,
                              state=st, **common)
                log.info("queue %s created", ident)
                return tx.get(q.id)  # type: ignore[return-value]  # inserted above
            log.info("consumer view %s created", ident)
            return tx.insert(parent=parent, name=name, kind="consumer", queue=p.queue,
                             state=State.WORKING, **common)

        return await self.tx(fn)

    async def _mkdir_batch(self, p: Entry, name: bytes, mode: int, who: Who) -> Entry:
        """``mkdir partial/b1`` makes a batch (one message); inside it, a directory member."""
        check_message_name(name)
        if p.kind == "state":
            self.guard.check(self.policies.of(p.queue))
            fields: dict[str, Any] = dict(kind="message", queue=p.queue)
        else:
            if not is_dir(p):
                raise NotADirectory()
            fields = dict(kind=MEMBER, queue=batches.check_mutable(self.r, p).queue)
        now = self.clock()
        gid, perm = inherit(p, who.gid, mode, is_dir=True)

        def fn(tx: WriteTx) -> Entry:
            if tx.lookup(p.id, name) is not None:
                raise Exists()
            row = dict(parent=p.id, name=name, mode=stat.S_IFDIR | perm, uid=who.uid, gid=gid,
                       mtime_ns=now, created_ns=now, **fields)
            if fields["kind"] == "message":
                return make(tx, Action.UPLOAD, State.PARTIAL, Context(now), (who.uid, who.pid),
                            why="a batch", **row)
            return tx.insert(ctime_ns=now, **row)

        return await self.tx(fn, durable=False)

    async def _remove_in_batch(self, parent: int, e: Entry, who: Who) -> None:
        """``rm`` of a batch's file or directory (``rm -r`` takes a batch apart, then removes
        its root like a message): not while the batch waits in ready/, where a claim must
        always take all of it."""
        if e.kind == "message":  # the root, emptied
            if self.r.has_children(e.id):
                raise NotEmpty("a batch is removed with its contents: rm -r")
            return await self.unlink(parent, e.name, who, as_dir=True)
        root = batches.root_of(self.r, e)
        if root.state not in batches.REMOVABLE:
            raise NotPermitted("files of a batch waiting in ready/ cannot be removed")
        cleanup: list[tuple[str, object]] = []

        def fn(tx: WriteTx) -> None:
            cur = tx.get(e.id)
            if cur is None or cur.parent != parent or cur.name != e.name:
                raise NotFound()
            if is_dir(cur) and tx.has_children(cur.id):
                raise NotEmpty()
            tx.delete(cur.id)
            self.content.release(tx, cur, cleanup)

        await self.tx(fn, durable=False)
        self.content.cleanup(cleanup)

    async def rmdir(self, parent: int, name: bytes, who: Who) -> None:
        e = self.lookup(parent, name)
        if e.kind in ("message", MEMBER):
            if not is_dir(e):
                raise NotADirectory()
            return await self._remove_in_batch(parent, e, who)
        rules.decide_rmdir(self.dir_kind(e))

        def fn(tx: WriteTx) -> None:
            cur = tx.get(e.id)
            if cur is None or cur.parent != parent or cur.name != name:
                raise NotFound()
            # children before parents: a row's parent must exist while it does
            views: list[int] = []
            states: list[int] = []
            if cur.kind == "queue":
                for st in tx.children(cur.id):
                    for c in tx.children(st.id):
                        if c.kind != "consumer" or tx.has_children(c.id):
                            raise NotEmpty(f"queue {name!r} is not empty")
                        views.append(c.id)
                    states.append(st.id)
            elif tx.has_children(cur.id):
                raise NotEmpty(f"consumer view {name!r} is not empty")
            for i in [*views, *states, cur.id]:
                tx.delete(i)

        await self.tx(fn)

    async def _rename_dir(self, e: Entry, parent: int, new_parent: int, new_name: bytes,
                          flags: int) -> None:
        kind = self.dir_kind(e)
        rules.decide_dir_rename(kind, parent == new_parent)
        check_ident(new_name, kind.value)

        def fn(tx: WriteTx) -> None:
            if tx.lookup(new_parent, new_name) is not None:
                raise Exists(f"{new_name!r} exists")
            if not tx.move(e.id, parent, e.name, new_parent, new_name):
                raise NotFound()
            if kind is DirKind.CONSUMER:
                for m in tx.children(e.id):
                    tx.update(m.id, consumer=new_name.decode())

        await self.tx(fn)

    # ---- uploads --------------------------------------------------------------------------

    async def create(self, parent: int, name: bytes, mode: int, who: Who) -> tuple[Entry, Handle]:
        """A new upload, opened for writing. In ``ready/`` (not a staging name) it stays
        invisible until its last writer closes, then appears complete."""
        d = self.get(parent)
        if d.kind in ("message", MEMBER) and is_dir(d):
            return await self._create_member(d, name, mode, who)
        state = self._message_dir(d)
        check_message_name(name)
        action = rules.decide_create(rules.kind_of(state, name))
        self.guard.check(self.policies.of(d.queue))
        now = self.clock()
        return await self._new_upload(d, name, mode, who, now, kind="message", queue=d.queue,
                                      state=state, **fields_of(transition(action, state), None,
                                                               Context(now)))

    async def _new_upload(self, d: Entry, name: bytes, mode: int, who: Who, now: int,
                          **fields: Any) -> tuple[Entry, Handle]:
        """The row and the empty staging file of a new upload in ``d``, opened for writing."""
        fields.setdefault("ctime_ns", now)
        made: list[Handle] = []

        def fn(tx: WriteTx) -> Entry:
            if tx.lookup(d.id, name) is not None:
                raise Exists()
            e = tx.insert(parent=d.id, name=name, staged=1, mode=stat.S_IFREG | (mode & 0o7777),
                          uid=who.uid, gid=inherit(d, who.gid, mode, is_dir=False)[0],
                          mtime_ns=now, created_ns=now, **fields)
            made.append(self.content.new_upload(e.id))  # held before the row commits
            return e

        try:
            e = await self.tx(fn, durable=False)
        except BaseException:
            for h in made:  # rolled back: the file names no row (recovery removes it)
                h.close()
            raise
        return e, self._open_handle(e, writable=True, who=who, handle=made[-1])

    async def _create_member(self, d: Entry, name: bytes, mode: int, who: Who
                             ) -> tuple[Entry, Handle]:
        """A file in a batch being built in partial/."""
        check_message_name(name)
        root = batches.check_mutable(self.r, d)
        self.guard.check(self.policies.of(root.queue))
        return await self._new_upload(d, name, mode, who, self.clock(), kind=MEMBER,
                                      queue=root.queue)

    def _open_handle(self, e: Entry, writable: bool, who: Who, handle: Handle | None = None
                     ) -> Handle:
        h = handle if handle is not None else self.content.open(self.r, e, writable)
        h.opener = who.pid
        h.queue = e.queue
        if e.kind == MEMBER:
            h.lease_id = batches.root_of(self.r, e).id
        self._open[h.lease_id] = self._open.get(h.lease_id, 0) + 1
        if writable:
            self._writers[e.id] = self._writers.get(e.id, 0) + 1
        return h

    async def open(self, entry_id: int, writable: bool, truncate: bool, who: Who) -> Handle:
        e = self.get(entry_id)
        if e.kind not in ("message", MEMBER) or is_dir(e):
            raise IsADirectory()
        if writable or truncate:
            self._check_modify(e)
        if truncate:
            self.truncate(e, 0)
        if self.content.blobs.remote and not e.staged and e.blob is not None:
            await trio.to_thread.run_sync(self.content.fetch, self.r, e)
        return self._open_handle(e, writable, who)

    def _check_modify(self, e: Entry) -> None:
        if e.kind == MEMBER:
            batches.check_mutable(self.r, e)
        else:
            rules.decide_modify(self.kind(e), e.hidden, e.staged)

    def truncate(self, e: Entry, size: int) -> None:
        """Resize an upload's staging file (its size is the file's: no transaction)."""
        fd = self.content.staging.open(e.id, create=True)
        try:
            os.ftruncate(fd, size)
        except OSError as err:
            raise staging_error(err, f"resize of staging file {e.id}") from err
        finally:
            os.close(fd)

    def awaits_publish(self, h: Handle) -> bool:
        """Whether ``h`` writes an upload into ``ready/`` that has not appeared yet."""
        if not h.writable or h.done:
            return False
        e = self.r.get(h.entry_id)
        return e is not None and e.hidden

    def writer_failed(self, h: Handle, why: str) -> None:
        """A process writing through ``h`` did not finish (``why``: it ``was killed by
        SIGKILL``, ...): its upload into ``ready/`` is never published as it is."""
        if self.awaits_publish(h):
            self._unfinished.setdefault(h.entry_id, why)
            log.info("upload %d: its writer %s", h.entry_id, why)

    async def publish_at_close(self, h: Handle, who: Who, unfinished: str | None = None
                               ) -> None:
        """The opener closed its descriptor and holds no other: an upload into ``ready/``
        appears now, durable before ``close(2)`` returns (``cp x ready/`` then exits 0 only
        once the message is safe). Later writes through a copy of the descriptor are refused.

        ``unfinished`` says how the opener ended when it did not finish (``was killed by
        SIGKILL``, ``exited with status 1``). Such an upload, or one a process holding a copy
        of the descriptor did not finish (``writer_failed``), is never published: it goes to
        ``partial/`` with the bytes written so far, now or, if another writer still holds
        it, at that writer's last close; a copy of the descriptor writes on into it there."""
        if not self.awaits_publish(h):
            return
        if unfinished is not None:
            self.writer_failed(h, unfinished)
        if self._writers.get(h.entry_id, 0) > 1:
            return  # another writer holds it: the last close decides
        h.done = h.entry_id not in self._unfinished
        await self._publish_settled(self.get(h.entry_id), who)

    async def close(self, h: Handle, who: Who) -> None:
        """The last writable handle publishes a pending upload into ``ready/``.
        Requests read after this one (the writer's next command) wait in ``settle`` until
        the upload has appeared."""
        h.close()
        left = self._open.get(h.lease_id, 1) - 1
        if left > 0:
            self._open[h.lease_id] = left
        else:
            self._open.pop(h.lease_id, None)
            await self._lease_from_now(h.lease_id)
        if not h.writable:
            return
        n = self._writers.get(h.entry_id, 1) - 1
        if n > 0:
            self._writers[h.entry_id] = n
            return
        self._writers.pop(h.entry_id, None)
        e = self.r.get(h.entry_id)
        try:
            if e is not None and e.hidden and not h.done:
                await self._publish_settled(e, who)
        finally:
            self._failed.discard(h.entry_id)
            self._unfinished.pop(h.entry_id, None)

    # ---- arrival in ready/: duplicates and fan-out (DESIGN §5) ---------------------------

    #: publishes that make a message arrive in a queue's ready/
    ARRIVALS = frozenset({Action.PUBLISH, Action.DIRECT_PUBLISH, Action.LINK_PUBLISH,
                          Action.FORWARD, Action.REDRIVE})

    def _arrive(self, tx: WriteTx, entry_id: int, now: int, who: Who,
                path: tuple[int, ...] = ()) -> bool:
        """In the publishing transaction: apply the queue's ``duplicates`` and ``fanout``
        policies to a message that just entered its ``ready/``. Raises (refusing the whole
        publish) for a rejected duplicate or a missing subscriber. True when the message left
        ``ready/`` (a skipped duplicate, or a topic's message handed to its subscribers)."""
        cur = tx.get(entry_id)
        if cur is None or cur.queue is None or is_staging_name(cur.name):
            return False
        queue = tx.get(cur.queue)
        assert queue is not None
        qname = queue.name.decode(errors="replace")
        policy = self.policies.of(cur.queue)
        if policy.duplicates != "allow" and cur.blob is not None:
            orig = tx.published_with(cur.queue, cur.blob, now - policy.duplicates_window, cur.id)
            if orig is not None:
                shown = orig.name.decode(errors="replace")
                why = f"duplicate of message {orig.id} ({place(orig)}/{shown})"
                if policy.duplicates == "reject":
                    raise Exists(f"queue {qname}: {why}")
                self._to_success(tx, cur, now, who, Action.DUPLICATE, why, duplicate_of=orig.id)
                return True
        if not policy.fanout:
            return False
        if cur.queue in path:  # refused when the policy is set; never loop regardless
            raise Invalid(f"queue {qname}: fanout cycle")
        for sub in policy.fanout:
            sq = tx.lookup(queue.parent, sub.encode()) if queue.parent is not None else None
            ready = tx.lookup(sq.id, b"ready") if sq is not None and sq.kind == "queue" else None
            if ready is None:
                raise NoSubscriber(f"queue {qname} fans out to {sub!r}, which does not exist")
            name = free_name(tx, ready.id, cur.name)
            copy = make(tx, Action.FANOUT, State.READY, Context(now), (who.uid, who.pid),
                        src=f"{qname}/ready", why=f"from message {cur.id} of queue {qname}",
                        parent=ready.id, name=name, kind="message", queue=ready.queue,
                        blob=cur.blob, size=cur.size, mode=cur.mode, uid=cur.uid, gid=cur.gid,
                        mtime_ns=cur.mtime_ns, created_ns=now)
            if is_batch(cur):
                batches.copy_tree(tx, cur, copy, now)
            else:
                assert cur.blob is not None, "a published message has sealed content"
                tx.blob_ref(cur.blob, 1)
            tx.copy_xattrs(cur.id, copy.id)
            self._arrive(tx, copy.id, now, who, path + (cur.queue,))
        self._to_success(tx, cur, now, who, Action.FANOUT, "to " + ", ".join(policy.fanout))
        return True

    @staticmethod
    def _to_success(tx: WriteTx, cur: Entry, now: int, who: Who, action: Action, why: str,
                    **fields: Any) -> None:
        assert cur.queue is not None and cur.parent is not None
        success = tx.lookup(cur.queue, State.SUCCESS.value.encode())
        assert success is not None
        apply(tx, cur, action, State.SUCCESS, Context(now), (who.uid, who.pid),
              into=(success.id, free_name(tx, success.id, cur.name)), why=why, **fields)

    # ---- leases ---------------------------------------------------------------------------

    def holds(self, entry_id: int) -> bool:
        """Whether a handle on the entry is open through this daemon (it holds the lease)."""
        return entry_id in self._open

    async def _lease_from_now(self, entry_id: int, only_if_due: bool = False) -> None:
        """Extend a claimed message's lease to a full timeout from now (a touch, the last
        close, or a read or open handle once half of the lease is gone)."""
        e = self.r.get(entry_id)
        if e is None or e.state is not State.WORKING or e.lease_ns is None:
            return
        policy = self.policies.of(e.queue)
        now = self.clock()
        if only_if_due and not L.renewal_due(policy, e.lease_ns, now):
            return
        until = L.lease_end(policy, now)
        if until - e.lease_ns < min(L.NS, policy.lease_timeout // 10):
            return  # a negligible extension (a close right after the claim): no commit

        def fn(tx: WriteTx) -> None:
            cur = tx.get(entry_id)
            if cur is not None and cur.state is State.WORKING and cur.lease_ns is not None:
                tx.update(entry_id, lease_ns=max(until, cur.lease_ns))

        await self.tx(fn, durable=False)

    async def reading(self, h: Handle) -> None:
        """A read keeps the lease of a claimed message (checked at most once a second)."""
        now = time.monotonic()
        if now - h.lease_checked >= 1.0:
            h.lease_checked = now
            await self._lease_from_now(h.lease_id, only_if_due=True)

    async def renew_held(self) -> None:
        """Extend the leases of claimed messages held open here, once half is gone."""
        for entry_id in list(self._open):
            await self._lease_from_now(entry_id, only_if_due=True)

    async def _publish_settled(self, e: Entry, who: Who) -> None:
        assert e.parent is not None
        done = trio.Event()  # registered before the first await: see settle()
        self._settling.setdefault(e.parent, []).append(done)
        try:
            if e.id in self._failed:  # the writer saw a write fail: the content is not whole
                raise NoSpace("a write to this upload failed; it was not published")
            unfinished = self._unfinished.get(e.id)
            if unfinished is not None:  # its content may be cut anywhere: never claimable
                await self._refused_upload(e, who, f"its writer {unfinished}")
                return
            await self._publish_hidden(e, who)
        except (NotFound, StoreFailure):
            raise  # gone meanwhile, or the store failed: recovery at mount reconciles it
        except SpoolError as refused:  # a rejected duplicate, a missing subscriber, ...
            await self._refused_upload(e, who, f"publish refused: {refused}")
            raise
        finally:
            done.set()
            waiting = self._settling[e.parent]
            waiting.remove(done)
            if not waiting:
                del self._settling[e.parent]

    async def _refused_upload(self, e: Entry, who: Who, why: str) -> None:
        """An upload into ``ready/`` that is not published at close (refused, or its writer
        did not finish) goes to ``partial/``, visible with all its bytes, to be fixed and
        published again (never stranded unseen)."""
        now = self.clock()

        def fn(tx: WriteTx) -> None:
            cur = tx.get(e.id)
            if cur is None or not cur.hidden or cur.queue is None or cur.parent is None:
                return
            partial = tx.lookup(cur.queue, State.PARTIAL.value.encode())
            assert partial is not None
            apply(tx, cur, Action.REFUSED, State.PARTIAL, Context(now), (who.uid, who.pid),
                  into=(partial.id, free_name(tx, partial.id, cur.name)), src="upload", why=why)

        await self.tx(fn)
        log.warning("upload %r: not published at close (%s); moved to partial/", e.name, why)

    async def settle(self, parent: int) -> None:
        """Wait until uploads into ``parent`` whose last writer has closed have appeared."""
        while parent in self._settling:
            await self._settling[parent][0].wait()

    async def _publish_hidden(self, e: Entry, who: Who) -> None:
        sealed = await self._seal(e)
        now = self.clock()

        def fn(tx: WriteTx) -> None:
            cur = tx.get(e.id)
            if cur is None or not cur.hidden:
                raise NotFound()
            self.content.attach(tx, e.id, sealed)
            apply(tx, cur, Action.PUBLISH, State.READY, Context(now), (who.uid, who.pid),
                  src="upload", dst=place(cur))
            self._arrive(tx, e.id, now, who)

        await self.tx(fn)
        self.content.cleanup([("staging", e.id)])

    async def _seal(self, e: Entry) -> Sealed:
        if self.content.blobs.remote:  # stored before the transaction that attaches it
            return await trio.to_thread.run_sync(self.content.seal_and_store, e.id,
                                                 self.store.reserve_blob_id)
        if self.size_of(e) > self.content.inline_max:
            return await trio.to_thread.run_sync(self.content.seal, e.id)
        return self.content.seal(e.id)

    def write(self, h: Handle, off: int, buf: bytes) -> int:
        try:
            self.guard.check(self.policies.of(h.queue), len(buf))
            return h.write(off, buf)
        except SpoolError:
            self._failed.add(h.entry_id)
            raise

    # ---- transitions ----------------------------------------------------------------------

    async def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes,
                     flags: int, who: Who) -> bool:
        """Rename; True when the message became a hidden upload (published once its writer
        closes), so that a name the kernel had cached must be dropped."""
        if flags & (RENAME_EXCHANGE | RENAME_WHITEOUT):
            raise Invalid("RENAME_EXCHANGE and RENAME_WHITEOUT are not supported")
        check_message_name(new_name)
        src = self.lookup(parent, name)
        if src.kind == MEMBER:
            await self._rename_member(src, parent, new_parent, new_name, flags)
            return False
        if src.kind != "message":
            await self._rename_dir(src, parent, new_parent, new_name, flags)
            return False
        d = self.get(new_parent)
        dst_state = self._message_dir(d)
        src_kind, dst_kind = self.kind(src), rules.kind_of(dst_state, new_name)
        scope = rules.scope_of(parent == new_parent, src.queue == d.queue)
        action = rules.decide_rename(src_kind, dst_kind, scope)
        if parent == new_parent and name == new_name:
            return False
        if action is Action.PUBLISH:
            self.guard.check(self.policies.of(d.queue))
        defer = action is Action.PUBLISH and self._writers.get(src.id, 0) > 0
        sealed = await self._seal(src) if action is Action.PUBLISH and src.staged and not defer \
            else None
        members = await self._seal_batch(src) if action is Action.PUBLISH and is_batch(src) \
            else []
        now = self.clock()
        policy = self.policies.of(d.queue)
        by = (who.uid, who.pid)
        # the values this row's effects may need (the table says which apply)
        ctx = Context(now, attempts=src.attempts, lease_end=L.lease_end(policy, now),
                      after=L.after_failure(policy, src.attempts, now, expired=False),
                      consumer=d.name.decode() if d.kind == "consumer" else None,
                      owner=(who.uid, inherit(d, who.gid, src.mode, is_dir=False)[0]),
                      writing=defer)
        cleanup: list[tuple[str, object]] = []
        left: list[bool] = []  # the message went on from ready/ (fan-out, skipped duplicate)

        def fn(tx: WriteTx) -> None:
            old = tx.lookup(new_parent, new_name)
            if old is not None and old.id != src.id:
                if flags & RENAME_NOREPLACE or old.hidden:
                    raise Exists("target exists")
                rules.decide_replace(dst_kind, False)
                if old.kind != "message":
                    raise IsADirectory()
                if dst_kind in rules.MUTABLE:  # uploads: a directory's rules, as anywhere
                    batches.check_replace(tx, src, old)
                self.delete_message(tx, old, cleanup)
                apply(tx, old, Action.REPLACED, None, ctx, by, why=f"replaced by {src.id}")
            if not apply(tx, src, action, dst_state, ctx, by, into=(new_parent, new_name),
                         queue=d.queue):
                raise NotFound("already moved")
            if sealed is not None:
                self.content.attach(tx, src.id, sealed)
                cleanup.append(("staging", src.id))
            for member_id, member_sealed in members:
                m = tx.get(member_id)
                if m is None or not m.staged:
                    raise NotFound("a file of the batch changed while it was published")
                self.content.attach(tx, member_id, member_sealed)
                cleanup.append(("staging", member_id))
            if action in self.ARRIVALS and not defer and self._arrive(tx, src.id, now, who):
                left.append(True)

        await self.tx(fn, durable=action in rules.DURABLE)
        self.content.cleanup(cleanup)
        log.debug("%s %s %r -> %s %r", action.value, src_kind.value, name, dst_kind.value, new_name)
        if left:
            self.on_gone(new_parent, new_name)
            self._link_counts_changed(self.get(src.id).blob)
        return defer

    #: at most this many sharers are told of a new link count; the rest see it within TIMEOUT
    STALE_MAX = 1000

    def _link_counts_changed(self, blob_id: int | None) -> None:
        if blob_id is not None:
            self.on_stale(self.r.sharing(blob_id, self.STALE_MAX))

    def delete_message(self, tx: WriteTx, e: Entry, cleanup: list[tuple[str, object]]) -> None:
        """In a transaction: delete a message (a batch with all its files) and drop its hold
        on content; files go in ``cleanup`` after the commit."""
        if is_batch(e):
            batches.delete_tree(tx, e, lambda tx, m: self.content.release(tx, m, cleanup))
        tx.delete(e.id)  # the row first: the last reference may delete its blob row
        self.content.release(tx, e, cleanup)

    async def _seal_batch(self, root: Entry) -> list[tuple[int, Sealed]]:
        """Publishing a batch seals every file in it; none may still be open for writing."""
        out = []
        for m in batches.walk(self.r, root):
            if m.staged:
                if self._writers.get(m.id, 0) > 0:
                    raise NotPermitted(f"{m.name!r} in the batch is still open for writing")
                out.append((m.id, await self._seal(m)))
        return out

    async def _rename_member(self, e: Entry, parent: int, new_parent: int, new_name: bytes,
                             flags: int) -> None:
        """Inside a batch being built in partial/, files and directories move freely."""
        root = batches.check_mutable(self.r, e)
        d = self.get(new_parent)
        if d.kind not in ("message", MEMBER) or not is_dir(d) or \
                batches.root_of(self.r, d).id != root.id:
            raise NotPermitted("a batch's files move only within the batch")
        if parent == new_parent and e.name == new_name:
            return
        cleanup: list[tuple[str, object]] = []

        def fn(tx: WriteTx) -> None:
            old = tx.lookup(new_parent, new_name)
            if old is not None:
                if flags & RENAME_NOREPLACE or is_dir(old) or is_dir(e):
                    raise Exists("target exists")
                tx.delete(old.id)
                self.content.release(tx, old, cleanup)
            if is_dir(e):  # never into itself
                up: Entry | None = d
                while up is not None and up.kind == MEMBER:
                    if up.id == e.id:
                        raise Invalid("a directory cannot move into itself")
                    up = tx.get(up.parent) if up.parent is not None else None
            if not tx.move(e.id, parent, e.name, new_parent, new_name, ctime_ns=self.clock()):
                raise NotFound()

        await self.tx(fn, durable=False)
        self.content.cleanup(cleanup)

    async def unlink(self, parent: int, name: bytes, who: Who, as_dir: bool = False) -> None:
        e = self.lookup(parent, name)
        if e.kind == MEMBER and not is_dir(e):
            return await self._remove_in_batch(parent, e, who)
        if e.kind != "message" or is_dir(e) != as_dir:
            raise IsADirectory() if not as_dir else NotADirectory()
        action = rules.decide_unlink(self.kind(e))
        now = self.clock()
        cleanup: list[tuple[str, object]] = []

        def fn(tx: WriteTx) -> None:
            cur = tx.get(e.id)
            if cur is None or cur.parent != parent or cur.name != name:
                raise NotFound()
            self.delete_message(tx, cur, cleanup)
            apply(tx, cur, action, None, Context(now), (who.uid, who.pid))

        await self.tx(fn)
        self.content.cleanup(cleanup)
        self._link_counts_changed(e.blob)

    async def link(self, entry_id: int, new_parent: int, new_name: bytes, who: Who) -> Entry:
        """A new message sharing the content of ``entry_id`` (sealing it if still staged)."""
        src = self.get(entry_id)
        if src.kind != "message" or src.hidden or is_dir(src):
            raise NotPermitted("only messages can be linked")
        check_message_name(new_name)
        d = self.get(new_parent)
        dst_state = self._message_dir(d)
        action = rules.decide_link(rules.kind_of(dst_state, new_name))
        self.guard.check(self.policies.of(d.queue))
        if src.staged and self._writers.get(src.id, 0) > 0:
            raise NotPermitted("an upload still open for writing cannot be linked")
        sealed = await self._seal(src) if src.staged else None
        now = self.clock()
        left: list[bool] = []

        def fn(tx: WriteTx) -> Entry:
            cur = tx.get(src.id)
            if cur is None:
                raise NotFound()
            if tx.lookup(new_parent, new_name) is not None:
                raise Exists()
            if sealed is not None and cur.staged:
                self.content.attach(tx, cur.id, sealed)
                cur = tx.get(cur.id)
                assert cur is not None
            assert cur.blob is not None
            tx.blob_ref(cur.blob, 1)
            e = make(tx, action, dst_state, Context(now), (who.uid, who.pid),
                     why=f"linked from message {cur.id}", parent=new_parent, name=new_name,
                     kind="message", queue=d.queue, blob=cur.blob, size=cur.size,
                     mode=cur.mode, uid=who.uid, gid=who.gid, mtime_ns=cur.mtime_ns,
                     created_ns=now)
            tx.copy_xattrs(cur.id, e.id)
            if action in self.ARRIVALS and self._arrive(tx, e.id, now, who):
                left.append(True)
                arrived = tx.get(e.id)
                assert arrived is not None  # inserted in this transaction
                return arrived
            return e

        e = await self.tx(fn, durable=action in rules.DURABLE)
        if sealed is not None:
            self.content.cleanup([("staging", src.id)])
        if left:
            self.on_gone(new_parent, new_name)
        self._link_counts_changed(e.blob)
        return e

    # ---- attributes -----------------------------------------------------------------------

    async def setattr(self, entry_id: int, *, size: int | None = None, mode: int | None = None,
                      uid: int | None = None, gid: int | None = None,
                      atime_ns: int | None = None, mtime_ns: int | None = None,
                      who: Who) -> Entry:
        """Truncate an upload, or change anyone's mode, owner or times. Only content is
        immutable once published: metadata changes as the kernel's permission checks allow,
        in every state (``install -m``, ``shutil.move`` and ``cp -p`` set it right after the
        copy, and would report a publish that worked as a failure)."""
        e = self.get(entry_id)
        if size is not None:
            if e.kind in ("message", MEMBER):
                self._check_modify(e)
            self.truncate(e, size)
        if (atime_ns is not None or mtime_ns is not None) and e.staged:
            self.content.staging.touch(e.id, atime_ns, mtime_ns)
        fields: dict[str, Any] = {}
        if atime_ns is not None and not e.staged:
            fields["atime_ns"] = atime_ns
        if mode is not None:
            fields["mode"] = (e.mode & ~0o7777) | (mode & 0o7777)
        if uid is not None:
            fields["uid"] = uid
        if gid is not None:
            fields["gid"] = gid
        if mtime_ns is not None:
            fields["mtime_ns"] = mtime_ns
        if fields:
            now = fields["ctime_ns"] = self.clock()
            until = L.lease_end(self.policies.of(e.queue), now)

            def fn(tx: WriteTx) -> None:
                extra = {}
                if mtime_ns is not None:  # touch: the shell heartbeat of a claimed message
                    cur = tx.get(entry_id)
                    if cur is not None and cur.state is State.WORKING and cur.lease_ns is not None:
                        extra["lease_ns"] = max(until, cur.lease_ns)
                tx.update(entry_id, **fields, **extra)

            await self.tx(fn, durable=e.kind not in ("message", MEMBER))
        return self.get(entry_id)

    def xattr_names(self, e: Entry) -> list[bytes]:
        if e.kind == "queue":
            return self.policies.xattr_names()
        if e.kind != "message":
            return []
        names = [b"state", b"attempts", b"size", b"created", b"history"]
        if e.blob is not None:
            names.append(b"sha256")
        if e.enqueued_ns:
            names.append(b"enqueued")
        if e.claimed_ns:
            names.append(b"claimed")
        if e.consumer:
            names.append(b"consumer")
        if e.error:
            names.append(b"error")
        if e.lease_ns is not None:
            names.append(b"lease_expires")
        if e.retry_ns is not None:
            names.append(b"retry_at")
        if e.abandoned:
            names.append(b"abandoned")
        if e.duplicate_of is not None:
            names.append(b"duplicate_of")
        return [SPOOL_XATTR + n for n in names] + list(self.r.xattrs(e.id))

    def getxattr(self, e: Entry, name: bytes) -> bytes:
        if e.kind == "queue" and name.startswith(SPOOL_XATTR):
            return self.policies.getxattr(e.id, name)
        if name.startswith(SPOOL_XATTR) and e.kind == "message":
            key = name[len(SPOOL_XATTR):]
            value = self._spool_attr(e, key)
            if value is None:
                raise NoAttribute()
            return value
        v = self.r.xattrs(e.id).get(name)
        if v is None:
            raise NoAttribute()
        return v

    def _spool_attr(self, e: Entry, key: bytes) -> bytes | None:
        def t(ns: int | None) -> bytes | None:
            if not ns:
                return None
            return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns / 1e9)).encode() + \
                b".%03dZ" % (ns // 1_000_000 % 1000)
        if key == b"state":
            return self.kind(e).value.encode() if not e.hidden else b"uploading"
        if key == b"attempts":
            return str(e.attempts).encode()
        if key == b"size":
            return str(self.size_of(e)).encode()
        if key == b"sha256":
            b = self.r.blob(e.blob) if e.blob is not None else None
            return b.sha256.hex().encode() if b else None
        if key == b"created":
            return t(e.created_ns)
        if key == b"enqueued":
            return t(e.enqueued_ns)
        if key == b"claimed":
            return t(e.claimed_ns)
        if key == b"consumer":
            return e.consumer.encode() if e.consumer else None
        if key == b"error":
            return e.error
        if key == b"history":
            return self.history_text(e.id).encode()
        if key == b"lease_expires":
            return t(e.lease_ns)
        if key == b"retry_at":
            return t(e.retry_ns)
        if key == b"abandoned":
            return b"1" if e.abandoned else None
        if key == b"duplicate_of":
            if e.duplicate_of is None:
                return None
            orig = self.r.get(e.duplicate_of)
            where = f" ({place(orig)}/{orig.name.decode(errors='replace')})" if orig else ""
            return f"message {e.duplicate_of}{where}".encode()
        return None

    def history_text(self, entry_id: int) -> str:
        lines = []
        for at_ns, action, src, dst, uid, pid, reason in self.r.history(entry_id):
            when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at_ns / 1e9))
            by = f"uid={uid} pid={pid}" if uid is not None else "by spoolfs"
            line = (f"{when}.{at_ns // 1_000_000 % 1000:03d}Z {action} "
                    f"{src or '-'} -> {dst or '-'} {by}")
            lines.append(line + (f" ({reason})" if reason else "") + "\n")
        return "".join(lines)

    async def setxattr(self, e: Entry, name: bytes, value: bytes, who: Who) -> None:
        if not name.startswith(b"user."):
            raise NotSupported("only user.* attributes are kept")
        if e.kind == "queue" and name.startswith(SPOOL_XATTR):
            return await self._set_policy(e, name, value)
        if e.kind != "message":
            raise NotPermitted("attributes are kept on messages only")
        kind = self.kind(e)
        if name == SPOOL_XATTR + b"error":
            if kind not in rules.ERROR_REASON_KINDS:
                raise NotPermitted("user.spool.error is set in working/ before mv to error/")
            await self.tx(lambda tx: tx.update(e.id, error=value))
            return
        if name.startswith(SPOOL_XATTR):
            raise NotPermitted(f"{name!r} is read-only")
        if kind not in rules.HEADER_KINDS and not e.hidden:
            raise NotPermitted("headers are set before publishing, in partial/")
        await self.tx(lambda tx: tx.set_xattr(e.id, name, value), durable=False)

    async def _set_policy(self, e: Entry, name: bytes, value: bytes | None) -> None:
        changes = self.policies.changes(name, value)

        def fn(tx: WriteTx) -> None:
            check_fanout(tx, e.id, changes)
            tx.set_policy(e.id, changes)

        await self.tx(fn)
        self.policies.refresh()
        shown = ", ".join(f"{k}={v if v is not None else '(default)'}"
                          for k, v in changes.items())
        log.info("queue %s: policy %s", e.name.decode(errors="replace"), shown)

    async def removexattr(self, e: Entry, name: bytes, who: Who) -> None:
        if not name.startswith(b"user."):
            raise NotSupported("only user.* attributes are kept")
        if e.kind == "queue" and name.startswith(SPOOL_XATTR):
            return await self._set_policy(e, name, None)
        if e.kind != "message":  # the root, queues' other names, state dirs, batch files
            raise NoAttribute(f"{name!r}: attributes are kept on messages only")
        if name.startswith(SPOOL_XATTR) or (
                self.kind(e) not in rules.HEADER_KINDS and not e.hidden):
            raise NotPermitted(f"{name!r} cannot be removed here")

        def fn(tx: WriteTx) -> None:
            if not tx.remove_xattr(e.id, name):
                raise NoAttribute()

        await self.tx(fn, durable=False)

    def statfs(self) -> os.statvfs_result:
        return os.statvfs(self.store_dir)
