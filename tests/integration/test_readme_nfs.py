"""The README's "Serving NFS clients" section, followed word for word: its server lines run as
root in a private mount namespace (a tmpfs over /mnt, /etc/ganesha, /var/lib/spoolfs and the
other directories they write, so the machine's own are left alone), its client lines with
``SERVER`` replaced by 127.0.0.1, and its restart lines after a kill -9 of the daemon; a
client that has been there all along (libnfs, NFSv3) goes on with its file handles.

The Linux client's ``mount -t nfs`` line is the one line not run: this kernel has no NFS
client. Its options are checked against what the section promises."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.devices import numbers_below_held
from helpers.mounts import mounting
from helpers.namespace import Namespace
from helpers.nfs import LOOPBACK, client, pids, port_2049
from helpers.nfsclient import NfsClient
from helpers.procs import process_exited, watch_daemon
from helpers.waiting import wait_until

pytestmark = pytest.mark.fuse

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HEADING = "## Serving NFS clients"
PRIVATE = ["/mnt", "/etc/ganesha", "/run/ganesha", "/var/lib/spoolfs", "/run/spoolfs",
           "/var/lib/nfs/ganesha"]


def section() -> str:
    text = README.read_text()
    start = text.index(HEADING)
    end = text.index("\n## ", start + len(HEADING))
    return text[start:end]


def blocks() -> list[list[str]]:
    """The section's shell blocks, each as its lines."""
    return [b.strip().splitlines() for b in re.findall(r"```sh\n(.*?)```", section(), re.S)]


@pytest.fixture
def ns(tmp_path: Path) -> Iterator[Namespace]:
    with port_2049():
        assert not pids("ganesha.nfsd"), "another ganesha.nfsd runs (port 2049 is taken)"
        had_rpcbind = bool(pids("rpcbind"))
        namespace = Namespace(tmp_path / "sbin", private=PRIVATE)
        try:
            yield namespace
        finally:
            namespace.shell("pkill -x ganesha.nfsd; while pgrep -x ganesha.nfsd >/dev/null; "
                            "do sleep 0.2; done; spoolfs umount /mnt/spool", cwd=ROOT)
            if not had_rpcbind:
                subprocess.run(["pkill", "-x", "rpcbind"])
            namespace.close()


def follow(ns: Namespace, lines: list[str], cwd: Path) -> None:
    for line in lines:
        res = ns.shell(line.replace("SERVER", LOOPBACK), cwd=cwd)
        assert res.returncode == 0, f"README line {line!r} exited {res.returncode}:\n" \
                                    f"{res.stdout}{res.stderr}"
    # The daemons these lines started are orphans the test process adopts (it is their
    # subreaper): reap them when they exit, as init would, or they would linger as zombies
    # that pgrep still finds.
    for name in ("spoolfs", "ganesha.nfsd", "rpcbind"):
        for pid in pids(name):
            watch_daemon(pid)


def listing(ns: Namespace, path: str) -> list[str]:
    return sorted(ns.ok("ls", "-A", path).split())


def _client_sees(c: NfsClient, path: str) -> list[str] | None:
    try:
        return sorted(c.listdir(path))
    except OSError:
        return None


def device_minor(ns: Namespace) -> int:
    """The anonymous device number of the mount on /mnt/spool (read from the mount table)."""
    major, _, minor = ns.ok("findmnt", "-n", "-o", "MAJ:MIN", "/mnt/spool").strip().partition(":")
    assert major == "0", major
    return int(minor)


def exported_daemon() -> int:
    """The daemon the section started: the spoolfs process serving /mnt/spool with
    ``nfs_export`` (other spoolfs daemons may run on the machine)."""
    for pid in pids("spoolfs"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"/mnt/spool" in args and b"nfs_export" in args:
            return pid
    raise AssertionError("no spoolfs daemon serves /mnt/spool with -o nfs_export")


def test_the_readme_nfs_section_word_for_word(ns: Namespace, tmp_path: Path) -> None:
    server_lines, client_lines, restart_lines = blocks()
    follow(ns, server_lines, cwd=ROOT)
    assert "fuse.spoolfs" in ns.ok("findmnt", "-n", "-o", "FSTYPE", "/mnt/spool")
    exported_daemon()
    # a client that mounted before anything below happens, and stays
    old3, old4 = client(3), client(4)
    try:
        workdir = tmp_path / "client"
        workdir.mkdir()
        follow(ns, client_lines, cwd=workdir)
        assert listing(ns, "/mnt/spool/jobs/ready") == ["job1"]
        assert ns.ok("cat", "/mnt/spool/jobs/ready/job1") == "hello\n"
        old4.mkdir("jobs/working/w1")
        old4.rename("jobs/ready/job1", "jobs/working/w1/job1")  # the claim, over NFSv4
        assert listing(ns, "/mnt/spool/jobs/working/w1") == ["job1"]

        pid = exported_daemon()
        minor = device_minor(ns)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: process_exited(pid), timeout=10, what="the daemon to die")
        with pytest.raises(OSError):
            old3.listdir("jobs/ready")  # clients see errors
        # The new mount must get the old device number, as on a quiet machine: the suite's
        # other mounts are kept out meanwhile (helpers/devices.py). A mount made otherwise
        # can still take it; the lines are then followed again, as an operator would.
        for _ in range(10):
            with mounting(alone=True), numbers_below_held(minor, tmp_path / "held"):
                follow(ns, restart_lines, cwd=ROOT)
            if device_minor(ns) == minor:
                break
        assert device_minor(ns) == minor, "other mounts kept taking the device number"
        # ... then go on: the v3 client with the file handles it had. libnfs cannot
        # re-establish an NFSv4 client's state on a new connection ("nfs_service failed"; a
        # kernel client does): the v4 client connects again, and finds its claim where it was.
        assert wait_until(lambda: _client_sees(old3, "jobs/working/w1"), timeout=30,
                          what="the NFSv3 client to see the spool again") == ["job1"]
        old4.close()
        old4 = client(4)
        assert sorted(old4.listdir("jobs/working/w1")) == ["job1"]
        old4.rename("jobs/working/w1/job1", "jobs/success/job1")
        old3.write_file("jobs/ready/after", b"after\n")
        assert listing(ns, "/mnt/spool/jobs/ready") == ["after"]
    finally:
        old3.close()
        old4.close()


def test_the_linux_client_mount_line_has_the_promised_options() -> None:
    text = " ".join(section().split())
    line = re.search(r"`(mount -t nfs -o (\S+) SERVER:/spool /mnt/spool)`", text)
    assert line, "the section shows no Linux client mount line"
    options = line.group(2).split(",")
    assert {"noac", "lookupcache=none"} <= set(options)
    assert "noac" in text and "lookupcache=none" in text
    # the export the line mounts is the example's pseudo path
    conf = (ROOT / "mount-examples" / "ganesha.conf").read_text()
    assert re.search(r"(?m)^\s*Pseudo = /spool;", conf)
    assert re.search(r"(?m)^\s*Path = /mnt/spool;", conf)
