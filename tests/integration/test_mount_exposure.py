"""What a mount shows beyond its files: the daemon's log never holds message content, the HTTP
endpoint listens on loopback unless told a host, and mistakes on the command line (a metrics
port in use, an empty queue name) are one line and a non-zero exit, with nothing mounted."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from helpers import (
    Mount,
    MountFactory,
    Queue,
    mounted,
    one_line_error,
    run,
    spoolfs_cli,
    wait_until,
)

pytestmark = pytest.mark.fuse


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                addr, _, hexport = fields[1].partition(":")
                if int(hexport, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.add(addr)
    return found


def test_a_refused_write_logs_its_size_not_its_content(mount: Mount, queue: Queue) -> None:
    secret = b"SECRET-PAYLOAD-" * 1000
    with open(queue.partial / "f", "wb", buffering=0) as f:
        spoolfs_cli("queue", "set", str(queue.path), "min_free=99%").check_returncode()
        with pytest.raises(OSError) as e:
            f.write(secret)
        assert e.value.errno == errno.ENOSPC
        spoolfs_cli("queue", "set", str(queue.path), "min_free=auto").check_returncode()
    log = mount.log_text()
    refused = [line for line in log.splitlines() if "refused write" in line]
    assert refused, f"no 'refused write' line in the log:\n{mount.log_tail()}"
    assert f"<{len(secret)} bytes>" in refused[-1], refused[-1]
    assert "SECRET-PAYLOAD" not in log, "the log holds the refused buffer's content"


def test_a_refused_setxattr_logs_its_size_not_its_value(mount: Mount, queue: Queue) -> None:
    queue.publish("m")
    with pytest.raises(OSError) as e:  # headers are set in partial/, before publishing
        os.setxattr(queue.ready / "m", "user.hidden", b"SECRET-HEADER-VALUE")
    assert e.value.errno == errno.EPERM
    log = mount.log_text()
    refused = [line for line in log.splitlines() if "refused setxattr" in line]
    assert refused and "b'user.hidden'" in refused[-1] and "<19 bytes>" in refused[-1], refused
    assert "SECRET-HEADER-VALUE" not in log


def test_metrics_listen_without_a_host_binds_loopback_only(mounter: MountFactory,
                                                           tmp_path: Path) -> None:
    port = _free_port()
    mounter(tmp_path / "store", tmp_path / "mnt", extra=["--metrics-listen", f":{port}"])
    addrs = wait_until(lambda: _listening(port), timeout=10, what=f"a listener on port {port}")
    assert addrs == {"0100007F"}, f"port {port} listens on {addrs}, not 127.0.0.1 only"


def test_metrics_port_in_use_is_one_line_error(mounter: MountFactory, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        m = mounter(tmp_path / "store", tmp_path / "mnt", start=False,
                    extra=["--metrics-listen", f"127.0.0.1:{port}"])
        m.path.mkdir()
        res = spoolfs_cli(*m.argv)
        line = one_line_error(res)
        assert str(port) in line and "in use" in line, line
        assert not mounted(m.path), "a mount was left behind"


@pytest.mark.parametrize("how", [["--queue", ""], ["-o", "queue="]])
def test_empty_queue_name_is_refused(tmp_path: Path, how: list[str]) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = spoolfs_cli(str(tmp_path / "store"), str(mnt), "--log-file", str(tmp_path / "log"),
                      *how)
    try:
        line = one_line_error(res)
        assert "queue" in line, line
        assert not mounted(mnt), "an empty queue name mounted the whole spool"
    finally:
        if mounted(mnt):
            run(["fusermount3", "-u", "-z", mnt])
