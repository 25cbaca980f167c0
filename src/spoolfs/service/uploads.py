"""Uploads: creating, opening, writing and closing files in partial/ and ready/ (an
upload into ready/ is published when its last writer closes it).
"""

from __future__ import annotations

import logging
import stat
from typing import Any

import trio

from spoolfs.blobs import freeing
from spoolfs.core import rules
from spoolfs.core.errors import (
    Exists,
    IsADirectory,
    NotFound,
    NotPermitted,
    SpoolError,
    StoreFailure,
)
from spoolfs.core.names import check_message_name
from spoolfs.core.rules import Action, State
from spoolfs.core.transitions import Context, fields_of, transition
from spoolfs.service import batches
from spoolfs.service.batches import MEMBER, is_dir
from spoolfs.service.content import Handle
from spoolfs.service.publishing import Publishing
from spoolfs.service.roles import inherit, keeps_setid, setid_bits
from spoolfs.service.spool_core import Who, free_off_loop
from spoolfs.service.steps import waited
from spoolfs.store.base import Blob, Entry, WriteTx

log = logging.getLogger(__name__)


class Uploads(Publishing):
    async def create(self, parent: int, name: bytes, mode: int, who: Who) -> tuple[Entry, Handle]:
        """A new upload, opened for writing. In ``ready/`` (not a staging name) it stays
        invisible until its last writer closes, then appears complete."""
        d = await self.directory(parent)
        if d.kind in ("message", MEMBER) and is_dir(d):
            return await self._create_member(d, name, mode, who)
        state = self._message_dir(d)
        check_message_name(name)
        action = rules.decide_create(rules.kind_of(state, name))
        self.guard.check(self.policies.of(d.queue))
        now = self.clock()
        try:
            return await self._new_upload(d, name, mode, who, now, kind="message",
                                          queue=d.queue, state=state,
                                          **fields_of(transition(action, state), None,
                                                      Context(now)))
        except ValueError:  # a database's constraint: the directory gone since it was read?
            if await self.row(parent) is None:
                raise NotFound(f"no entry {parent}") from None
            raise

    async def _new_upload(self, d: Entry, name: bytes, mode: int, who: Who, now: int,
                          **fields: Any) -> tuple[Entry, Handle]:
        """The row and the empty staging file of a new upload in ``d``, opened for writing
        (the file made ahead when the pool has one: service/staging_pool.py)."""
        fields.setdefault("ctime_ns", now)
        made: list[Handle] = []
        modes_seen = self.mode_changes
        pooled = self.staging_pool.take()
        if pooled is not None:
            fields["id"] = pooled[0]

        def fn(tx: WriteTx) -> Entry:
            e = tx.insert_unless_named(
                parent=d.id, name=name, staged=1, mode=stat.S_IFREG | (mode & 0o7777),
                uid=who.uid, gid=inherit(d, who.gid, mode, is_dir=False)[0], mtime_ns=now,
                created_ns=now, **fields)
            if e is None:
                raise Exists()
            for earlier in made:  # a database server's retry of the transaction
                self._let_go(earlier)
                earlier.close()
            made.clear()
            # held before the row commits
            h = self.content.new_upload(e.id, pooled[1] if pooled else None)
            made.append(h)
            if e.hidden:
                h.private = True
            else:  # shared before any other daemon can see the row: nothing seals it yet
                h.shares = self.writer_locks.try_share(e.id, h.fd)
            return e

        try:
            e = await self.tx(fn, durable=False)
        except BaseException as err:
            if pooled is not None and pooled[1] is not None and not made:
                # refused before its row was written (the name exists...): no row names
                # the file; after a failed commit, recovery judges it
                named = not isinstance(err, SpoolError) or isinstance(err, StoreFailure)
                self.staging_pool.unused(pooled[0], pooled[1], remove=not named)
            for h in made:  # rolled back: the file names no row (recovery removes it)
                self._let_go(h)
                self.content.forget(h.entry_id, wait=True)
                h.close()
            raise
        if pooled is None:
            self.staging_pool.used(e.id)
        if self.left_names is not None:  # (an unpublished upload's row is in no change log)
            self.left_names.made(d.id, name)
        h = self._open_handle(e, writable=True, who=who, h=made[-1])
        if not setid_bits(e.mode):
            # the mode it was made with, as a read of the row would give it: read again only
            # once a mode may have changed since (a chmod here, a change seen from another
            # host), as after any write (drop_setid)
            h.setid_clear_at = modes_seen
        return e, h

    async def _create_member(self, d: Entry, name: bytes, mode: int, who: Who
                             ) -> tuple[Entry, Handle]:
        """A file in a batch being built in partial/."""
        check_message_name(name)
        root = await self.mutable_batch(d)
        self.guard.check(self.policies.of(root.queue))
        return await self._new_upload(d, name, mode, who, self.clock(), kind=MEMBER,
                                      queue=root.queue)

    def _open_handle(self, e: Entry, writable: bool, who: Who, h: Handle,
                     counted: bool = False) -> Handle:
        """``h``, a handle on ``e``'s content, registered as this opener's (``counted``: as
        a writer already, from the start of its opening)."""
        h.opener = who.pid
        h.queue = e.queue
        if writable and not who.nfs:  # an NFS server acts for clients it does not name
            h.checks_setid = True
            h.opener_uid = who.uid
        if e.kind == MEMBER:
            h.lease_id = batches.root_of(self.r, e).id
        elif e.state is State.WORKING and e.lease_ns is not None:
            h.lease_seen = (e.queue, e.lease_ns)
        if who.nfs:  # the server's descriptor: no lease, no say in when an upload appears
            h.nfs = True
            self._nfs.setdefault(e.id, []).append(h)
            return h
        self._open[h.lease_id] = self._open.get(h.lease_id, 0) + 1
        if writable and not counted:
            self._writers[e.id] = self._writers.get(e.id, 0) + 1
        return h

    async def open(self, entry_id: int, writable: bool, truncate: bool, who: Who) -> Handle:
        # one round trip on a database server, the loop answering others meanwhile
        e, blob = await waited(self.r.get_with_blob_steps(entry_id))
        if e is None:
            raise NotFound(f"no entry {entry_id}")
        if e.kind not in ("message", MEMBER) or is_dir(e):
            raise IsADirectory()
        if e.hidden and not (writable or truncate or who.nfs):
            # an upload into ready/ not published yet, reached through a name the kernel still
            # held (a mv while it is written): no such file to a reader, as to a lookup
            raise NotFound(f"upload {entry_id} is not published yet")
        shares = counted = False
        if writable or truncate:
            e, shares = await self.writing(e)
        try:
            writable = self._may_modify(e, writable, truncate, who)
            # A writer from here on: a publish of the upload while its truncation (or the
            # clearing of its set-ID bits) waits is left to its last close, as for any other
            # writer (a rename leaves a writer writing the file it renamed); a link refused.
            counted = writable and not who.nfs
            if counted:
                self._writers[e.id] = self._writers.get(e.id, 0) + 1
            if truncate:
                e = await self._truncated(e, writable, who)
                if not writable:  # it only truncated
                    held, shares = shares, False
                    await self._stopped_writing(e.id, who, held)
                    e = self.get(e.id)
            if writable and e.hidden:  # its publish is left to its writers: this one too
                self.writer_locks.leave(e.id)
            h = await self._opened(e, writable, blob)
        except BaseException:
            await self._stopped_writing(e.id, who, shares, counted)
            raise
        if shares and not h.writable:  # (an NFS server's, refusing writes: held no wait)
            self.writer_locks.unshare(e.id)
            shares = False
        h.shares = shares
        return self._open_handle(e, h.writable, who, h, counted=counted)

    async def _stopped_writing(self, entry_id: int, who: Who, shares: bool,
                               counted: bool = False) -> None:
        """An opening or a resize that held a share of the upload's writers' lock
        (``shares``), or counted as its writer (``counted``), writes no more: both given
        back. A publish left to it meanwhile (a rename here, or through another mount while
        it held the share) is made now if no other writer here holds the upload (nor an NFS
        server's descriptor). Not cancelled (the upload would stay hidden until the next
        mount); a refusal of that publish (the upload went to ``partial/``) is logged, and
        the caller's own error, if any, goes on."""
        if shares:
            self.writer_locks.unshare(entry_id)
        if not (counted or shares and entry_id not in self._writers
                and not self.nfs_writes(entry_id)):
            return
        with trio.CancelScope(shield=True):
            try:
                if counted:
                    await self._writer_gone(entry_id, who)
                else:
                    await self.appear_unless_written(entry_id, who)
            except SpoolError as refused:
                log.warning("upload %d: the publish left to its last writer: %s", entry_id,
                            refused)

    def _may_modify(self, e: Entry, writable: bool, truncate: bool, who: Who) -> bool:
        """Whether the handle about to be opened on ``e`` writes (NotPermitted: it may not be
        opened so)."""
        if writable or truncate:
            try:
                self._check_modify(e)
            except NotPermitted:
                if not who.nfs or truncate:
                    raise
                # An NFS server opens files read-write for its own reasons (to set times: a
                # client's touch of its claim): it gets a handle that refuses writes instead.
                return False
        return writable

    async def _truncated(self, e: Entry, writable: bool, who: Who) -> Entry:
        """``e`` cut to nothing by an open that truncates, as it is then. Counted as a change
        under way from before its first wait: a publish or link meanwhile seals what the cut
        leaves (one begun before waited in ``writing``). Read again after each wait: removed
        meanwhile, NotFound (no staging file made again for it)."""
        with self.write_pace.under_way(e.id):
            if not who.nfs and setid_bits(e.mode) and not keeps_setid(who.pid, who.uid):
                await self._clear_setid(e.id, who.pid)  # as a write would
                e = self.get(e.id)
            await self.truncate(e, 0)
        e = self.get(e.id)
        if writable:  # (published meanwhile: by a client's rename, for an NFS server's)
            self._check_modify(e)
        return e

    async def _opened(self, e: Entry, writable: bool, blob: Blob | None = None) -> Handle:
        """A handle on ``e``'s content; ``blob``: its blob row, if read with it (else read
        here when needed)."""
        if blob is not None and blob.id != e.blob:
            blob = None  # (the row was read before a truncation)
        if self.content.blobs.remote and not e.staged and e.blob is not None:
            blob = await trio.to_thread.run_sync(self.content.fetch, self.r, e, blob,
                                                 limiter=self.limiter)
        h = self.content.open_cached(self.r, e, writable, blob)
        if h is None:  # its file's path is not in the kernel's cache: looked up on the disk
            if blob is None:  # (read here: the thread need not query)
                blob = self.r.blob(e.blob) if e.blob is not None else None
            try:  # (not behind the store's transfers: the default limiter)
                h = await trio.to_thread.run_sync(self.content.open, self.r, e, writable, blob)
            except StoreFailure:
                self.get(e.id)  # removed meanwhile, its file with it: NotFound, as a lookup
                raise
            try:
                self.get(e.id)  # removed meanwhile, its file still there (shared): the same
            except NotFound:
                h.close()
                raise
        return h

    def _check_modify(self, e: Entry) -> None:
        if e.kind == MEMBER:
            batches.check_mutable(self.r, e)
        else:
            rules.decide_modify(self.kind(e), e.hidden, e.staged)

    async def truncate(self, e: Entry, size: int) -> None:
        """Resize an upload's staging file (its size is the file's: no transaction). A cut
        that may free much of the disk waits in a worker thread, counted as a change of the
        upload under way: a seal of it waits for it (``write_pace.landed``). The caller reads
        the upload again after it."""
        cut = self.content.resize(e.id, size)
        if cut is None:
            return
        try:
            with trio.CancelScope(shield=True):  # (made once begun: its caller waits for it)
                await self.write_pace.changing(e.id, cut.make)
        finally:
            cut.abandon()  # no thread to be had: its descriptor closed, nothing cut

    def awaits_publish(self, h: Handle) -> bool:
        """Whether ``h`` writes an upload into ``ready/`` that has not appeared yet."""
        return self.pending_upload(h) is not None

    def pending_upload(self, h: Handle) -> Entry | None:
        """The upload into ``ready/`` that ``h`` writes, if it has not appeared yet."""
        if not h.writable or h.done:
            return None
        if not self._may_be_hidden(h):
            return None  # in partial/ still: no rename left its publish to its writers
        e = self.r.get(h.entry_id)
        return e if e is not None and e.hidden else None

    def _may_be_hidden(self, h: Handle) -> bool:
        """Whether the upload ``h`` writes may be hidden, its publish left to its writers:
        made hidden here, an NFS server's (whose client's renames it cannot tell), or marked
        so by a rename (service/writers.py). False: its row needs no look."""
        return h.private or h.nfs or self.writer_locks.may_be_left(h.fd)

    def writer_failed(self, h: Handle, why: str) -> None:
        """A process writing through ``h`` did not finish (``why``: it ``was killed by
        SIGKILL``, ...): its upload into ``ready/`` is never published as it is."""
        if self.awaits_publish(h):
            self._unfinished.setdefault(h.entry_id, why)
            log.info("upload %d: its writer %s", h.entry_id, why)

    async def publish_at_close(self, h: Handle, who: Who, unfinished: str | None = None,
                               pending: Entry | None = None) -> None:
        """The opener closed its descriptor and holds no other: an upload into ``ready/``
        appears now, durable before ``close(2)`` returns (``cp x ready/`` then exits 0 only
        once the message is safe). Later writes through a copy of the descriptor are refused.

        ``unfinished`` says how the opener ended when it did not finish (``was killed by
        SIGKILL``, ``exited with status 1``). Such an upload, or one a process holding a copy
        of the descriptor did not finish (``writer_failed``), is never published: it goes to
        ``partial/`` with the bytes written so far, now or, if another writer still holds
        it, at that writer's last close; a copy of the descriptor writes on into it there.
        ``pending``: the upload as ``pending_upload`` just read it (saves reading it again)."""
        e = pending if pending is not None else self.pending_upload(h)
        if e is None:
            return
        if unfinished is not None:
            self.writer_failed(h, unfinished)
        if self._writers.get(h.entry_id, 0) > 1:
            return  # another writer holds it: the last close decides
        h.done = h.entry_id not in self._unfinished
        if not await self._publish_settled(e, who, h.private):
            h.done = False  # a writer through another mount holds it: it decides

    async def close(self, h: Handle, who: Who) -> None:
        """The last writable handle publishes a pending upload into ``ready/``.
        Requests read after this one (the writer's next command) wait in ``settle`` until
        the upload has appeared. The handle's file (and with it the lock that tells another
        daemon's recovery the upload is being written) is closed only once it is published."""
        try:
            await self._closing(h, who)
        finally:
            self._let_go(h)
            held = h.close_unless_holding()  # (a message removed while it was read)
            await free_off_loop(freeing.Held([held] if held is not None else []))

    async def _closing(self, h: Handle, who: Who) -> None:
        # before it looks whether the upload is left to publish: a writer through another
        # daemon that closes meanwhile then sees this one gone (``appear_unless_written``)
        self._let_go(h)
        if h.nfs:
            await self._nfs_closing(h, who)
            return
        left = self._open.get(h.lease_id, 1) - 1
        if left > 0:
            self._open[h.lease_id] = left
        else:
            self._open.pop(h.lease_id, None)
            if not h.writable:  # (a writable handle is an upload's: never claimed, no lease)
                await self._lease_from_now(h.lease_id, seen=h.lease_seen)
        if h.writable:  # (its share let go: a rename after this look publishes it itself)
            await self._writer_gone(h.entry_id, who, h.done, h.private,
                                    left=self._may_be_hidden(h))

    async def _writer_gone(self, entry_id: int, who: Who, done: bool = False,
                           private: bool = False, left: bool = True) -> None:
        """A writer here writes the upload no more (closed, or its opening failed). The last
        publishes it if a publish was left to it (hidden), unless ``done`` (published at its
        close already). ``left``: a rename may have left it its publish (False: none did,
        and the row needs no look)."""
        n = self._writers.get(entry_id, 1) - 1
        if n > 0:
            self._writers[entry_id] = n
            return
        self._writers.pop(entry_id, None)
        try:
            if done or not left:  # published at the close (FLUSH) already, or never hidden
                return
            e = self.r.get(entry_id)
            if e is not None and e.hidden:
                await self._publish_settled(e, who, private)
        finally:
            self._failed.discard(entry_id)
            self._unfinished.pop(entry_id, None)

    # ---- uploads written by an NFS server (-o nfs_export) ----------------------------------
    #
    # An NFS server keeps descriptors open on its clients' behalf and closes them when it
    # pleases (nfs-ganesha: when its descriptor cache is trimmed), so a close says nothing
    # about a client. What does: the client's COMMIT (the server's fsync) of a file it
    # created in ready/, and its rename of a file into ready/. Either publishes at once;
    # writes through the server's descriptors after that are refused (EPERM), never lost.

    async def committed(self, h: Handle, who: Who) -> None:
        """The server synced an upload it created in ``ready/`` (a client's COMMIT, or a
        stable WRITE): it appears now, unless a local writer still holds it."""
        e = self.pending_upload(h) if h.nfs else None
        if e is None or self._writers.get(e.id, 0) > 0:
            return
        self._nfs_published(e.id)
        try:
            await self._publish_settled(e, who)
        except BaseException:
            self._nfs_published(e.id, False)  # still an upload (or one in partial/ now)
            raise

    async def commit_failed(self, h: Handle, who: Who, why: str) -> None:
        """The server's sync of an upload it created in ``ready/`` failed (a client's COMMIT,
        told EIO): the upload goes to ``partial/`` with its bytes now, as a local ``cp``'s
        does at its close, not left unseen until the server lets its descriptor go; unless a
        local writer still holds it (its close decides, and the seal refuses it)."""
        e = self.pending_upload(h) if h.nfs else None
        if e is not None and self._writers.get(e.id, 0) == 0:
            await self._refused_upload(e, who, why)

    async def _nfs_closing(self, h: Handle, who: Who) -> None:
        """The server closed a descriptor: a pending upload nobody else writes appears
        (a client that created a file and wrote nothing, then never synced)."""
        held = self._nfs.get(h.entry_id, [])
        if h in held:
            held.remove(h)
        if not held:
            self._nfs.pop(h.entry_id, None)
        if not h.writable or h.done or self._writers.get(h.entry_id, 0) > 0 \
                or self.nfs_writes(h.entry_id):
            return
        e = self.r.get(h.entry_id)
        try:
            if e is not None and e.hidden:
                self._nfs_published(e.id)
                await self._publish_settled(e, who)
        finally:
            self._failed.discard(h.entry_id)

    # ---- arrival in ready/: duplicates and fan-out (DESIGN §5) ---------------------------

    #: publishes that make a message arrive in a queue's ready/
    ARRIVALS = frozenset({Action.PUBLISH, Action.DIRECT_PUBLISH, Action.LINK_PUBLISH,
                          Action.FORWARD, Action.REDRIVE})

    async def drop_setid(self, h: Handle) -> None:
        """Before each write through ``h``: clear the set-user-ID and set-group-ID bits its
        opener may not keep (roles.setid_bits, keeps_setid), as the kernel does before each of
        its cached writes: bits set while the file is open go at the next write. Uploads are
        written past the kernel's cache (fuse/ops.py), so the daemon does it. The mode is read
        again only after a mode may have changed (``mode_changes``)."""
        if h.setid_clear_at == self.mode_changes:
            return
        seen = self.mode_changes
        e = self.r.get(h.entry_id)
        if e is None or not setid_bits(e.mode):
            h.setid_clear_at = seen
            return
        if keeps_setid(h.opener, h.opener_uid):
            h.checks_setid = False  # its opener may keep them, whatever the mode becomes
            return
        await self._clear_setid(e.id, h.opener)

    async def _clear_setid(self, entry_id: int, pid: int) -> None:
        """Durably, before the write or truncation that makes it due: the new content is
        never on disk under the old bits."""
        cleared: list[int] = []

        def fn(tx: WriteTx) -> None:
            e = tx.get(entry_id)
            if e is not None and (bits := setid_bits(e.mode)):
                tx.update(e.id, mode=e.mode & ~bits, ctime_ns=self.clock())
                cleared.append(e.id)

        await self.tx(fn, durable=True)
        if cleared:
            log.info("upload %d: set-ID bits cleared for pid %d", entry_id, pid)
            self.on_stale(cleared)

    def write(self, h: Handle, off: int, buf: bytes) -> int:
        """A write through ``h``, on the calling thread."""
        try:
            self.guard.check(self.policies.of(h.queue), len(buf))
            return h.write(off, buf)
        except SpoolError:
            self._failed.add(h.entry_id)
            raise

    async def write_paced(self, h: Handle, off: int, buf: bytes) -> int:
        """A write through ``h``: checked and accounted on the event loop, written there or,
        while the disk holds writers back, in a worker thread (service/writepace.py)."""
        try:
            self.guard.check(self.policies.of(h.queue), len(buf))
            h.may_write()
            return h.wrote(off, await self.write_pace.pwrite(h, off, buf))
        except SpoolError:
            self._failed.add(h.entry_id)
            raise
