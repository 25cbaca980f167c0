"""Mounts of spoolfs in the mount table, and the one left behind by a daemon that died.

After ``kill -9`` (or a crash) the kernel keeps the mount: it stays in ``/proc/self/mountinfo``
and every access fails with "Transport endpoint is not connected". ``spoolfs umount`` and a new
mount on the same point detach it (``fusermount3 -u -z``), first aborting its FUSE connection
through fusectl in case a thread of the dead daemon still holds it (requests would hang
instead of failing). Nothing here stats the mount point: on a dead or hung mount that fails or
waits.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from spoolfs.runtime import mount_key, pidfile

FUSECTL = "/sys/fs/fuse/connections"
_ESCAPE = re.compile(rb"\\([0-7]{3})")


@dataclass(frozen=True)
class MountEntry:
    point: str
    fstype: str
    #: MAJOR:MINOR of the mount's device: the kernel's name for its backing device (sysfs)
    device: str

    @property
    def connection(self) -> str:
        """The FUSE connection number (the device minor): fusectl's name for it."""
        return self.device.partition(":")[2]


def find(mountpoint: str) -> MountEntry | None:
    """The newest mount on ``mountpoint`` (an absolute path), or None."""
    found = None
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(b" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or not rest:
            continue
        point = os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4]))
        if point == mountpoint:
            found = MountEntry(point, rest[0].decode(), fields[2].decode())
    return found


#: How far ahead the kernel reads a file on a spoolfs mount. Its default for a FUSE mount,
#: 128 KiB, makes a large read one request to the daemon per 128 KiB; 1 MiB (the largest
#: request the mount takes) made a 256 MiB read 260 requests instead of 2,052 and 1.6x faster.
READ_AHEAD_KB = 1024


def set_read_ahead(mountpoint: str, kb: int = READ_AHEAD_KB) -> str | None:
    """Set the read-ahead of the mount on ``mountpoint`` (an absolute path) through sysfs,
    without touching the mount itself; why not (it takes root), or None once done."""
    entry = find(mountpoint)
    if entry is None or not entry.device:
        return f"{mountpoint} is not in the mount table"
    try:
        with open(f"/sys/class/bdi/{entry.device}/read_ahead_kb", "w") as f:
            f.write(f"{kb}\n")
    except OSError as e:
        return f"read-ahead of {entry.device} left as it was: {e.strerror}"
    return None


#: where a store's own directory keeps the device number of each exported mount point
EXPORTED_DIR = "exported"


def device_record(mountpoint: str, record_dir: str) -> str:
    """The file under ``record_dir`` that keeps the device number under which an NFS server
    last served the mount on ``mountpoint``. (Resolved before mounting: the daemon cannot stat
    its own mount point from its event loop.)

    An NFS server's file handles for a FUSE mount carry its device number (FUSE reports no
    fsid of its own). The kernel gives a new mount the lowest number free, so a mount made
    again after a restart keeps its number only when no other mount took it meanwhile and
    none below it was unmounted since: otherwise every handle the clients hold is stale."""
    return os.path.join(record_dir, EXPORTED_DIR, mount_key(mountpoint))


def device(mountpoint: str) -> str | None:
    """MAJOR:MINOR of the mount on ``mountpoint`` (an absolute path), or None."""
    entry = find(mountpoint)
    return entry.device if entry is not None and entry.device else None


def recorded_device(record: str) -> str | None:
    """The device number kept in ``record`` (``device_record``), if any."""
    try:
        with open(record) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def record_device(record: str, number: str) -> None:
    """Keep the device number ``number`` in ``record``, replacing what it held."""
    os.makedirs(os.path.dirname(record), 0o700, exist_ok=True)
    with open(record + ".new", "w") as f:
        f.write(number + "\n")
    os.replace(record + ".new", record)


def is_spoolfs(entry: MountEntry) -> bool:
    return entry.fstype in ("fuse.spoolfs", "fuseblk.spoolfs")


def daemon_pid(mountpoint: str) -> int | None:
    """The pid the daemon serving ``mountpoint`` recorded, if it is still a spoolfs process."""
    try:
        with open(pidfile(mountpoint)) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b") ")[2][:1]
    except (OSError, ValueError):
        return None
    return pid if b"spoolfs" in cmdline and state not in (b"Z", b"X") else None


def answers(mountpoint: str, timeout: float = 2.0) -> bool:
    """Whether the mount answers a statfs (never answered from the kernel's caches, unlike a
    stat): a dead one says ENOTCONN at once, one whose connection a stuck thread of a dead
    daemon holds never answers (the probe is a process of its own, killed at the timeout)."""
    try:
        res = subprocess.run(["stat", "-f", "-c", "%b", "--", mountpoint], capture_output=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return res.returncode == 0


def dead_mount(mountpoint: str) -> MountEntry | None:
    """The spoolfs mount on ``mountpoint`` whose daemon is gone, or None: no spoolfs process
    recorded for it is running, and the mount does not answer."""
    entry = find(mountpoint)
    if entry is None or not is_spoolfs(entry) or daemon_pid(mountpoint) is not None \
            or answers(mountpoint):
        return None
    return entry


def detach(entry: MountEntry) -> None:
    """Abort the mount's connection (if it still exists) and detach it (lazily: a process
    whose directory is inside keeps it until it leaves, and gets ENOTCONN meanwhile)."""
    abort = os.path.join(FUSECTL, entry.connection, "abort")
    if entry.connection and not os.path.exists(FUSECTL + "/" + entry.connection):
        subprocess.run(["mount", "-t", "fusectl", "none", FUSECTL], capture_output=True)
    try:
        with open(abort, "w") as f:
            f.write("1")
    except OSError:
        pass  # the connection ended with its daemon (the usual case), or fusectl is absent
    res = subprocess.run(["fusermount3", "-u", "-z", entry.point], capture_output=True,
                         text=True)
    if res.returncode != 0:
        res = subprocess.run(["umount", "-l", entry.point], capture_output=True, text=True)
    if find(entry.point) == entry:
        raise OSError(f"cannot detach {entry.point}: {res.stderr.strip()}")
