"""Two daemons of one embedded store, each a spool of its own over the same directory, as two
mounts of it are (DESIGN §6). A publish through one never seals an upload that a writer
through the other still holds: it appears when the last writer closes, complete (DESIGN §3),
and a writer opening it while the other seals it waits, then finds it published."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from helpers.spool import WHO, Q, content, upload
from spoolfs.core.errors import NotPermitted
from spoolfs.core.rules import State
from spoolfs.service.content import Handle
from spoolfs.service.spool import Spool
from spoolfs.store.base import Entry


async def writing(spool: Spool, q: Q, data: bytes) -> tuple[Entry, Handle]:
    """``partial/up`` made through ``spool``, ``data`` written, still open."""
    e, h = await spool.create(q[State.PARTIAL], b"up", 0o644, WHO)
    spool.write(h, 0, data)
    return e, h


async def test_a_publish_through_one_daemon_waits_for_a_writer_through_the_other(
        daemons: tuple[Spool, Spool, Q]) -> None:
    a, b, q = daemons
    e, h = await writing(b, q, b"first ")

    assert await a.rename(q[State.PARTIAL], b"up", q[State.READY], b"up", 0, WHO)
    shown = a.get(e.id)
    assert shown.hidden and shown.staged and shown.parent == q[State.READY]

    b.write(h, 6, b"second")  # nothing sealed it: the writer goes on
    await b.close(h, WHO)
    m = a.get(e.id)
    assert (m.state, m.hidden, m.staged) == (State.READY, False, False)
    assert content(a, e.id) == b"first second"
    assert a.writer_locks.holding() == b.writer_locks.holding() == 0


async def test_an_upload_written_through_another_daemon_is_not_linked(
        daemons: tuple[Spool, Spool, Q]) -> None:
    a, b, q = daemons
    e, h = await writing(b, q, b"first ")
    with pytest.raises(NotPermitted):
        await a.link(e.id, q[State.READY], b"copy", WHO)
    assert a.r.lookup(q[State.READY], b"copy") is None
    b.write(h, 6, b"second")
    await b.close(h, WHO)
    assert content(a, e.id) == b"first second"  # still an upload, whole
    assert a.writer_locks.holding() == b.writer_locks.holding() == 0


async def test_a_writer_through_another_daemon_waits_for_a_seal_then_finds_it_published(
        daemons: tuple[Spool, Spool, Q]) -> None:
    a, b, q = daemons
    eid = await upload(a, q[State.PARTIAL], b"up", b"whole")

    assert a.writer_locks.try_take(eid)  # as a publish's seal holds it
    refused: list[BaseException] = []

    async def open_for_writing() -> None:
        try:
            await b.open(eid, True, False, WHO)
        except NotPermitted as err:
            refused.append(err)

    async with trio.open_nursery() as n:
        n.start_soon(open_for_writing)
        await trio.testing.wait_all_tasks_blocked()
        assert not refused  # waiting for the seal
        await a.rename(q[State.PARTIAL], b"up", q[State.READY], b"up", 0, WHO)
        a.writer_locks.untake(eid)
    assert len(refused) == 1
    assert content(b, eid) == b"whole"
    assert a.writer_locks.holding() == b.writer_locks.holding() == 0


async def test_a_writer_through_another_daemon_goes_on_when_a_seal_fails(
        daemons: tuple[Spool, Spool, Q]) -> None:
    a, b, q = daemons
    eid = await upload(a, q[State.PARTIAL], b"up", b"")
    assert a.writer_locks.try_take(eid)
    opened = []

    async def open_for_writing() -> None:
        opened.append(await b.open(eid, True, False, WHO))

    async with trio.open_nursery() as n:
        n.start_soon(open_for_writing)
        await trio.testing.wait_all_tasks_blocked()
        assert not opened
        a.writer_locks.untake(eid)  # the publish did not happen after all
    b.write(opened[0], 0, b"more")
    await b.close(opened[0], WHO)
    assert content(a, eid) == b"more"
    assert a.writer_locks.holding() == b.writer_locks.holding() == 0


async def test_an_upload_the_other_daemon_published_meanwhile_is_not_published_again(
        daemons: tuple[Spool, Spool, Q]) -> None:
    """Both daemons may find the upload left to publish (each looks after giving up its
    share): the one that seals second finds it published, and says nothing went wrong."""
    a, b, q = daemons
    e, h = await writing(b, q, b"whole")
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
