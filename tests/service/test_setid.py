"""Set-ID bits and writes past the page cache (docs/design.md, "fast path"): the daemon clears
the set-user-ID and set-group-ID bits before a write its opener may not keep them through,
whenever they are there at that write, and reads the mode only after a mode may have
changed, so that a write costs no store round trip (a query to a database server, with one)."""

from __future__ import annotations

import stat
from typing import Any

import pytest

from helpers.spool import Q, content
from spoolfs.core.rules import State
from spoolfs.service.spool import Spool, Who
from spoolfs.store.base import WriteTx

#: an unprivileged writer whose process is gone: only root may keep the bits (roles.py)
NOBODY = Who(65534, 65534, 2**22 + 4242)


def mode(spool: Spool, entry_id: int) -> int:
    return stat.S_IMODE(spool.get(entry_id).mode)


async def write(spool: Spool, h: Any, off: int, data: bytes) -> None:
    """What fuse/ops.py does for a WRITE request."""
    if h.checks_setid:
        await spool.drop_setid(h)
    spool.write(h, off, data)


async def test_bits_set_while_the_file_is_open_go_at_the_next_write(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch) -> None:
    spool, q = env
    e, h = await spool.create(q[State.PARTIAL], b"tool", 0o777, NOBODY)
    await write(spool, h, 0, b"#!/bin/sh\n")
    reads = []
    get = spool.r.get
    monkeypatch.setattr(spool.r, "get", lambda i: reads.append(i) or get(i))
    await write(spool, h, 10, b"one\n")
    assert reads == [], "a write read the mode though no mode changed"

    await spool.setattr(e.id, mode=0o6777, who=Who())  # a chmod here, by root
    await write(spool, h, 14, b"two\n")
    assert mode(spool, e.id) == 0o777

    def elsewhere(tx: WriteTx) -> None:  # another host's chmod, seen through the store
        tx.update(e.id, mode=stat.S_IFREG | 0o4777)

    await spool.tx(elsewhere)
    spool.changed_elsewhere([e.id])
    await write(spool, h, 18, b"three\n")
    assert mode(spool, e.id) == 0o777
    await spool.close(h, NOBODY)
    assert content(spool, e.id) == b"#!/bin/sh\none\ntwo\nthree\n"


async def test_an_opener_that_may_keep_them_keeps_them(env: tuple[Spool, Q]) -> None:
    spool, q = env
    root = Who(0, 0, 2**22 + 4243)  # gone, uid 0: root may
    e, h = await spool.create(q[State.PARTIAL], b"tool", 0o6777, root)
    await write(spool, h, 0, b"#!/bin/sh\n")
    assert mode(spool, e.id) == 0o6777
    assert not h.checks_setid  # asked once: never again for this handle
    await spool.close(h, root)


@pytest.mark.parametrize("into", [State.READY, State.PARTIAL])
async def test_a_new_upload_reads_no_mode_at_its_first_write(
        env: tuple[Spool, Q], monkeypatch: pytest.MonkeyPatch, into: State) -> None:
    """A new upload's mode is the one it was made with until a mode may have changed (a
    chmod here, a change seen from another host), so its first write reads no row (a query
    less per ``cp``, a round trip on a database server). A chmod here before that write, or
    set-ID bits it was made with, still go at it."""
    spool, q = env
    e, h = await spool.create(q[into], b"tool", 0o777, NOBODY)
    reads: list[int] = []
    get = spool.r.get
    monkeypatch.setattr(spool.r, "get", lambda i: reads.append(i) or get(i))
    await write(spool, h, 0, b"#!/bin/sh\n")
    assert reads == [], "the first write read the mode of a file nobody else can open"
    monkeypatch.undo()

    await spool.setattr(e.id, mode=0o6777, who=Who())  # through the descriptor, by root
    await write(spool, h, 10, b"one\n")
    assert mode(spool, e.id) == 0o777
    await spool.close(h, NOBODY)
    assert content(spool, e.id) == b"#!/bin/sh\none\n"

    e2, h2 = await spool.create(q[into], b"tool2", 0o4777, NOBODY)
    await write(spool, h2, 0, b"x")
    assert mode(spool, e2.id) == 0o777
    await spool.close(h2, NOBODY)
