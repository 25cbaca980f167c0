"""Moving messages: the transitions of DESIGN §3 (rename), removal and hard links.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from spoolfs.core import lifecycle as L
from spoolfs.core import rules
from spoolfs.core.errors import (
    Exists,
    Invalid,
    IsADirectory,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
)
from spoolfs.core.names import check_ident, check_message_name
from spoolfs.core.rules import Action, DirKind, State
from spoolfs.core.transitions import Context
from spoolfs.service import batches
from spoolfs.service.batches import MEMBER, is_batch, is_dir
from spoolfs.service.moves import apply, make
from spoolfs.service.roles import inherit
from spoolfs.service.spool_core import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    RENAME_WHITEOUT,
    Who,
)
from spoolfs.service.uploads import Uploads
from spoolfs.store.base import Entry, WriteTx

log = logging.getLogger(__name__)


class Moving(Uploads):
    async def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes,
                     flags: int, who: Who) -> bool:
        """Rename; True when the message became a hidden upload (published once its writer
        closes), so that a name the kernel had cached must be dropped."""
        if flags & (RENAME_EXCHANGE | RENAME_WHITEOUT):
            raise Invalid("RENAME_EXCHANGE and RENAME_WHITEOUT are not supported")
        check_message_name(new_name)
        src, d, there = await self.rename_reads(parent, name, new_parent, new_name)
        if src.kind == MEMBER:
            await self._rename_member(src, parent, new_parent, new_name, flags)
            return False
        if src.kind != "message":
            await self._rename_dir(src, parent, new_parent, new_name, flags)
            return False
        if d is None:
            raise NotFound(f"no entry {new_parent}")
        dst_state = self._message_dir(d)
        src_kind, dst_kind = self.kind(src), rules.kind_of(dst_state, new_name)
        scope = rules.scope_of(parent == new_parent, src.queue == d.queue)
        action = rules.decide_rename(src_kind, dst_kind, scope)
        if parent == new_parent and name == new_name:
            return False
        if action is Action.PUBLISH:
            self.guard.check(self.policies.of(d.queue))
        defer = action is Action.PUBLISH and self._writers.get(src.id, 0) > 0
        seals = action is Action.PUBLISH and not defer and (src.staged or is_batch(src))
        taken = self._exclusive(src) if seals else []
        elsewhere = taken is None  # a writer through another mount of the store holds it
        if taken is None:
            if is_batch(src):
                raise NotPermitted("a file of the batch is still open for writing through "
                                   "another mount")
            taken, defer, seals = [], True, False  # it appears when that writer closes
        if defer:  # its writers' last close publishes it: they find it marked so
            self.writer_locks.leave(src.id)
        try:
            with self._sealing_of(src) if seals else nullcontext():
                deferred = await self._rename_message(src, d, action, defer, parent, name,
                                                      new_parent, new_name, flags, who,
                                                      there is None)
        finally:
            self._unexclusive(taken)
        if (elsewhere or defer) and src.id not in self._writers:
            # (a writer that stopped while the rename committed found nothing to publish)
            await self.appear_unless_written(src.id, who)
        return deferred

    @contextmanager
    def _sealing_of(self, src: Entry) -> Iterator[None]:
        """``sealing`` for a publish or a link of an upload (or a batch's files); an NFS
        server's descriptors on them write no more from the start (its client wrote
        everything first), and write again if the sealing fails."""
        ids = [m.id for m in batches.walk(self.r, src)] if self._nfs and is_batch(src) \
            else [src.id]
        stopped = [i for i in ids if i in self._nfs]
        for i in stopped:
            self._nfs_published(i)
        try:
            with self.sealing(src.id):
                yield
        except BaseException:
            for i in stopped:
                self._nfs_published(i, False)
            raise

    async def _rename_message(self, src: Entry, d: Entry, action: Action, defer: bool,
                              parent: int, name: bytes, new_parent: int, new_name: bytes,
                              flags: int, who: Who, seen_free: bool) -> bool:
        """``seen_free``: the new name was free before the transaction. Its move then takes
        the name only if it is still free (no lookup first: a round trip less on a database
        server), and looks it up only when it is not."""
        dst_state = self._message_dir(d)
        src_kind, dst_kind = self.kind(src), rules.kind_of(dst_state, new_name)
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
            into = (new_parent, new_name)
            if not (seen_free and apply(tx, src, action, dst_state, ctx, by, into=into,
                                        queue=d.queue, free=True)):
                # (the name was not free before, or was taken since; or the message moved)
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
                elif seen_free:  # the name is free: the message moved
                    raise NotFound("already moved")
                if not apply(tx, src, action, dst_state, ctx, by, into=into, queue=d.queue):
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
            if action in self.ARRIVALS and not defer \
                    and self._arrive(tx, src.id, d.queue, now, who):
                left.append(True)

        await self.tx(fn, durable=action in rules.DURABLE)
        log.debug("%s %s %r -> %s %r", action.value, src_kind.value, name, dst_kind.value, new_name)
        if left:
            self.on_gone(new_parent, new_name)
            self.link_counts_changed(self.get(src.id).blob)
        await self.removed(cleanup)  # (told first: this may wait for the disk)
        return defer

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

    async def _rename_member(self, e: Entry, parent: int, new_parent: int, new_name: bytes,
                             flags: int) -> None:
        """Inside a batch being built in partial/, files and directories move freely."""
        root = await self.mutable_batch(e)
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
                self.delete_message(tx, old, cleanup)
            if is_dir(e):  # never into itself
                up: Entry | None = d
                while up is not None and up.kind == MEMBER:
                    if up.id == e.id:
                        raise Invalid("a directory cannot move into itself")
                    up = tx.get(up.parent) if up.parent is not None else None
            if not tx.move(e.id, parent, e.name, new_parent, new_name, ctime_ns=self.clock()):
                raise NotFound()

        await self.tx(fn, durable=False)
        await self.removed(cleanup)

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
            self.delete_message(tx, cur, cleanup)

        await self.tx(fn, durable=False)
        await self.removed(cleanup)

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
        self.link_counts_changed(e.blob)
        await self.removed(cleanup)

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
        taken = self._exclusive(src) if src.staged else []
        if taken is None:
            raise NotPermitted("an upload still open for writing through another mount "
                               "cannot be linked")
        try:
            with self._sealing_of(src) if src.staged else nullcontext():
                return await self._link(src, d, dst_state, action, new_parent, new_name, who)
        finally:
            self._unexclusive(taken)

    async def _link(self, src: Entry, d: Entry, dst_state: State, action: Action,
                    new_parent: int, new_name: bytes, who: Who) -> Entry:
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
            if action in self.ARRIVALS and self._arrive(tx, e.id, d.queue, now, who):
                left.append(True)
                arrived = tx.get(e.id)
                assert arrived is not None  # inserted in this transaction
                return arrived
            return e

        e = await self.tx(fn, durable=action in rules.DURABLE)
        if left:
            self.on_gone(new_parent, new_name)
        self.link_counts_changed(e.blob)
        if sealed is not None:
            await self.removed([("staging", src.id)])
        return e
