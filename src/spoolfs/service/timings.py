"""Counts and latencies the daemon keeps of itself: FUSE requests per operation, and commits.

Shown as Prometheus counters and histograms in ``metrics`` (``MOUNT/.spool/metrics`` and
``--metrics-listen``), and as JSON in ``MOUNT/.spool/requests``, which ``spoolfs bench`` reads to
count the requests each step of a cycle costs. Recording is two integer additions and a bisect:
cheap enough for every request.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Container, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

#: histogram bucket bounds, seconds (10 µs .. 10 s)
BOUNDS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
_BOUNDS_NS = tuple(int(b * 1e9) for b in BOUNDS)


class Latency:
    """A count, a sum and bucket counts of durations."""

    __slots__ = ("count", "total_ns", "buckets")

    def __init__(self) -> None:
        self.count = 0
        self.total_ns = 0
        self.buckets = [0] * (len(BOUNDS) + 1)

    def add(self, ns: int) -> None:
        self.count += 1
        self.total_ns += ns
        self.buckets[bisect_left(_BOUNDS_NS, ns)] += 1

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*(repr(b) for b in BOUNDS), "+Inf"), self.buckets, strict=True):
            running += n
            out.append((bound, running))
        return out


class Timings:
    """Per FUSE operation: requests and daemon time; per commit: latency and batch size."""

    def __init__(self) -> None:
        self.ops: dict[str, Latency] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.commits = Latency()
        self.committed_requests = 0
        self.syncs = Latency()
        #: (action, queue name) -> transitions committed; "abandon" counts abandoned messages
        self.transitions: dict[tuple[str, str], int] = {}

    def request(self, op: str, ns: int) -> None:
        lat = self.ops.get(op)
        if lat is None:
            lat = self.ops[op] = Latency()
        lat.add(ns)

    def refused(self, op: str, code: str) -> None:
        self.errors[op, code] = self.errors.get((op, code), 0) + 1

    def moved(self, action: str, queue: str) -> None:
        key = (action, queue)
        self.transitions[key] = self.transitions.get(key, 0) + 1

    def commit(self, ns: int, requests: int) -> None:
        self.commits.add(ns)
        self.committed_requests += requests

    def sync(self, ns: int) -> None:
        self.syncs.add(ns)

    def as_json(self) -> dict[str, Any]:
        return {"requests": {op: {"count": lat.count, "seconds": lat.total_ns / 1e9}
                             for op, lat in sorted(self.ops.items())},
                "errors": {f"{op} {code}": n for (op, code), n in sorted(self.errors.items())},
                "commits": {"count": self.commits.count, "seconds": self.commits.total_ns / 1e9,
                            "requests": self.committed_requests},
                "syncs": {"count": self.syncs.count, "seconds": self.syncs.total_ns / 1e9}}

    def collect(self, queues: Container[str] | None = None) -> Iterator[Any]:
        """The prometheus_client collector protocol; with ``queues``, per-queue figures of
        those queues only (what the reader may see)."""
        requests = CounterMetricFamily("spoolfs_fuse_requests", "FUSE requests answered, per "
                                       "operation", labels=["op"])
        errors = CounterMetricFamily("spoolfs_fuse_errors", "FUSE requests answered with an "
                                     "error, per operation and errno", labels=["op", "errno"])
        latency = HistogramMetricFamily("spoolfs_fuse_request_seconds", "Daemon time per FUSE "
                                        "request, per operation", labels=["op"])
        for op, lat in sorted(self.ops.items()):
            requests.add_metric([op], lat.count)
            latency.add_metric([op], lat.cumulative(), lat.total_ns / 1e9)
        for (op, code), n in sorted(self.errors.items()):
            errors.add_metric([op, code], n)
        commits = HistogramMetricFamily("spoolfs_commit_seconds", "Store commit latency (one "
                                        "transaction, one fsync, for a batch of requests)")
        commits.add_metric([], self.commits.cumulative(), self.commits.total_ns / 1e9)
        batched = CounterMetricFamily("spoolfs_committed_requests", "Requests committed (a "
                                      "batch shares one commit)")
        batched.add_metric([], self.committed_requests)
        syncs = HistogramMetricFamily("spoolfs_sync_seconds", "Store sync latency (one fsync of "
                                      "the log, making every commit before it durable)")
        syncs.add_metric([], self.syncs.cumulative(), self.syncs.total_ns / 1e9)
        yield from (requests, errors, latency, commits, batched, syncs)
        yield from self._transitions(queues)

    #: counters of their own for what dashboards ask most (also in spoolfs_transitions_total)
    _OWN = {"expire": ("spoolfs_lease_expiries", "Claims whose lease ran out (moved to error/)"),
            "retry": ("spoolfs_retries", "Messages sent back from error/ to ready/ for a retry"),
            "abandon": ("spoolfs_abandoned_messages", "Messages abandoned in error/ (out of "
                        "attempts)")}

    def _transitions(self, queues: Container[str] | None) -> Iterator[Any]:
        moves = CounterMetricFamily("spoolfs_transitions", "Transitions committed by this "
                                    "daemon, per action of the transition table and queue",
                                    labels=["action", "queue"])
        own = {a: CounterMetricFamily(name, text, labels=["queue"])
               for a, (name, text) in self._OWN.items()}
        for (action, queue), n in sorted(self.transitions.items()):
            if queues is not None and queue not in queues:
                continue
            if action in own:
                own[action].add_metric([queue], n)
            if action != "abandon":
                moves.add_metric([action, queue], n)
        yield moves
        yield from own.values()


#: this daemon's figures (one daemon per process)
TIMINGS = Timings()
