"""Where a running daemon leaves its pid, keyed by mount point, so ``spoolfs umount`` can wait
for it to exit: ``/run/spoolfs`` for root, ``$XDG_RUNTIME_DIR/spoolfs`` for a user who has one,
and else ``STORE/run``, inside the store (which is private to its user). Never a fixed path in
a directory others can write (``/tmp``): another user could make it first and read or plant
pid files there. ``spoolfs umount`` finds the store of a mount in the mount table (its source
is the store directory) and looks in every place the daemon may have used."""

from __future__ import annotations

import os
import re

from spoolfs.private import private_dir


def runtime_dir() -> str | None:
    """The user's own runtime directory for pid files, or None (then the store holds them)."""
    if os.geteuid() == 0:
        return "/run/spoolfs"
    base = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(base, "spoolfs") if base else None


def _key(mountpoint: str) -> str:
    return os.path.realpath(mountpoint).strip("/").replace("%", "%25").replace("/", "%2F") or "%2F"


def pidfile(mountpoint: str, store_dir: str) -> str:
    """Where the daemon serving ``mountpoint`` from ``store_dir`` writes its pid (the directory
    made private to this user)."""
    return os.path.join(private_dir(runtime_dir() or os.path.join(store_dir, "run")),
                        _key(mountpoint) + ".pid")


def _unescape(field: bytes) -> str:
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field))


def mounted_store(mountpoint: str) -> str | None:
    """The source of the spoolfs mount at ``mountpoint`` (its store directory), from
    /proc/self/mountinfo."""
    target = os.path.realpath(mountpoint)
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or _unescape(fields[4]) != target or b"-" not in fields:
            continue
        fstype, source = fields[fields.index(b"-") + 1:][:2]
        if fstype == b"fuse.spoolfs":
            return _unescape(source)
    return None


def read_pid(mountpoint: str) -> int | None:
    """The pid of the daemon serving ``mountpoint``, from the first pid file found in the
    places it may have used, or None."""
    dirs = [d for d in (runtime_dir(),) if d]
    store = mounted_store(mountpoint)
    if store:
        dirs.append(os.path.join(store, "run"))
    for d in dirs:
        try:
            with open(os.path.join(d, _key(mountpoint) + ".pid")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


def default_store() -> str:
    if os.geteuid() == 0:
        return "/var/lib/spoolfs"
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(base, "spoolfs")
