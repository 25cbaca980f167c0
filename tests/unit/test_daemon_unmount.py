"""What an unmount waits for: recovery's walk of the blob files (daemon.end_sweep)."""

from __future__ import annotations

import threading

import trio

from spoolfs.daemon import end_sweep


async def walker(done: trio.Event, stop: threading.Event, pages: int) -> None:
    """A walk of ``pages`` pages that looks at ``stop`` between them, as gc's does."""
    for _ in range(pages):
        if stop.is_set():
            break
        await trio.sleep(0.01)
    done.set()


async def test_an_unmount_waits_for_a_short_walk() -> None:
    done, stop = trio.Event(), threading.Event()
    async with trio.open_nursery() as n:
        n.start_soon(walker, done, stop, 5)
        await end_sweep(done, stop, wait_s=60)
    assert done.is_set() and not stop.is_set()


async def test_an_unmount_stops_a_long_walk_at_its_next_page() -> None:
    done, stop = trio.Event(), threading.Event()
    async with trio.open_nursery() as n:
        n.start_soon(walker, done, stop, 1_000_000)
        with trio.fail_after(30):
            await end_sweep(done, stop, wait_s=0.05)
    assert done.is_set() and stop.is_set()
