"""The command line of DESIGN §9: mount returns once mounted, errors are one clear line,
``spoolfs umount`` waits for the daemon, SIGTERM unmounts cleanly, ``-f`` stays in front."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.inspection import ls, read, visible
from helpers.mounts import Mount, mounted, wait_foreground_mount
from helpers.procs import describe_status, exit_status, one_line_error, process_exited, spoolfs_cli
from helpers.queues import Queue
from helpers.waiting import patience, wait_until

pytestmark = pytest.mark.fuse


def test_mount_returns_when_ready_and_logs_its_pid(mount: Mount) -> None:
    assert os.path.ismount(mount.path)
    assert (mount.store / "meta.db").is_file()
    assert not process_exited(mount.pid), "the pid in the log is not a running process"
    assert visible(ls(mount.path)) == []


def test_missing_mountpoint_is_one_line_error(store: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    res = spoolfs_cli(str(store), str(missing), "--log-file", str(tmp_path / "log"))
    line = one_line_error(res)
    assert str(missing) in line or "mountpoint" in line.lower(), line
    assert not missing.exists()
    assert not mounted(missing)


def test_mountpoint_not_empty_is_one_line_error(store: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "full"
    mnt.mkdir()
    (mnt / "something").write_text("here\n")
    res = spoolfs_cli(str(store), str(mnt), "--log-file", str(tmp_path / "log"))
    one_line_error(res)
    assert not mounted(mnt)
    assert (mnt / "something").read_text() == "here\n"


def test_store_that_is_a_file_is_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "store-file"
    bad.write_text("not a directory\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = spoolfs_cli(str(bad), str(mnt), "--log-file", str(tmp_path / "log"))
    one_line_error(res)
    assert not mounted(mnt)


def test_already_mounted_is_one_line_error(mount: Mount, queue: Queue, tmp_path: Path) -> None:
    data = queue.publish("m")
    res = spoolfs_cli(str(mount.store), str(mount.path), "--log-file", str(tmp_path / "log2"))
    one_line_error(res)
    # the first mount is untouched and still serves
    assert os.path.ismount(mount.path)
    assert not process_exited(mount.pid)
    assert read(queue.ready / "m") == data


def test_umount_waits_for_the_daemon_to_exit(mount: Mount, queue: Queue) -> None:
    queue.publish("m")
    pid = mount.pid
    res = spoolfs_cli("umount", str(mount.path))
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    Mount.live.discard(mount)
    assert process_exited(pid), "spoolfs umount returned while the daemon was still running"
    assert exit_status(pid) in (None, 0), \
        f"the daemon did not exit cleanly: {describe_status(exit_status(pid))}"
    assert not mounted(mount.path)


def test_umount_of_something_not_mounted_is_one_line_error(tmp_path: Path) -> None:
    res = spoolfs_cli("umount", str(tmp_path))
    one_line_error(res)


def test_sigterm_unmounts_cleanly(mount: Mount, queue: Queue) -> None:
    data = queue.publish("m")
    queue.claim("m")
    pid = mount.pid
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: process_exited(pid), timeout=15, what="the daemon to exit on SIGTERM")
    assert exit_status(pid) in (None, 0), \
        f"SIGTERM did not shut down cleanly: {describe_status(exit_status(pid))}"
    wait_until(lambda: not mounted(mount.path), timeout=5, what="the mount to go away")
    Mount.live.discard(mount)
    fsck = spoolfs_cli("fsck", str(mount.store), timeout=60)
    assert fsck.returncode == 0, fsck.stdout.decode(errors="replace") + fsck.stderr.decode(
        errors="replace")
    mount.start()
    assert ls(queue.working / "w1") == ["m"]
    assert read(queue.working / "w1/m") == data


def test_foreground_mode_serves_until_unmounted(store: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "fg"
    mnt.mkdir()
    log = tmp_path / "fg.log"
    with open(tmp_path / "fg.out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "spoolfs", str(store), str(mnt), "-f",
                                 "--log-file", str(log)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_foreground_mount(proc, mnt, tmp_path / "fg.out")
        os.mkdir(mnt / "q")
        assert sorted(os.listdir(mnt / "q")) == ["error", "partial", "ready", "success", "working"]
        res = spoolfs_cli("umount", str(mnt))
        assert res.returncode == 0, res.stderr.decode(errors="replace")
        assert proc.wait(timeout=patience(15)) == 0
    finally:
        if proc.poll() is None:
            if mounted(mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
            proc.kill()
            proc.wait()


def test_fsck_of_a_clean_store_exits_zero(mount: Mount, queue: Queue) -> None:
    for i in range(3):
        queue.publish(f"m{i}")
    queue.claim("m1")
    queue.claim("m2")
    queue.finish("m2")
    mount.umount()
    res = spoolfs_cli("fsck", str(mount.store), timeout=60)
    assert res.returncode == 0, res.stdout.decode(errors="replace") + res.stderr.decode(
        errors="replace")


@pytest.mark.parametrize("url", ["memory:", "postgresql://db.example/spool"])
def test_a_store_url_without_a_directory_is_refused_in_one_line(url: str, tmp_path: Path) -> None:
    # a mount keeps content in a store directory: an engine URL is refused before anything
    # is made, never taken for a local directory named after its scheme (the CLI runs in /)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    local = Path("/") / url.split("/")[0]
    assert not local.exists()
    res = spoolfs_cli(url, str(mnt), "--log-file", str(tmp_path / "log"))
    if os.path.ismount(mnt):  # the defect: it mounted; leave nothing behind
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
    assert url in one_line_error(res)
    assert not mounted(mnt) and not local.exists()


def test_the_daemon_raises_its_soft_limit_on_open_files(store: Path, tmp_path: Path) -> None:
    """Each open upload holds descriptors in the daemon: started with a soft limit below the
    hard one (often 1,024 against 524,288), it serves with the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256
    assert hard > low, f"this machine's hard limit on open files is {hard}"
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        m = Mount(store, tmp_path / "mnt", tmp_path / "spoolfs.log").start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        limits = Path(f"/proc/{m.pid}/limits").read_text().splitlines()
        row = next(line for line in limits if line.startswith("Max open files")).split()
        assert row[3:5] == [str(hard), str(hard)], row
        assert f"the soft limit was {low}" in m.log_text()
    finally:
        m.umount()
