"""Subscribers and the duplicates policy (DESIGN §5) on a real store, without a kernel: each
publish applies them in its own transaction, all or none."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from helpers.spool import WHO, Q, content, running, upload
from spoolfs.core.errors import Exists, Invalid, NoSubscriber
from spoolfs.core.rules import State
from spoolfs.service.content import INLINE_MAX
from spoolfs.service.spool import Spool
from spoolfs.store.sqlite import open_store


class Env:
    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self.queues: dict[str, Q] = {}

    async def queue(self, name: str, **policy: str) -> Q:
        e = await self.spool.mkdir(1, name.encode(), 0o755, WHO)
        q = self.queues[name] = Q(self.spool, e.id)
        if policy:
            await self.policy(name, **policy)
        return q

    async def policy(self, name: str, **values: str) -> None:
        text = " ".join(f"{k}={v}" for k, v in values.items())
        await self.spool.setxattr(self.spool.get(self.queues[name].id), b"user.spool.policy",
                                  text.encode(), WHO)

    def names(self, queue: str, state: State) -> set[bytes]:
        return {e.name for e in self.spool.listdir(self.queues[queue][state])}

    async def publish(self, queue: str, name: bytes, data: bytes) -> int:
        q = self.queues[queue]
        mid = await upload(self.spool, q[State.PARTIAL], name, data)
        await self.spool.rename(q[State.PARTIAL], name, q[State.READY], name, 0, WHO)
        return mid


@pytest.fixture(params=["sqlite", "memory"])
async def env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Env]:
    async with running(tmp_path, request.param) as spool:
        yield Env(spool)


@pytest.mark.parametrize("size", [10, INLINE_MAX + 1])
async def test_publish_into_a_topic_lands_in_every_subscriber(env: Env, size: int) -> None:
    for s in ("a", "b", "c"):
        await env.queue(s)
    await env.queue("t", fanout="a,b,c")
    data = os.urandom(size)
    q = env.queues["t"]
    mid = await upload(env.spool, q[State.PARTIAL], b"m", data)
    await env.spool.setxattr(env.spool.get(mid), b"user.kind", b"invoice", WHO)
    await env.spool.rename(q[State.PARTIAL], b"m", q[State.READY], b"m", 0, WHO)

    assert env.names("t", State.READY) == set()
    assert env.names("t", State.SUCCESS) == {b"m"}
    blobs = set()
    for s in ("a", "b", "c"):
        e = env.spool.lookup(env.queues[s][State.READY], b"m")
        assert content(env.spool, e.id) == data
        assert env.spool.getxattr(e, b"user.kind") == b"invoice"
        assert e.enqueued_ns is not None
        blobs.add(e.blob)
    assert len(blobs) == 1 and env.spool.get(mid).blob in blobs  # shared, not copied
    assert env.spool.nlink_of(env.spool.get(mid)) == 4
    assert [h[1] for h in env.spool.r.history(mid)] == ["publish", "fanout"]


async def test_a_missing_subscriber_refuses_the_whole_publish(env: Env) -> None:
    await env.queue("a")
    await env.queue("t", fanout="a,nope")
    with pytest.raises(NoSubscriber, match="nope"):
        await env.publish("t", b"m", b"x")
    assert env.names("t", State.PARTIAL) == {b"m"}
    assert env.names("t", State.READY) == env.names("t", State.SUCCESS) == set()
    assert env.names("a", State.READY) == set(), "half of a fan-out was published"
    await env.queue("nope")
    q = env.queues["t"]
    await env.spool.rename(q[State.PARTIAL], b"m", q[State.READY], b"m", 0, WHO)
    assert env.names("a", State.READY) == env.names("nope", State.READY) == {b"m"}


async def test_chains_and_cycles(env: Env) -> None:
    await env.queue("leaf")
    await env.queue("mid", fanout="leaf")
    await env.queue("t", fanout="mid")
    await env.publish("t", b"m", b"chained")
    assert env.names("leaf", State.READY) == {b"m"}
    assert env.names("mid", State.SUCCESS) == {b"m"}
    with pytest.raises(Invalid, match="cycle"):
        await env.policy("leaf", fanout="t")
    assert env.spool.policies.of(env.queues["leaf"].id).fanout == ()


async def test_a_taken_name_in_a_subscriber_is_kept_apart(env: Env) -> None:
    await env.queue("a")
    await env.queue("t", fanout="a")
    await env.publish("a", b"m", b"already there")
    await env.publish("t", b"m", b"new")
    assert env.names("a", State.READY) == {b"m", b"m.~1~"}
    assert content(env.spool, env.spool.lookup(env.queues["a"][State.READY], b"m").id) == \
        b"already there"


async def test_duplicates_reject_and_skip(env: Env) -> None:
    await env.queue("r", duplicates="reject")
    await env.queue("s", duplicates="skip")
    await env.queue("k")
    for name in ("r", "s", "k"):
        await env.publish(name, b"one", b"same")
    with pytest.raises(Exists, match="duplicate"):
        await env.publish("r", b"two", b"same")
    assert env.names("r", State.PARTIAL) == {b"two"}

    orig = env.spool.lookup(env.queues["s"][State.READY], b"one")
    await env.publish("s", b"two", b"same")
    dup = env.spool.lookup(env.queues["s"][State.SUCCESS], b"two")
    assert dup.duplicate_of == orig.id
    assert env.spool.getxattr(dup, b"user.spool.duplicate_of") == \
        f"message {orig.id} (ready/one)".encode()

    await env.publish("k", b"two", b"same")  # allow: the default
    assert env.names("k", State.READY) == {b"one", b"two"}
    await env.publish("r", b"other", b"different")
    assert b"other" in env.names("r", State.READY)


async def test_duplicates_window(tmp_path: Path) -> None:
    now = [10**18]
    store = open_store(str(tmp_path))
    spool = Spool(store, str(tmp_path), clock=lambda: now[0])
    env = Env(spool)
    await env.queue("r", duplicates="reject", duplicates_window="10s")
    await env.publish("r", b"one", b"same")
    now[0] += 5 * 10**9
    with pytest.raises(Exists):
        await env.publish("r", b"two", b"same")
    now[0] += 6 * 10**9  # 11 s after the original: outside the window
    q = env.queues["r"]
    await spool.rename(q[State.PARTIAL], b"two", q[State.READY], b"two", 0, WHO)
    assert env.names("r", State.READY) == {b"one", b"two"}
    store.close()


async def test_a_refused_direct_publish_goes_to_partial(env: Env) -> None:
    await env.queue("t", fanout="nope")
    q = env.queues["t"]
    e, h = await env.spool.create(q[State.READY], b"up", 0o644, WHO)
    env.spool.write(h, 0, b"complete content")
    with pytest.raises(NoSubscriber):
        await env.spool.close(h, WHO)
    moved = env.spool.get(e.id)
    assert moved.state is State.PARTIAL and not moved.hidden
    assert content(env.spool, e.id) == b"complete content"
    assert "refused" in [h[1] for h in env.spool.r.history(e.id)]
