"""``spoolfs status [MOUNT|STORE] [--json] [--check] [--watch SECONDS]`` (DESIGN §7).

Per queue and state: count, bytes, age of the oldest (``ready/``: the oldest claimable); per
consumer view: messages in flight, the oldest claim and the next lease end; abandoned
messages and those waiting for a retry; free disk and inodes. From a mount it reads
``MOUNT/.spool/status``; from a store directory it reads the store itself.

``--check`` exits 2 and prints one line per crossed threshold (queue policies
``max_age.partial``, ``max_age.ready``, ``max_age.working``, ``max_error``,
``max_working_per_consumer``, ``min_free``), 0 otherwise: for cron and Nagios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, cast

from spoolfs.core.errors import UserError
from spoolfs.runtime import default_store

CHECK_FAILED = 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spoolfs status", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", metavar="MOUNT|STORE",
                   help="a spoolfs mount or a store directory (default: the default store)")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    p.add_argument("--check", action="store_true", help="exit 2 when a threshold is crossed")
    p.add_argument("--watch", type=float, metavar="SECONDS",
                   help="refresh in place every SECONDS until interrupted")
    return p


def load(path: str) -> dict[str, Any]:
    virtual = os.path.join(path, ".spool", "status")
    if os.path.exists(virtual):
        with open(virtual, "rb") as f:
            return cast(dict[str, Any], json.loads(f.read()))
    from spoolfs.store.registry import store_layout
    from spoolfs.store.site import is_url, place_of

    if is_url(path) or store_layout(path).is_store():
        from spoolfs.service.policies import Policies
        from spoolfs.service.status import snapshot
        from spoolfs.store.registry import open_store

        store = open_store(path)
        try:
            return snapshot(store.reader(), place_of(path, store), Policies(store.reader()).of)
        finally:
            store.close()
    raise UserError(f"{path} is neither a spoolfs mount nor a store")


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.1f}s"


def _size(n: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        k = {"TiB": 1 << 40, "GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[unit]
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def render(snap: dict[str, Any]) -> str:
    lines = [f"{'QUEUE':<20} {'STATE':<8} {'COUNT':>8} {'BYTES':>11} {'OLDEST':>8}"]
    for name, q in snap["queues"].items():
        for state, v in q["states"].items():
            lines.append(f"{name:<20} {state:<8} {v['count']:>8} {_size(v['bytes']):>11} "
                         f"{_age(v['oldest_age_s']):>8}")
        for c, info in q["consumers"].items():
            nxt = info["next_lease_end_s"]
            lease = "-" if nxt is None else (f"in {_age(nxt)}" if nxt >= 0 else "overdue")
            lines.append(f"{'':<20} consumer {c or '(working/)'}: {info['in_flight']} in "
                         f"flight, oldest claim {_age(info['oldest_claim_age_s'])}, next lease "
                         f"end {lease}")
        if q["abandoned"] or q["waiting_retry"]:
            lines.append(f"{'':<20} error/: {q['abandoned']} abandoned, "
                         f"{q['waiting_retry']} waiting for a retry")
    d = snap["disk"]
    pct = 100 * d["free_bytes"] // max(d["total_bytes"], 1)
    lines.append(f"disk: {_size(d['free_bytes'])} free of {_size(d['total_bytes'])} ({pct}%), "
                 f"{d['free_inodes']:,} inodes free; {snap['time']}")
    return "\n".join(lines) + "\n"


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    path = args.path or default_store()
    from spoolfs.service.status import problems

    while True:
        snap = load(path)
        out = json.dumps(snap, indent=1) + "\n" if args.json else render(snap)
        found = problems(snap) if args.check else []
        if args.watch:
            sys.stdout.write("\x1b[H\x1b[2J")  # home, clear: refresh in place
        sys.stdout.write(out)
        for line in found:
            print(f"CHECK: {line}")
        if args.check and not found:
            print("CHECK: ok")
        sys.stdout.flush()
        if not args.watch:
            return CHECK_FAILED if found else 0
        time.sleep(args.watch)
