"""The status snapshot as the daemon serves it (service/snapshots.py): computed off the event
loop, shared by concurrent readers, fresh after the reader's own writes, and shown to each
caller with only the queues it may enter."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from helpers.spool import WHO, Q, running, upload
from spoolfs.core.rules import State
from spoolfs.service import status
from spoolfs.service.roles import Caller
from spoolfs.service.spool import Spool
from spoolfs.store.base import WriteTx
from spoolfs.store.sqlite import SqliteRead

DEEP = 100_000
DEADLINE_S = 60.0  # only ever reached when something is wrong


class Gate:
    """Stands in for ``status.snapshot``: records the thread each computation runs on and
    holds it until ``release`` (so a test controls when a snapshot is in flight)."""

    def __init__(self, real: Callable[..., dict[str, Any]]) -> None:
        self.real = real
        self.threads: list[int] = []
        self.entered = threading.Event()
        self.open = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.threads.append(threading.get_ident())
        self.entered.set()
        if not self.open.wait(DEADLINE_S):  # on the loop's thread nothing could release it
            raise AssertionError("the snapshot was never released: it ran on the event loop")
        return self.real(*args, **kwargs)

    def release(self) -> None:
        self.open.set()

    async def wait_entered(self) -> None:
        with trio.fail_after(DEADLINE_S):
            while not self.entered.is_set():
                await trio.sleep(0.01)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(status.snapshot)
    monkeypatch.setattr(status, "snapshot", g)
    yield g
    g.release()


def seed(spool: Spool, ready: int, template: int, n: int) -> None:
    """``n`` more messages in ``ready`` sharing the content of message ``template``: straight
    through the store, one transaction (the service would take a commit each)."""
    t = spool.get(template)

    def fn(tx: WriteTx) -> None:
        for i in range(n):
            tx.insert(parent=ready, name=b"m%07d" % i, kind="message", queue=t.queue,
                      state=State.READY, blob=t.blob, size=t.size, mode=t.mode, uid=t.uid,
                      gid=t.gid, mtime_ns=t.mtime_ns, ctime_ns=t.ctime_ns,
                      created_ns=t.created_ns, enqueued_ns=t.enqueued_ns)
        assert t.blob is not None
        tx.blob_ref(t.blob, n)

    [(ok, err)] = spool.store.run_batch([fn], durable=False)
    assert ok, err


class Readers:
    """Readers of the snapshot, each a task; what they got, in the order it came back."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self.got: list[dict[str, Any]] = []

    async def read(self) -> None:
        self.got.append(await self.spool.snapshot())


def count(snap: dict[str, Any], queue: str, state: str = "ready") -> int:
    return int(snap["queues"][queue]["states"][state]["count"])


async def test_a_slow_snapshot_of_a_deep_queue_stalls_no_request(tmp_path: Path,
                                                                 gate: Gate) -> None:
    async with running(tmp_path) as spool:
        deep = Q(spool, (await spool.mkdir(1, b"deep", 0o755, WHO)).id)
        busy = Q(spool, (await spool.mkdir(1, b"busy", 0o755, WHO)).id)
        first = await upload(spool, deep[State.READY], b"first", b"x" * 10)
        seed(spool, deep[State.READY], first, DEEP - 1)
        readers = Readers(spool)
        got = readers.got
        async with trio.open_nursery() as n:
            n.start_soon(readers.read)
            await gate.wait_entered()
            # The snapshot is held in flight: every create in the other queue still completes.
            for i in range(20):
                await upload(spool, busy[State.READY], b"b%d" % i, b"y")
            assert not got, "the snapshot finished while it was held"
            assert [e.name for e in spool.listdir(busy[State.READY])] == \
                [b"b%d" % i for i in range(20)]
            gate.release()
        assert gate.threads and threading.get_ident() not in gate.threads
        assert count(got[0], "deep") == DEEP
        # A reader after those writes gets a new snapshot that shows them.
        snap = await spool.snapshot()
        assert count(snap, "deep") == DEEP and count(snap, "busy") == 20
        assert spool.snapshots.computed == 2


