"""Names a daemon saw leave, answered absent with no round trip to a shared store
(service/left_names.py): its own changes at their commit, other hosts' through the change
log; a name made again, here or elsewhere, is asked of the store again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

from helpers.kernel import Ctx
from helpers.spool import WHO, Q, upload
from spoolfs.core.rules import State
from spoolfs.fuse.ops import Operations
from spoolfs.service.follower import Follower
from spoolfs.service.left_names import LeftNames
from spoolfs.service.spool import Spool
from spoolfs.store.postgres import PostgresStore


def test_a_change_frees_where_an_entry_was_and_takes_where_it_is() -> None:
    names = LeftNames(limit=3)
    names.changes([(7, 2, b"n", 1, b"n")])  # moved from 1/n to 2/n
    assert (1, b"n") in names and (2, b"n") not in names
    names.changes([(8, 1, b"n", None, None)])  # made again
    assert (1, b"n") not in names
    names.changes([(8, None, None, 1, b"n")])  # deleted
    assert (1, b"n") in names
    names.changes([(9, 5, b"x", 1, b"n")], committed=False)  # an outcome not known
    assert (1, b"n") not in names and (5, b"x") not in names
    names.changes([(9, 3, b"m", 3, b"m"), (4, None, None, None, None)])  # in place; a dir
    assert len(names) == 0
    for i in range(5):  # the oldest forgotten first
        names.changes([(i, 9, b"to", 1, b"%d" % i)])
    assert [(1, b"%d" % i) in names for i in range(5)] == [False, False, True, True, True]
    names.made(1, b"4")
    assert (1, b"4") not in names and len(names) == 2


class _Host:
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


async def test_a_name_claimed_here_or_elsewhere_is_absent_with_no_round_trip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str) -> None:
    monkeypatch.setattr(pyfuse3, "invalidate_entry_async", lambda *a, **k: None)
    monkeypatch.setattr(pyfuse3, "invalidate_inode", lambda *a, **k: None)
    a, b = _Host(pg_url, tmp_path / "a"), _Host(pg_url, tmp_path / "b")
    try:
        async with trio.open_nursery() as n:
            await n.start(a.spool.committer.run)
            await n.start(b.spool.committer.run)
            qe = await a.spool.mkdir(1, b"q", 0o755, WHO)
            q = Q(a.spool, qe.id)
            ready = q[State.READY]
            w = await a.spool.mkdir(q[State.WORKING], b"w", 0o755, WHO)
            await b.follower.catch_up()

            async def publish(host: _Host, name: bytes) -> int:
                mid = await upload(host.spool, q[State.PARTIAL], name, b"bytes")
                await host.spool.rename(q[State.PARTIAL], name, ready, name, 0, WHO)
                return mid

            # claimed here: absent at once, with no read
            await publish(a, b"f")
            await a.spool.rename(ready, b"f", w.id, b"f", 0, WHO)
            assert await a.lookup(ready, b"f") == 0 and a.reads == []
            # published again elsewhere: asked of the store once the change is seen
            again = await publish(b, b"f")
            await a.follower.catch_up()
            assert await a.lookup(ready, b"f") == again and a.reads
            # claimed elsewhere: absent with no read once the change is seen
            await b.spool.rename(ready, b"f", w.id, b"f2", 0, WHO)
            assert await a.lookup(ready, b"f") == 0 and a.reads  # not seen yet: asked
            await a.follower.catch_up()
            assert await a.lookup(ready, b"f") == 0 and a.reads == []
            # made again here, unpublished (an upload into ready/, in no change log): asked
            e, h = await a.spool.create(ready, b"f", 0o644, WHO)
            assert (ready, b"f") not in a.names
            with pytest.raises(pyfuse3.FUSEError):  # not shown until it is complete
                await a.lookup(ready, b"f")
            assert a.reads
            await a.spool.close(h, WHO)
            assert await a.lookup(ready, b"f") == e.id
            a.spool.committer.close()
            b.spool.committer.close()
    finally:
        a.store.close()
        b.store.close()
