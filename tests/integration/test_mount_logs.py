"""The daemon's log as an admin reads it: one prefix, refusals by path with who asked, a log
file that follows logrotate, a daemon that keeps no directory of its caller busy."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers.mounts import Mount
from helpers.queues import Queue
from helpers.waiting import wait_until

pytestmark = pytest.mark.fuse


def _line(mount: Mount, needle: str) -> str:
    def found() -> str | None:
        lines = [line for line in mount.log_text().splitlines() if needle in line]
        return lines[-1] if lines else None

    return wait_until(found, timeout=10, what=f"{needle!r} in {mount.log}")


def test_a_refusal_names_paths_errno_and_who_asked(mount: Mount, tmp_path: Path) -> None:
    q = Queue.create(mount.path, "q", tmp_path / "scratch")
    q.publish("m")
    mv = subprocess.Popen(["mv", str(q.ready / "m"), str(q.path / "success" / "m")],
                          stderr=subprocess.PIPE)
    _, err = mv.communicate()
    assert mv.returncode != 0 and b"not permitted" in err
    line = _line(mount, "refused rename(")
    assert re.search(r" INFO spoolfs\.fuse\.ops: refused rename\(q/ready/m, q/success/m\): "
                     rf"EPERM \(.+\) uid=0 pid={mv.pid}$", line), line


def test_one_prefix_per_line(mount: Mount) -> None:
    text = mount.log_text()
    assert re.search(r" INFO spoolfs: mounted .* \(pid \d+\)\n", text), text
    assert "spoolfs: spoolfs:" not in text


def test_the_daemon_lets_go_of_its_callers_directory(mount: Mount) -> None:
    assert os.readlink(f"/proc/{mount.pid}/cwd") == "/"


def test_the_log_file_follows_logrotate(mount: Mount, tmp_path: Path) -> None:
    """logrotate renames the log and lets the daemon go on: the next line goes to a new file
    of the old name, made owner-only like the first."""
    q = Queue.create(mount.path, "q", tmp_path / "scratch")
    rotated = mount.log.with_name(mount.log.name + ".1")
    mount.log.rename(rotated)
    q.publish("after")
    with pytest.raises(PermissionError):
        (q.ready / "after").rename(q.path / "success" / "after")
    wait_until(lambda: mount.log.exists() and "refused rename(q/ready/after" in
               mount.log.read_text(), timeout=10, what="a new log file with the refusal")
    assert mount.log.stat().st_mode & 0o077 == 0
    assert "refused rename(q/ready/after" not in rotated.read_text()
