"""Where a running daemon leaves its pid, keyed by mount point, so ``spoolfs umount`` can wait
for it to exit; and where stores live by default.

The pid directory is never a predictable path in a shared directory (``/tmp/spoolfs-UID``
could be made by another user first): root's is ``/run/spoolfs``, another user's is
``$XDG_RUNTIME_DIR/spoolfs`` (systemd's private per-user directory) or, without one,
``$XDG_STATE_HOME/spoolfs/run`` in the user's home. It is made 0700 and must be the user's own.
"""

from __future__ import annotations

import os
import stat

from spoolfs.core.errors import UserError


def runtime_dir() -> str:
    if os.geteuid() == 0:
        return "/run/spoolfs"
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "spoolfs")
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(state, "spoolfs", "run")


def make_runtime_dir() -> str:
    """The pid directory, made 0700 if missing; refused unless it is a directory of this user
    that no one else may write to."""
    d = runtime_dir()
    os.makedirs(d, 0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise UserError(f"{d} must be a directory of uid {os.geteuid()} that others cannot "
                        "write to")
    return d


def mount_key(mountpoint: str) -> str:
    """A file name standing for the mount point ``mountpoint`` (its real path, escaped)."""
    return os.path.realpath(mountpoint).strip("/").replace("%", "%25").replace("/", "%2F") or "%2F"


def pidfile(mountpoint: str) -> str:
    return os.path.join(runtime_dir(), mount_key(mountpoint) + ".pid")


def default_store() -> str:
    if os.geteuid() == 0:
        return "/var/lib/spoolfs"
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(base, "spoolfs")
