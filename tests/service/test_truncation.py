"""Truncating an upload: a cut that frees much of the disk waits in a worker thread (freeing
blocks can take long: with ``discard``, 0.4 s for 256 MiB on this kind of machine), the
mount's other requests answered meanwhile; a publish, a link or a removal of the same upload
that comes while it is under way finds the upload as a plain file system would."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from helpers.spool import WHO, Q, content
from spoolfs.blobs import freeing
from spoolfs.core.errors import NotFound, NotPermitted
from spoolfs.core.rules import State
from spoolfs.service.spool import Spool, Who

BIG = os.urandom(64 * 1024)  # past the inline size and one block
#: a process that may not keep set-ID bits (no such process: no capabilities)
NOBODY = Who(65534, 65534, 2**22 + 4242)


def slow_cuts(monkeypatch: pytest.MonkeyPatch, seconds: float) -> tuple[list[str],
                                                                        threading.Event]:
    """``os.ftruncate`` noted (where it ran, whether it freed much) and made slow: the list
    of notes, and an event set once a cut has begun."""
    notes: list[str] = []
    started = threading.Event()
    real = os.ftruncate

    def ftruncate(fd: int, size: int) -> None:
        frees = os.fstat(fd).st_blocks * 512 - size > freeing.SMALL
        where = "on the loop" if threading.current_thread() is threading.main_thread() \
            else "in a thread"
        notes.append(f"cut {'freeing much ' if frees else ''}{where}")
        started.set()
        if frees:
            time.sleep(seconds)
        real(fd, size)
    monkeypatch.setattr(os, "ftruncate", ftruncate)
    return notes, started


async def begun(started: threading.Event) -> None:
    """Once the slow cut has begun (it fails the test if it never does)."""
    with trio.fail_after(10):
        while not started.is_set():
            await trio.sleep(0.001)


async def during_a_cut(cut: Callable[[], Awaitable[object]], started: threading.Event,
                       then: Callable[[], Awaitable[object]]) -> None:
    """``cut()`` begun, and ``then()`` once its slow cut is under way."""
    async with trio.open_nursery() as n:
        n.start_soon(cut)
        await begun(started)
        await then()


async def upload_in_partial(spool: Spool, q: Q, name: bytes, data: bytes) -> int:
    e, h = await spool.create(q[State.PARTIAL], name, 0o644, WHO)
    spool.write(h, 0, data)
    await spool.close(h, WHO)
    return e.id


async def answered_meanwhile(spool: Spool, q: Q, started: threading.Event,
                             notes: list[str]) -> None:
    await begun(started)
    spool.lookup(q[State.PARTIAL], b"f")
    notes.append("lookup answered")


@pytest.mark.parametrize("how", ["setattr", "open"])
async def test_a_cut_that_frees_much_runs_in_a_thread(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """``truncate -s 0 partial/f`` (a resize) and ``: > partial/f`` (an open that truncates)
    of a large upload: the cut waits in a worker thread while another request is answered;
    a cut that frees at most a block (or grows the file) stays on the loop."""
    spool, q = env
    eid = await upload_in_partial(spool, q, b"f", BIG)
    notes, started = slow_cuts(monkeypatch, 0.2)

    async def cut() -> None:
        if how == "setattr":
            await spool.setattr(eid, size=10, who=WHO)
        else:
            h = await spool.open(eid, True, True, WHO)
            spool.write(h, 0, b"0123456789")
            await spool.close(h, WHO)
        notes.append("cut answered")

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(cut)
            await answered_meanwhile(spool, q, started, notes)
    assert notes == ["cut freeing much in a thread", "lookup answered", "cut answered"]
    left = BIG[:10] if how == "setattr" else b"0123456789"
    assert content(spool, eid) == left
    notes.clear()
    await spool.setattr(eid, size=5, who=WHO)
    await spool.setattr(eid, size=8192, who=WHO)  # a hole: nothing to free
    assert notes == ["cut on the loop", "cut on the loop"]
    assert content(spool, eid) == left[:5] + bytes(8187)


async def test_a_publish_during_a_truncating_open_waits_for_its_writer(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """``cat new > partial/f`` while ``mv partial/f ready/`` runs: the opener is a writer from
    the start, so the move leaves the publish to its close, and the message holds what it
    wrote (as a rename on a plain file system leaves the writer writing the renamed file);
    never an empty message published under a writer about to fill it."""
    spool, q = env
    eid = await upload_in_partial(spool, q, b"f", BIG)
    notes, started = slow_cuts(monkeypatch, 0.2)
    handles = []

    async def truncating_open() -> None:
        handles.append(await spool.open(eid, True, True, WHO))

    async with trio.open_nursery() as n:
        n.start_soon(truncating_open)
        await begun(started)
        await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    assert spool.listdir(q[State.READY]) == []  # not yet: its writer writes on
    (h,) = handles
    spool.write(h, 0, b"new")
    await spool.close(h, WHO)
    assert spool.lookup(q[State.READY], b"f").id == eid
    assert content(spool, eid) == b"new"


async def test_a_publish_during_a_cut_seals_what_the_cut_left(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """``truncate -s 100 partial/f`` while ``mv partial/f ready/`` runs: the publish waits for
    the cut, and the message's content is the cut file, matching its address."""
    spool, q = env
    eid = await upload_in_partial(spool, q, b"f", BIG)
    notes, started = slow_cuts(monkeypatch, 0.2)
    await during_a_cut(lambda: spool.setattr(eid, size=100, who=WHO), started,
                       lambda: spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f",
                                            0, WHO))
    e = spool.lookup(q[State.READY], b"f")
    assert e.id == eid and e.size == 100 and content(spool, eid) == BIG[:100]
    blob = spool.r.blob(e.blob) if e.blob is not None else None
    assert blob is not None and blob.sha256 == hashlib.sha256(BIG[:100]).digest()


