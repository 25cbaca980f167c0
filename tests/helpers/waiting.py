"""Waiting by polling with a deadline that grows with the machine's slowness (SLOW)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
#: How many times slower than a quiet developer machine this one may be (SPOOLFS_TEST_SLOW;
#: CI at a load average of 20 on 2 cores needs about 5). Every deadline a test waits for is
#: multiplied by it: a deadline only bounds how long a broken test takes to fail, never how long
#: a passing one takes, so the default is generous.
SLOW = float(os.environ.get("SPOOLFS_TEST_SLOW", "5"))
CMD_TIMEOUT = 60.0
MOUNT_TIMEOUT = 30.0


def patience(seconds: float) -> float:
    """A deadline of ``seconds`` on a quiet machine, stretched for this one (see ``SLOW``)."""
    return seconds * SLOW


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float = 10.0,
    what: str = "condition",
    alive: Callable[[], None] | None = None,
) -> T:
    """Poll ``predicate`` until it returns a truthy value and return that value.

    ``timeout`` is what a quiet machine needs; the deadline is ``patience(timeout)``.

    ``alive`` is called between polls and should raise when something the wait depends on has
    died (so a dead daemon fails the test at once instead of after the deadline).
    """
    timeout = patience(timeout)
    deadline = time.monotonic() + timeout
    interval = 0.002
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None:
            alive()
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
        interval = min(interval * 2, 0.05)


def stretched(first: float, attempt: Callable[[float], bool], *, what: str,
              tries: int = 3) -> None:
    """Run a scenario whose premise is "these steps fit in a span of time" (a lease, a
    duplicates window), with a span 4 times longer each time the machine was too slow for it.

    ``attempt(span)`` sets the span up on fresh objects, runs its steps and returns False when
    they took longer than the span (before it concludes anything that depends on the span),
    True once it has checked everything. The checks stay exact; only the span adapts.
    """
    span = first
    for _ in range(tries):
        if attempt(span):
            return
        span *= 4
    raise AssertionError(f"{what}: the steps never fitted in the span, up to {span / 4:g}s")