async def test_concurrent_readers_share_one_snapshot_and_see_their_writes(
        tmp_path: Path, gate: Gate) -> None:
    async with running(tmp_path) as spool:
        q = Q(spool, (await spool.mkdir(1, b"q", 0o755, WHO)).id)
        readers = Readers(spool)
        got = readers.got
        async with trio.open_nursery() as n:
            n.start_soon(readers.read)
            await gate.wait_entered()
            for _ in range(5):  # nothing committed since it began: they wait for it
                n.start_soon(readers.read)
            await trio.testing.wait_all_tasks_blocked()
            gate.release()
        assert len(got) == 6 and spool.snapshots.computed == 1
        assert all(count(s, "q") == 0 for s in got)

        await upload(spool, q[State.READY], b"a", b"1")
        async with trio.open_nursery() as n:
            for _ in range(5):
                n.start_soon(readers.read)
        assert spool.snapshots.computed == 2, "the readers after a write did not share one"
        assert [count(s, "q") for s in got[6:]] == [1] * 5, "a reader missed its own write"
        assert len(gate.threads) == 2 and threading.get_ident() not in gate.threads


async def test_a_caller_sees_only_the_queues_it_may_enter(tmp_path: Path) -> None:
    async with running(tmp_path) as spool:
        for name, mode, uid, gid in [(b"open", 0o755, 0, 0), (b"owners", 0o700, 1000, 1000),
                                     (b"group", 0o750, 0, 2000), (b"closed", 0o754, 0, 0)]:
            e = await spool.mkdir(1, name, mode, WHO)
            await spool.setattr(e.id, uid=uid, gid=gid, who=WHO)
        await upload(spool, spool.lookup(spool.lookup(1, b"owners").id, b"ready").id,
                     b"m", b"x")

        async def shown(caller: Caller | None, only: int | None = None) -> list[str]:
            return sorted((await spool.snapshot(caller, only))["queues"])

        everything = ["closed", "group", "open", "owners"]
        assert await shown(None) == everything
        assert await shown(Caller(0, 0)) == everything
        assert await shown(Caller(1000, 1000)) == ["open", "owners"]
        assert await shown(Caller(1001, 1001)) == ["open"]
        assert await shown(Caller(1001, 1001, frozenset({2000}))) == ["group", "open"]
        assert await shown(Caller(1001, 2000)) == ["group", "open"]
        assert await shown(Caller(1000, 1000), spool.lookup(1, b"open").id) == ["open"]
        # The figures themselves are not filtered: the owner sees its queue's message.
        assert count(await spool.snapshot(Caller(1000, 1000)), "owners") == 1


async def test_the_sizes_of_uploads_are_read_a_page_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload's size is its staging file's: a snapshot reads the uploads a page at a time,
    not a list of every one (a million left in ``partial/`` held 166 MB while it ran)."""
    monkeypatch.setattr(status, "PAGE", 3)
    read: list[int] = []
    uploads = SqliteRead.uploads

    def counted(self: SqliteRead, after: int, limit: int) -> list[tuple[int, int, str]]:
        got = uploads(self, after, limit)
        read.append(len(got))
        return got
    monkeypatch.setattr(SqliteRead, "uploads", counted)
    async with running(tmp_path) as spool:
        qe = await spool.mkdir(1, b"q", 0o755, WHO)
        q = Q(spool, qe.id)
        for i in range(8):
            await upload(spool, q[State.PARTIAL], b"p%d" % i, b"x" * i)
        await upload(spool, q[State.READY], b"done", b"12345")
        snap = await spool.snapshot()
    assert snap["queues"]["q"]["states"]["partial"] == \
        {"count": 8, "bytes": sum(range(8)), "oldest_age_s": snap["queues"]["q"]["states"]
         ["partial"]["oldest_age_s"]}
    assert read and max(read) <= 3 and sum(read) == 8