@pytest.mark.parametrize("cut", ["setattr", "open"])
async def test_an_upload_removed_during_a_cut_stays_removed(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch, cut: str) -> None:
    """``rm partial/f`` while a cut of it is under way: the cut (and the opening) ends as for
    a file removed first (ENOENT), and no staging file is left that no row names (fsck)."""
    spool, q = env
    eid = await upload_in_partial(spool, q, b"f", BIG)
    notes, started = slow_cuts(monkeypatch, 0.2)
    call: Callable[[], object] = (lambda: spool.setattr(eid, size=0, who=WHO)) \
        if cut == "setattr" else (lambda: spool.open(eid, True, True, WHO))
    failed: list[BaseException] = []

    async def cutting() -> None:
        try:
            await call()  # type: ignore[misc]
        except NotFound as e:
            failed.append(e)

    async with trio.open_nursery() as n:
        n.start_soon(cutting)
        await begun(started)
        await spool.unlink(q[State.PARTIAL], b"f", WHO)
    assert len(failed) == 1
    assert spool.listdir(q[State.PARTIAL]) == []
    assert not os.path.exists(spool.content.staging.path(eid))
    assert writers_left(spool) == ({}, 0)


def writers_left(spool: Spool) -> tuple[dict[int, int], int]:
    return spool._writers, spool.writer_locks.holding()


