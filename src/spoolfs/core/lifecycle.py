"""The lifecycle rules of DESIGN §4 as pure functions of a policy and a clock.

Leases, attempts, retries with backoff, abandonment and retention. The service applies them
in transactions; the unit tests drive them with a fake clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from spoolfs.core.policy import NS as NS  # re-exported: the lifecycle's time unit
from spoolfs.core.policy import Policy

LEASE_EXPIRED = b"lease expired"


def lease_end(policy: Policy, now_ns: int) -> int:
    """A claim, a ``touch`` or a read holds the message until then."""
    return now_ns + policy.lease_timeout


#: an open handle or a read renews a lease with less than this left, whatever its length: the
#: renewal must land in the store before any daemon's timer (a tick of 0.5 s) sees it lapse
RENEW_MARGIN = 2 * NS


def renewal_due(policy: Policy, lease_ns: int | None, now_ns: int) -> bool:
    """Whether a read or an open handle should extend the lease now: once half of it is gone,
    or less than ``RENEW_MARGIN`` is left (so a busy reader commits about twice per lease, and
    a short lease held open never lapses between two ticks)."""
    return lease_ns is not None and \
        lease_ns - now_ns < max(policy.lease_timeout // 2, RENEW_MARGIN)


def lease_expired(lease_ns: int | None, now_ns: int) -> bool:
    return lease_ns is not None and lease_ns <= now_ns


def backoff(policy: Policy, attempts: int) -> int:
    """The wait before retrying a message that failed its ``attempts``-th claim: the base,
    doubling per attempt, capped by ``retry_backoff_max``."""
    if policy.retry_backoff <= 0:
        return 0
    doublings = min(max(attempts - 1, 0), 62)
    return min(policy.retry_backoff << doublings, policy.retry_backoff_max)


@dataclass(frozen=True, slots=True)
class AfterFailure:
    """What happens to a message that reached ``error/``."""

    retry_ns: int | None  # back to ready/ then; None: it stays in error/
    abandoned: bool  # out of attempts: stays until an explicit ``mv error/f ready/``


FINAL = AfterFailure(None, False)


def after_failure(policy: Policy, attempts: int, now_ns: int, *, expired: bool) -> AfterFailure:
    """A lease expiry always retries while attempts are left; a consumer's own ``mv … error/``
    only when the queue's ``retry_errors`` is on (otherwise an explicit error is final)."""
    if not expired and not policy.retry_errors:
        return FINAL
    if attempts >= policy.max_attempts:
        return AfterFailure(None, True)
    return AfterFailure(now_ns + backoff(policy, attempts), False)


def retention_cutoff(retention_ns: int | None, now_ns: int) -> int | None:
    """Finished messages older than this are purged; None: keep forever."""
    return None if retention_ns is None else now_ns - retention_ns
