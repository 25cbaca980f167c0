"""The lock pyfuse3's request loop waits under (fuse/session.py), driven by a copy of that loop
(pyfuse3 3.5, internal.pxi: ``_session_loop`` and ``_wait_fuse_readable``) over a socket pair
standing for ``/dev/fuse``: a handler that never blocks keeps one task serving every request;
one that blocks hands the reading over, so that a request it waits for is still read."""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pyfuse3
import pytest
import trio
import trio.lowlevel

from spoolfs.fuse import session
from spoolfs.fuse.session import ReaderLock

Handler = Callable[[bytes], Awaitable[None]]


class Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.of: Counter[trio.lowlevel.Task] = Counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.of[task] += 1


class Loop:
    """pyfuse3's loop, line for line but for the buffer handling (``exited`` stands for
    ``fuse_session_exited``, ``terminate`` for ``pyfuse3.terminate``)."""

    def __init__(self, lock: Any, fd: socket.socket, handler: Handler) -> None:
        self.lock, self.fd, self.handler = lock, fd, handler
        self.active_readers = 0
        self.task_count = 0
        self.exited = False
        self.handled_by: Counter[trio.lowlevel.Task] = Counter()
        self.tasks: set[trio.lowlevel.Task] = set()

    def terminate(self) -> None:
        self.exited = True
        trio.lowlevel.notify_closing(self.fd)

    async def _wait_readable(self) -> bool:
        self.active_readers += 1
        try:
            async with self.lock:
                if self.exited:
                    return False
                await trio.lowlevel.wait_readable(self.fd)
        except trio.ClosedResourceError:
            return False
        finally:
            self.active_readers -= 1
        return True

    async def run(self, nursery: trio.Nursery, min_tasks: int = 1, max_tasks: int = 99) -> None:
        me = trio.lowlevel.current_task()
        self.tasks.add(me)
        while not self.exited:
            if self.active_readers > min_tasks:
                break
            if not await self._wait_readable():
                break
            request = self.fd.recv(1)
            if not self.active_readers and self.task_count < max_tasks:
                self.task_count += 1
                nursery.start_soon(self.run, nursery, min_tasks, max_tasks)
            if not request:
                break
            self.handled_by[me] += 1
            await self.handler(request)
        self.task_count -= 1


Client = Callable[[socket.socket, Loop], Awaitable[None]]


async def serve(lock: Any, handler: Handler, client: Client) -> Loop:
    """Run the loop until ``client`` returns; then cancel it, unless the client terminated it
    (then every task must end by itself)."""
    theirs, ours = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    loop = Loop(lock, ours, handler)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                loop.task_count = 1
                nursery.start_soon(loop.run, nursery)
                await client(theirs, loop)
                if not loop.exited:
                    nursery.cancel_scope.cancel()
    finally:
        ours.close()
        theirs.close()
    return loop


def handover_lock() -> ReaderLock:
    """A lock with its hand-over, for the rest of this trio run (each test has its own)."""
    lock = ReaderLock()
    trio.lowlevel.add_instrument(session._Handover(lock))
    return lock


async def _sequential(fd: socket.socket, replies: trio.MemoryReceiveChannel[bytes],
                      n: int) -> None:
    for _ in range(n):
        fd.send(b"r")
        assert await replies.receive() == b"r"


@pytest.mark.parametrize("handover", [False, True], ids=["trio.Lock", "ReaderLock"])
async def test_requests_that_never_block_are_served_by_one_task(handover: bool) -> None:
    lock = handover_lock() if handover else trio.Lock()
    steps = Steps()
    trio.lowlevel.add_instrument(steps)
    send, receive = trio.open_memory_channel[bytes](10)

    async def handler(request: bytes) -> None:
        send.send_nowait(request)

    loop = await serve(lock, handler, lambda fd, _: _sequential(fd, receive, 200))
    assert sum(loop.handled_by.values()) == 200 and len(loop.tasks) == 2
    idle = min(loop.tasks, key=lambda t: loop.handled_by[t])
    if handover:  # the second task, made at the first request, waits and is never woken
        assert loop.handled_by[idle] == 0
        assert steps.of[idle] <= 2
    else:  # every release wakes the other task: they take turns
        assert loop.handled_by[idle] >= 99
        assert steps.of[idle] >= 200


async def _w_waits_for_s(lock: Any, rounds: int) -> Loop:
    """Request w waits for request s (as a flush waits for a release): with the reading kept
    by the task blocked in w, s would never be read. 20 plain requests first, so that one
    task serves and the other waits for the lock; 50 more after."""
    s_done = trio.Event()
    send, receive = trio.open_memory_channel[bytes](10)

    async def handler(request: bytes) -> None:
        nonlocal s_done
        if request == b"w":
            await s_done.wait()
        elif request == b"s":
            s_done.set()
            s_done = trio.Event()
        send.send_nowait(request)

    async def client(fd: socket.socket, _: Loop) -> None:
        await _sequential(fd, receive, 20)
        for _ in range(rounds):
            fd.send(b"w")
            await trio.sleep(0.01)
            fd.send(b"s")
            assert {await receive.receive(), await receive.receive()} == {b"w", b"s"}
        await _sequential(fd, receive, 50)

    loop = await serve(lock, handler, client)
    assert sum(loop.handled_by.values()) == 20 + 2 * rounds + 50
    assert len(loop.tasks) >= 2
    return loop


