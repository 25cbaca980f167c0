"""A fake kernel for calling the FUSE handlers directly: the request context, recorders for
the pyfuse3 calls that need a mounted session, and the handlers on one spool with a queue."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pyfuse3

from spoolfs.core.rules import State
from spoolfs.fuse.ops import Operations
from spoolfs.service.spool import Spool


@dataclass
class Ctx:
    """What pyfuse3's RequestContext carries: the caller of a request."""

    uid: int = 0
    gid: int = 0
    pid: int = field(default_factory=os.getpid)
    umask: int = 0o022


@dataclass
class Kernel:
    """What the handlers told the kernel outside their replies."""

    invalidated_entries: list[tuple[int, bytes]] = field(default_factory=list)
    invalidated_inodes: list[int] = field(default_factory=list)


@dataclass
class Listing:
    """Collects ``pyfuse3.readdir_reply`` calls; accepts ``room`` entries per readdir."""

    room: int = 1 << 30
    replies: list[tuple[bytes, int, int]] = field(default_factory=list)  # name, ino, cookie

    def reply(self, token: Any, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        if self.room <= 0:
            return False
        self.room -= 1
        self.replies.append((name, attr.st_ino, next_id))
        return True


@dataclass
class Fs:
    """The handlers on one spool, a queue ``q`` made through them, and the fake kernel."""

    ops: Operations
    spool: Spool
    kernel: Kernel
    listing: Listing
    queue: int = 0
    dirs: dict[State, int] = field(default_factory=dict)

    async def make_queue(self, name: bytes = b"q") -> None:
        attr = await self.ops.mkdir(pyfuse3.ROOT_INODE, name, 0o755, Ctx())
        self.queue = attr.st_ino
        for st in State:
            self.dirs[st] = (await self.ops.lookup(self.queue, st.value.encode(), Ctx())).st_ino

    def __getitem__(self, st: State) -> int:
        return self.dirs[st]

    async def upload(self, d: int, name: bytes, data: bytes, ctx: Ctx | None = None) -> int:
        """create + write + flush + release, as ``cp`` does: the new inode."""
        ctx = ctx or Ctx()
        fi, attr = await self.ops.create(d, name, 0o644, os.O_WRONLY | os.O_CREAT, ctx)
        await self.ops.write(fi.fh, 0, data)
        await self.ops.flush(fi.fh)
        await self.ops.release(fi.fh)
        return int(attr.st_ino)

    async def read_all(self, ino: int) -> bytes:
        fi = await self.ops.open(ino, os.O_RDONLY, Ctx())
        try:
            return bytes(await self.ops.read(fi.fh, 0, 1 << 20))
        finally:
            await self.ops.release(fi.fh)

    async def readdir(self, fh: int, cookie: int, room: int) -> list[tuple[bytes, int, int]]:
        """One readdir of open directory ``fh`` from ``cookie``, the kernel's buffer full
        after ``room`` entries: the replies (name, inode, cookie)."""
        self.listing.replies.clear()
        self.listing.room = room
        await self.ops.readdir(fh, cookie, None)
        return list(self.listing.replies)

    async def names(self, ino: int) -> list[bytes]:
        self.listing.replies.clear()
        self.listing.room = 1 << 30
        fh = await self.ops.opendir(ino, Ctx())
        await self.ops.readdir(fh, 0, None)
        await self.ops.releasedir(fh)
        return [name for name, _, _ in self.listing.replies]
