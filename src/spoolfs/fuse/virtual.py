"""``MOUNT/.spool/``: read-only files made by the daemon on open: ``status`` (the JSON of
``spoolfs status``) and ``metrics`` (Prometheus text), each showing the queues its opener may
enter, and ``requests`` (JSON: FUSE requests and daemon time per operation, and commits). Not
listed in the root, reachable by name; inode numbers far above any entry id. Their size reads
as 0, as in /proc: it is known only once made, and a stat must not make one; they are opened
with direct I/O, so reads go on to the end all the same."""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Callable
from typing import Any

import pyfuse3

from spoolfs.service.timings import TIMINGS

DIR_NAME = b".spool"
BASE = 1 << 62
DIR = BASE
FILES = {b"status": BASE + 1, b"metrics": BASE + 2, b"requests": BASE + 3}
NAMES = {ino: name for name, ino in FILES.items()}


def is_virtual(ino: int) -> bool:
    return ino >= BASE


def needs_snapshot(ino: int) -> bool:
    return ino != FILES[b"requests"]


def render(ino: int, snap: dict[str, Any], metrics: Callable[[dict[str, Any]], bytes]) -> bytes:
    if ino == FILES[b"requests"]:
        return json.dumps(TIMINGS.as_json(), indent=1).encode() + b"\n"
    if ino == FILES[b"status"]:
        return json.dumps(snap, indent=1).encode() + b"\n"
    return metrics(snap)


def attr(ino: int) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    a.entry_timeout = a.attr_timeout = 0  # made fresh at every open
    if ino == DIR:
        a.st_mode, a.st_nlink = stat.S_IFDIR | 0o555, 2
    else:
        a.st_mode, a.st_nlink = stat.S_IFREG | 0o444, 1
    now = time.time_ns()
    a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = now
    a.st_blksize = 4096
    return a
