"""Watching the spool (DESIGN §7): one snapshot of every queue, the checks of its thresholds,
and the same figures as Prometheus metrics.

The snapshot is plain data (JSON-ready); ``spoolfs status``, ``MOUNT/.spool/status``,
``MOUNT/.spool/metrics`` and ``--metrics-listen`` all show the same one. Its cost grows with
the number of messages: the daemon computes it off the event loop (service/snapshots.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from operator import itemgetter
from typing import Any, NamedTuple

from prometheus_client.core import CollectorRegistry, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from spoolfs.core.policy import DEFAULT, NS, Policy
from spoolfs.core.rules import STATES
from spoolfs.service.timings import TIMINGS
from spoolfs.store.base import ReadTx, by_id
from spoolfs.store.site import Place, embedded

PolicyOf = Any  # callable: queue id -> Policy
#: uploads whose sizes are read per query: what a snapshot holds, however many are under way
#: or left in ``partial/``
PAGE = 500


def _age(now: int, ns: int | None) -> float | None:
    return None if ns is None else round(max(now - ns, 0) / NS, 3)


def snapshot(r: ReadTx, where: str | Place, policy_of: PolicyOf, now: int | None = None,
             only_queue: int | None = None) -> dict[str, Any]:
    """``where``: the store directory of an embedded store, or the ``Place`` of any (the disk
    shown is this host's part of it)."""
    place = where if isinstance(where, Place) else embedded(where)
    now = time.time_ns() if now is None else now
    st = os.statvfs(place.local)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    queues: dict[int, dict[str, Any]] = {}
    names: dict[int, str] = {}
    for q in r.children(1):
        if q.kind != "queue" or (only_queue is not None and q.id != only_queue):
            continue
        names[q.id] = q.name.decode(errors="replace")
        policy: Policy = policy_of(q.id)
        queues[q.id] = {
            "states": {s.value: {"count": 0, "bytes": 0, "oldest_age_s": None} for s in STATES},
            "consumers": {},
            "abandoned": 0,
            "waiting_retry": 0,
            "min_free_bytes": policy.min_free_bytes(total),
            "thresholds": {k: v for k, v in policy.shown().items()
                           if k.startswith("max_") or k == "min_free"},
        }
        working = next((c for c in r.children(q.id) if c.name == b"working"), None)
        for c in r.subdirectories(working.id) if working is not None else []:
            if c.kind == "consumer":  # a view's time moves with every claim in or out of it
                queues[q.id]["consumers"][c.name.decode(errors="replace")] = {
                    "in_flight": 0, "oldest_claim_age_s": None, "next_lease_end_s": None,
                    "last_activity_age_s": _age(now, c.mtime_ns)}
    for qid, state, consumer, count, size, oldest, lease, abandoned, waiting in r.stats():
        shown = queues.get(qid)
        if shown is None:
            continue
        s = shown["states"][state]
        s["count"] += count
        s["bytes"] += size
        age = _age(now, oldest)
        if age is not None and (s["oldest_age_s"] is None or age > s["oldest_age_s"]):
            s["oldest_age_s"] = age
        shown["abandoned"] += abandoned or 0
        shown["waiting_retry"] += waiting or 0
        if state == "working":
            c = shown["consumers"].setdefault(consumer or "", {
                "in_flight": 0, "oldest_claim_age_s": None, "next_lease_end_s": None,
                "last_activity_age_s": None})
            c["in_flight"] += count
            c["oldest_claim_age_s"] = age
            c["next_lease_end_s"] = None if lease is None else round((lease - now) / NS, 3)
    uploads = (u for u in by_id(r.uploads, PAGE) if u[1] in queues)  # in id order
    for (_, qid, state), size in place.staging.sizes(uploads, key=itemgetter(0)):
        if size is not None:  # sizes of uploads are their files'
            queues[qid]["states"][state]["bytes"] += size
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now / NS)),
        "store": place.name,
        "disk": {"free_bytes": free, "total_bytes": total,
                 "free_inodes": st.f_favail, "total_inodes": st.f_files},
        "queues": {names[qid]: q for qid, q in sorted(queues.items(), key=lambda i: names[i[0]])},
    }


def access(r: ReadTx) -> dict[str, tuple[int, int, int, int]]:
    """Queue name (as the snapshot shows it) -> (id, mode, uid, gid) of its directory: who
    may see the queue in a snapshot."""
    return {q.name.decode(errors="replace"): (q.id, q.mode, q.uid, q.gid)
            for q in r.children(1) if q.kind == "queue"}


class Problem(NamedTuple):
    """A crossed threshold: ``critical`` when writes will soon be refused (the disk), a
    warning when a queue is behind (ages, errors, a consumer's load)."""

    critical: bool
    text: str


