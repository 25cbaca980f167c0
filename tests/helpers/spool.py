"""The service on a real store in ``tmp_path``, without a kernel: a spool with its committer
running, a queue's state directories, uploads and reads (tests/service)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import trio

from helpers.kernel import Ctx
from spoolfs.core.rules import State
from spoolfs.fuse.ops import Operations
from spoolfs.service.follower import Follower
from spoolfs.service.fsck import Fsck
from spoolfs.service.spool import Spool, Who
from spoolfs.store.base import Entry
from spoolfs.store.postgres import PostgresStore
from spoolfs.store.registry import open_store

WHO = Who(0, 0, 1)


class Q:
    def __init__(self, spool: Spool, qid: int) -> None:
        self.spool, self.id = spool, qid
        self.dirs = {st: spool.lookup(qid, st.value.encode()).id for st in State}

    def __getitem__(self, st: State) -> int:
        return self.dirs[st]


@contextlib.asynccontextmanager
async def running(tmp_path: Path, engine: str = "sqlite") -> AsyncIterator[Spool]:
    """A spool on a store in ``tmp_path`` with its committer running; fsck must be clean
    once it is closed. ``engine="memory"``: the metadata in the in-memory engine (content
    still in ``tmp_path``), to show the service's rules hold on any engine."""
    store = open_store(str(tmp_path) if engine == "sqlite" else "memory:")
    spool = Spool(store, str(tmp_path))
    async with trio.open_nursery() as n:
        await n.start(spool.committer.run)
        yield spool
        spool.committer.close()
    store.close()
    if engine == "sqlite":
        assert Fsck(str(tmp_path)).run() == [], "fsck is not clean at the end of the test"


async def upload(spool: Spool, d: int, name: bytes, data: bytes) -> int:
    e, h = await spool.create(d, name, 0o644, WHO)
    spool.write(h, 0, data)
    await spool.close(h, WHO)
    return e.id


def content(spool: Spool, entry_id: int) -> bytes:
    h = spool.content.open(spool.r, spool.get(entry_id), False)
    try:
        return h.read(0, 1 << 30)
    finally:
        h.close()


async def copies(spool: Spool, d: int, n: int) -> list[bytes]:
    """``n`` messages in ``d`` (``m000``, ``m001``...), one content shared by fan-out links:
    a deep directory made quickly."""
    names = [b"m%03d" % i for i in range(n)]
    first = await upload(spool, d, names[0], b"x")
    for name in names[1:]:
        await spool.link(first, d, name, WHO)
    return names


@contextlib.contextmanager
def entries_read() -> Iterator[list[int]]:
    """Counts the store's rows read into entries meanwhile: ``[n]``, final once the block
    ends. What a path reads, whatever the engine, without a clock."""
    count = [0]
    init = Entry.__init__

    def counting(self: Entry, *args: object, **kw: object) -> None:
        count[0] += 1
        init(self, *args, **kw)  # type: ignore[arg-type]
    Entry.__init__ = counting  # type: ignore[method-assign]
    try:
        yield count
    finally:
        Entry.__init__ = init  # type: ignore[method-assign]


class SharedHost:
    """A daemon of the shared store: its spool, handlers and follower (run by hand)."""

    def __init__(self, url: str, where: Path) -> None:
        where.mkdir()
        self.store = PostgresStore(url)
        self.spool = Spool(self.store, str(where))
        self.ops = Operations(self.spool)
        assert self.spool.left_names is not None
        self.names = self.spool.left_names
        self.follower = Follower(self.store, self.spool.on_gone, self.spool.changed_elsewhere,
                                 None, self.names)
        self.follower.seq = self.store.last_change()
        self.reads: list[str] = []
        run, steps = self.spool.r._run, self.spool.r._steps  # type: ignore[attr-defined]

        def counting(query: str, params: Any) -> Any:
            self.reads.append(query)
            return run(query, params)

        def counting_steps(query: str, params: Any) -> Any:
            self.reads.append(query)
            return (yield from steps(query, params))
        self.spool.r._run = counting  # type: ignore[attr-defined]
        self.spool.r._steps = counting_steps  # type: ignore[attr-defined]

    async def lookup(self, parent: int, name: bytes) -> int:
        """The inode the kernel gets (0: absent); what the store was asked is in ``reads``."""
        self.reads.clear()
        attr = await self.ops.lookup(parent, name, Ctx())
        return int(attr.st_ino)
