"""The store and the daemon's files are their owner's alone (issue: hardening). A store holds
every message's content and the whole history: no other local user may read any of it, nor
the log, and the daemon keeps no file at a predictable path in a shared directory. What the
daemon logs and serves gives away no content and listens on no public interface unasked."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from helpers.mounts import Mount, MountFactory, mounted
from helpers.ports import free_port
from helpers.procs import ok, one_line_error, spoolfs_cli
from helpers.queues import Queue, make_content
from helpers.waiting import wait_until

pytestmark = pytest.mark.fuse

#: another local user, with no group in common with root
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def open_to_others(root: Path) -> list[str]:
    """Everything at or under ``root`` that grants any permission to group or others."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if not stat.S_ISLNK(mode) and mode & 0o077:
            found.append(f"{path.relative_to(root.parent)} {stat.filemode(mode)}")
    return found


def fill(q: Queue) -> bytes:
    """Small (inline) and large (blob file) messages, an upload, and history. Returns the
    large message's content."""
    q.publish("small", b"secret\n")
    large = q.publish("large", make_content("large", 300_000))
    q.put("upload", b"draft\n")
    q.claim("small")
    return large


def test_a_new_store_and_its_log_are_owner_only(mounter: MountFactory, tmp_path: Path,
                                                open_dir: Path) -> None:
    m = mounter(open_dir / "store", tmp_path / "mnt")
    m.log = open_dir / "spoolfs.log"
    m.umount()
    m.start()
    fill(Queue.create(m.path, "q", tmp_path / "scratch"))
    assert open_to_others(m.store) == []
    assert stat.S_IMODE(m.log.stat().st_mode) == 0o600
    m.umount()
    assert open_to_others(m.store) == [], "files made while unmounting are private too"
    for what in (m.store / "meta.db", m.log):
        res = subprocess.run([*AS_NOBODY, "cat", str(what)], capture_output=True)
        assert res.returncode != 0 and b"Permission denied" in res.stderr, what
    res = subprocess.run([*AS_NOBODY, "ls", str(m.store)], capture_output=True)
    assert res.returncode != 0 and b"Permission denied" in res.stderr


def test_an_open_store_is_tightened_on_mount(mounter: MountFactory, tmp_path: Path) -> None:
    m = mounter(tmp_path / "store", tmp_path / "mnt")
    large = fill(Queue.create(m.path, "q", tmp_path / "scratch"))
    m.umount()
    ok("chmod", "-R", "go+rX", m.store)  # as an older spoolfs left it, or an admin opened it
    m.log.chmod(0o644)
    assert open_to_others(m.store)
    since = m.log_size()
    m.start()
    assert open_to_others(m.store) == []
    assert "open to other users" in m.log_text(since)
    assert stat.S_IMODE(m.log.stat().st_mode) == 0o640, "others lose their read; the group keeps it"
    assert (m.path / "q" / "ready" / "large").read_bytes() == large


def test_no_pid_file_in_a_shared_directory(open_dir: Path) -> None:
    """A user's pid directory is under $XDG_RUNTIME_DIR or in its home, made 0700, never
    /tmp/spoolfs-UID; one that others can write to is refused."""
    code = ("from spoolfs.runtime import make_runtime_dir, pidfile; "
            "print(make_runtime_dir()); print(pidfile('/mnt/x'))")
    home = open_dir / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)
    env = {"PATH": os.environ["PATH"], "HOME": str(home)}
    out = subprocess.run([*AS_NOBODY, os.sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == f"{home}/.local/state/spoolfs/run"
    assert out[1].startswith(out[0] + "/")
    assert stat.S_IMODE(os.stat(out[0]).st_mode) == 0o700
    rundir = open_dir / "run"
    rundir.mkdir()
    os.chown(rundir, 65534, 65534)
    env["XDG_RUNTIME_DIR"] = str(rundir)
    out = subprocess.run([*AS_NOBODY, os.sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == f"{rundir}/spoolfs"
    (rundir / "spoolfs").chmod(0o777)
    res = subprocess.run([*AS_NOBODY, os.sys.executable, "-c", code], env=env,
                         capture_output=True, text=True)
    assert res.returncode != 0 and "others cannot write" in res.stderr


def test_a_refused_write_logs_its_size_not_its_content(mount: Mount, tmp_path: Path) -> None:
    q = Queue.create(mount.path, "q", tmp_path / "scratch")
    secret = b"credit card 4111-1111-1111-1111\n" * 100
    with open(q.partial / "f", "wb", buffering=0) as f:
        f.write(b"x")
        ok("setfattr", "-n", "user.spool.policy.min_free", "-v", "99%", q.path)
        with pytest.raises(OSError) as e:
            f.write(secret)
    assert e.value.errno == 28  # ENOSPC, at write time
    def logged() -> str | None:
        text = mount.log_text()
        return text if "refused write" in text else None

    log = wait_until(logged, timeout=10, what="the refused write in the log")
    assert "credit card" not in log
    assert f"<{len(secret)} bytes>" in log


def test_a_refused_setxattr_logs_its_name_and_size_not_its_value(mount: Mount,
                                                                 tmp_path: Path) -> None:
    """A header value is content too; its name is what an operator needs to see."""
    q = Queue.create(mount.path, "q", tmp_path / "scratch")
    q.publish("m")
    with pytest.raises(OSError) as e:  # headers are set in partial/, before publishing
        os.setxattr(q.ready / "m", "user.token", b"secret-token-0123456789")
    assert e.value.errno == 1  # EPERM

    def logged() -> str | None:
        lines = [line for line in mount.log_text().splitlines() if "refused setxattr" in line]
        return lines[-1] if lines else None

    line = wait_until(logged, timeout=10, what="the refused setxattr in the log")
    assert "refused setxattr(q/ready/m user.token, <23 bytes>): EPERM" in line, line
    assert "secret-token" not in mount.log_text()


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, p = local.partition(":")
                if state == "0A" and int(p, 16) == port:
                    out.append(addr)
    return out


def test_metrics_without_a_host_listen_on_loopback_only(mounter: MountFactory,
                                                         tmp_path: Path) -> None:
    port = free_port()
    mounter(tmp_path / "store", tmp_path / "mnt", extra=["--metrics-listen", f":{port}"])
    assert _listening(port) == ["0100007F"]  # 127.0.0.1, and nothing else


def test_metrics_port_in_use_is_one_line_and_no_mount(store: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        res = spoolfs_cli(str(store), str(mnt), "--metrics-listen", f"127.0.0.1:{port}",
                          "--log-file", str(tmp_path / "log"))
        line = one_line_error(res)
    assert "in use" in line and str(port) in line, line
    assert not mounted(mnt)


@pytest.mark.parametrize("how", [["--queue", ""], ["--queue", "a/b"], ["-o", "queue="]])
def test_an_empty_or_bad_queue_name_is_refused(store: Path, tmp_path: Path,
                                               how: list[str]) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = spoolfs_cli(str(store), str(mnt), *how, "--log-file", str(tmp_path / "log"))
    if mounted(mnt):  # the defect: it mounted the whole spool; leave no daemon behind
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
    assert res.returncode == 2
    assert "queue" in one_line_error(res)
    assert not mounted(mnt)
