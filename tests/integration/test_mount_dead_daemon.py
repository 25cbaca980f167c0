"""After ``kill -9`` of a daemon the kernel keeps its mount: every access says "Transport
endpoint is not connected". ``spoolfs umount`` detaches it and says so; mounting again over
it detaches it first. Nothing published is lost."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from helpers.mounts import Mount, mounted
from helpers.procs import one_line_error, process_exited, spoolfs_cli
from helpers.queues import Queue
from helpers.waiting import wait_until

pytestmark = pytest.mark.fuse


def _kill(mount: Mount) -> None:
    pid = mount.pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: process_exited(pid), timeout=10, what=f"daemon {pid} to die")
    with pytest.raises(OSError) as e:
        os.stat(mount.path)
    assert e.value.errno == errno.ENOTCONN
    assert mounted(mount.path)


def test_umount_detaches_the_mount_of_a_dead_daemon(mount: Mount, tmp_path: Path) -> None:
    data = Queue.create(mount.path, "q", tmp_path / "scratch").publish("m")
    _kill(mount)
    res = spoolfs_cli("umount", str(mount.path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.decode() == f"{mount.path}: the daemon was gone; detached\n"
    assert not mounted(mount.path)
    mount.start()
    assert (mount.path / "q" / "ready" / "m").read_bytes() == data


def test_mounting_over_a_dead_mount_detaches_it_first(mount: Mount, tmp_path: Path) -> None:
    Queue.create(mount.path, "q", tmp_path / "scratch").publish("m")
    _kill(mount)
    mount.start()
    assert os.listdir(mount.path / "q" / "ready") == ["m"]
    assert "the daemon of the mount there was gone; detached" in mount.last_stderr


def test_umount_of_what_is_not_mounted_is_one_line(tmp_path: Path) -> None:
    res = spoolfs_cli("umount", str(tmp_path))
    assert res.returncode == 1
    assert one_line_error(res).endswith(f"{tmp_path} is not mounted")
