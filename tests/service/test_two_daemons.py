"""Two daemons of one embedded store, each a spool of its own over the same directory, as two
mounts of it are (DESIGN §6). A publish through one never seals an upload that a writer
through the other still holds: it appears when the last writer closes, complete (DESIGN §3),
and a writer opening it while the other seals it waits, then finds it published."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from helpers.spool import WHO, Q, content, running
from spoolfs.core.errors import NotPermitted
from spoolfs.core.rules import State


async def test_a_publish_through_one_daemon_waits_for_a_writer_through_the_other(
        tmp_path: Path) -> None:
    async with running(tmp_path) as a, running(tmp_path) as b:
        q = Q(a, (await a.mkdir(1, b"q", 0o755, WHO)).id)
        e, h = await b.create(q[State.PARTIAL], b"up", 0o644, WHO)
        b.write(h, 0, b"first ")

        assert await a.rename(q[State.PARTIAL], b"up", q[State.READY], b"up", 0, WHO)
        shown = a.get(e.id)
        assert shown.hidden and shown.staged and shown.parent == q[State.READY]

        b.write(h, 6, b"second")  # nothing sealed it: the writer goes on
        await b.close(h, WHO)
        m = a.get(e.id)
        assert (m.state, m.hidden, m.staged) == (State.READY, False, False)
        assert content(a, e.id) == b"first second"
        assert a.writer_locks.holding() == b.writer_locks.holding() == 0


async def test_an_upload_written_through_another_daemon_is_not_linked(tmp_path: Path) -> None:
    async with running(tmp_path) as a, running(tmp_path) as b:
        q = Q(a, (await a.mkdir(1, b"q", 0o755, WHO)).id)
        e, h = await b.create(q[State.PARTIAL], b"up", 0o644, WHO)
        b.write(h, 0, b"first ")
        with pytest.raises(NotPermitted):
            await a.link(e.id, q[State.READY], b"copy", WHO)
        assert a.r.lookup(q[State.READY], b"copy") is None
        b.write(h, 6, b"second")
        await b.close(h, WHO)
        assert content(a, e.id) == b"first second"  # still an upload, whole
        assert a.writer_locks.holding() == b.writer_locks.holding() == 0


async def test_a_writer_through_another_daemon_waits_for_a_seal_then_finds_it_published(
        tmp_path: Path) -> None:
    async with running(tmp_path) as a, running(tmp_path) as b:
        q = Q(a, (await a.mkdir(1, b"q", 0o755, WHO)).id)
        e, h = await a.create(q[State.PARTIAL], b"up", 0o644, WHO)
        a.write(h, 0, b"whole")
        await a.close(h, WHO)

        assert a.writer_locks.try_take(e.id)  # as a publish's seal holds it
        refused: list[BaseException] = []

        async def open_for_writing() -> None:
            try:
                await b.open(e.id, True, False, WHO)
            except NotPermitted as err:
                refused.append(err)

        async with trio.open_nursery() as n:
            n.start_soon(open_for_writing)
            await trio.testing.wait_all_tasks_blocked()
            assert not refused  # waiting for the seal
            await a.rename(q[State.PARTIAL], b"up", q[State.READY], b"up", 0, WHO)
            a.writer_locks.untake(e.id)
        assert len(refused) == 1
        assert content(b, e.id) == b"whole"
        assert a.writer_locks.holding() == b.writer_locks.holding() == 0


async def test_a_writer_through_another_daemon_goes_on_when_a_seal_fails(
        tmp_path: Path) -> None:
    async with running(tmp_path) as a, running(tmp_path) as b:
        q = Q(a, (await a.mkdir(1, b"q", 0o755, WHO)).id)
        e, h = await a.create(q[State.PARTIAL], b"up", 0o644, WHO)
        await a.close(h, WHO)
        assert a.writer_locks.try_take(e.id)
        opened = []

        async def open_for_writing() -> None:
            opened.append(await b.open(e.id, True, False, WHO))

        async with trio.open_nursery() as n:
            n.start_soon(open_for_writing)
            await trio.testing.wait_all_tasks_blocked()
            assert not opened
            a.writer_locks.untake(e.id)  # the publish did not happen after all
        b.write(opened[0], 0, b"more")
        await b.close(opened[0], WHO)
        assert content(a, e.id) == b"more"
        assert a.writer_locks.holding() == b.writer_locks.holding() == 0


async def test_an_upload_the_other_daemon_published_meanwhile_is_not_published_again(
        tmp_path: Path) -> None:
    """Both daemons may find the upload left to publish (each looks after giving up its
    share): the one that seals second finds it published, and says nothing went wrong."""
    async with running(tmp_path) as a, running(tmp_path) as b:
        q = Q(a, (await a.mkdir(1, b"q", 0o755, WHO)).id)
        e, h = await b.create(q[State.PARTIAL], b"up", 0o644, WHO)
        b.write(h, 0, b"whole")
        assert await a.rename(q[State.PARTIAL], b"up", q[State.READY], b"up", 0, WHO)
        seen = a.get(e.id)  # as A saw it: hidden, left to publish
        assert seen.hidden
        await b.close(h, WHO)  # B's last close publishes it
        assert await a._publish_settled(seen, WHO)
        m = a.get(e.id)
        assert (m.state, m.hidden, m.staged) == (State.READY, False, False)
        assert content(a, e.id) == b"whole"
        assert m.blob is not None and a.r.blob(m.blob).refcount == 1  # attached once
        assert a.writer_locks.holding() == b.writer_locks.holding() == 0
