"""Names a daemon saw leave, answered absent with no round trip to a shared store
(service/left_names.py): its own changes at their commit, other hosts' through the change
log; a name made again, here or elsewhere, is asked of the store again. A consumer's view
known whole answers every name not in it absent, kept current by the same changes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pyfuse3
import pytest
import trio

from helpers.spool import WHO, Q, SharedHost, upload
from spoolfs.core.errors import NotFound
from spoolfs.core.rules import State
from spoolfs.service import left_names, spool_core
from spoolfs.service.left_names import LeftNames


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


def test_a_directory_known_whole_answers_every_name_not_in_it() -> None:
    now = [0.0]
    names = LeftNames(dirs=2, dir_names=3, clock=lambda: now[0])
    assert not names.wanted(5)
    names.view(5)
    assert names.wanted(5) and (5, b"x") not in names
    names.learn(5, [b"a"], names.mark())
    assert not names.wanted(5)
    assert (5, b"x") in names and (5, b"a") not in names
    names.changes([(7, 5, b"x", 1, b"x")])  # claimed into it
    assert (5, b"x") not in names and (1, b"x") in names
    names.changes([(7, 2, b"x", 5, b"x")])  # finished out of it
    assert (5, b"x") in names
    names.made(5, b"m")  # (made here, in no change log)
    assert (5, b"m") not in names
    names.changes([(8, 5, b"y", 1, b"y")], committed=False)  # an outcome not known
    assert (5, b"zz") not in names and names.wanted(5)
    # a change between the mark and the listing: the listing is not kept
    mark = names.mark()
    names.changes([(9, 5, b"z", 1, b"z")])
    names.learn(5, [], mark)
    assert (5, b"z") not in names and not names.wanted(5)  # (read whole again in a second)
    now[0] += left_names.AGAIN_S
    assert names.wanted(5)
    names.learn(5, [b"z"], names.mark())
    assert (5, b"q") in names
    # more names than it may hold: forgotten, asked again
    names.changes([(i, 5, b"n%d" % i, 1, b"n%d" % i) for i in range(10, 13)])
    assert (5, b"q") not in names
    # too many to learn; the directory itself moved or removed
    names.learn(5, [b"a", b"b", b"c", b"d"], names.mark())
    assert (5, b"q") not in names and not names.wanted(5)  # (not before a minute)
    now[0] += left_names.AGAIN_BIG_S
    assert names.wanted(5)
    names.view(6)
    names.learn(6, [], names.mark())
    assert (6, b"q") in names
    names.changes([(6, 3, b"c1", 3, b"c1"), (6, None, None, None, None)])  # its times
    assert (6, b"q") in names
    names.changes([(6, None, None, 3, b"c1")])
    assert (6, b"q") not in names


def test_a_listing_read_across_a_change_is_never_kept_whatever_the_order() -> None:
    """A change applied by another thread while the listing is kept: before the check, it
    drops what was kept; after it, it is applied to what was kept."""
    for when in range(3):
        names = LeftNames()
        names.view(5)
        mark = names.mark()
        if when == 0:
            names.changes([(9, 5, b"z", 1, b"z")])
        names.learn(5, [] if when == 0 else [b"z"] if when == 2 else [], mark)
        if when == 1:
            names.changes([(9, 5, b"z", 1, b"z")])
        assert (5, b"z") not in names


@asynccontextmanager
async def two_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
                    ) -> AsyncIterator[tuple[SharedHost, SharedHost, Q]]:
    """Two daemons of one shared store, their committers running, and a queue ``q`` made
    through the first (the second has followed it)."""
    monkeypatch.setattr(pyfuse3, "invalidate_entry_async", lambda *a, **k: None)
    monkeypatch.setattr(pyfuse3, "invalidate_inode", lambda *a, **k: None)
    a, b = SharedHost(url, tmp_path / "a"), SharedHost(url, tmp_path / "b")
    try:
        async with trio.open_nursery() as n:
            await n.start(a.spool.committer.run)
            await n.start(b.spool.committer.run)
            qe = await a.spool.mkdir(1, b"q", 0o755, WHO)
            await b.follower.catch_up()
            yield a, b, Q(a.spool, qe.id)
            a.spool.committer.close()
            b.spool.committer.close()
    finally:
        a.store.close()
        b.store.close()


async def test_a_name_claimed_here_or_elsewhere_is_absent_with_no_round_trip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str) -> None:
    async with two_hosts(tmp_path, monkeypatch, pg_url) as (a, b, q):
        ready = q[State.READY]
        w = await a.spool.mkdir(q[State.WORKING], b"w", 0o755, WHO)
        await b.follower.catch_up()

        async def publish(host: SharedHost, name: bytes) -> int:
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


async def test_a_claims_new_name_in_a_view_known_whole_is_free_with_no_round_trip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str) -> None:
    """The kernel looks a claim's new name up before the rename, holding the rename lock
    every claim through the mount waits for: in a consumer's view read whole once, a name
    not in it is free with no read. Names claimed into it here or elsewhere (once the change
    is seen) are asked of the store."""
    async with two_hosts(tmp_path, monkeypatch, pg_url) as (a, b, q):
        ready, working = q[State.READY], q[State.WORKING]
        w = await a.spool.mkdir(working, b"w", 0o755, WHO)
        await b.follower.catch_up()
        for name in (b"f", b"g", b"h"):
            mid = await upload(a.spool, q[State.PARTIAL], name, b"bytes")
            await a.spool.rename(q[State.PARTIAL], name, ready, name, 0, WHO)
        assert await a.lookup(working, b"w") == a.ops._ino(w.id)  # noqa: SLF001
        assert await a.lookup(w.id, b"f") == 0 and len(a.reads) == 2  # and read whole
        assert await a.lookup(w.id, b"g") == 0 and a.reads == []
        await a.spool.rename(ready, b"f", w.id, b"f", 0, WHO)
        assert await a.lookup(w.id, b"f") != 0 and a.reads
        assert await a.lookup(w.id, b"other") == 0 and a.reads == []
        # claimed into it elsewhere: asked of the store once the change is seen
        await b.follower.catch_up()
        await b.spool.rename(ready, b"g", w.id, b"g", 0, WHO)
        await a.follower.catch_up()
        assert await a.lookup(w.id, b"g") != 0 and a.reads
        # finished out of it here: free again with no read
        await a.spool.rename(w.id, b"f", q[State.SUCCESS], b"f", 0, WHO)
        assert await a.lookup(w.id, b"f") == 0 and a.reads == []
        assert mid


async def test_a_create_reads_its_directory_at_most_once_a_second_unless_it_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str) -> None:
    """A create reads the directory it makes its entry in (its kind, its mode: what the new
    entry inherits): on a shared store a round trip before every ``cp``. A queue's state
    directory is read at most once a second: again at once after a change of it here (a
    ``chmod g+s``: the next file takes its group) or seen from another host; a queue
    removed elsewhere meanwhile refuses the create with ENOENT."""
    async with two_hosts(tmp_path, monkeypatch, pg_url) as (a, b, q):
        ready = q[State.READY]

        async def made(name: bytes) -> tuple[list[str], int]:
            a.reads.clear()
            e, h = await a.spool.create(ready, name, 0o644, WHO)
            reads = list(a.reads)
            await a.spool.close(h, WHO)
            return reads, e.gid

        assert len((await made(b"f1"))[0]) == 1
        assert (await made(b"f2"))[0] == []
        await a.spool.setattr(ready, mode=0o2775, gid=123, who=WHO)
        reads, gid = await made(b"f3")
        assert len(reads) == 1 and gid == 123
        assert (await made(b"f4"))[0] == []
        await b.follower.catch_up()
        await b.spool.setattr(ready, mode=0o755, who=WHO)
        await a.follower.catch_up()
        reads, gid = await made(b"f5")
        assert len(reads) == 1 and gid == WHO.gid
        monkeypatch.setattr(spool_core, "STRUCTURE_ROW_S", 0.0)
        assert len((await made(b"f6"))[0]) == 1
        monkeypatch.setattr(spool_core, "STRUCTURE_ROW_S", 60.0)
        for name in (b"f1", b"f2", b"f3", b"f4", b"f5", b"f6"):
            await b.spool.unlink(ready, name, WHO)
        await b.spool.rmdir(1, b"q", WHO)
        with pytest.raises(NotFound):
            await a.spool.create(ready, b"late", 0o644, WHO)
