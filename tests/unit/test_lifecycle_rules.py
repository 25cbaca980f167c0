"""The lifecycle rules of DESIGN §4 as pure functions, driven by a fake clock (plain ints)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spoolfs.core import lifecycle as L
from spoolfs.core.lifecycle import FINAL, AfterFailure
from spoolfs.core.policy import DEFAULT, NS, Policy

T0 = 1_700_000_000 * NS  # the fake clock's "now"
MIN = 60 * NS

policies = st.builds(
    Policy,
    lease_timeout=st.integers(1, 10**15),
    max_attempts=st.integers(1, 50),
    retry_backoff=st.integers(0, 10**13),
    retry_backoff_max=st.integers(0, 10**14),
    retry_errors=st.booleans(),
)
nows = st.integers(0, 2**62)


# ---- leases -----------------------------------------------------------------------------------

def test_lease_end_default_is_ten_minutes() -> None:
    assert L.lease_end(DEFAULT, T0) == T0 + 10 * MIN
    assert L.lease_end(Policy(lease_timeout=10 * NS), T0) == T0 + 10 * NS


@given(policies, nows)
def test_lease_end_is_a_full_timeout_from_now(p: Policy, now: int) -> None:
    end = L.lease_end(p, now)
    assert end - now == p.lease_timeout and end > now
    assert not L.lease_expired(end, now)
    assert L.lease_expired(end, end)  # expires exactly at its end
    # a fresh lease needs no renewal, unless it is shorter than the renewal margin
    assert L.renewal_due(p, end, now) == (p.lease_timeout < L.RENEW_MARGIN)


def test_renewal_due_once_half_is_gone() -> None:
    assert L.RENEW_MARGIN < 5 * NS  # (so half of this 10 s lease is what counts)
    p = Policy(lease_timeout=10 * NS)
    lease = L.lease_end(p, T0)
    assert not L.renewal_due(p, lease, T0)
    assert not L.renewal_due(p, lease, T0 + 4 * NS)
    assert not L.renewal_due(p, lease, T0 + 5 * NS)  # exactly half left: not yet
    assert L.renewal_due(p, lease, T0 + 5 * NS + 1)
    assert L.renewal_due(p, lease, T0 + 9 * NS)
    assert L.renewal_due(p, lease, T0 + 11 * NS)  # overdue: renew (the holder keeps it)
    assert not L.renewal_due(p, None, T0 + 11 * NS)  # no lease (not claimed): nothing to renew


def test_short_lease_renews_within_the_margin() -> None:
    """A lease shorter than twice the margin renews once less than the margin is left, so a
    short lease held open cannot lapse between two ticks of a timer."""
    p = Policy(lease_timeout=3 * NS)
    lease = L.lease_end(p, T0)
    assert not L.renewal_due(p, lease, T0 + NS - 1)
    assert L.renewal_due(p, lease, T0 + NS + 1)  # under 2 s left, though more than half
    one = Policy(lease_timeout=NS)
    assert L.renewal_due(one, L.lease_end(one, T0), T0)  # 1 s: always within the margin


@given(policies, nows, st.integers(0, 2**40))
def test_renewal_due_iff_less_than_half_or_the_margin_left(p: Policy, now: int,
                                                          left: int) -> None:
    lease = now + left
    assert L.renewal_due(p, lease, now) == (left < max(p.lease_timeout // 2, L.RENEW_MARGIN))
    if left < p.lease_timeout // 2:
        assert L.renewal_due(p, lease, now)  # past half-life: always
    # a renewal gives back a full lease: none is due right after one (if longer than the margin)
    if p.lease_timeout >= L.RENEW_MARGIN:
        assert not L.renewal_due(p, L.lease_end(p, now), now)


def test_lease_expired() -> None:
    assert not L.lease_expired(None, T0)
    assert not L.lease_expired(T0 + 1, T0)
    assert L.lease_expired(T0, T0)
    assert L.lease_expired(T0 - 1, T0)


# ---- backoff ----------------------------------------------------------------------------------

def test_backoff_zero_by_default() -> None:
    assert DEFAULT.retry_backoff == 0
    assert [L.backoff(DEFAULT, n) for n in range(0, 10)] == [0] * 10


def test_backoff_doubles_then_caps() -> None:
    p = Policy(retry_backoff=30 * NS, retry_backoff_max=5 * MIN)
    assert [L.backoff(p, n) // NS for n in range(1, 8)] == [30, 60, 120, 240, 300, 300, 300]
    assert L.backoff(p, 0) == 30 * NS  # never claimed (a consumer's error without a claim)
    assert L.backoff(p, 10**6) == 5 * MIN  # no overflow, still the cap


def test_backoff_cap_below_base_wins() -> None:
    p = Policy(retry_backoff=10 * MIN, retry_backoff_max=1 * MIN)
    assert L.backoff(p, 1) == 1 * MIN


@given(policies, st.integers(0, 200), st.integers(0, 200))
def test_backoff_monotonic_and_capped(p: Policy, a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert 0 <= L.backoff(p, lo) <= L.backoff(p, hi) <= max(p.retry_backoff_max, 0)
    if p.retry_backoff == 0:
        assert L.backoff(p, hi) == 0


@given(policies, st.integers(1, 60))
def test_backoff_is_base_times_power_of_two_below_cap(p: Policy, attempts: int) -> None:
    b = L.backoff(p, attempts)
    if p.retry_backoff > 0:
        assert b == min(p.retry_backoff * 2 ** (attempts - 1), p.retry_backoff_max)


# ---- after a failure --------------------------------------------------------------------------

def test_expiry_retries_now_with_default_backoff() -> None:
    assert L.after_failure(DEFAULT, 1, T0, expired=True) == AfterFailure(T0, False)
    assert L.after_failure(DEFAULT, 4, T0, expired=True) == AfterFailure(T0, False)


def test_expiry_out_of_attempts_is_abandoned() -> None:
    out = L.after_failure(DEFAULT, 5, T0, expired=True)
    assert out.retry_ns is None and out.abandoned
    assert L.after_failure(DEFAULT, 6, T0, expired=True) == out
    assert L.after_failure(Policy(max_attempts=1), 1, T0, expired=True) == out


def test_explicit_error_is_final_by_default() -> None:
    for attempts in (0, 1, 4):
        out = L.after_failure(DEFAULT, attempts, T0, expired=False)
        assert out == FINAL and out.retry_ns is None and not out.abandoned


def test_explicit_error_out_of_attempts_stays_without_retry() -> None:
    assert L.after_failure(DEFAULT, 5, T0, expired=False).retry_ns is None


def test_explicit_error_retries_when_retry_errors_on() -> None:
    p = Policy(retry_errors=True, retry_backoff=10 * NS, retry_backoff_max=MIN)
    assert L.after_failure(p, 1, T0, expired=False) == AfterFailure(T0 + 10 * NS, False)
    assert L.after_failure(p, 2, T0, expired=False) == AfterFailure(T0 + 20 * NS, False)
    assert L.after_failure(p, 4, T0, expired=False) == AfterFailure(T0 + 60 * NS, False)
    assert L.after_failure(p, 5, T0, expired=False) == AfterFailure(None, True)


def test_expiry_retries_even_with_retry_errors_off_and_uses_backoff() -> None:
    p = Policy(retry_errors=False, retry_backoff=NS, retry_backoff_max=MIN)
    assert L.after_failure(p, 3, T0, expired=True) == AfterFailure(T0 + 4 * NS, False)


@given(policies, st.integers(0, 100), nows, st.booleans())
def test_after_failure_properties(p: Policy, attempts: int, now: int, expired: bool) -> None:
    out = L.after_failure(p, attempts, now, expired=expired)
    assert not (out.abandoned and out.retry_ns is not None)  # abandoned never retries
    if out.retry_ns is not None:
        assert attempts < p.max_attempts  # a retry only with attempts left
        assert expired or p.retry_errors  # an explicit error retries only when switched on
        assert out.retry_ns == now + L.backoff(p, attempts) >= now
    if expired or p.retry_errors:
        assert (out.retry_ns is None) == (attempts >= p.max_attempts)
        assert out.abandoned == (attempts >= p.max_attempts)
    else:
        assert out.retry_ns is None


# ---- retention --------------------------------------------------------------------------------

def test_retention_cutoff() -> None:
    assert L.retention_cutoff(None, T0) is None  # forever: nothing is ever purged
    assert DEFAULT.success_retention is None and DEFAULT.error_retention is None
    assert L.retention_cutoff(7 * 86400 * NS, T0) == T0 - 7 * 86400 * NS
    assert L.retention_cutoff(0, T0) == T0


@given(st.integers(0, 2**50), nows, st.integers(0, 2**50))
def test_retention_cutoff_moves_with_the_clock(retention: int, now: int, dt: int) -> None:
    a = L.retention_cutoff(retention, now)
    b = L.retention_cutoff(retention, now + dt)
    assert a is not None and b is not None
    assert b - a == dt and now - a == retention


@pytest.mark.parametrize("attempts", [1, 2, 3, 4, 5])
def test_a_sequence_of_expiries_ends_abandoned_after_max_attempts(attempts: int) -> None:
    """Claim, expire, retry ... with a fake clock: the last of ``max_attempts`` is abandoned."""
    p = Policy(lease_timeout=10 * NS, max_attempts=attempts)
    now, n, outcome = T0, 0, None
    while True:
        n += 1  # a claim
        lease = L.lease_end(p, now)
        now = lease  # nobody touches it
        assert L.lease_expired(lease, now)
        outcome = L.after_failure(p, n, now, expired=True)
        if outcome.retry_ns is None:
            break
        now = outcome.retry_ns
    assert n == attempts and outcome.abandoned


def test_renewing_a_lease_is_a_row_of_the_table() -> None:
    """A claimed message kept (touch, a read, a handle held open): only its lease moves."""
    from spoolfs.core.errors import NotPermitted
    from spoolfs.core.rules import Action, Kind, State
    from spoolfs.core.transitions import Context, fields_of, transition

    row = transition(Action.RENEW, State.WORKING)
    assert fields_of(row, Kind.WORKING, Context(5, lease_end=99)) == {"lease_ns": 99}
    for elsewhere in (Kind.READY, Kind.ERROR, None):
        with pytest.raises(NotPermitted):
            fields_of(row, elsewhere, Context(5, lease_end=99))