async def test_a_blocked_handler_hands_the_reading_over() -> None:
    lock = handover_lock()
    await _w_waits_for_s(lock, 3)


async def test_handlers_that_block_in_turn_never_lose_a_request() -> None:
    """Every handler sleeps a little: the tasks pass the reading round while 8 clients send."""
    lock = handover_lock()
    replies: list[bytes] = []

    async def handler(request: bytes) -> None:
        await trio.sleep(0.001)
        replies.append(request)

    async def client(fd: socket.socket, _: Loop) -> None:
        for i in range(400):
            fd.send(b"%d" % (i % 10))
            if i % 8 == 7:
                await trio.sleep(0.002)
        with trio.fail_after(5):
            while len(replies) < 400:
                await trio.sleep(0.01)

    loop = await serve(lock, handler, client)
    assert len(replies) == 400 and sum(loop.handled_by.values()) == 400


async def test_three_blocked_handlers_wait_for_a_later_request() -> None:
    lock = handover_lock()
    later = trio.Event()
    send, receive = trio.open_memory_channel[bytes](10)

    async def handler(request: bytes) -> None:
        if request == b"d":
            later.set()
        elif request in (b"a", b"b", b"c"):
            await later.wait()
        send.send_nowait(request)

    async def client(fd: socket.socket, _: Loop) -> None:
        await _sequential(fd, receive, 20)
        for request in (b"a", b"b", b"c", b"d"):
            fd.send(request)
            await trio.sleep(0.005)
        assert sorted([await receive.receive() for _ in range(4)]) == [b"a", b"b", b"c", b"d"]
        await _sequential(fd, receive, 20)

    loop = await serve(lock, handler, client)
    assert len(loop.tasks) >= 4  # a task blocked in each of a, b, c; one read d


async def test_terminate_ends_every_task_blocked_or_waiting() -> None:
    """pyfuse3.terminate while tasks wait for the lock and others are blocked in handlers:
    the blocked ones finish, and every task leaves the loop by itself."""
    lock = handover_lock()
    go_on = trio.Event()
    send, receive = trio.open_memory_channel[bytes](10)

    async def handler(request: bytes) -> None:
        if request == b"w":
            await go_on.wait()
        send.send_nowait(request)

    async def client(fd: socket.socket, loop: Loop) -> None:
        await _sequential(fd, receive, 20)
        fd.send(b"w")
        fd.send(b"w")
        await trio.testing.wait_all_tasks_blocked()
        assert loop.task_count >= 3
        loop.terminate()
        await trio.testing.wait_all_tasks_blocked()
        go_on.set()

    loop = await serve(lock, handler, client)
    assert loop.task_count == 0  # every task ended by itself, none was cancelled
    assert [receive.receive_nowait() for _ in range(2)] == [b"w", b"w"]


async def test_a_handler_that_raises_ends_the_loop_without_a_stall() -> None:
    """pyfuse3 lets a handler's exception end its main loop: the others must not hang."""
    lock = handover_lock()
    send, receive = trio.open_memory_channel[bytes](10)

    async def handler(request: bytes) -> None:
        if request == b"x":
            raise RuntimeError("handler failed")
        send.send_nowait(request)

    async def client(fd: socket.socket, _: Loop) -> None:
        await _sequential(fd, receive, 20)
        fd.send(b"x")
        await trio.sleep_forever()

    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="handler failed"),
                            flatten_subgroups=True):
        await serve(lock, handler, client)


def test_the_daemon_way_instruments_given_to_trio_run() -> None:
    """As daemon.py does it: the instrument passed to ``trio.run``."""
    lock = ReaderLock()
    trio.run(_w_waits_for_s, lock, 1, instruments=[session._Handover(lock)])


async def test_tasks_waiting_for_the_lock_end_when_cancelled() -> None:
    lock = handover_lock()

    async def hold() -> None:
        async with lock:
            await trio.sleep_forever()

    async def wait() -> None:
        async with lock:
            raise AssertionError("the lock is held")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(3):
            nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    async with lock:  # free again: nobody left waiting or holding
        pass


def test_install_gives_pyfuse3_trio_with_one_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pyfuse3, "trio", trio, raising=False)
    first = session.install()
    shim = pyfuse3.trio  # type: ignore[attr-defined]
    assert shim is not trio and len(first) == 1
    assert shim.lowlevel is trio.lowlevel and shim.ClosedResourceError is trio.ClosedResourceError
    assert shim.open_nursery is trio.open_nursery
    assert shim.Lock() is shim.Lock()
    again = session.install()  # a second session in the process: the same lock, handed over
    assert pyfuse3.trio is shim and len(again) == 1  # type: ignore[attr-defined]
    assert again[0].lock is shim.Lock()  # type: ignore[attr-defined]


def test_install_leaves_pyfuse3_alone_when_it_does_not_run_on_trio(
        monkeypatch: pytest.MonkeyPatch) -> None:
    other = object()
    monkeypatch.setattr(pyfuse3, "trio", other, raising=False)
    assert session.install() == []
    assert pyfuse3.trio is other  # type: ignore[attr-defined]