def problems(snap: dict[str, Any]) -> list[Problem]:
    """The thresholds crossed (queue policies ``max_age.*``, ``max_error``,
    ``max_working_per_consumer``, ``min_free``), one each."""
    out = []
    free = snap["disk"]["free_bytes"]
    for name, q in snap["queues"].items():
        t = q["thresholds"]
        for state in ("partial", "ready", "working"):
            limit = t.get(f"max_age.{state}", "none")
            age = q["states"][state]["oldest_age_s"]
            if limit != "none" and age is not None:
                limit_s = DEFAULT.with_values({f"max_age.{state}": limit}).get(
                    f"max_age.{state}") / NS
                if age > limit_s:
                    out.append(Problem(False, f"{name}: oldest in {state}/ is {age:.0f}s old "
                                              f"(max_age.{state}={limit})"))
        if t.get("max_error", "none") != "none":
            n = q["states"]["error"]["count"]
            if n > int(t["max_error"]):
                out.append(Problem(False, f"{name}: {n} message(s) in error/ "
                                          f"(max_error={t['max_error']})"))
        if t.get("max_working_per_consumer", "none") != "none":
            for c, info in q["consumers"].items():
                if info["in_flight"] > int(t["max_working_per_consumer"]):
                    out.append(Problem(False, f"{name}: consumer {c or '(working/ itself)'} "
                                              f"holds {info['in_flight']} "
                                              f"(max_working_per_consumer="
                                              f"{t['max_working_per_consumer']})"))
        if free < q["min_free_bytes"]:
            out.append(Problem(True, f"{name}: {free >> 20} MiB free on the store's disk, below "
                                     f"min_free ({q['min_free_bytes'] >> 20} MiB): uploads are "
                                     "refused"))
    return out


class _Collector:
    def __init__(self, snap: dict[str, Any]) -> None:
        self.snap = snap

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.snap
        count = GaugeMetricFamily("spoolfs_messages", "Messages per queue and state",
                                  labels=["queue", "state"])
        size = GaugeMetricFamily("spoolfs_bytes", "Bytes of content per queue and state",
                                 labels=["queue", "state"])
        oldest = GaugeMetricFamily("spoolfs_oldest_age_seconds",
                                   "Age of the oldest message per queue and state (ready: "
                                   "the oldest claimable)", labels=["queue", "state"])
        inflight = GaugeMetricFamily("spoolfs_consumer_in_flight",
                                     "Messages claimed per consumer view",
                                     labels=["queue", "consumer"])
        abandoned = GaugeMetricFamily("spoolfs_abandoned", "Abandoned messages in error/",
                                      labels=["queue"])
        waiting = GaugeMetricFamily("spoolfs_waiting_retry", "Messages in error/ waiting for "
                                    "a retry", labels=["queue"])
        for name, q in s["queues"].items():
            for state, v in q["states"].items():
                count.add_metric([name, state], v["count"])
                size.add_metric([name, state], v["bytes"])
                oldest.add_metric([name, state], v["oldest_age_s"] or 0.0)
            for c, info in q["consumers"].items():
                inflight.add_metric([name, c], info["in_flight"])
            abandoned.add_metric([name], q["abandoned"])
            waiting.add_metric([name], q["waiting_retry"])
        yield from (count, size, oldest, inflight, abandoned, waiting)
        d = s["disk"]
        yield GaugeMetricFamily("spoolfs_disk_free_bytes", "Free space on the store's disk",
                                value=d["free_bytes"])
        yield GaugeMetricFamily("spoolfs_disk_total_bytes", "Size of the store's disk",
                                value=d["total_bytes"])
        yield GaugeMetricFamily("spoolfs_disk_free_inodes", "Free inodes on the store's disk",
                                value=d["free_inodes"])


class Families:
    """A collector of metric families gathered earlier (on the event loop): what an exporter
    thread serializes without touching the daemon's state."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Iterator[Any]:
        return iter(self.families)


def families(snap: dict[str, Any]) -> list[Any]:
    """The snapshot's gauges and this daemon's counters and histograms (service/timings.py),
    as prometheus_client metric families: per-queue figures only of the snapshot's queues
    (a user's snapshot holds the queues it may enter, and nothing of the others shows)."""
    return [*_Collector(snap).collect(), *TIMINGS.collect(queues=snap["queues"])]


def registry_of(snap: dict[str, Any]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(families(snap)))
    return registry


def metrics(snap: dict[str, Any]) -> bytes:
    """The snapshot in the Prometheus text exposition format, with this daemon's request and
    commit figures (service/timings.py)."""
    return generate_latest(registry_of(snap))
