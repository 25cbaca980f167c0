"""Queue policies (DESIGN §4): the keys, their defaults, and how values are written and read.

Pure: the command line, the xattrs on a queue directory and the lifecycle all go through
``parse`` and ``Policy``, so a value refused in one place is refused everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any

from spoolfs.core.errors import Invalid

NS = 1_000_000_000
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"([0-9]+)(s|m|h|d|w|)")
FOREVER = ("forever", "never", "off", "none", "0")  # retention: keep forever


@dataclass(frozen=True, slots=True)
class Policy:
    """One queue's lifecycle settings; durations in nanoseconds, ``None``: forever."""

    lease_timeout: int = 10 * 60 * NS
    max_attempts: int = 5
    retry_backoff: int = 0
    retry_backoff_max: int = 3600 * NS
    retry_errors: bool = False
    success_retention: int | None = None
    error_retention: int | None = None
    fanout: tuple[str, ...] = ()  # subscriber queues: a publish here lands in each of them
    duplicates: str = "allow"  # allow | reject | skip: a publish of content seen in the window
    duplicates_window: int = 7 * 86400 * NS
    # Watching (DESIGN §7): thresholds for ``spoolfs status --check``; None: not checked.
    max_age_partial: int | None = None
    max_age_ready: int | None = None
    max_age_working: int | None = None
    max_error: int | None = None
    max_working_per_consumer: int | None = None
    # Consumer views of working/ that are empty and had no claim in or out for this long are
    # removed by the lifecycle (consumers that died leave no views behind); None: never.
    idle_views: int | None = None
    # The disk guard: below this much free space, uploads and publishes get ENOSPC.
    min_free: str = "auto"  # "auto" (5% or 1 GiB, whichever is less), a size, or "N%"

    def with_values(self, values: dict[str, str]) -> Policy:
        """A copy with ``values`` (raw text, as stored) applied; refuses any bad one."""
        return replace(self, **{_field(k): parse(k, v) for k, v in values.items()})

    def shown(self) -> dict[str, str]:
        return {_key(f.name): show(_key(f.name), getattr(self, f.name)) for f in fields(self)}

    def get(self, key: str) -> Any:
        return getattr(self, _field(key))

    def min_free_bytes(self, total_bytes: int) -> int:
        """The disk guard's floor for a file system of ``total_bytes``."""
        spec = self.min_free
        if spec == "auto":
            return min(total_bytes // 20, 1 << 30)
        if spec.endswith("%"):
            return total_bytes * int(spec[:-1]) // 100
        return parse_size(spec)


def _key(field_name: str) -> str:
    return field_name.replace("max_age_", "max_age.")


def _field(key: str) -> str:
    return key.replace("max_age.", "max_age_")


KEYS = tuple(_key(f.name) for f in fields(Policy))
DEFAULT = Policy()

HELP = {
    "lease_timeout": "how long a claim holds a message without touch/read/open (duration > 0)",
    "max_attempts": "claims before a failing message is abandoned (integer >= 1)",
    "retry_backoff": "wait before the first retry, doubling per attempt (duration)",
    "retry_backoff_max": "the longest wait between retries (duration)",
    "retry_errors": "whether a consumer's own mv to error/ is retried (on/off)",
    "success_retention": "purge success/ messages finished longer ago (duration or forever)",
    "error_retention": "purge error/ messages finished longer ago (duration or forever)",
    "fanout": "subscriber queues, comma-separated: a publish here lands in each (or none)",
    "duplicates": "a publish of content already published within the window: allow, "
                  "reject (EEXIST) or skip (straight to success/)",
    "duplicates_window": "how far back duplicates are looked for (duration)",
    "max_age.partial": "status --check: the oldest upload in partial/ may be this old "
                       "(duration or none)",
    "max_age.ready": "status --check: the oldest claimable message may wait this long "
                     "(duration or none)",
    "max_age.working": "status --check: the oldest claim may be this old (duration or none)",
    "max_error": "status --check: at most this many messages in error/ (number or none)",
    "max_working_per_consumer": "status --check: at most this many claims per consumer view "
                                "(number or none)",
    "idle_views": "remove empty consumer views with no claim in or out for this long "
                  "(duration, or off)",
    "min_free": "below this free space uploads and publishes get ENOSPC: auto (5% or 1G, whichever "
                "is less), a size (500M, 2G) or a share (10%)",
}
_SIZE = re.compile(r"([0-9]+)([kmgt]?)b?")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
DUPLICATES = ("allow", "reject", "skip")
_QUEUE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


#: the longest duration a policy may hold: times stay well inside the store's 64-bit integers
MAX_DURATION = 100 * 365 * 86400 * NS


def parse_duration(text: str) -> int:
    """``45``, ``45s``, ``10m``, ``2h``, ``7d``, ``1w`` → nanoseconds (at most 100 years)."""
    m = _DURATION.fullmatch(text.strip().lower())
    if m is None:
        raise Invalid(f"bad duration {text!r}: use a number with s, m, h, d or w (45, 10m, 7d)")
    ns = int(m.group(1)) * _UNITS[m.group(2)] * NS
    if ns > MAX_DURATION:
        raise Invalid(f"duration {text!r} is longer than 100 years")
    return ns


def show_duration(ns: int) -> str:
    s = ns // NS
    for unit in ("d", "h", "m"):
        if s and s % _UNITS[unit] == 0:
            return f"{s // _UNITS[unit]}{unit}"
    return f"{s}s"


def parse_size(text: str) -> int:
    m = _SIZE.fullmatch(text.strip().lower())
    if m is None:
        raise Invalid(f"bad size {text!r}: a number with k, M, G or T (500M, 2G)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def show_size(n: int) -> str:
    for unit in ("t", "g", "m", "k"):
        if n and n % _SIZE_UNITS[unit] == 0:
            return f"{n // _SIZE_UNITS[unit]}{unit.upper()}"
    return str(n)


def parse(key: str, text: str) -> Any:
    """The value of ``key`` written as ``text``; ``Invalid`` with a clear message otherwise."""
    t = text.strip().lower()
    if key.startswith("max_age."):
        if key not in KEYS:
            raise Invalid(f"unknown policy key {key!r}; keys: {', '.join(KEYS)}")
        return None if t in FOREVER else parse_duration(t)
    if key in ("max_error", "max_working_per_consumer"):
        if t in ("none", "off", ""):
            return None
        if not re.fullmatch(r"[0-9]+", t):
            raise Invalid(f"bad {key} {text!r}: a whole number, or none")
        return int(t)
    if key == "min_free":
        if t == "auto":
            return t
        if t.endswith("%"):
            if not re.fullmatch(r"[0-9]{1,2}%", t):
                raise Invalid(f"bad min_free {text!r}: a share from 0% to 99%")
            return t
        return show_size(parse_size(t))
    if key in ("lease_timeout",):
        v = parse_duration(t)
        if v <= 0:
            raise Invalid(f"{key} must be longer than 0")
        return v
    if key in ("retry_backoff", "retry_backoff_max", "duplicates_window"):
        return parse_duration(t)
    if key == "idle_views":
        if t in FOREVER:
            return None
        v = parse_duration(t)
        if v <= 0:
            raise Invalid(f"{key} must be longer than 0, or off")
        return v
    if key in ("success_retention", "error_retention"):
        return None if t in FOREVER else parse_duration(t)
    if key == "max_attempts":
        if not re.fullmatch(r"[0-9]+", t) or int(t) < 1:
            raise Invalid(f"bad max_attempts {text!r}: a whole number, at least 1")
        return int(t)
    if key == "fanout":
        names = tuple(n.strip() for n in text.split(",") if n.strip()) \
            if t not in ("", "none", "off") else ()
        for n in names:
            if not _QUEUE_NAME.fullmatch(n) or n.startswith("."):
                raise Invalid(f"bad fanout queue name {n!r}: 1-64 of [A-Za-z0-9._-]")
        if len(set(names)) != len(names):
            raise Invalid(f"fanout names a queue twice: {text!r}")
        return names
    if key == "duplicates":
        if t not in DUPLICATES:
            raise Invalid(f"bad duplicates {text!r}: {', '.join(DUPLICATES)}")
        return t
    if key == "retry_errors":
        if t in ("on", "yes", "true", "1"):
            return True
        if t in ("off", "no", "false", "0"):
            return False
        raise Invalid(f"bad retry_errors {text!r}: on or off")
    raise Invalid(f"unknown policy key {key!r}; keys: {', '.join(KEYS)}")


def show(key: str, value: Any) -> str:
    """The canonical text of a value (what is stored and shown)."""
    if key == "retry_errors":
        return "on" if value else "off"
    if key == "fanout":
        return ",".join(value) if value else "none"
    if key == "min_free":
        return str(value)
    if key in ("max_error", "max_working_per_consumer"):
        return "none" if value is None else str(value)
    if key == "idle_views" and value is None:
        return "off"
    if key.startswith("max_age.") and value is None:
        return "none"
    if key == "duplicates":
        return str(value)
    if key == "max_attempts":
        return str(value)
    if value is None:
        return "forever"
    return show_duration(value)


def parse_assignments(args: list[str]) -> dict[str, str]:
    """``key=value`` words → canonical texts, all checked before any is applied."""
    out: dict[str, str] = {}
    for a in args:
        key, eq, text = a.partition("=")
        key = key.strip()
        if not eq:
            raise Invalid(f"expected key=value, got {a!r}")
        out[key] = show(key, parse(key, text))
    return out


def format_lines(values: dict[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in values.items())


def parse_lines(text: str) -> dict[str, str]:
    """The ``user.spool.policy`` xattr: ``key=value`` lines (or words) set together."""
    return parse_assignments(text.replace("\n", " ").split())


def check_fanout(graph: dict[str, tuple[str, ...]]) -> None:
    """Refuse a fan-out graph (queue name -> subscribers) with a cycle: a publish would never
    end. Subscribers that do not exist (yet) are no cycle."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(q: str, path: list[str]) -> None:
        if state.get(q) == 1:
            cycle = path[path.index(q):] + [q]
            raise Invalid(f"fanout would make a cycle: {' -> '.join(cycle)}")
        if state.get(q) == 2:
            return
        state[q] = 1
        for sub in graph.get(q, ()):
            visit(sub, path + [q])
        state[q] = 2

    for q in graph:
        visit(q, [])
