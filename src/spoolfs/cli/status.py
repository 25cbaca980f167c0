"""``spoolfs status [MOUNT|STORE] [--json | --check | --watch SECONDS]``.

Per queue and state: count, bytes, age of the oldest (``ready/``: the oldest claimable); per
consumer view: messages in flight, the oldest claim and the next lease end; abandoned
messages and those waiting for a retry; free disk and inodes. From a mount it reads
``MOUNT/.spool/status``; from a store it reads the store itself, read-only (a running daemon
is not disturbed).

``--check`` is for cron and Nagios: a one-line summary, then one line per crossed threshold
(the queue settings max_age.partial, max_age.ready, max_age.working, max_error,
max_working_per_consumer and min_free), nothing else. Exit status: 0 OK, 1 WARNING (a queue
is behind), 2 CRITICAL (the store's disk is below min_free), 3 UNKNOWN (no status to read).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, cast

from spoolfs.cli.args import Parser, positive_seconds
from spoolfs.cli.exits import Check
from spoolfs.core.errors import SpoolError, UserError
from spoolfs.runtime import default_store


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="spoolfs status", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", metavar="MOUNT|STORE",
                   help="a spoolfs mount or a store (default: the default store)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    how.add_argument("--check", action="store_true",
                     help="print only what is wrong; exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN")
    how.add_argument("--watch", type=positive_seconds, metavar="SECONDS",
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


def _ago(s: float | None) -> str:
    return "-" if s is None else f"{_age(s)} ago"


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
                         f"end {lease}, last active {_ago(info.get('last_activity_age_s'))}")
        if q["abandoned"] or q["waiting_retry"]:
            lines.append(f"{'':<20} error/: {q['abandoned']} abandoned, "
                         f"{q['waiting_retry']} waiting for a retry")
    d = snap["disk"]
    pct = 100 * d["free_bytes"] // max(d["total_bytes"], 1)
    lines.append(f"disk: {_size(d['free_bytes'])} free of {_size(d['total_bytes'])} ({pct}%), "
                 f"{d['free_inodes']:,} inodes free; {snap['time']}")
    return "\n".join(lines) + "\n"


def check(path: str) -> int:
    """Nagios's way: the summary line first, then each crossed threshold; its exit status."""
    from spoolfs.service.status import problems

    try:
        snap = load(path)
    except (UserError, SpoolError, OSError) as e:
        why = e.message if isinstance(e, UserError) else (
            e.hint if isinstance(e, SpoolError) else f"{path}: {e.strerror or e}")
        print(f"SPOOLFS UNKNOWN - {why}")
        return Check.UNKNOWN
    found = problems(snap)
    if not found:
        print(f"SPOOLFS OK - {len(snap['queues'])} queue(s), no threshold crossed")
        return Check.OK
    level = Check.CRITICAL if any(p.critical for p in found) else Check.WARNING
    print(f"SPOOLFS {level.name} - {len(found)} threshold(s) crossed: {found[0].text}")
    for p in found:
        print(f"{'CRITICAL' if p.critical else 'WARNING'}: {p.text}")
    return level


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    path = args.path or default_store()
    if args.check:
        return check(path)
    while True:
        snap = load(path)
        out = json.dumps(snap, indent=1) + "\n" if args.json else render(snap)
        if args.watch:
            sys.stdout.write("\x1b[H\x1b[2J")  # home, clear: refresh in place
        sys.stdout.write(out)
        sys.stdout.flush()
        if not args.watch:
            return 0
        time.sleep(args.watch)
