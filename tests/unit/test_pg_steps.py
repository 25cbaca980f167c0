"""Reads as steps on PostgreSQL (``ReadTx.lookup_steps``, ``service/steps.py``): the event
loop answers other requests while the server answers a lookup; a read stopped half-way
leaves nothing behind; a broken or busy step connection reads on the reader's own."""

from __future__ import annotations

import select
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import trio

from spoolfs.service.steps import waited
from spoolfs.store import postgres
from spoolfs.store.base import WAIT_R, Entry
from spoolfs.store.postgres import PostgresStore
from spoolfs.store.sqlite import SqliteStore


@pytest.fixture
def store(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[PostgresStore]:
    """A store whose lookups go as steps: as on a server farther than this one (below)."""
    monkeypatch.setattr(postgres, "STEP_AFTER_S", 0.0)
    yield from _opened(pg_url)


@pytest.fixture
def near(pg_url: str) -> Iterator[PostgresStore]:
    yield from _opened(pg_url)


def _opened(pg_url: str) -> Iterator[PostgresStore]:
    s = PostgresStore(pg_url)
    [(made, why)] = s.run_batch([lambda tx: tx.insert(
        parent=1, name=b"q", kind="queue", mode=0o40755, mtime_ns=1, ctime_ns=1, created_ns=1)],
        True)
    assert made, why
    assert s.reader().get(1) is not None  # (step connections are made while this one is up)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def locked(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection ready to hold every read of the entries up (``lock``)."""
    with psycopg.connect(pg_url) as conn:
        yield conn


def _lock(conn: psycopg.Connection[Any]) -> None:
    conn.execute("LOCK TABLE entries IN ACCESS EXCLUSIVE MODE")


def _name(e: Entry | None) -> bytes | None:
    return None if e is None else e.name


async def test_the_loop_answers_others_while_a_lookup_waits_on_the_server(
        store: PostgresStore, locked: psycopg.Connection[Any]) -> None:
    r = store.reader()
    _lock(locked)
    got: list[Entry | None] = []
    ticks = 0
    async with trio.open_nursery() as nursery:
        async def look() -> None:
            got.append(await waited(r.lookup_steps(1, b"q")))

        nursery.start_soon(look)
        for _ in range(20):  # the other requests the loop answers meanwhile
            await trio.sleep(0.01)
            ticks += 1
        assert got == []  # still waiting for the lock
        locked.rollback()
    assert ticks == 20 and [_name(e) for e in got] == [b"q"]
    # a rename's three reads, the same way
    e, d, there = await waited(r.rename_reads_steps(1, b"q", 1, b"q"))
    assert _name(e) == b"q" and d is not None and d.id == 1 and _name(there) == b"q"
    e, d, there = await waited(r.rename_reads_steps(1, b"absent", 123456, b"q"))
    assert e is None and d is None and there is None
    # a row by id (a create's directory, an attribute), one with its content's blob row
    # (an open), a directory's subdirectories (its link count), the same way
    q = r.lookup(1, b"q")
    assert q is not None
    _lock(locked)
    by_id: list[Any] = []
    ticks = 0
    async with trio.open_nursery() as nursery:
        async def get() -> None:
            by_id.append(await waited(r.get_steps(q.id)))
            by_id.append(await waited(r.get_with_blob_steps(q.id)))
            by_id.append(await waited(r.subdirs_steps(1)))  # (a directory's link count)

        nursery.start_soon(get)
        for _ in range(10):
            await trio.sleep(0.01)
            ticks += 1
        assert by_id == []
        locked.rollback()
    assert ticks == 10 and _name(by_id[0]) == b"q"
    assert _name(by_id[1][0]) == b"q" and by_id[1][1] is None and by_id[2] == 1
    assert await waited(r.get_steps(123456)) is None
    assert await waited(r.get_with_blob_steps(123456)) == (None, None)


async def test_a_lookup_stopped_half_way_leaves_no_statement_behind(
        store: PostgresStore, locked: psycopg.Connection[Any]) -> None:
    """Cancelled while the server has its statement (an interrupted request, an unmount):
    the connection it was on is closed, not used again with an answer still to come."""
    r = store.reader()
    assert _name(await waited(r.lookup_steps(1, b"q"))) == b"q"  # a step connection made
    _lock(locked)
    with trio.move_on_after(0.2) as scope:
        await waited(r.lookup_steps(1, b"q"))
    assert scope.cancelled_caught
    locked.rollback()
    assert store._reader._stepping == 0  # noqa: SLF001 (closed, not kept)
    for name in (b"q", b"absent", b"q"):
        assert _name(await waited(r.lookup_steps(1, name))) == (None if name == b"absent"
                                                                 else name)


async def test_a_broken_step_connection_reads_again_on_the_readers_own(
        store: PostgresStore, locked: psycopg.Connection[Any]) -> None:
    """The server ended the step connection's session (a restart, an administrator): the
    lookup answers all the same, and the next one makes a new connection."""
    r = store.reader()
    assert _name(await waited(r.lookup_steps(1, b"q"))) == b"q"
    spare = store._reader._spare  # noqa: SLF001
    assert len(spare) == 1
    locked.execute("SELECT pg_terminate_backend(%s)", (spare[0].conn.info.backend_pid,))
    locked.commit()
    assert _name(await waited(r.lookup_steps(1, b"q"))) == b"q"
    assert store._reader._stepping == 0  # noqa: SLF001
    assert _name(await waited(r.lookup_steps(1, b"q"))) == b"q"
    assert store._reader._stepping == 1  # noqa: SLF001


def test_with_every_step_connection_busy_a_lookup_is_waited_for_at_once(
        store: PostgresStore, locked: psycopg.Connection[Any]) -> None:
    r = store.reader()
    under_way = []
    for _ in range(postgres.STEP_CONNECTIONS):
        steps = r.lookup_steps(1, b"q")
        next(steps)  # sent: waits for its answer
        under_way.append(steps)
    with pytest.raises(StopIteration) as done:
        next(r.lookup_steps(1, b"q"))  # answered on the reader's own connection, no step
    assert _name(done.value.value) == b"q"
    for steps in under_way:
        steps.close()  # stopped half-way: each connection closed
    assert store._reader._stepping == 0  # noqa: SLF001


async def test_the_embedded_store_answers_without_giving_the_loop_up(tmp_path: Any) -> None:
    """No step: the lookup is the plain call it was, with no checkpoint (a cancelled scope
    would raise at one)."""
    s = SqliteStore(str(tmp_path / "m.db"))
    try:
        with trio.CancelScope() as scope:
            scope.cancel()
            assert await waited(s.reader().lookup_steps(1, b"absent")) is None
        assert not scope.cancelled_caught
    finally:
        s.close()


def test_with_the_readers_own_connection_down_no_step_connection_is_tried(
        store: PostgresStore) -> None:
    """A server gone away: a lookup waits for one connect (the reader's own), not for a step
    connection's first and then that one."""
    r = store.reader()
    store._reader.close()  # noqa: SLF001 (as after a failed read)
    with pytest.raises(StopIteration) as done:
        next(r.lookup_steps(1, b"q"))  # answered at once, on the reader's own, made again
    assert _name(done.value.value) == b"q"
    assert store._reader._stepping == 0  # noqa: SLF001
    steps = r.lookup_steps(1, b"q")
    next(steps)  # its own is up again: a step connection for the next
    steps.close()


def test_a_store_closed_while_a_lookup_waits_closes_its_connection_at_the_end(
        store: PostgresStore) -> None:
    """An unmount while a lookup waits: the lookup gets its answer, and its connection is
    closed then, not kept for a reader that is gone."""
    r = store.reader()
    steps = r.lookup_steps(1, b"q")
    fd, _ = next(steps)
    store._reader.close_all()  # noqa: SLF001
    with pytest.raises(StopIteration) as done:
        while True:
            select.select([fd], [], [], 5)
            fd, _ = steps.send(WAIT_R)
    assert _name(done.value.value) == b"q"
    assert store._reader._spare == [] and store._reader._stepping == 0  # noqa: SLF001


def test_a_near_server_is_waited_for_at_once_and_a_far_one_as_steps(
        near: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Near the server a lookup's round trip costs the loop less than its steps' own work:
    waited for at once, and timed. Once they take ``STEP_AFTER_S`` on average (a server
    farther away), they go as steps, and one in ``MEASURE_EVERY`` is timed again. (The
    line is moved far off, so that how fast this machine answers does not matter.)"""
    monkeypatch.setattr(postgres, "STEP_AFTER_S", 60.0)
    r, reader = near.reader(), near._reader  # noqa: SLF001
    for _ in range(5):
        with pytest.raises(StopIteration):
            next(r.lookup_steps(1, b"q"))  # no step
    assert reader._took > 0  # noqa: SLF001 (timed)
    reader._took = 120.0  # noqa: SLF001 (as a server that far away)
    steps = r.lookup_steps(1, b"q")
    next(steps)  # a step: the loop goes on
    steps.close()
    reader._reads = postgres.MEASURE_EVERY - 1  # noqa: SLF001
    with pytest.raises(StopIteration):
        next(r.lookup_steps(1, b"q"))  # timed again, waited for at once
    assert reader._took < 120.0  # noqa: SLF001
