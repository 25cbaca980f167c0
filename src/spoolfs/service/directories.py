"""Directories: queues, consumer views and batches made, renamed and removed.
"""

from __future__ import annotations

import logging
import stat
from typing import Any

from spoolfs.core import rules
from spoolfs.core.errors import (
    Exists,
    NotADirectory,
    NotEmpty,
    NotFound,
)
from spoolfs.core.names import check_ident, check_message_name
from spoolfs.core.rules import Action, DirKind, State
from spoolfs.core.transitions import Context
from spoolfs.service.batches import MEMBER, is_dir
from spoolfs.service.moves import make
from spoolfs.service.moving import Moving
from spoolfs.service.roles import inherit
from spoolfs.service.spool_core import Who
from spoolfs.store.base import Entry, WriteTx

log = logging.getLogger(__name__)


class Directories(Moving):
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
            fields = dict(kind=MEMBER, queue=(await self.mutable_batch(p)).queue)
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
            # children before parents: a row's parent must exist while it does. A state
            # directory is looked at through its views and one more row: a refusal beside a
            # million messages reads none of them (rolled back with the function)
            if cur.kind == "queue":
                for st in tx.children(cur.id):
                    for c in tx.subdirectories(st.id):
                        if c.kind != "consumer" or tx.has_children(c.id):
                            raise NotEmpty(f"queue {name!r} is not empty")
                        tx.delete(c.id)
                    if tx.has_children(st.id):  # a message, or an upload being written
                        raise NotEmpty(f"queue {name!r} is not empty")
                    tx.delete(st.id)
            elif tx.has_children(cur.id):
                raise NotEmpty(f"consumer view {name!r} is not empty")
            tx.delete(cur.id)

        await self.tx(fn)

    async def remove_idle_view(self, view: Entry) -> bool:
        """Remove consumer view ``view`` if it is still as seen (no claim in or out since:
        its time is unchanged) and empty; whether it was removed."""
        assert view.kind == "consumer" and view.parent is not None

        def fn(tx: WriteTx) -> bool:
            cur = tx.get(view.id)
            if cur is None or cur.mtime_ns != view.mtime_ns or tx.has_children(cur.id):
                return False
            return tx.delete(cur.id)

        if not await self.tx(fn):
            return False
        self.on_gone(view.parent, view.name)
        return True