async def test_a_publish_during_an_open_that_only_truncates_seals_what_it_cut(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """``O_RDONLY|O_TRUNC`` of a set-user-ID upload by a process that may not keep the bit:
    the bit is cleared first (a durable transaction), then the file cut. A ``mv`` into
    ``ready/`` meanwhile waits for the cut and publishes what it left: no cut under a seal,
    no staging file made again for a published message (fsck); the opener reads it."""
    spool, q = env
    eid = await upload_in_partial(spool, q, b"f", BIG)
    await spool.setattr(eid, mode=0o4755, who=WHO)
    gate = trio.Event()
    real_clear = spool._clear_setid

    async def clear(entry_id: int, pid: int) -> None:
        await real_clear(entry_id, pid)
        await gate.wait()
    monkeypatch.setattr(spool, "_clear_setid", clear)
    handles = []

    async def truncating_open() -> None:
        handles.append(await spool.open(eid, False, True, NOBODY))

    async with trio.open_nursery() as n:
        n.start_soon(truncating_open)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(spool.rename, q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
        await trio.testing.wait_all_tasks_blocked()
        assert spool.listdir(q[State.READY]) == []  # the rename waits for the cut
        gate.set()
    (h,) = handles
    assert h.read(0, 10) == b""
    await spool.close(h, WHO)
    e = spool.lookup(q[State.READY], b"f")
    assert e.id == eid and not e.staged and e.mode & 0o7777 == 0o755
    assert content(spool, eid) == b""
    assert not os.path.exists(spool.content.staging.path(eid))
    assert writers_left(spool) == ({}, 0)


@pytest.mark.parametrize("how", ["mv", "ln"])
async def test_a_rename_or_link_during_a_cut_waits_for_it(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """``mv partial/f ready/`` or ``ln partial/f ready/g`` while ``truncate -s 100
    partial/f`` cuts: a resize is no writer, so the move or link is neither refused nor left
    to it; it waits for the cut, and returns with the message in ``ready/``."""
    spool, q = env
    eid = await upload_in_partial(spool, q, b"f", BIG)
    notes, started = slow_cuts(monkeypatch, 0.2)
    async with trio.open_nursery() as n:
        n.start_soon(lambda: spool.setattr(eid, size=100, who=WHO))
        await begun(started)
        if how == "mv":
            assert not await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0,
                                          WHO)
        else:
            await spool.link(eid, q[State.READY], b"g", WHO)
        m = spool.lookup(q[State.READY], b"f" if how == "mv" else b"g")
        assert notes == ["cut freeing much in a thread"]
    assert content(spool, m.id) == BIG[:100]
    assert writers_left(spool) == ({}, 0)


async def test_a_publish_through_another_mount_during_a_cut_appears_after_it(
        daemons: tuple[Spool, Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """``truncate -s 0 partial/f`` through one mount, ``mv partial/f ready/`` through another
    meanwhile: the cut holds the upload's writers' lock, so the other mount leaves the publish
    to it, and the message appears once the cut is made (never left hidden in ``ready/``)."""
    a, b, q = daemons
    eid = await upload_in_partial(a, q, b"f", BIG)
    notes, started = slow_cuts(monkeypatch, 0.3)
    await during_a_cut(lambda: a.setattr(eid, size=0, who=WHO), started,
                       lambda: b.rename(q[State.PARTIAL], b"f", q[State.READY], b"f",
                                        0, WHO))
    e = a.lookup(q[State.READY], b"f")
    assert e.id == eid and not e.hidden and not e.staged and content(a, eid) == b""
    assert writers_left(a) == ({}, 0) and writers_left(b) == ({}, 0)


async def test_a_cut_never_begun_leaves_no_descriptor(env: tuple[Spool, Q],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No worker thread to be had for a cut: the staging file's descriptor opened for it is
    closed, nothing is cut, and the resize fails as the store would."""
    spool, q = env
    eid = await upload_in_partial(spool, q, b"f", BIG)

    async def no_thread(*args: object, **kw: object) -> None:
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(trio.to_thread, "run_sync", no_thread)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError):
        await spool.setattr(eid, size=0, who=WHO)
    assert len(os.listdir("/proc/self/fd")) == before
    monkeypatch.undo()
    assert content(spool, eid) == BIG
    assert writers_left(spool) == ({}, 0)


async def test_a_writer_that_stops_while_a_deferred_rename_commits_publishes(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """``mv partial/f ready/`` while a writer holds ``f`` leaves the publish to its last
    close; a close that comes while the rename's transaction is under way finds nothing
    hidden to publish yet: the rename then publishes it itself."""
    spool, q = env
    e, h = await spool.create(q[State.PARTIAL], b"f", 0o644, WHO)
    spool.write(h, 0, b"x")
    real_tx, entered, gate = spool.tx, trio.Event(), trio.Event()

    async def tx(fn: Callable[..., object], durable: bool = True) -> object:
        if not entered.is_set():  # the rename's
            entered.set()
            await gate.wait()
        return await real_tx(fn, durable)
    monkeypatch.setattr(spool, "tx", tx)
    async with trio.open_nursery() as n:
        n.start_soon(spool.rename, q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
        await entered.wait()
        await spool.close(h, WHO)  # the last writer goes: nothing hidden yet
        gate.set()
    m = spool.lookup(q[State.READY], b"f")
    assert m.id == e.id and not m.hidden and content(spool, e.id) == b"x"


async def test_a_rename_and_the_last_close_publish_once(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's last close comes just after a deferred rename committed, and publishes;
    the rename, finding no writer left, would publish too: it leaves it to the close, and
    neither is told ENOENT."""
    spool, q = env
    e, h = await spool.create(q[State.PARTIAL], b"f", 0o644, WHO)
    spool.write(h, 0, b"x")
    real_tx = spool.tx
    calls = 0
    committed, gate, publishing, gate2 = trio.Event(), trio.Event(), trio.Event(), trio.Event()

    async def tx(fn: Callable[..., object], durable: bool = True) -> object:
        nonlocal calls
        calls += 1
        me = calls
        if me == 2:  # the close's publish
            publishing.set()
            await gate2.wait()
        done = await real_tx(fn, durable)
        if me == 1:  # the rename's, committed
            committed.set()
            await gate.wait()
        return done
    monkeypatch.setattr(spool, "tx", tx)
    async with trio.open_nursery() as n:
        n.start_soon(spool.rename, q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
        await committed.wait()
        n.start_soon(spool.close, h, WHO)
        await publishing.wait()
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        gate2.set()
    m = spool.lookup(q[State.READY], b"f")
    assert m.id == e.id and not m.hidden and content(spool, e.id) == b"x"


NFS = Who(0, 0, 4242, nfs=True)


async def test_an_nfs_servers_resize_publishes_nothing_under_its_writer(
        daemons: tuple[Spool, Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """An NFS client writing ``partial/f`` through one mount truncates it (SETATTR) and goes
    on writing; ``mv partial/f ready/`` through another mount during the cut is left to the
    first: the server's descriptor still writes, so the client's COMMIT publishes it, with
    what it wrote after the cut."""
    a, b, q = daemons
    eid = await upload_in_partial(a, q, b"f", BIG)
    h = await a.open(eid, True, False, NFS)
    notes, started = slow_cuts(monkeypatch, 0.3)
    await during_a_cut(lambda: a.setattr(eid, size=0, who=NFS), started,
                       lambda: b.rename(q[State.PARTIAL], b"f", q[State.READY], b"f",
                                        0, WHO))
    assert a.listdir(q[State.READY]) == []
    a.write(h, 0, b"after the cut")
    await a.committed(h, NFS)
    await a.close(h, NFS)
    assert content(a, a.lookup(q[State.READY], b"f").id) == b"after the cut"


async def test_a_publish_left_to_a_writer_here_stops_the_nfs_servers_descriptors(
        env: tuple[Spool, Q]) -> None:
    """An NFS client and a local process both write ``partial/f``; ``mv partial/f ready/``
    is left to the local writer, whose last close publishes it: a later write through the
    NFS server's descriptor is refused (EPERM), never taken and lost."""
    spool, q = env
    eid = await upload_in_partial(spool, q, b"f", b"data")
    nfs = await spool.open(eid, True, False, NFS)
    local = await spool.open(eid, True, False, WHO)
    assert await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    await spool.close(local, WHO)
    assert spool.lookup(q[State.READY], b"f").id == eid
    with pytest.raises(NotPermitted):
        spool.write(nfs, 0, b"late")
    await spool.close(nfs, NFS)
    assert content(spool, eid) == b"data"


async def test_a_rename_left_to_another_mount_publishes_nothing_under_a_writer_here(
        daemons: tuple[Spool, Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    """``mv partial/f ready/`` through mount A while a process writes ``f`` through mount B:
    left to B's writer. A writer that opens ``f`` through A while the rename commits holds
    it too: B's close does not publish it under A's writer, A's last close does."""
    a, b, q = daemons
    eid = await upload_in_partial(a, q, b"f", b"old")
    hb = await b.open(eid, True, False, WHO)
    real_tx, entered, gate = a.tx, trio.Event(), trio.Event()

    async def tx(fn: Callable[..., object], durable: bool = True) -> object:
        if not entered.is_set():
            entered.set()
            await gate.wait()
        return await real_tx(fn, durable)
    monkeypatch.setattr(a, "tx", tx)
    async with trio.open_nursery() as n:
        n.start_soon(a.rename, q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
        await entered.wait()
        ha = await a.open(eid, True, False, WHO)  # a writer here, opened meanwhile
        await b.close(hb, WHO)
        gate.set()
    assert a.listdir(q[State.READY]) == []
    a.write(ha, 0, b"new")
    await a.close(ha, WHO)
    assert content(a, a.lookup(q[State.READY], b"f").id) == b"new"
