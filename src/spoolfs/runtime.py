"""Where a running daemon leaves its pid, keyed by mount point, so ``spoolfs umount`` can wait
for it to exit."""

from __future__ import annotations

import os


def runtime_dir() -> str:
    if os.geteuid() == 0:
        return "/run/spoolfs"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/spoolfs-{os.geteuid()}"
    return os.path.join(base, "spoolfs") if "XDG_RUNTIME_DIR" in os.environ else base


def pidfile(mountpoint: str) -> str:
    key = os.path.realpath(mountpoint).strip("/").replace("%", "%25").replace("/", "%2F") or "%2F"
    return os.path.join(runtime_dir(), key + ".pid")


def default_store() -> str:
    if os.geteuid() == 0:
        return "/var/lib/spoolfs"
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(base, "spoolfs")
