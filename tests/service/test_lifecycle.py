"""The lifecycle (DESIGN §4) on a real store in tmp_path, with a fake clock and no kernel:
leases, attempts, retries with backoff, abandonment, retention, and two daemons on one store.
Every test ends with fsck clean."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from helpers.spool import Q, copies, entries_read
from spoolfs.core import policy as P
from spoolfs.core.errors import Invalid, NoAttribute, NotFound, SpoolError
from spoolfs.core.policy import NS
from spoolfs.core.rules import State
from spoolfs.service import lifecycle
from spoolfs.service.content import INLINE_MAX
from spoolfs.service.fsck import Fsck
from spoolfs.service.lifecycle import Lifecycle
from spoolfs.service.spool import Spool, Who
from spoolfs.store.base import Entry
from spoolfs.store.registry import open_store as open_any
from spoolfs.store.site import Place, place_of
from spoolfs.store.sqlite import open_store

WHO = Who(0, 0, 1)
T0 = 1_700_000_000 * NS
MIN = 60 * NS


class Clock:
    """A fake clock: nanoseconds that only move when the test says so."""

    def __init__(self, t: int = T0) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t

    def advance(self, ns: int) -> int:
        self.t += ns
        return self.t


@dataclass
class Env:
    spool: Spool
    q: Q
    clock: Clock
    lc: Lifecycle
    path: str

    async def policy(self, **values: str) -> None:
        await set_policy(self.spool, self.q.id, **values)

    async def view(self, name: bytes = b"w") -> int:
        return (await self.spool.mkdir(self.q[State.WORKING], name, 0o755, WHO)).id


async def set_policy(spool: Spool, qid: int, **values: str) -> None:
    canonical = P.parse_assignments([f"{k}={v}" for k, v in values.items()])
    await spool.tx(lambda tx: tx.set_policy(qid, canonical))
    spool.policies.refresh()


@pytest.fixture(params=["sqlite", "memory"])
async def env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Env]:
    engine = request.param
    store = open_any(str(tmp_path) if engine == "sqlite" else "memory:")
    clock = Clock()
    spool = Spool(store, str(tmp_path), clock=clock)
    async with trio.open_nursery() as n:
        await n.start(spool.committer.run)
        qe = await spool.mkdir(1, b"q", 0o755, WHO)
        yield Env(spool, Q(spool, qe.id), clock, Lifecycle(spool), str(tmp_path))
        spool.committer.close()
    store.close()
    if engine == "sqlite":
        assert Fsck(str(tmp_path)).run() == []


async def upload(spool: Spool, d: int, name: bytes, data: bytes = b"x") -> int:
    e, h = await spool.create(d, name, 0o644, WHO)
    spool.write(h, 0, data)
    await spool.close(h, WHO)
    return e.id


async def claim(spool: Spool, q: Q, view: int, name: bytes) -> Entry:
    await spool.rename(q[State.READY], name, view, name, 0, WHO)
    return spool.lookup(view, name)


def names(spool: Spool, d: int) -> set[bytes]:
    return {e.name for e in spool.listdir(d)}


def actions(spool: Spool, mid: int) -> list[str]:
    return [h[1] for h in spool.r.history(mid)]


def attr(spool: Spool, mid: int, key: bytes) -> bytes:
    return spool.getxattr(spool.get(mid), b"user.spool." + key)


# ---- leases -----------------------------------------------------------------------------------

async def test_claim_starts_a_lease_and_counts_an_attempt(env: Env) -> None:
    spool, q, clock = env.spool, env.q, env.clock
    await env.policy(lease_timeout="10s")
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    e = await claim(spool, q, w, b"f")
    assert e.id == mid and e.state is State.WORKING and e.attempts == 1
    assert e.lease_ns == clock() + 10 * NS and e.claimed_ns == clock()
    assert b"user.spool.lease_expires" in spool.xattr_names(e)


async def test_default_lease_is_ten_minutes(env: Env) -> None:
    spool, q, clock = env.spool, env.q, env.clock
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    assert (await claim(spool, q, w, b"f")).lease_ns == clock() + 10 * MIN
    clock.advance(10 * MIN - 1)
    await env.lc.step()
    assert spool.get(mid).state is State.WORKING
    clock.advance(1)
    assert await env.lc.expire_leases() == 1
    assert spool.get(mid).state is State.ERROR


async def test_expired_lease_goes_to_error_then_back_to_ready(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s")
    mid = await upload(spool, q[State.READY], b"f", b"payload")
    w = await env.view()
    await claim(spool, q, w, b"f")
    clock.advance(9 * NS)
    await lc.step()
    assert spool.get(mid).state is State.WORKING and names(spool, w) == {b"f"}

    clock.advance(2 * NS)
    assert await lc.expire_leases() == 1
    e = spool.get(mid)
    assert e.state is State.ERROR and e.parent == q[State.ERROR] and e.name == b"f"
    assert e.error == b"lease expired" and attr(spool, mid, b"error") == b"lease expired"
    assert e.lease_ns is None and e.consumer is None and e.attempts == 1
    assert e.retry_ns == clock() and not e.abandoned  # backoff 0: due now
    assert names(spool, w) == set() and names(spool, q[State.ERROR]) == {b"f"}
    # the fence: the stale holder's later mv fails with ENOENT and changes nothing
    with pytest.raises(NotFound):
        await spool.rename(w, b"f", q[State.SUCCESS], b"f", 0, WHO)
    assert names(spool, q[State.SUCCESS]) == set()

    assert await lc.send_retries() == 1
    e = spool.get(mid)
    assert e.state is State.READY and e.parent == q[State.READY] and e.name == b"f"
    assert e.retry_ns is None and e.attempts == 1 and not e.abandoned and e.lease_ns is None
    assert actions(spool, mid) == ["publish", "claim", "expire", "retry"]
    assert lc.expired == 1 and lc.retried == 1
    assert await lc.expire_leases() == 0 and await lc.send_retries() == 0  # nothing twice


async def test_a_retried_message_finished_in_success_has_no_error(env: Env) -> None:
    """The failure reason stays with a retried message in ready/ (why it came back), but a
    message that then succeeds shows none in success/: finishing to success clears it."""
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s")
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    await claim(spool, q, w, b"f")
    clock.advance(10 * NS)
    await lc.step()  # expired, then retried at once (backoff 0)
    assert spool.get(mid).state is State.READY and attr(spool, mid, b"error") == b"lease expired"
    await claim(spool, q, w, b"f")
    await spool.rename(w, b"f", q[State.SUCCESS], b"f", 0, WHO)
    e = spool.get(mid)
    assert e.state is State.SUCCESS and e.error is None
    with pytest.raises(NoAttribute):
        attr(spool, mid, b"error")
    assert b"user.spool.error" not in spool.xattr_names(e)


async def test_one_step_expires_and_retries_with_zero_backoff(env: Env) -> None:
    spool, q, clock = env.spool, env.q, env.clock
    await env.policy(lease_timeout="10s")
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    await claim(spool, q, w, b"f")
    clock.advance(10 * NS)
    await env.lc.step()
    assert spool.get(mid).state is State.READY
    assert names(spool, q[State.READY]) == {b"f"} and names(spool, q[State.ERROR]) == set()
    e = await claim(spool, q, w, b"f")
    assert e.attempts == 2


async def test_touch_extends_the_lease(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s")
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    await claim(spool, q, w, b"f")
    for _ in range(5):  # a shell heartbeat every 8 s keeps it well past 10 s
        clock.advance(8 * NS)
        e = await spool.setattr(mid, mtime_ns=clock(), who=WHO)
        assert e.lease_ns == clock() + 10 * NS and e.mtime_ns == clock()
        await lc.step()
        assert spool.get(mid).state is State.WORKING
    clock.advance(9 * NS)
    await lc.step()
    assert spool.get(mid).state is State.WORKING
    clock.advance(1 * NS)
    assert await lc.expire_leases() == 1
    assert spool.get(mid).error == b"lease expired"


async def test_touch_never_shortens_a_lease(env: Env) -> None:
    spool, q, clock = env.spool, env.q, env.clock
    await env.policy(lease_timeout="10m")
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    lease = (await claim(spool, q, w, b"f")).lease_ns
    await env.policy(lease_timeout="10s")  # shortened while claimed
    clock.advance(NS)
    assert (await spool.setattr(mid, mtime_ns=clock(), who=WHO)).lease_ns == lease


async def test_touch_outside_working_sets_no_lease(env: Env) -> None:
    spool, q = env.spool, env.q
    mid = await upload(spool, q[State.READY], b"f")
    e = await spool.setattr(mid, mtime_ns=env.clock() + 5, who=WHO)
    assert e.lease_ns is None and e.state is State.READY


async def test_open_handle_keeps_the_lease_across_steps(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s")
    mid = await upload(spool, q[State.READY], b"f", b"data")
    w = await env.view()
    await claim(spool, q, w, b"f")
    h = await spool.open(mid, False, False, WHO)
    assert spool.holds(mid)
    for _ in range(12):  # a minute, far past the 10 s lease, in ticks shorter than it
        clock.advance(4 * NS)
        await lc.step()
        e = spool.get(mid)
        assert e.state is State.WORKING and e.lease_ns is not None and e.lease_ns > clock()
    clock.advance(30 * NS)  # even a long stall of the timer: the holder keeps it
    await lc.step()
    assert spool.get(mid).state is State.WORKING
    await spool.close(h, WHO)
    assert not spool.holds(mid)
    closed = clock()
    assert spool.get(mid).lease_ns == closed + 10 * NS  # the timeout counts from the close
    clock.advance(9 * NS)
    await lc.step()
    assert spool.get(mid).state is State.WORKING
    clock.advance(1 * NS)
    assert await lc.expire_leases() == 1
    assert spool.get(mid).state is State.ERROR
    assert actions(spool, mid).count("expire") == 1


async def test_handover_keeps_the_lease(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s")
    mid = await upload(spool, q[State.READY], b"f")
    w1, w2 = await env.view(b"w1"), await env.view(b"w2")
    lease = (await claim(spool, q, w1, b"f")).lease_ns
    clock.advance(5 * NS)
    await spool.rename(w1, b"f", w2, b"f", 0, WHO)
    e = spool.get(mid)
    assert e.consumer == "w2" and e.lease_ns == lease and e.attempts == 1
    clock.advance(5 * NS)
    await lc.step()
    assert names(spool, w2) == set()
    assert actions(spool, mid)[-2:] == ["expire", "retry"]


async def test_release_and_finish_end_the_lease(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s")
    a = await upload(spool, q[State.READY], b"a")
    b = await upload(spool, q[State.READY], b"b")
    w = await env.view()
    await claim(spool, q, w, b"a")
    await claim(spool, q, w, b"b")
    await spool.rename(w, b"a", q[State.READY], b"a", 0, WHO)  # release
    await spool.rename(w, b"b", q[State.SUCCESS], b"b", 0, WHO)  # finish
    assert spool.get(a).lease_ns is None and spool.get(b).lease_ns is None
    clock.advance(MIN)
    await lc.step()
    assert spool.get(a).state is State.READY and spool.get(b).state is State.SUCCESS
    assert lc.expired == 0
    assert "expire" not in actions(spool, a) + actions(spool, b)


async def test_a_read_renews_the_lease_once_half_is_gone(env: Env) -> None:
    spool, q, clock = env.spool, env.q, env.clock
    await env.policy(lease_timeout="10s")
    mid = await upload(spool, q[State.READY], b"f", b"data")
    w = await env.view()
    lease = (await claim(spool, q, w, b"f")).lease_ns
    h = await spool.open(mid, False, False, WHO)
    try:
        clock.advance(4 * NS)
        await spool.reading(h)  # 6 s of 10 left: not yet
        assert spool.get(mid).lease_ns == lease
        h.lease_checked = 0.0  # (reads look at the lease at most once a real second)
        clock.advance(2 * NS)
        await spool.reading(h)  # 4 s left: renewed to a full lease from now
        assert spool.get(mid).lease_ns == clock() + 10 * NS
    finally:
        await spool.close(h, WHO)


async def test_a_claimed_message_read_right_away_reads_its_row_once(env: Env) -> None:
    """A consumer's open, read and close: the open's row shows that neither the first read
    nor the close has a lease to renew (a lease only grows while claimed), so neither reads
    the row again (each read is a round trip to a database server)."""
    spool, q = env.spool, env.q
    await env.policy(lease_timeout="10s")
    mid = await upload(spool, q[State.READY], b"f", b"data")
    w = await env.view()
    lease = (await claim(spool, q, w, b"f")).lease_ns
    with entries_read() as read:
        h = await spool.open(mid, False, False, WHO)
        try:
            assert h.read(0, 10) == b"data"
            await spool.reading(h)
        finally:
            await spool.close(h, WHO)
    assert read == [1]  # the open's
    assert spool.get(mid).lease_ns == lease


async def test_the_kernel_is_told_of_every_automatic_move(env: Env) -> None:
    """``on_gone`` (the FUSE layer drops the cached name) for each name the timer takes away:
    an expiry's working/ name, a retry's error/ name, a purge's name; and for each name it
    makes appear (a kernel may hold it as absent): the expiry's error/ name, the retry's
    ready/ name."""
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    gone: list[tuple[int, bytes]] = []
    spool.on_gone = lambda parent, name: gone.append((parent, name))
    await env.policy(lease_timeout="10s", retry_backoff="1m", error_retention="1h")
    w = await env.view()
    await upload(spool, q[State.READY], b"f")
    await claim(spool, q, w, b"f")
    clock.advance(10 * NS)
    await lc.expire_leases()
    assert gone == [(w, b"f"), (q[State.ERROR], b"f")]
    gone.clear()
    clock.advance(MIN)
    assert await lc.send_retries() == 1
    assert names(spool, q[State.ERROR]) == set()
    assert gone == [(q[State.ERROR], b"f"), (q[State.READY], b"f")], \
        f"the retry left error/f cached, or ready/f absent: {gone}"
    gone.clear()
    await claim(spool, q, w, b"f")
    await spool.rename(w, b"f", q[State.ERROR], b"f", 0, WHO)
    clock.advance(3601 * NS)
    assert await lc.purge() == 1
    assert gone == [(q[State.ERROR], b"f")]


async def test_a_bad_stored_policy_value_falls_back_to_the_default(env: Env) -> None:
    """A value written by another tool that this one refuses is ignored (the default holds),
    the other keys still apply."""
    spool, q = env.spool, env.q
    await spool.tx(lambda tx: tx.set_policy(q.id, {"max_attempts": "zero", "colour": "red",
                                                   "lease_timeout": "20s"}))
    spool.policies.refresh()
    p = spool.policies.of(q.id)
    assert p.max_attempts == 5 and p.lease_timeout == 20 * NS


# ---- attempts, backoff, abandonment ---------------------------------------------------------

async def test_retry_waits_for_the_backoff_doubling(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s", retry_backoff="30s", retry_backoff_max="1m")
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    for attempt, wait in ((1, 30), (2, 60), (3, 60)):
        e = await claim(spool, q, w, b"f")
        assert e.attempts == attempt
        clock.advance(10 * NS)
        await lc.step()
        e = spool.get(mid)
        assert e.state is State.ERROR and e.retry_ns == clock() + wait * NS
        assert b"user.spool.retry_at" in spool.xattr_names(e)
        clock.advance(wait * NS - 1)
        await lc.step()
        assert spool.get(mid).state is State.ERROR
        clock.advance(1)
        await lc.step()
        assert spool.get(mid).state is State.READY


async def test_abandoned_after_max_attempts_until_redriven(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s", max_attempts="3")
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    for n in (1, 2, 3):
        assert (await claim(spool, q, w, b"f")).attempts == n
        clock.advance(11 * NS)
        await lc.step()
    e = spool.get(mid)
    assert e.state is State.ERROR and e.abandoned and e.retry_ns is None and e.attempts == 3
    assert attr(spool, mid, b"abandoned") == b"1" and attr(spool, mid, b"attempts") == b"3"
    clock.advance(365 * 86400 * NS)  # it stays, whatever the wait
    await lc.step()
    assert spool.get(mid).state is State.ERROR and names(spool, q[State.READY]) == set()
    assert actions(spool, mid) == ["publish"] + ["claim", "expire", "retry"] * 2 + [
        "claim", "expire"]
    history = spool.history_text(mid)
    assert "abandoned" in history and "attempt 3 of 3" in history

    await spool.rename(q[State.ERROR], b"f", q[State.READY], b"f", 0, WHO)  # redrive
    e = spool.get(mid)
    assert e.state is State.READY and e.attempts == 0 and not e.abandoned and e.error is None
    assert b"user.spool.abandoned" not in spool.xattr_names(e)
    assert (await claim(spool, q, w, b"f")).attempts == 1


async def test_explicit_error_is_final_by_default(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    await claim(spool, q, w, b"f")
    await spool.setxattr(spool.get(mid), b"user.spool.error", b"bad input", WHO)
    await spool.rename(w, b"f", q[State.ERROR], b"f", 0, WHO)
    e = spool.get(mid)
    assert e.retry_ns is None and not e.abandoned and e.error == b"bad input"
    clock.advance(7 * 86400 * NS)
    await lc.step()
    assert spool.get(mid).state is State.ERROR and lc.retried == 0


async def test_explicit_error_retries_when_retry_errors_on(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(retry_errors="on", max_attempts="2", retry_backoff="5s")
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    await claim(spool, q, w, b"f")
    await spool.rename(w, b"f", q[State.ERROR], b"f", 0, WHO)
    assert spool.get(mid).retry_ns == clock() + 5 * NS
    clock.advance(5 * NS)
    await lc.step()
    assert spool.get(mid).state is State.READY and spool.get(mid).attempts == 1
    await claim(spool, q, w, b"f")
    await spool.rename(w, b"f", q[State.ERROR], b"f", 0, WHO)
    e = spool.get(mid)  # the second of two attempts: out of attempts
    assert e.abandoned and e.retry_ns is None
    clock.advance(MIN)
    await lc.step()
    assert spool.get(mid).state is State.ERROR


async def test_attempts_never_exceed_max_in_working(env: Env) -> None:
    """A claim counts an attempt; a message with none left is never in working/ again.
    Releasing (giving back unprocessed) must not let a message be claimed more than
    max_attempts times between two redrives."""
    spool, q = env.spool, env.q
    await env.policy(max_attempts="2")
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    for _ in range(3):
        e = await claim(spool, q, w, b"f")
        assert e.attempts <= 2, f"claimed with attempts={e.attempts} > max_attempts=2"
        await spool.rename(w, b"f", q[State.READY], b"f", 0, WHO)  # release
    assert spool.get(mid).state is State.READY


async def test_policy_set_as_xattr_takes_effect(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    qe = spool.get(q.id)
    await spool.setxattr(qe, b"user.spool.policy.lease_timeout", b"20", WHO)
    assert spool.getxattr(qe, b"user.spool.policy.lease_timeout") == b"20s"
    with pytest.raises(Invalid):
        await spool.setxattr(qe, b"user.spool.policy.max_attempts", b"0", WHO)
    assert spool.getxattr(qe, b"user.spool.policy.max_attempts") == b"5"
    mid = await upload(spool, q[State.READY], b"f")
    w = await env.view()
    assert (await claim(spool, q, w, b"f")).lease_ns == clock() + 20 * NS
    clock.advance(20 * NS)
    await lc.step()
    assert spool.get(mid).state is State.READY


async def test_policy_too_large_for_the_store_is_refused_or_works(env: Env) -> None:
    """A lease of 10^10 s (an operator's typo) either is refused when set, with a clear
    message, or claims keep working: never an internal error on every claim."""
    spool, q = env.spool, env.q
    try:
        await env.policy(lease_timeout="10000000000")
    except Invalid:
        return
    await upload(spool, q[State.READY], b"f")
    w = await env.view()
    try:
        e = await claim(spool, q, w, b"f")
    except SpoolError as err:
        pytest.fail(f"lease_timeout=10000000000 was accepted, then the claim failed: {err!r}")
    assert e.state is State.WORKING


async def test_one_queue_with_a_huge_backoff_does_not_stall_expiry_elsewhere(env: Env) -> None:
    """Policies are per queue: a backoff beyond what the store can hold (accepted by
    ``queue set``) must not stop the timer for every other queue of the store."""
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    try:
        await env.policy(lease_timeout="10s", retry_backoff="1000000w",
                         retry_backoff_max="1000000w")
    except Invalid:
        return  # refused when set: nothing can stall
    q2 = Q(spool, (await spool.mkdir(1, b"q2", 0o755, WHO)).id)
    await set_policy(spool, q2.id, lease_timeout="10s")
    other = await upload(spool, q2[State.READY], b"g")
    w2 = (await spool.mkdir(q2[State.WORKING], b"w", 0o755, WHO)).id
    await claim(spool, q2, w2, b"g")
    await upload(spool, q[State.READY], b"f")
    await claim(spool, q, await env.view(), b"f")
    clock.advance(10 * NS)
    failure = None
    try:
        await lc.step()
    except SpoolError as err:
        failure = err
    assert spool.get(other).state is not State.WORKING, \
        f"q2's lease ran out but it stayed in working/: the round failed with {failure!r}"
    assert failure is None


# ---- retention --------------------------------------------------------------------------------

async def test_retention_purges_and_frees_content(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(success_retention="1h", error_retention="1d")
    big = os.urandom(INLINE_MAX * 2)
    w = await env.view()
    s = await upload(spool, q[State.READY], b"s", big)
    e = await upload(spool, q[State.READY], b"e", os.urandom(INLINE_MAX * 2))
    await claim(spool, q, w, b"s")
    await claim(spool, q, w, b"e")
    await spool.rename(w, b"s", q[State.SUCCESS], b"s", 0, WHO)
    await spool.rename(w, b"e", q[State.ERROR], b"e", 0, WHO)
    assert len(list(spool.content.blobs.walk())) == 2

    clock.advance(3600 * NS)
    assert await lc.purge() == 0  # exactly the retention: not older yet
    clock.advance(1)
    assert await lc.purge() == 1
    with pytest.raises(NotFound):
        spool.get(s)
    assert names(spool, q[State.SUCCESS]) == set() and spool.r.history(s) == []
    assert len(list(spool.content.blobs.walk())) == 1  # the purged message's blob file is gone
    assert spool.get(e).state is State.ERROR

    clock.advance(86400 * NS)
    await lc.step()  # the timer purges too
    with pytest.raises(NotFound):
        spool.get(e)
    assert list(spool.content.blobs.walk()) == [] and lc.purged == 2


async def test_retention_keeps_shared_content_and_pending_retries(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(success_retention="1m", error_retention="1m", retry_backoff="1h",
                     retry_backoff_max="1h", lease_timeout="10s")
    data = os.urandom(INLINE_MAX * 2)
    w = await env.view()
    a = await upload(spool, q[State.READY], b"a", data)
    await claim(spool, q, w, b"a")
    await spool.rename(w, b"a", q[State.SUCCESS], b"a", 0, WHO)
    b = (await spool.link(a, q[State.READY], b"b", WHO)).id  # fan-out shares the blob
    r = await upload(spool, q[State.READY], b"r")
    await claim(spool, q, w, b"r")
    clock.advance(10 * NS)
    await lc.step()  # r expires, retry due in an hour
    assert spool.get(r).state is State.ERROR and spool.get(r).retry_ns is not None
    clock.advance(2 * MIN)
    stale: list[int] = []
    spool.on_stale = stale.extend
    assert await lc.purge() == 1  # a only: r waits for its retry
    with pytest.raises(NotFound):
        spool.get(a)
    assert stale == [b]  # its link count fell: the kernel must ask again
    assert spool.nlink_of(spool.get(b)) == 1
    assert spool.get(r).state is State.ERROR
    assert len(list(spool.content.blobs.walk())) == 1  # b still holds the shared content
    h = spool.content.open(spool.r, spool.get(b), False)
    try:
        assert h.read(0, 1 << 30) == data
    finally:
        h.close()


async def test_retention_keeps_up_with_a_queue_faster_than_one_batch_a_sweep(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep deletes a batch (500) per transaction, and sweeps came every 5 s: a queue that
    finished more than 100 messages a second grew success/ without end. While a sweep finds
    a full batch, the next tick sweeps again."""
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    monkeypatch.setattr(lifecycle, "BATCH", 5)
    await env.policy(success_retention="1m")
    w = await env.view()
    first = await upload(spool, q[State.READY], b"m00")
    for i in range(1, 12):
        await spool.link(first, q[State.READY], b"m%02d" % i, WHO)
    for i in range(12):
        await claim(spool, q, w, b"m%02d" % i)
        await spool.rename(w, b"m%02d" % i, q[State.SUCCESS], b"m%02d" % i, 0, WHO)
    clock.advance(2 * MIN)
    left = []
    for _ in range(4):  # four ticks, 0.5 s apart: well within one 5 s sweep period
        await lc.step()
        left.append(len(names(spool, q[State.SUCCESS])))
        clock.advance(NS // 2)
    assert left == [7, 2, 0, 0]
    assert lc.purged == 12


async def test_retention_keeps_up_while_another_daemon_shares_the_batches(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two daemons on one store both sweep: each reads the same full batch and purges only
    what the other has not. A batch read full still means more may be due."""
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    monkeypatch.setattr(lifecycle, "BATCH", 5)
    await env.policy(success_retention="1m")
    w = await env.view()
    for name in await copies(spool, q[State.READY], 12):
        await claim(spool, q, w, name)
        await spool.rename(w, name, q[State.SUCCESS], name, 0, WHO)
    clock.advance(2 * MIN)
    seen = spool.r.finished_before(q.id, State.SUCCESS, clock(), 5)
    for e in seen[:2]:  # the other daemon's sweep got there first
        await spool.unlink(q[State.SUCCESS], e.name, WHO)
    read = spool.r.finished_before
    monkeypatch.setattr(spool.r, "finished_before", lambda *a: seen)
    await lc.step()
    monkeypatch.setattr(spool.r, "finished_before", read)
    assert len(names(spool, q[State.SUCCESS])) == 7 and lc.purged == 3
    clock.advance(NS // 2)
    await lc.step()  # 0.5 s later, not 5 s
    assert len(names(spool, q[State.SUCCESS])) == 2


async def test_default_retention_keeps_forever(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    w = await env.view()
    mids = [await upload(spool, q[State.READY], n) for n in (b"s", b"e")]
    await claim(spool, q, w, b"s")
    await claim(spool, q, w, b"e")
    await spool.rename(w, b"s", q[State.SUCCESS], b"s", 0, WHO)
    await spool.rename(w, b"e", q[State.ERROR], b"e", 0, WHO)
    await env.policy(lease_timeout="10m")  # stored settings, retention still the default
    clock.advance(100 * 365 * 86400 * NS)
    await lc.step()
    assert await lc.purge() == 0
    assert [spool.get(m).state for m in mids] == [State.SUCCESS, State.ERROR]


async def test_idle_views_are_found_without_reading_the_claims_beside_them(env: Env) -> None:
    """``idle_views``: the sweep looks at the views in working/, not at the claims in flight
    beside them (with 100,000 claims, reading them all held the mount for a second at every
    sweep)."""
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(idle_views="1m", lease_timeout="1d")
    idle, busy = await env.view(b"idle"), await env.view(b"busy")
    first, *rest = await copies(spool, q[State.READY], 200)
    await claim(spool, q, busy, first)
    for name in rest:
        await spool.rename(q[State.READY], name, q[State.WORKING], name, 0, WHO)
    clock.advance(2 * MIN)
    with entries_read() as read:
        assert await lc.remove_idle_views(q.id, clock() - MIN) == 1
    assert read[0] < 20, f"{read[0]} entries read to find 2 views beside 199 claims"
    assert names(spool, q[State.WORKING]) == {b"busy", *rest}
    with pytest.raises(NotFound):
        spool.get(idle)


# ---- names ------------------------------------------------------------------------------------

async def test_name_clash_in_error_gives_numbered_names(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s", retry_backoff="1h")
    w = await env.view()
    first = await upload(spool, q[State.READY], b"f", b"1")
    await claim(spool, q, w, b"f")
    await spool.rename(w, b"f", q[State.ERROR], b"f", 0, WHO)  # an explicit, final error
    expired = []
    for data in (b"2", b"3"):
        expired.append(await upload(spool, q[State.READY], b"f", data))
        await claim(spool, q, w, b"f")
        clock.advance(10 * NS)
        await lc.step()
    assert names(spool, q[State.ERROR]) == {b"f", b"f.~1~", b"f.~2~"}
    assert spool.get(first).name == b"f"  # never replaced
    assert [spool.get(m).name for m in expired] == [b"f.~1~", b"f.~2~"]


async def test_name_clash_in_ready_on_retry(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s", retry_backoff="1m")
    w = await env.view()
    old = await upload(spool, q[State.READY], b"f", b"old")
    await claim(spool, q, w, b"f")
    clock.advance(10 * NS)
    await lc.step()
    new = await upload(spool, q[State.READY], b"f", b"new")  # the name is free again
    clock.advance(MIN)
    await lc.step()
    assert names(spool, q[State.READY]) == {b"f", b"f.~1~"}
    assert spool.get(new).name == b"f" and spool.get(old).name == b"f.~1~"


async def test_long_name_clash_stays_within_name_max(env: Env) -> None:
    spool, q, clock, lc = env.spool, env.q, env.clock, env.lc
    await env.policy(lease_timeout="10s", retry_backoff="1h")
    w = await env.view()
    long = b"n" * 255
    await upload(spool, q[State.READY], long)
    await claim(spool, q, w, long)
    await spool.rename(w, long, q[State.ERROR], long, 0, WHO)
    mid = await upload(spool, q[State.READY], long)
    await claim(spool, q, w, long)
    clock.advance(10 * NS)
    await lc.step()
    name = spool.get(mid).name
    assert len(name) <= 255 and name.endswith(b".~1~") and name != long


# ---- two daemons on one store -----------------------------------------------------------------

@pytest.fixture(params=["sqlite", "postgresql"])
async def two(request: pytest.FixtureRequest, tmp_path: Path
              ) -> AsyncIterator[tuple[list[Spool], list[Lifecycle], Q, Clock]]:
    """Two daemons (two stores, two spools, two timers) on one store, one clock: a store
    directory, or a PostgreSQL database (where the two commit truly at once, in threads)."""
    clock = Clock()
    where: str | Place
    if request.param == "sqlite":
        stores = [open_store(str(tmp_path)) for _ in range(2)]
        where = str(tmp_path)
    else:
        url = request.getfixturevalue("pg_url")
        stores = [open_any(url) for _ in range(2)]
        where = place_of(url, stores[0], blobs=str(tmp_path / "blobs"),
                         local_base=str(tmp_path / "local"))
    spools = [Spool(s, where, clock=clock) for s in stores]
    async with trio.open_nursery() as n:
        for sp in spools:
            await n.start(sp.committer.run)
        qe = await spools[0].mkdir(1, b"q", 0o755, WHO)
        await set_policy(spools[0], qe.id, lease_timeout="10s", max_attempts="3")
        for sp in spools:
            sp.policies.refresh()
        yield spools, [Lifecycle(sp) for sp in spools], Q(spools[1], qe.id), clock
        for sp in spools:
            sp.committer.close()
    for s in stores:
        s.close()
    assert Fsck(where).run() == []


def record_due(spool: Spool, method: str) -> list[int]:
    """Count what the timer found due (before its transaction's compare-and-set)."""
    seen: list[int] = []
    real = getattr(spool.r, method)

    def spy(*args: Any) -> Any:
        out = real(*args)
        seen.append(len(out))
        return out

    setattr(spool.r, method, spy)
    return seen


async def test_two_daemons_never_move_a_message_twice(two: Any) -> None:
    spools, lcs, q, clock = two
    a = spools[0]
    w = (await a.mkdir(q[State.WORKING], b"w", 0o755, WHO)).id
    n = 20
    mids = [await upload(a, q[State.READY], b"m%d" % i) for i in range(n)]
    for i in range(n):
        await spools[i % 2].rename(q[State.READY], b"m%d" % i, w, b"m%d" % i, 0, WHO)
    seen_leases = [record_due(sp, "due_leases") for sp in spools]
    seen_retries = [record_due(sp, "due_retries") for sp in spools]
    clock.advance(10 * NS)
    async with trio.open_nursery() as nursery:  # both timers fire in the same instant
        for lc in lcs:
            nursery.start_soon(lc.expire_leases)
    assert [s[-1] for s in seen_leases] == [n, n]  # both saw every lease due ...
    assert sum(lc.expired for lc in lcs) == n  # ... and each moved once
    async with trio.open_nursery() as nursery:
        for lc in lcs:
            nursery.start_soon(lc.send_retries)
    assert [s[-1] for s in seen_retries] == [n, n]
    assert sum(lc.retried for lc in lcs) == n
    for mid in mids:
        e = a.get(mid)
        assert e.state is State.READY and e.attempts == 1
        assert actions(a, mid) == ["publish", "claim", "expire", "retry"]
    assert names(a, q[State.READY]) == {b"m%d" % i for i in range(n)}  # no f.~1~ copies

    # then many rounds of both full timers, claims in between, until all are abandoned
    for _ in range(3):
        for i in range(n):
            name = b"m%d" % i
            if name in names(a, q[State.READY]):
                await spools[i % 2].rename(q[State.READY], name, w, name, 0, WHO)
        clock.advance(10 * NS)
        async with trio.open_nursery() as nursery:
            for lc in lcs:
                nursery.start_soon(lc.step)
    for mid in mids:
        e = a.get(mid)
        assert e.state is State.ERROR and e.abandoned and e.attempts == 3
        acts = actions(a, mid)
        assert acts.count("claim") == 3 and acts.count("expire") == 3
        assert acts.count("retry") == 2
    assert len(a.listdir(q[State.ERROR])) == n


async def test_a_handle_held_in_one_daemon_keeps_the_lease_in_both(two: Any) -> None:
    spools, lcs, q, clock = two
    a, b = spools
    w = (await a.mkdir(q[State.WORKING], b"w", 0o755, WHO)).id
    mid = await upload(a, q[State.READY], b"f")
    await b.rename(q[State.READY], b"f", w, b"f", 0, WHO)
    h = await a.open(mid, False, False, WHO)
    for _ in range(20):  # each timer ticks well within half a lease
        clock.advance(3 * NS)
        for lc in (lcs[1], lcs[0]):
            await lc.step()
        assert b.get(mid).state is State.WORKING
    await a.close(h, WHO)
    clock.advance(10 * NS)
    await lcs[1].step()
    assert b.get(mid).state is State.READY
    assert actions(b, mid).count("expire") == 1
