"""An upload into ``ready/`` whose writer did not finish is never published (DESIGN §3): the
service side of the decision the FUSE layer reads from /proc, on a real store."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import trio

from helpers.spool import WHO, Q, content
from spoolfs.core.errors import NoSpace
from spoolfs.core.rules import State
from spoolfs.service.spool import Spool

KILLED = "was killed by SIGKILL"


def history(spool: Spool, entry_id: int) -> list[tuple[str, str]]:
    return [(h[1], h[-1] or "") for h in spool.r.history(entry_id)]


@pytest.mark.parametrize("unfinished", [KILLED, None])
async def test_only_a_finished_opener_publishes(env: tuple[Spool, Q],
                                                unfinished: str | None) -> None:
    spool, q = env
    e, h = await spool.create(q[State.READY], b"f", 0o644, WHO)
    spool.write(h, 0, b"data")
    await spool.publish_at_close(h, WHO, unfinished)
    await spool.close(h, WHO)
    at, not_at = (State.READY, State.PARTIAL) if unfinished is None \
        else (State.PARTIAL, State.READY)
    assert spool.listdir(q[not_at]) == []
    assert spool.lookup(q[at], b"f").id == e.id and content(spool, e.id) == b"data"
    if unfinished is not None:
        assert ("refused", f"its writer {KILLED}") in history(spool, e.id)


async def test_a_failed_copy_holder_keeps_it_back_until_the_last_close(
        env: tuple[Spool, Q]) -> None:
    """Two writers: one that failed marks the upload; the other's close still does not
    publish it."""
    spool, q = env
    e, h1 = await spool.create(q[State.READY], b"f", 0o644, WHO)
    h2 = await spool.open(e.id, True, False, WHO)
    spool.write(h1, 0, b"part")
    spool.writer_failed(h1, "exited with status 1")
    await spool.close(h1, WHO)
    assert spool.listdir(q[State.PARTIAL]) == []  # still hidden: h2 writes on
    await spool.publish_at_close(h2, WHO)
    await spool.close(h2, WHO)
    assert [m.name for m in spool.listdir(q[State.PARTIAL])] == [b"f"]
    assert spool.listdir(q[State.READY]) == []


@pytest.mark.parametrize("fails", [False, True], ids=["lands", "fails"])
async def test_a_publish_waits_for_a_write_under_way_in_a_thread(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """A write handed to a worker thread (the disk held writers back) by a process holding a
    copy of the descriptor, under way when the opener's close publishes: the publish waits
    for it. Landed, it is in the sealed content (the message holds every byte a write was
    acknowledged for); failed (the disk is full), the upload goes to ``partial/`` with what
    was written, never published without the write's bytes."""
    spool, q = env
    e, h = await spool.create(q[State.READY], b"f", 0o644, WHO)
    spool.write(h, 0, b"head ")
    started = threading.Event()
    real_pwrite = os.pwrite

    def slow_pwrite(fd: int, buf: bytes, off: int) -> int:
        started.set()
        time.sleep(0.2)
        if fails:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, buf, off)
    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    spool.write_pace.off_loop_until = time.monotonic_ns() + 10**10  # the disk lags

    async def write() -> None:
        if fails:
            with pytest.raises(NoSpace):
                await spool.write_paced(h, 5, b"tail")
        else:
            await spool.write_paced(h, 5, b"tail")

    async with trio.open_nursery() as n:
        n.start_soon(write)
        await trio.to_thread.run_sync(started.wait)
        if fails:
            with pytest.raises(NoSpace):
                await spool.publish_at_close(h, WHO)
        else:
            await spool.publish_at_close(h, WHO)
    await spool.close(h, WHO)
    if fails:
        assert spool.listdir(q[State.READY]) == []
        assert spool.lookup(q[State.PARTIAL], b"f").id == e.id
        assert content(spool, e.id) == b"head "
    else:
        assert spool.lookup(q[State.READY], b"f").id == e.id
        assert content(spool, e.id) == b"head tail"
