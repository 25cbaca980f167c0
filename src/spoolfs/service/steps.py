"""Reads as steps (``store.base.Steps``) driven by the event loop: the store yields the
descriptor it waits on, and the loop answers other requests until it is ready. A read that
never waits (the embedded store's) returns without giving the loop up, as a plain call.
"""

from __future__ import annotations

from typing import TypeVar

import trio

from spoolfs.store.base import WAIT_R, WAIT_W, Steps

T = TypeVar("T")


async def waited(steps: Steps[T]) -> T:
    """The value of ``steps``, the loop answering other requests while it waits. Cancelled,
    the steps are closed (the store drops what was under way)."""
    try:
        fd, wait = next(steps)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    try:
        while True:
            got = await _ready(fd, wait)
            fd, wait = steps.send(got)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        steps.close()  # (nothing left to close once it returned)


async def _ready(fd: int, wait: int) -> int:
    if wait == WAIT_R:
        await trio.lowlevel.wait_readable(fd)
        return WAIT_R
    if wait == WAIT_W:
        await trio.lowlevel.wait_writable(fd)
        return WAIT_W
    # Both (a statement longer than the socket's buffer: the server may answer while it is
    # still sent); whichever comes first.
    got = 0
    async with trio.open_nursery() as nursery:
        async def one(bit: int) -> None:
            nonlocal got
            await (trio.lowlevel.wait_readable if bit == WAIT_R
                   else trio.lowlevel.wait_writable)(fd)
            got |= bit
            nursery.cancel_scope.cancel()
        nursery.start_soon(one, WAIT_R)
        nursery.start_soon(one, WAIT_W)
    return got
