"""``spoolfs umount MOUNTPOINT``: unmount and wait until the daemon has flushed and exited; a
mount whose daemon died is detached (mounttable.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import time

from spoolfs import mounttable
from spoolfs.cli.args import Parser, positive_seconds
from spoolfs.core.errors import UserError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="spoolfs umount",
               description="Unmount a spool and wait until its daemon has finished and exited.")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="where the spool is mounted")
    p.add_argument("--timeout", type=positive_seconds, default=60.0, metavar="SECONDS",
                   help="how long to wait for the daemon to exit (default 60)")
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    mp = os.path.abspath(args.mountpoint)
    entry = mounttable.find(mp)
    if entry is None:
        raise UserError(f"{mp} is not mounted")
    if not mounttable.is_spoolfs(entry):
        raise UserError(f"{mp} is not a spoolfs mount (it is {entry.fstype})")
    dead = mounttable.dead_mount(mp)
    if dead is not None:  # kill -9, a crash: the kernel kept the mount
        try:
            mounttable.detach(dead)
        except OSError as e:
            raise UserError(str(e)) from None
        print(f"{mp}: the daemon was gone; detached")
        return 0
    pid = mounttable.daemon_pid(mp)
    res = subprocess.run(["fusermount3", "-u", mp], capture_output=True, text=True)
    if res.returncode != 0:
        raise UserError(f"cannot unmount {mp}: {res.stderr.strip()}")
    deadline = time.monotonic() + args.timeout
    while pid is not None and _alive(pid):
        if time.monotonic() > deadline:
            raise UserError(f"daemon {pid} did not exit within {args.timeout:.0f}s")
        time.sleep(0.02)
    return 0
