"""Attributes: setattr, user.spool.* and user headers, queue policies.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from spoolfs.core import lifecycle as L
from spoolfs.core import rules
from spoolfs.core.errors import (
    NoAttribute,
    NotPermitted,
    NotSupported,
)
from spoolfs.core.rules import State
from spoolfs.service.batches import MEMBER
from spoolfs.service.directories import Directories
from spoolfs.service.moves import place
from spoolfs.service.policies import check_fanout
from spoolfs.service.spool_core import SPOOL_XATTR, Who
from spoolfs.store.base import Entry, WriteTx

log = logging.getLogger(__name__)


class Attributes(Directories):
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
            e, shares = await self.writing(e)
            try:
                if e.kind in ("message", MEMBER):
                    self._check_modify(e)
                await self.truncate(e, size)
            finally:
                await self._stopped_writing(e.id, who, shares)
            e = self.get(e.id)  # as the cut left it (published or removed meanwhile)
        if (atime_ns is not None or mtime_ns is not None) and e.staged:
            self.content.touch(e.id, atime_ns, mtime_ns)
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

            if mode is not None:  # before and after: a writer that looked meanwhile looks again
                self.mode_changes += 1
            await self.tx(fn, durable=e.kind not in ("message", MEMBER))
            if mode is not None:
                self.mode_changes += 1
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
