"""Publishing: sealing uploads and their arrival in ready/ (duplicates and fan-out,
DESIGN §5), uploads refused because their writer did not finish.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

from spoolfs.core.errors import (
    Exists,
    Invalid,
    NoSpace,
    NoSubscriber,
    NotFound,
    NotPermitted,
    SpoolError,
    StoreFailure,
    SyncFailed,
)
from spoolfs.core.names import is_staging_name
from spoolfs.core.rules import Action, State
from spoolfs.core.transitions import Context
from spoolfs.service import batches
from spoolfs.service.batches import MEMBER, is_batch
from spoolfs.service.content import Handle, Sealed
from spoolfs.service.moves import apply, make, place
from spoolfs.service.spool_core import SpoolCore, Who, free_name
from spoolfs.store.base import Entry, WriteTx

log = logging.getLogger(__name__)

#: a writer waiting for another daemon's seal of its upload looks again after this long, then
#: twice as long each time, up to ``SEAL_POLL_MAX_S``
SEAL_POLL_S = 0.005
SEAL_POLL_MAX_S = 0.1


class Publishing(SpoolCore):
    def _arrive(self, tx: WriteTx, entry_id: int, queue: int | None, now: int, who: Who,
                path: tuple[int, ...] = ()) -> bool:
        """In the publishing transaction: apply the ``duplicates`` and ``fanout`` policies of
        ``queue`` to a message that just entered its ``ready/``. Raises (refusing the whole
        publish) for a rejected duplicate or a missing subscriber. True when the message left
        ``ready/`` (a skipped duplicate, or a topic's message handed to its subscribers). A
        queue with neither policy (most) costs no read of the row."""
        if queue is None:
            return False
        policy = self.policies.of(queue)
        if policy.duplicates == "allow" and not policy.fanout:
            return False
        cur = tx.get(entry_id)
        if cur is None or cur.queue != queue or is_staging_name(cur.name):
            return False
        qe = tx.get(queue)
        assert qe is not None
        qname = qe.name.decode(errors="replace")
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
            sq = tx.lookup(qe.parent, sub.encode()) if qe.parent is not None else None
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
            self._arrive(tx, copy.id, ready.queue, now, who, path + (cur.queue,))
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

    async def _publish_settled(self, e: Entry, who: Who, private: bool = False) -> bool:
        """Publish a hidden upload whose writers here have closed (or move it to
        ``partial/`` if one did not finish); False when it was left to a writer through
        another daemon (``_publish_hidden``)."""
        assert e.parent is not None
        done = (e.name, trio.Event())  # registered before the first await: see settle()
        self._settling.setdefault(e.parent, []).append(done)
        self._publishing.add(e.id)  # (a rename and a last close: one of them publishes)
        try:
            await self.write_pace.landed(e.id)  # writes under way in threads: ended first
            if e.id in self._failed:  # the writer saw a write fail: the content is not whole
                raise NoSpace("a write to this upload failed; it was not published")
            unfinished = self._unfinished.get(e.id)
            if unfinished is not None:  # its content may be cut anywhere: never claimable
                await self._refused_upload(e, who, f"its writer {unfinished}")
                return True
            return await self._publish_hidden(e, who, private)
        except SyncFailed as failed:  # the disk may not hold it: shown, never published
            await self._refused_upload(e, who, str(failed))
            raise
        except (NotFound, StoreFailure):
            raise  # gone meanwhile, or the store failed: recovery at mount reconciles it
        except SpoolError as refused:  # a rejected duplicate, a missing subscriber, ...
            await self._refused_upload(e, who, f"publish refused: {refused}")
            raise
        finally:
            self._publishing.discard(e.id)
            done[1].set()
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

    async def settle(self, parent: int, name: bytes | None = None) -> None:
        """Wait until uploads into ``parent`` whose last writer has closed have appeared: all of
        them (a listing), or the one called ``name`` (a lookup, a rename, an unlink). Other
        names in the directory go on meanwhile."""
        while True:
            waiting = self._settling.get(parent, ())
            pending = next((ev for n, ev in waiting if name is None or n == name), None)
            if pending is None:
                return
            await pending.wait()

    @contextmanager
    def sealing(self, entry_id: int) -> Iterator[None]:
        """While an upload (or a batch: all its files) is sealed and attached by a publish or
        a link: sealed bytes become the message's blob file, so nothing may write them. A
        writer opening it (or a resize) meanwhile waits (``unsealed``), then finds it
        published (refused) or, if the publish failed, still an upload."""
        done = trio.Event()
        self._sealing.setdefault(entry_id, []).append(done)  # two at once: each its own
        try:
            yield
        finally:
            waiting = self._sealing[entry_id]
            waiting.remove(done)
            if not waiting:
                del self._sealing[entry_id]
            done.set()

    async def unsealed(self, e: Entry) -> Entry:
        """``e`` as it is once no publish or link is sealing it (or its batch)."""
        while self._sealing:
            ids = (e.id, batches.root_of(self.r, e).id) if e.kind == MEMBER else (e.id,)
            pending = next((self._sealing[i][0] for i in ids if i in self._sealing), None)
            if pending is None:
                break
            await pending.wait()
            e = self.get(e.id)
        return e

    async def writing(self, e: Entry) -> tuple[Entry, bool]:
        """``e`` as it is once nothing seals it, through this daemon (``unsealed``) or another
        of the store, for a handle about to write it or a resize. True: this daemon's share of
        its writers' lock now counts one more (``writer_locks.unshare`` it), so that no seal
        begins until it is given back; an upload another daemon cannot reach (made hidden
        here, or published) takes none. Read again once the share is held: a seal that just
        ended has published it (the caller refuses to write it)."""
        delay = SEAL_POLL_S
        while True:
            e = await self.unsealed(e)
            if not e.staged or e.hidden:
                return e, False
            if self.writer_locks.try_share(e.id):
                try:
                    return self.get(e.id), True
                except BaseException:
                    self.writer_locks.unshare(e.id)
                    raise
            await trio.sleep(delay)
            delay = min(2 * delay, SEAL_POLL_MAX_S)
            e = self.get(e.id)

    def _let_go(self, h: Handle) -> None:
        """``h`` writes no more: it leaves this daemon's share of its upload's writers' lock."""
        if h.shares:
            h.shares = False
            self.writer_locks.unshare(h.entry_id)

    def _exclusive(self, src: Entry) -> list[int] | None:
        """Before a publish or a link seals ``src`` (an upload, or a batch's files): the
        writers' lock of each, held exclusive until ``_unexclusive``. None, holding nothing,
        while a writer through another daemon of the store holds one of them."""
        ids = [m.id for m in batches.walk(self.r, src) if m.staged] if is_batch(src) \
            else [src.id]
        taken: list[int] = []
        for i in ids:
            if not self.writer_locks.try_take(i):
                self._unexclusive(taken)
                return None
            taken.append(i)
        return taken

    def _unexclusive(self, taken: list[int]) -> None:
        for i in taken:
            self.writer_locks.untake(i)

    async def mutable_batch(self, e: Entry) -> Entry:
        """The root of the batch ``e`` belongs to (or is), once no publish is sealing it, if
        it is still in partial/ (``batches.check_mutable``): a file made, moved or resized
        in a batch while its publish seals it would be published unsealed."""
        if self._sealing:
            root = batches.root_of(self.r, e)
            if root.id in self._sealing:
                await self.unsealed(root)
                e = self.get(e.id)  # as it is now
        return batches.check_mutable(self.r, e)

    async def _publish_hidden(self, e: Entry, who: Who, private: bool) -> bool:
        """Publish a hidden upload: False, leaving it hidden, while a writer through another
        daemon holds it (that writer's last close publishes it). ``private``: made hidden
        here, no other daemon can reach it."""
        taken = [] if private else self._exclusive(e)
        if taken is None:
            log.info("upload %d: still open for writing through another mount; it appears "
                     "when that writer closes", e.id)
            return False
        stopped = False
        try:
            if not private:  # another daemon's last writer may have published it meanwhile
                cur = self.r.get(e.id)
                if cur is None or not cur.hidden:
                    return True
            stopped = e.id in self._nfs  # an NFS server's descriptors write no more
            self._nfs_published(e.id)
            with self.sealing(e.id):
                await self._publish_sealed(e, who)
            stopped = False
        finally:
            if stopped:  # still an upload (or one in partial/ now): they write again
                self._nfs_published(e.id, False)
            self._unexclusive(taken)
        return True

    def _nfs_published(self, entry_id: int, published: bool = True) -> None:
        """The upload appears: the server's descriptors on it write no more (``False``: it
        did not after all)."""
        for h in self._nfs.get(entry_id, ()):
            h.done = published

    async def appear_unless_written(self, entry_id: int, who: Who) -> None:
        """A publish left to a writer through another daemon: that writer may have closed
        before the upload became hidden, and found nothing to publish then. It appears now,
        unless a writer still holds it (whose last close publishes it: each daemon gives up
        its share before it looks)."""
        e = self.r.get(entry_id)
        if e is not None and e.hidden and entry_id not in self._publishing:
            await self._publish_settled(e, who)

    async def _publish_sealed(self, e: Entry, who: Who) -> None:
        sealed = await self._seal(e)
        now = self.clock()

        def fn(tx: WriteTx) -> None:
            cur = tx.get(e.id)
            if cur is None or not cur.hidden:
                raise NotFound()
            self.content.attach(tx, e.id, sealed)
            apply(tx, cur, Action.PUBLISH, State.READY, Context(now), (who.uid, who.pid),
                  src="upload", dst=place(cur))
            self._arrive(tx, e.id, cur.queue, now, who)

        await self.tx(fn)
        # a writer's handle here still holds the staging file (a publish at its close): only
        # the name goes now, and the handle's last close frees it, off the loop
        await self.removed([("staging", e.id)], open_here=e.id in self._writers)

    async def _seal(self, e: Entry) -> Sealed:
        await self.write_pace.landed(e.id)  # a write under way in a thread is in the content
        remote = self.content.blobs.remote  # stored before the transaction that attaches it
        if self.size_of(e) > self.content.inline_max or self.content.seal_may_wait():
            if remote:
                return await trio.to_thread.run_sync(self.content.seal_and_store, e.id,
                                                     self.store.reserve_blob_id, self.r,
                                                     limiter=self.limiter)
            return await trio.to_thread.run_sync(self.content.seal, e.id)
        sealed = self.content.seal(e.id)  # small: inline, read and hashed here
        if remote and sealed.data is None:  # (grown since it was looked at)
            return await trio.to_thread.run_sync(self.content.store, sealed,
                                                 self.store.reserve_blob_id, self.r,
                                                 limiter=self.limiter)
        return sealed

    async def _seal_batch(self, root: Entry) -> list[tuple[int, Sealed]]:
        """Publishing a batch seals every file in it; none may still be open for writing."""
        out = []
        for m in batches.walk(self.r, root):
            if m.staged:
                if self._writers.get(m.id, 0) > 0:
                    raise NotPermitted(f"{m.name!r} in the batch is still open for writing")
                out.append((m.id, await self._seal(m)))
        return out
