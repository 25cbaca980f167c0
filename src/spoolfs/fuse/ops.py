"""FUSE handlers: parse the request, call the service, build attributes. Nothing else.

Every handler goes through ``_guard``: a ``SpoolError`` becomes its errno with one log line; any
other exception is logged and answered with EIO (an exception escaping a pyfuse3 handler would
leave the request unanswered and end the main loop).
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from time import monotonic, perf_counter_ns
from typing import Any, TypeVar, cast

import pyfuse3
import trio

from spoolfs.core.errors import NotFound, NotPermitted, SpoolError, SyncFailed
from spoolfs.fuse import procinfo, virtual
from spoolfs.service import status
from spoolfs.service.content import Handle
from spoolfs.service.roles import Caller, Gate, proc_groups
from spoolfs.service.spool import Spool, Who
from spoolfs.service.spool_core import STRUCTURE
from spoolfs.service.timings import TIMINGS
from spoolfs.store.base import Entry

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

#: Seconds the kernel may cache names, absent names and attributes. Other daemons on the same
#: store see changes within this; this daemon's own changes reach the kernel through its
#: replies, or by dropping the names it changed without a request.
TIMEOUT = 1.0
#: On a shared store, seconds the kernel may cache the name of a queue, a state directory or
#: a consumer's view (not their attributes: a directory's times move with every name in it).
#: Such a name changes only in a transaction: this mount's through the kernel's own request,
#: another host's seen by the follower, which drops the name (service/follower.py), as the
#: change log is kept far longer than this. So a command run now and then (a cron job's
#: ``mv``) walks its path with no round trip. Other daemons of an embedded store are
#: followed by no one: TIMEOUT there.
STRUCTURE_TIMEOUT = 60.0
#: how long the kernel may keep the attributes of a reply, counted here from its making: the
#: kernel counts TIMEOUT from its receipt, a little later
FRESH = TIMEOUT + 0.5
#: entries read from the store at a time for a listing
PAGE = 256
#: seconds the rest of a page the kernel did not take may wait for its next readdir (then it
#: is read again): within this, only another daemon's changes can have made it stale
REST_AGE = TIMEOUT / 10


@dataclass(slots=True)
class _Listing:
    """An open directory: its id, and the rest of the last page read for it (the entries the
    kernel's buffer had no room for), as read after ``after`` when ``seen`` was the spool's
    count of changes, at ``at`` (monotonic)."""

    sid: int
    rest: list[Entry] = field(default_factory=list)
    full: bool = False  # the page was full: more may follow the rest
    after: int = -1
    seen: int | None = None
    at: float = 0.0

    def resume(self, after: int, seen: int | None, now: float
               ) -> tuple[list[Entry], bool] | None:
        """The rest, if it follows ``after`` and nothing changed since it was read (``seen``:
        ``Spool.changes_seen``, None while a commit is under way)."""
        if seen is None or after != self.after or seen != self.seen \
                or now - self.at > REST_AGE:
            self.rest, self.after = [], -1  # read again: nothing held for a handle left open
            return None
        return self.rest, self.full


def _holds(pid: int, ino: int) -> bool:
    """Whether process ``pid`` still has a descriptor open on inode ``ino``."""
    return procinfo.holds(pid, ino)


async def _after_init(fn: Callable[[], None]) -> None:
    await trio.lowlevel.checkpoint()
    try:
        fn()
    except Exception:  # a system task must not raise: that would end the session
        log.exception("after the kernel's INIT")


def _guard(fn: F) -> F:
    op = fn.__name__
    params = tuple(inspect.signature(fn).parameters)[1:]  # after self

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> Any:
        start = perf_counter_ns()
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError as e:
            TIMINGS.refused(op, errno.errorcode.get(e.errno, str(e.errno)))
            raise
        except SpoolError as e:
            code = errno.errorcode.get(e.errno, str(e.errno))
            TIMINGS.refused(op, code)
            if not isinstance(e, NotFound) or e.hint:
                log.info("refused %s(%s): %s (%s)%s", op, self._describe(op, params, args), code,
                         e.hint, self._caller(params, args))
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            TIMINGS.refused(op, "EIO")
            log.exception("internal error in %s(%s)%s", op, self._describe(op, params, args),
                          self._caller(params, args))
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            TIMINGS.request(op, perf_counter_ns() - start)

    return cast(F, wrapper)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, spool: Spool, root_id: int = 1, roles: Gate | None = None,
                 nfs_export: bool = False, direct_writes: bool = True) -> None:
        super().__init__()
        self.spool = spool
        self.root_id = root_id
        self.roles = roles  # -o strict_roles: the daemon checks the modes too, root included
        #: -o nfs_export: thread id -> whether it is the NFS server's (procinfo.nfs_server)
        self._nfs_threads: dict[int, bool] | None = {} if nfs_export else None
        #: uploads are written straight to the daemon, past the page cache (not -o shared_mmap)
        self._direct_writes = direct_writes
        #: what the kernel may keep a queue's, a state directory's, a view's name for
        self._structure_timeout = STRUCTURE_TIMEOUT if spool.store.shared else TIMEOUT
        self._handles: dict[int, Handle] = {}
        self._dirs: dict[int, _Listing] = {}  # open directory handle -> its listing
        self._next_fh = 1
        self._lookups: dict[int, int] = {}
        #: messages opened here since the kernel last learned their inode, their content
        #: published: what the kernel caches of them now is theirs (``open``)
        self._opened_sealed: set[int] = set()
        #: until when (monotonic) the kernel may keep the attributes it was last given, for
        #: the entries it knows: once they expire it asks again, nobody need tell it
        self._fresh: dict[int, float] = {}
        self._gone: dict[int, pyfuse3.EntryAttributes] = {}  # unlinked, still known to the kernel
        self._dropped = 0  # names dropped by _drop_name so far
        spool.on_gone = self._drop_name
        spool.on_deleted = self._keep_attributes
        spool.on_stale = self._drop_attributes
        #: runs once the kernel has the reply to its INIT request (the daemon tunes the mount)
        self.after_init: Callable[[], None] | None = None
        #: runs at the first request of the NFS server exporting the mount (-o nfs_export)
        self.on_nfs_server: Callable[[], None] | None = None

    def init(self) -> None:
        # Called while INIT is answered; the reply is on its way when the task runs.
        if self.after_init is not None:
            trio.lowlevel.spawn_system_task(_after_init, self.after_init)


    def _drop_attributes(self, ids: list[int]) -> None:
        """Attributes changed without a request naming them (another message's link count, the
        set-ID bits a write cleared): the kernel must ask again. (Attributes only: it takes no
        lock a pending request could hold.)"""
        now = monotonic()
        for sid in ids:
            if self._fresh.get(sid, 0.0) > now:  # the kernel knows it and may keep its count
                try:
                    pyfuse3.invalidate_inode(self._ino(sid), attr_only=True)
                except OSError:
                    pass  # forgotten meanwhile

    def _drop_name(self, parent: int, name: bytes) -> None:
        """The lifecycle moved or purged ``parent/name``, or a transaction made it unasked (a
        publish's fan-out, ``moves.UNASKED``): the kernel must not keep the name."""
        self._dropped += 1
        if self.spool.left_names is not None:
            self.spool.left_names.made(parent, name)  # (or went: asked again, to be sure)
        pyfuse3.invalidate_entry_async(self._ino(parent), name, ignore_enoent=True)

    # ---- inode mapping and attributes ---------------------------------------------------

    def _who(self, ctx: Any) -> Who:
        if ctx is None:
            return Who()
        return Who(ctx.uid, ctx.gid, ctx.pid, self._nfs_threads is not None
                   and self._is_nfs_server(ctx.pid))

    def _is_nfs_server(self, tid: int) -> bool:
        """Whether a request comes from the NFS server exporting the mount (its threads
        are few and long-lived: each is looked up in /proc once)."""
        assert self._nfs_threads is not None
        known = self._nfs_threads.get(tid)
        if known is None:
            if len(self._nfs_threads) > 4096:  # thread ids are reused: start over now and then
                self._nfs_threads.clear()
            known = self._nfs_threads[tid] = procinfo.nfs_server(tid)
            if known and self.on_nfs_server is not None:
                served, self.on_nfs_server = self.on_nfs_server, None
                served()
        return known

    def _sid(self, ino: int) -> int:
        return self.root_id if ino == pyfuse3.ROOT_INODE else ino

    def _ino(self, sid: int | None) -> int:
        if sid is None or sid == self.root_id:
            return pyfuse3.ROOT_INODE
        return sid

    def _may(self, ctx: Any, change: tuple[int, ...] = (),
             remove: tuple[tuple[int, bytes], ...] = ()) -> None:
        """``-o strict_roles``: refuse (EACCES) a change the directory's mode does not allow
        this caller, even root (service/roles.py)."""
        if self.roles is not None and ctx is not None:
            self.roles.check(ctx.uid, ctx.gid, ctx.pid, change, remove)

    #: arguments that name an inode, a name in the directory before it, an open file
    _INODES = frozenset({"inode", "parent_inode", "parent_inode_old", "parent_inode_new",
                         "new_parent_inode"})
    _NAMES = frozenset({"name", "name_old", "name_new", "new_name"})

    def _describe(self, op: str, params: Sequence[str], args: Sequence[Any]) -> str:
        """The paths a refused request named, inside the mount (``q/ready/a``); never
        content. Built only for a refusal's log line."""
        shown: list[str] = []
        for param, arg in zip(params, args, strict=False):
            if param in self._INODES and isinstance(arg, int):
                shown.append(self._path(arg))
            elif param in self._NAMES and isinstance(arg, bytes) and shown:
                # a name follows its directory's inode; an extended attribute's, its file's
                name = arg.decode(errors="backslashreplace")
                sep = " " if op.endswith("xattr") else "/"
                shown[-1] = f"{shown[-1]}{sep}{name}" if shown[-1] else name
            elif param in ("buf", "value") and isinstance(arg, bytes):
                shown.append(f"<{len(arg)} bytes>")  # content: its size only
            elif param == "fh" and isinstance(arg, int):
                h = self._handles.get(arg)
                shown.append(self._path(self._ino(h.entry_id)) if h is not None
                             else f"handle {arg}")
        return ", ".join(p or "/" for p in shown)

    def _path(self, ino: int) -> str:
        """Where inode ``ino`` is in this mount (``q/ready/a``; ``""`` for its root), or its
        number when the store cannot say (a database gone: the refusal is logged still)."""
        if virtual.is_virtual(ino):
            return virtual.DIR_NAME.decode() if ino == virtual.DIR else ".spool/…"
        try:
            path = self.spool.path_of(self._sid(ino), self.root_id)
        except SpoolError:
            return f"inode {ino}"
        return path if path is not None else f"inode {ino} (gone)"

    @staticmethod
    def _caller(params: Sequence[str], args: Sequence[Any]) -> str:
        ctx = dict(zip(params, args, strict=False)).get("ctx")
        return f" uid={ctx.uid} pid={ctx.pid}" if ctx is not None else ""

    def _attr(self, e: Entry, nlink: int | None = None) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = self._ino(e.id)
        a.generation = 0
        # The name of an unpublished upload, or of one a rename into ready/ would hide (a
        # writer holds it), is never cached: ready/ shows only complete files. (A rename that
        # hides an upload opened after its name was cached drops the name: see rename.)
        a.entry_timeout = 0 if e.hidden or (e.staged and self.spool.being_written(e.id)) \
            else self._structure_timeout if e.kind in STRUCTURE else TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_mode = e.mode
        a.st_nlink = self.spool.nlink_of(e) if nlink is None else nlink
        a.st_uid = e.uid
        a.st_gid = e.gid
        a.st_rdev = 0
        size, a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = self.spool.times(e)
        a.st_size = size if e.kind in ("message", "member") and not stat.S_ISDIR(e.mode) else 0
        a.st_blksize = 4096
        a.st_blocks = (a.st_size + 511) // 512
        if e.id in self._fresh:
            self._fresh[e.id] = monotonic() + FRESH
        return a

    def _remember(self, e: Entry, attr: pyfuse3.EntryAttributes) -> pyfuse3.EntryAttributes:
        self._counted(e.id)
        return attr

    def _counted(self, sid: int) -> None:
        """The kernel got an entry (a lookup it will forget) with fresh attributes."""
        self._lookups[sid] = self._lookups.get(sid, 0) + 1
        self._fresh[sid] = monotonic() + FRESH

    def _keep_attributes(self, e: Entry) -> None:
        """An entry is deleted (in the transaction that deletes it): keep its attributes for
        the kernel's remaining uses. (A database server's transactions run in a worker thread:
        nothing here reads the store.)"""
        if e.kind in ("message", "member") and self._lookups.get(e.id):
            self._gone[e.id] = self._attr(e, nlink=0)

    # ---- lookups ------------------------------------------------------------------------

    # ---- MOUNT/.spool/ -------------------------------------------------------------------

    async def _render(self, ino: int, ctx: Any) -> bytes:
        only = self.root_id if self.root_id != 1 else None
        caller = Caller(ctx.uid, ctx.gid, proc_groups(ctx.pid, ctx.uid, ctx.gid))
        snap = await self.spool.snapshot(caller, only) if virtual.needs_snapshot(ino) else {}
        return virtual.render(ino, snap, status.metrics)

    def _virtual_attr(self, ino: int) -> pyfuse3.EntryAttributes:
        return virtual.attr(ino)

    def _virtual_lookup(self, parent_inode: int, name: bytes) -> pyfuse3.EntryAttributes | None:
        if parent_inode == pyfuse3.ROOT_INODE and name == virtual.DIR_NAME:
            return self._virtual_attr(virtual.DIR)
        if parent_inode == virtual.DIR:
            if name in virtual.FILES:
                return self._virtual_attr(virtual.FILES[name])
            raise NotFound()
        return None

    @_guard
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        found = self._virtual_lookup(parent_inode, name)
        if found is not None:
            return found
        pid = self._sid(parent_inode)
        await self.spool.settle(pid, name)
        if name == b".":
            e = self.spool.get(pid)
        elif name == b"..":
            e = self.spool.get(pid)
            e = self.spool.get(e.parent if e.parent is not None and pid != self.root_id else pid)
        else:
            dropped = self._dropped
            entry = await self.spool.find(pid, name, self._who(ctx))
            if dropped != self._dropped:
                # A name was dropped from the kernel's cache while the store answered (on a
                # database server): this answer may be older than that, and is not kept.
                if entry is None:
                    return self._absent(0)
                attr = self._attr(entry)
                attr.entry_timeout = attr.attr_timeout = 0
                return self._remember(entry, attr)
            if entry is None:  # the kernel keeps the answer as long as a name (see TIMEOUT)
                return self._absent()
            e = entry
        return self._remember(e, self._attr(e, await self.spool.nlink(e)))

    @staticmethod
    def _absent(timeout: float = TIMEOUT) -> pyfuse3.EntryAttributes:
        """A negative entry: no such name, for TIMEOUT seconds. A name this daemon makes
        appears through the kernel's own request, or is dropped from its cache (lifecycle
        moves, names a publish makes elsewhere, other daemons' changes on a shared store);
        another daemon on the same embedded store is seen within TIMEOUT, as for names that
        exist."""
        a = pyfuse3.EntryAttributes()
        a.st_ino = 0
        a.entry_timeout = timeout
        return a

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            sid = self._sid(ino)
            left = self._lookups.get(sid, 0) - n
            if left > 0:
                self._lookups[sid] = left
            else:
                self._lookups.pop(sid, None)
                self._fresh.pop(sid, None)
                self._gone.pop(sid, None)
                self._opened_sealed.discard(sid)

    @_guard
    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        if virtual.is_virtual(inode):
            return self._virtual_attr(inode)
        sid = self._sid(inode)
        e = await self.spool.row(sid)
        if e is None:
            gone = self._gone.get(sid)
            if gone is not None:
                return self._still_written(sid, gone)
            raise NotFound()
        return self._attr(e, await self.spool.nlink(e))

    def _still_written(self, sid: int, gone: pyfuse3.EntryAttributes) -> pyfuse3.EntryAttributes:
        """An unlinked upload still open takes writes (POSIX): its size and time are its
        staging file's, which the open descriptor keeps."""
        if virtual.is_virtual(sid):
            return gone
        for h in self._handles.values():
            if h.entry_id == sid:
                now = h.staged_size_and_mtime()
                if now is not None:
                    gone.st_size, gone.st_mtime_ns = now
                    gone.st_atime_ns = gone.st_mtime_ns
                    gone.st_blocks = (gone.st_size + 511) // 512
                    break
        return gone

    @_guard
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
        e = await self.spool.setattr(
            self._sid(inode),
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None, who=self._who(ctx))
        return self._attr(e)

    @_guard
    async def opendir(self, inode: int, ctx: Any) -> int:
        sid = virtual.DIR
        if inode != virtual.DIR:
            sid = self._sid(inode)
            await self.spool.settle(sid)
            self.spool.check_dir(sid)
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = _Listing(sid)
        return fh

    @_guard
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        """A page at a time, in entry order: the offset of an entry is its id, so the next
        call resumes after it however many names came or went meanwhile (keyset). The part
        of a page the kernel had no room for is the next call's, unless the spool changed
        meanwhile."""
        listing = self._dirs[fh]
        sid = listing.sid
        if sid == virtual.DIR:  # MOUNT/.spool/
            for i, (name, ino) in enumerate(list(virtual.FILES.items())[start_id:], start_id):
                if not pyfuse3.readdir_reply(token, name, virtual.attr(ino), i + 1):
                    return
            return
        after = start_id
        seen = self.spool.changes_seen()
        kept = listing.resume(after, seen, monotonic())
        now = listing.at  # a rest keeps the age of its page
        while True:
            if kept is not None:
                page, full = kept
                kept = None
            else:
                page = self.spool.r.listing(sid, after, PAGE)
                full = len(page) == PAGE
                now = monotonic()
            sent = 0
            for e in page:
                if not pyfuse3.readdir_reply(token, e.name, self._attr(e), e.id):
                    break
                self._counted(e.id)
                after = e.id
                sent += 1
            if sent == len(page) and full:
                continue
            # kept: what had no room, or the end (the kernel asks once more, to be sure)
            listing.rest, listing.full, listing.after = page[sent:], full, after
            listing.seen, listing.at = seen, now
            return

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # ---- directories --------------------------------------------------------------------

    @_guard
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Any:
        self._may(ctx, change=(self._sid(parent_inode),))
        e = await self.spool.mkdir(self._sid(parent_inode), name, mode & ~ctx.umask, self._who(ctx))
        return self._remember(e, self._attr(e))

    @_guard
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self._may(ctx, remove=((self._sid(parent_inode), name),))
        await self.spool.rmdir(self._sid(parent_inode), name, self._who(ctx))

    @_guard
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        pold, pnew = self._sid(parent_inode_old), self._sid(parent_inode_new)
        self._may(ctx, change=(pnew,), remove=((pold, name_old), (pnew, name_new)))
        await self.spool.settle(pold, name_old)
        await self.spool.settle(pnew, name_new)
        if await self.spool.rename(pold, name_old, pnew, name_new, flags, self._who(ctx)):
            # Published while a writer holds it: the kernel moves its cached name into ready/,
            # where it must not be seen until the last close. The invalidation waits for the
            # rename to finish (it takes the directory's lock).
            pyfuse3.invalidate_entry_async(parent_inode_new, name_new, ignore_enoent=True)

    @_guard
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        pid = self._sid(parent_inode)
        self._may(ctx, remove=((pid, name),))
        await self.spool.settle(pid, name)
        await self.spool.unlink(pid, name, self._who(ctx))

    @_guard
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> Any:
        self._may(ctx, change=(self._sid(new_parent_inode),))
        e = await self.spool.link(self._sid(inode), self._sid(new_parent_inode), new_name,
                                  self._who(ctx))
        attr = self._attr(e)
        if (e.parent, e.name) != (self._sid(new_parent_inode), new_name):
            # gone on in its own transaction (a topic's message to success/): the kernel
            # must not keep the name until the drop of it lands
            attr.entry_timeout = 0
        return self._remember(e, attr)

    @_guard
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EPERM)

    @_guard
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> Any:
        if not stat.S_ISREG(mode):
            log.info("refused mknod(%r): EPERM (only regular files)", name)
            raise pyfuse3.FUSEError(errno.EPERM)
        self._may(ctx, change=(self._sid(parent_inode),))
        e, h = await self.spool.create(self._sid(parent_inode), name, mode, self._who(ctx))
        await self.spool.close(h, self._who(ctx))
        return self._remember(e, self._attr(e))

    # ---- files --------------------------------------------------------------------------

    def _new_fh(self, h: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = h
        return fh

    def _writes_direct(self, h: Handle) -> bool:
        """Whether writes through ``h`` bypass the page cache (see ``open``). Not an NFS
        server's: it acts for clients, so the kernel's checks at each cached write (set-ID
        bits) stay its own, as before."""
        return h.writable and not h.nfs and self._direct_writes

    def _watch_opener(self, h: Handle, pending: bool) -> None:
        """A handle whose close may publish (``pending``: it awaits its publish) remembers its
        opener's process rather than the thread that opened it: ``flush`` reads how that
        process ends (procinfo.py)."""
        if not h.nfs and pending:
            h.opener = procinfo.process_of(h.opener)

    @_guard
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> Any:
        self._may(ctx, change=(self._sid(parent_inode),))
        e, h = await self.spool.create(self._sid(parent_inode), name, mode & ~ctx.umask,
                                       self._who(ctx))
        self._watch_opener(h, e.hidden)  # a new upload: hidden until published, in ready/
        attr = self._attr(e)
        return (pyfuse3.FileInfo(fh=self._new_fh(h), direct_io=self._writes_direct(h)),
                self._remember(e, attr))

    @_guard
    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        acc = flags & os.O_ACCMODE
        if virtual.is_virtual(inode):
            if acc != os.O_RDONLY or inode == virtual.DIR:
                raise NotPermitted("MOUNT/.spool/ is read-only")
            h = Handle(inode, None, await self._render(inode, ctx), False)
            return pyfuse3.FileInfo(fh=self._new_fh(h), direct_io=True, keep_cache=False)
        sid = self._sid(inode)
        h = await self.spool.open(sid, acc != os.O_RDONLY, bool(flags & os.O_TRUNC),
                                  self._who(ctx))
        self._watch_opener(h, self.spool.awaits_publish(h))
        # Published content never changes: the page cache may keep it, once the first open of
        # it here has dropped what the kernel held of the inode before (pages read while it
        # was an upload, which a writer through another mount may have changed since; the
        # inode is the message's from its creation on). An upload is written
        # straight to the daemon (direct_io): a copy fewer, and no security.capability lookup
        # before each write; pages cached while writing were dropped anyway as soon as the
        # kernel saw the newer mtime. The cost: no shared writable mmap of an upload (ENODEV)
        # unless -o shared_mmap.
        keep = h.sealed and sid in self._opened_sealed
        if h.sealed:
            self._opened_sealed.add(sid)
        return pyfuse3.FileInfo(fh=self._new_fh(h), keep_cache=keep,
                                direct_io=self._writes_direct(h))

    @_guard
    # pyfuse3 replies with any contiguous buffer (its read handler takes the buffer of what
    # this returns), though its stub says bytes: a read from the page cache is no copy more
    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray:  # type: ignore[override]
        h = self._handles[fh]
        if virtual.is_virtual(h.entry_id):
            return h.read(off, size)
        data = h.read_cached(off, size)
        if data is None:  # from the disk: as long as it takes, off the loop (the kernel sends
            # no RELEASE while the caller's read holds the file)
            data = await trio.to_thread.run_sync(h.read, off, size)
        await self.spool.reading(h)  # a read keeps a claimed message's lease
        return data

    @_guard
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handles[fh]
        if h.checks_setid:
            await self.spool.drop_setid(h)
        return await self.spool.write_paced(h, off, buf)

    @_guard
    async def flush(self, fh: int) -> None:
        # close(2) waits for FLUSH but not for RELEASE. FLUSH also comes when a child closes
        # an inherited copy (at exec or exit), and once per closed duplicate (a shell's
        # redirection): only the opener's last close publishes. A process that is exiting is
        # still in /proc while the kernel closes its files: whether a writer finished is
        # known now, and never later (procinfo.py).
        h = self._handles[fh]
        if h.nfs:  # the server closes for itself, not for a client (uploads.py)
            return
        pending = self.spool.pending_upload(h)
        if pending is None:
            return
        if _holds(h.opener, self._ino(h.entry_id)):
            why = await trio.to_thread.run_sync(procinfo.child_unfinished, h.opener)
            if why is not None:
                self.spool.writer_failed(h, why)
            return
        await self.spool.publish_at_close(h, Who(pid=h.opener),
                                          procinfo.opener_unfinished(h.opener), pending)

    @_guard
    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handles[fh]
        if h.fd is not None and h.writable:
            # as long as the disk takes for the file's dirty pages: off the loop (the kernel
            # sends no RELEASE while the caller's fsync holds the file)
            try:
                await trio.to_thread.run_sync(h.sync, datasync)
            except SyncFailed as failed:
                if h.nfs:  # a client's COMMIT: its upload is shown in partial/ now
                    await self.spool.commit_failed(h, Who(nfs=True), str(failed))
                raise
        if h.nfs:  # a client's COMMIT: what it created in ready/ appears
            await self.spool.committed(h, Who(nfs=True))

    @_guard
    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh)
        if virtual.is_virtual(h.entry_id):
            return
        await self.spool.close(h, Who())

    # ---- extended attributes ------------------------------------------------------------

    @_guard
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if not name.startswith(b"user."):
            # The kernel asks for security.capability on every write: answer at once.
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return self.spool.getxattr(self.spool.get(self._sid(inode)), name)

    @_guard
    async def listxattr(self, inode: int, ctx: Any) -> Any:
        return self.spool.xattr_names(self.spool.get(self._sid(inode)))

    @_guard
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        await self.spool.setxattr(self.spool.get(self._sid(inode)), name, value, self._who(ctx))

    @_guard
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        await self.spool.removexattr(self.spool.get(self._sid(inode)), name, self._who(ctx))

    @_guard
    async def statfs(self, ctx: Any) -> Any:
        st = self.spool.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = st.f_bsize
        s.f_frsize = st.f_frsize
        s.f_blocks = st.f_blocks
        s.f_bfree = st.f_bfree
        s.f_bavail = st.f_bavail
        s.f_files = st.f_files
        s.f_ffree = st.f_ffree
        s.f_favail = st.f_favail
        s.f_namemax = 255
        return s
