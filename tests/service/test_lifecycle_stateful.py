"""The lifecycle (DESIGN §4) as a state machine: random publishes, claims by several consumers,
finishes, releases, redrives, touches, open handles, clock jumps and timer rounds of one or two
daemons on one real store, checked after every step against a small model:

- no message is ever lost or present twice: every published message is in the tree exactly
  once, in the state the model expects, unless retention purged it (or a finished entry was
  replaced by a same-named one, which §3 allows);
- a timer round moves exactly what is due: expired leases not held open by that daemon go to
  ``error/`` (and straight back to ``ready/`` when the backoff is 0), due retries go to
  ``ready/``, and only finished messages past their retention are purged;
- attempts never exceed ``max_attempts`` in ``working/``; ``abandoned`` only in ``error/``;
  a lease only in ``working/`` (and every claimed message has one); the history records one
  claim per claim and one expire per expired lease.

Each rule runs its async calls with ``trio.run``; the committers are not started, so every
request commits directly (``Committer.submit`` before ``run``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from spoolfs.core import policy as P
from spoolfs.core.errors import Exists
from spoolfs.core.policy import NS
from spoolfs.core.rules import Action, State
from spoolfs.core.transitions import transition
from spoolfs.service.committer import Committer
from spoolfs.service.content import Handle
from spoolfs.service.fsck import Fsck
from spoolfs.service.lifecycle import Lifecycle
from spoolfs.service.spool import Spool, Who
from spoolfs.store.base import Entry
from spoolfs.store.sqlite import SqliteStore, open_store

WHO = Who(0, 0, 1)
T0 = 1_700_000_000 * NS
CONSUMERS = (b"c0", b"c1", b"c2")
SHM = "/dev/shm"
R = TypeVar("R")


def run(fn: Callable[[], Awaitable[R]]) -> R:
    return trio.run(fn)


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> int:
        return self.t


@dataclass
class M:
    """What the model knows of one message."""

    state: State
    attempts: int = 0
    claims: int = 0
    expires: int = 0


picks = st.integers(0, 1 << 16)


class LifecycleMachine(RuleBasedStateMachine):

    def __init__(self) -> None:
        super().__init__()
        # tmpfs when there is one: the store's fsyncs cost nothing there, which keeps the
        # hundreds of examples (and the shrinking of a failure) fast
        self.dir = tempfile.mkdtemp(prefix="spoolfs-lc-", dir=SHM if os.path.isdir(SHM) else None)
        self.clock = Clock()
        self.stores: list[SqliteStore] = []
        self.spools: list[Spool] = []
        self.lcs: list[Lifecycle] = []
        self.model: dict[int, M] = {}
        self.gone: set[int] = set()  # purged by retention or replaced by a finished namesake
        self.handles: list[tuple[int, int, Handle]] = []  # (daemon, entry id, handle)
        self.n = 0
        self.policy = P.DEFAULT
        self.qid = 0
        self.dirs: dict[State, int] = {}
        self.views: dict[bytes, int] = {}

    # ---- setup ------------------------------------------------------------------------------

    @initialize(
        daemons=st.sampled_from([1, 2]),
        lease=st.sampled_from(["5s", "10s", "30s"]),
        max_attempts=st.sampled_from(["1", "2", "3"]),
        backoff=st.sampled_from(["0", "0", "4s"]),
        retry_errors=st.sampled_from(["on", "off"]),
        success_retention=st.sampled_from(["forever", "10s", "1m"]),
        error_retention=st.sampled_from(["forever", "forever", "30s"]),
        initial=st.integers(0, 4),
    )
    def setup(self, daemons: int, lease: str, max_attempts: str, backoff: str,
              retry_errors: str, success_retention: str, error_retention: str,
              initial: int) -> None:
        for _ in range(daemons):
            store = open_store(self.dir)
            self.stores.append(store)
            spool = Spool(store, self.dir, clock=self.clock)
            self.spools.append(spool)
            self.lcs.append(Lifecycle(spool))
        values = P.parse_assignments([
            f"lease_timeout={lease}", f"max_attempts={max_attempts}",
            f"retry_backoff={backoff}", "retry_backoff_max=10s", f"retry_errors={retry_errors}",
            f"success_retention={success_retention}", f"error_retention={error_retention}"])
        self.policy = P.DEFAULT.with_values(values)
        sp = self.spools[0]

        async def go() -> None:
            q = await sp.mkdir(1, b"q", 0o755, WHO)
            self.qid = q.id
            await sp.tx(lambda tx: tx.set_policy(q.id, values))
            self.dirs = {s: sp.lookup(q.id, s.value.encode()).id for s in State}
            for c in CONSUMERS:
                self.views[c] = (await sp.mkdir(self.dirs[State.WORKING], c, 0o755, WHO)).id
        run(go)
        event(f"daemons={daemons}")
        for s in self.spools:
            s.policies.refresh()
            assert s.policies.of(self.qid) == self.policy
        for i in range(initial):
            self.publish(i, False, 0)

    def teardown(self) -> None:
        try:
            if self.spools:
                async def close_all() -> None:
                    for d, _, h in self.handles:
                        await self.spools[d].close(h, WHO)
                run(close_all)
            for s in self.stores:
                s.close()
            if self.stores:
                assert Fsck(self.dir).run() == []
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---- helpers ----------------------------------------------------------------------------

    def sp(self, daemon: int) -> Spool:
        return self.spools[daemon % len(self.spools)]

    def entries(self) -> dict[int, Entry]:
        return {e.id: e for e in self.spools[0].r.all_entries() if e.kind == "message"}

    def in_state(self, state: State) -> list[Entry]:
        return sorted((e for e in self.entries().values() if e.state is state),
                      key=lambda e: e.id)

    def pick(self, state: State, i: int) -> Entry:
        es = self.in_state(state)
        return es[i % len(es)]

    def has(self, state: State) -> bool:
        return any(e.state is state for e in self.entries().values())

    def dir_of(self, e: Entry) -> int:
        assert e.parent is not None
        return e.parent

    # ---- user operations --------------------------------------------------------------------

    @precondition(lambda self: self.spools)
    @rule(daemon=st.integers(0, 1), dup=st.booleans(), i=picks)
    def publish(self, daemon: int, dup: bool, i: int) -> None:
        """A new message in ready/; sometimes named like a finished one (a later finish or
        expiry then meets a namesake)."""
        sp = self.sp(daemon)
        finished = self.in_state(State.SUCCESS) + self.in_state(State.ERROR)
        ready = {e.name for e in self.in_state(State.READY)}
        name = b"m%d" % self.n
        if dup and finished and finished[i % len(finished)].name not in ready:
            name = finished[i % len(finished)].name
            event("publish: namesake of a finished message")
        self.n += 1

        async def go() -> int:
            e, h = await sp.create(self.dirs[State.READY], name, 0o644, WHO)
            sp.write(h, 0, b"message %d" % e.id)
            await sp.close(h, WHO)
            return e.id
        mid = run(go)
        self.model[mid] = M(State.READY)

    @precondition(lambda self: self.spools and self.has(State.READY))
    @rule(daemon=st.integers(0, 1), consumer=st.sampled_from((None,) + CONSUMERS), i=picks)
    def claim(self, daemon: int, consumer: bytes | None, i: int) -> None:
        sp = self.sp(daemon)
        e = self.pick(State.READY, i)
        view = self.views[consumer] if consumer else self.dirs[State.WORKING]
        now = self.clock()
        try:
            run(lambda: sp.rename(self.dirs[State.READY], e.name, view, e.name, 0, WHO))
        except Exists:  # working/ already has that name (a namesake): nothing changed
            assert sp.r.lookup(view, e.name) is not None
            event("claim refused: namesake in working/")
            return
        m = self.model[e.id]
        m.state, m.attempts, m.claims = State.WORKING, m.attempts + 1, m.claims + 1
        after = sp.get(e.id)
        assert after.lease_ns == now + self.policy.lease_timeout
        assert after.consumer == (consumer.decode() if consumer else None)

    @precondition(lambda self: self.spools and self.has(State.WORKING))
    @rule(daemon=st.integers(0, 1), ok=st.booleans(), i=picks)
    def finish(self, daemon: int, ok: bool, i: int) -> None:
        sp = self.sp(daemon)
        e = self.pick(State.WORKING, i)
        target = State.SUCCESS if ok else State.ERROR
        old = sp.r.lookup(self.dirs[target], e.name)
        run(lambda: sp.rename(self.dir_of(e), e.name, self.dirs[target], e.name, 0, WHO))
        if old is not None:  # §3: a finished namesake is replaced
            self.gone.add(old.id)
            del self.model[old.id]
            event("finish replaced a finished namesake")
        self.model[e.id].state = target
        after = sp.get(e.id)
        if not ok:  # an explicit error retries only when retry_errors is on, attempts left
            out = e.attempts >= self.policy.max_attempts
            assert (after.retry_ns is not None) == (self.policy.retry_errors and not out)
            if self.policy.retry_errors:
                assert after.abandoned == out

    @precondition(lambda self: self.spools and self.has(State.WORKING))
    @rule(daemon=st.integers(0, 1), i=picks)
    def release(self, daemon: int, i: int) -> None:
        sp = self.sp(daemon)
        e = self.pick(State.WORKING, i)
        try:
            run(lambda: sp.rename(self.dir_of(e), e.name, self.dirs[State.READY], e.name, 0,
                                  WHO))
        except Exists:
            return
        m = self.model[e.id]
        m.state, m.attempts = State.READY, max(m.attempts - 1, 0)  # given back: not an attempt

    @precondition(lambda self: self.spools and (self.has(State.ERROR) or self.has(State.SUCCESS)))
    @rule(daemon=st.integers(0, 1), i=picks)
    def redrive(self, daemon: int, i: int) -> None:
        sp = self.sp(daemon)
        es = self.in_state(State.ERROR) + self.in_state(State.SUCCESS)
        e = es[i % len(es)]
        try:
            run(lambda: sp.rename(self.dir_of(e), e.name, self.dirs[State.READY], e.name, 0,
                                  WHO))
        except Exists:
            return
        m = self.model[e.id]
        m.state, m.attempts = State.READY, 0

    @precondition(lambda self: self.spools and self.has(State.WORKING))
    @rule(daemon=st.integers(0, 1), i=picks)
    def touch(self, daemon: int, i: int) -> None:
        sp = self.sp(daemon)
        e = self.pick(State.WORKING, i)
        now = self.clock()
        after = run(lambda: sp.setattr(e.id, mtime_ns=now, who=WHO))
        assert e.lease_ns is not None
        assert after.lease_ns == max(e.lease_ns, now + self.policy.lease_timeout)

    @precondition(lambda self: self.spools and self.has(State.WORKING) and len(self.handles) < 4)
    @rule(daemon=st.integers(0, 1), i=picks)
    def open_handle(self, daemon: int, i: int) -> None:
        d = daemon % len(self.spools)
        e = self.pick(State.WORKING, i)
        h = run(lambda: self.spools[d].open(e.id, False, False, WHO))
        assert h.read(0, 100) == b"message %d" % e.id
        self.handles.append((d, e.id, h))

    @precondition(lambda self: self.handles)
    @rule(i=picks)
    def close_handle(self, i: int) -> None:
        d, mid, h = self.handles.pop(i % len(self.handles))
        sp = self.spools[d]
        before = sp.r.get(mid)
        now = self.clock()
        run(lambda: sp.close(h, WHO))
        after = sp.r.get(mid)
        if (before is not None and before.state is State.WORKING and not sp.holds(mid)
                and after is not None):
            # the last close here: the timeout counts from now (a lease is never shortened;
            # a negligible extension is skipped)
            assert before.lease_ns is not None and after.lease_ns is not None
            t = self.policy.lease_timeout
            assert after.lease_ns >= before.lease_ns
            assert after.lease_ns >= now + t - min(NS, t // 10)

    # ---- time and the timer -----------------------------------------------------------------

    @precondition(lambda self: self.spools)
    @rule(seconds=st.sampled_from([1, 2, 3, 5, 8, 13, 30, 60]))
    def advance(self, seconds: int) -> None:
        self.clock.t += seconds * NS

    @precondition(lambda self: self.spools)
    @rule(seconds=st.sampled_from([1, 3, 5, 10, 30]), daemon=st.integers(0, 1))
    def tick(self, seconds: int, daemon: int) -> None:
        """Time passes and a timer fires: the common case, as its own rule."""
        self.advance(seconds)
        self.step(daemon)

    @precondition(lambda self: self.spools)
    @rule(daemon=st.integers(0, 1))
    def step(self, daemon: int) -> None:
        """One daemon's timer round."""
        self.timer_round([daemon % len(self.spools)])

    @precondition(lambda self: len(self.spools) == 2)
    @rule()
    def step_both(self) -> None:
        """Both daemons' timers fire in the same instant, their committers running: each finds
        the same messages due before either commits (the compare-and-set decides)."""
        self.timer_round([0, 1])

    def timer_round(self, ds: list[int]) -> None:
        now = self.clock()
        pre = self.entries()
        held = set().union(*({m for m in pre if self.spools[d].holds(m)} for d in ds))
        # one daemon: what it holds open stays; two at once: the other may expire it first
        must_keep = held if len(ds) == 1 else set()
        lcs = [self.lcs[d] for d in ds]
        before = [(lc.expired, lc.retried, lc.purged, lc._last_purge) for lc in lcs]
        if len(ds) == 1:
            run(lcs[0].step)
        else:
            run(self._concurrent_steps)
            event("step: both daemons at once")
        post = self.entries()
        purge_ran = any(lc._last_purge != b[3] for lc, b in zip(lcs, before))
        expired = retried = 0
        p = self.policy
        assert not set(post) - set(pre), "a timer round created a message"
        for mid, e in pre.items():
            a = post.get(mid)
            m = self.model[mid]
            if e.state is State.WORKING:
                assert e.lease_ns is not None and a is not None
                kept = a.state is State.WORKING
                if mid in must_keep:
                    assert kept, f"message {mid} held open by the stepping daemon left working/"
                if kept and mid in held:
                    assert a.lease_ns is not None and a.lease_ns >= e.lease_ns
                    assert a.lease_ns > now, f"message {mid} held open, its lease not renewed"
                    event("step: lease held open here kept")
                elif kept:
                    assert e.lease_ns > now, \
                        f"message {mid}: lease ran out at {e.lease_ns} <= {now}, not expired"
                    assert a.lease_ns == e.lease_ns and a.consumer == e.consumer
                else:
                    assert e.lease_ns <= now or mid in held, \
                        f"message {mid} expired before its lease ran out"
                    assert a.state in (State.ERROR, State.READY)
                    assert a.error == b"lease expired" and a.attempts == e.attempts
                    m.expires += 1
                    expired += 1
                    event("step: expired")
                    if any(self.spools[d].holds(mid) for d in range(len(self.spools))):
                        event("step: expired while held open by another daemon")
                    if a.name != e.name:
                        event("step: renamed on a clash")
                    out = e.attempts >= p.max_attempts
                    if a.state is State.READY:  # expired and retried in the same round
                        assert not out and p.retry_backoff == 0
                        retried += 1
                        event("step: expired and retried at once")
                    else:
                        assert a.abandoned == out and (a.retry_ns is None) == out
                        if out:
                            event("step: abandoned")
                        else:
                            assert a.retry_ns == now + min(
                                p.retry_backoff << max(e.attempts - 1, 0), p.retry_backoff_max)
                            assert a.retry_ns > now
            elif e.state is State.ERROR and e.retry_ns is not None:
                assert a is not None
                assert a.state is (State.READY if e.retry_ns <= now else State.ERROR)
                assert a.attempts == e.attempts
                if a.state is State.READY:
                    retried += 1
                    event("step: retry sent")
                else:
                    event("step: retry waits")
            elif e.state in (State.SUCCESS, State.ERROR):
                retention = p.success_retention if e.state is State.SUCCESS \
                    else p.error_retention
                assert e.finished_ns is not None
                due = retention is not None and e.finished_ns < now - retention
                if a is None:
                    assert due, f"message {mid} purged before its retention"
                    event(f"step: purged from {e.state.value}/")
                else:
                    assert a.state is e.state and a.name == e.name
                    assert not (due and purge_ran), f"message {mid} past retention kept"
            else:
                assert a is not None and a.state is e.state and a.name == e.name
            if a is None:
                self.gone.add(mid)
                del self.model[mid]
            else:
                m.state = a.state
        # each move made once, by one daemon
        assert sum(lc.expired - b[0] for lc, b in zip(lcs, before)) == expired
        assert sum(lc.retried - b[1] for lc, b in zip(lcs, before)) == retried
        assert sum(lc.purged - b[2] for lc, b in zip(lcs, before)) == len(set(pre) - set(post))

    async def _concurrent_steps(self) -> None:
        async with trio.open_nursery() as n:
            for sp in self.spools:
                sp.committer = Committer(sp.store)
                await n.start(sp.committer.run)
            async with trio.open_nursery() as steps:
                for lc in self.lcs:
                    steps.start_soon(lc.step)
            for sp in self.spools:
                sp.committer.close()
        for sp in self.spools:  # back to committing directly, as before the loop runs
            sp.committer = Committer(sp.store)

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def tree_matches_model(self) -> None:
        if not self.spools:
            return
        for sp in self.spools:  # every daemon sees the same tree
            seen: dict[int, State] = {}

            def visit(d: int, state: State, consumer: str | None) -> None:
                for c in sp.listdir(d):
                    if c.kind == "consumer":
                        assert state is State.WORKING
                        visit(c.id, state, c.name.decode())
                        continue
                    assert c.kind == "message", c
                    assert c.id not in seen, f"message {c.id} is present twice"
                    assert c.state is state and c.consumer == consumer
                    seen[c.id] = state

            for state in State:
                visit(self.dirs[state], state, None)
            expected = {mid: m.state for mid, m in self.model.items()}
            lost = set(expected) - set(seen)
            assert not lost, f"lost: {sorted(lost)}"
            assert seen == expected
            assert not set(seen) & self.gone
        assert set(self.entries()) == set(self.model)

    @invariant()
    def lifecycle_fields(self) -> None:
        if not self.spools:
            return
        p = self.policy
        for mid, e in self.entries().items():
            m = self.model[mid]
            assert e.attempts == m.attempts, f"message {mid}: attempts {e.attempts} != {m.attempts}"
            if e.state is State.WORKING:
                assert e.attempts <= p.max_attempts, \
                    f"message {mid} in working/ with attempts {e.attempts} > {p.max_attempts}"
                assert e.lease_ns is not None, f"claimed message {mid} without a lease"
            else:
                assert e.lease_ns is None, f"message {mid} in {e.state} with a lease"
                assert e.consumer is None
            if e.abandoned:
                assert e.state is State.ERROR and e.retry_ns is None
            if e.retry_ns is not None:
                assert e.state is State.ERROR and not e.abandoned
            if e.state is State.SUCCESS:
                assert e.error is None, f"message {mid} in success/ with error {e.error!r}"
            history = self.spools[0].r.history(mid)
            for _, action, _, dst, *_ in history:  # every move is a row of the table
                transition(Action(action), State(dst.split("/")[0]) if dst else None)
            actions = [h[1] for h in history]
            assert actions.count("claim") == m.claims
            assert actions.count("expire") == m.expires


# No "explain" phase: on a failure it replays hundreds of variants (most of a minute here);
# the shrunk sequence of rules is the explanation.
SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target,
                            Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
LifecycleMachine.TestCase.settings = SETTINGS
TestLifecycle = LifecycleMachine.TestCase
