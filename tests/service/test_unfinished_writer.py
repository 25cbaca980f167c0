"""An upload into ``ready/`` whose writer did not finish is never published (DESIGN §3): the
service side of the decision the FUSE layer reads from /proc, on a real store."""

from __future__ import annotations

import pytest

from helpers.spool import WHO, Q, content
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

