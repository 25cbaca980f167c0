"""System integration, as shipped in mount-examples/: ``mount -t fuse.spoolfs`` and fstab lines
(through mount(8) and mount.fuse3, for real), systemd's ``Type=notify`` protocol, the unit
files, and where the daemon logs.

mount(8) hands its helper no PATH: mount.fuse3 runs ``spoolfs`` through /bin/sh, which looks on
its default PATH, /usr/local/sbin first. The mount(8) tests therefore run in a private mount
namespace in which a directory holding this installation's ``spoolfs`` is bound over
/usr/local/sbin (and a tmpfs over /run/mount, libmount's state): the machine's own files and
mounts are left as they are.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.mounts import (
    Mount,
    MountFactory,
    mounted,
    new_store,
    stop_foreground,
    wait_foreground_mount,
)
from helpers.namespace import Namespace, run, spoolfs_program
from helpers.procs import one_line_error, process_exited
from helpers.queues import STATES
from helpers.waiting import patience, wait_until

pytestmark = pytest.mark.fuse

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "mount-examples"
FSTAB = EXAMPLES / "fstab"
SERVICE = EXAMPLES / "spoolfs.service"
MOUNT_UNIT = EXAMPLES / "mnt-spool.mount"
CONSUMER_UNIT = EXAMPLES / "spoolfs-consumer@.service"
INSTALLED_SPOOLFS = "/usr/local/bin/spoolfs"
INSTALLED_CONSUMER = "/usr/local/lib/spoolfs/consumer.sh"
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) ")


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    wait_until(lambda: process_exited(pid), timeout=timeout, what=f"daemon {pid} to exit")


# --------------------------------------------------------------------------- mount(8), fstab


@pytest.fixture
def ns(tmp_path: Path) -> Iterator[Namespace]:
    namespace = Namespace(tmp_path / "sbin")
    try:
        yield namespace
    finally:
        namespace.close()


def test_mount_t_fuse_spoolfs_takes_spoolfs_options_and_umount_unmounts(
        ns: Namespace, mounter: MountFactory, tmp_path: Path) -> None:
    store, mnt, log = new_store(tmp_path / "store"), tmp_path / "mnt", tmp_path / "spoolfs.log"
    mnt.mkdir()
    pid = ns.mount("-t", "fuse.spoolfs", store, mnt, "-o",
                   f"queue=q,log_level=debug,log_file={log}", log=log, mountpoint=mnt)
    seen = ns.findmnt(mnt)
    assert seen is not None and seen["FSTYPE"] == "fuse.spoolfs", seen
    assert seen["SOURCE"] == str(store)
    # queue=q: the mount is rooted at queue q, made on first use
    assert ns.ok("ls", mnt).split() == sorted(STATES)
    ns.ok("sh", "-c", 'printf hello > "$1/partial/m" && mv "$1/partial/m" "$1/ready/"', "sh", mnt)
    assert ns.ok("cat", mnt / "ready" / "m") == "hello"
    text = log.read_text()
    assert "queue q created" in text
    assert any(" DEBUG " in line for line in text.splitlines()), "log_level=debug not applied"

    assert ns.ok("umount", mnt) == ""
    wait_gone(pid)
    assert ns.findmnt(mnt) is None
    assert "unmounted, store closed" in log.read_text()

    # what was published is in the store, in queue q
    again = mounter(store, tmp_path / "check")
    assert (again.path / "q" / "ready" / "m").read_bytes() == b"hello"


def fstab_example() -> list[str]:
    """The fields of the one active line of mount-examples/fstab."""
    lines = [line.split() for line in FSTAB.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) == 1, f"{FSTAB} should hold exactly one active line: {lines}"
    assert len(lines[0]) == 6, f"an fstab line has six fields: {lines[0]}"
    return lines[0]


def test_fstab_line_mounts_with_mount_T_and_spoolfs_umount_unmounts(ns: Namespace,
                                                                   tmp_path: Path) -> None:
    _, _, fstype, options, dump, passno = fstab_example()
    assert fstype == "fuse.spoolfs"
    store, mnt, log = new_store(tmp_path / "store"), tmp_path / "spool", tmp_path / "spoolfs.log"
    mnt.mkdir()
    # the example, its paths made this test's, appended to a copy of the example file
    fstab = tmp_path / "fstab"
    fstab.write_text(FSTAB.read_text()
                     + f"{store} {mnt} {fstype} {options},log_file={log} {dump} {passno}\n")
    pid = ns.mount("--fstab", fstab, mnt, log=log, mountpoint=mnt)  # mount -T FILE MNT
    seen = ns.findmnt(mnt)
    assert seen is not None and seen["FSTYPE"] == "fuse.spoolfs", seen
    assert seen["SOURCE"] == str(store)
    # FUSE's own options reach the kernel (nofail, for mount(8), does not)
    assert "allow_other" in options.split(",")
    assert {"allow_other", "default_permissions"} <= set(seen["OPTIONS"].split(",")), seen
    ns.ok("mkdir", mnt / "jobs")
    assert ns.ok("ls", mnt / "jobs").split() == sorted(STATES)

    spoolfs = tmp_path / "sbin" / "spoolfs"
    assert ns.ok(spoolfs, "umount", mnt) == ""
    assert process_exited(pid), "spoolfs umount returned before the daemon exited"
    assert ns.findmnt(mnt) is None


def unit(path: Path) -> configparser.ConfigParser:
    ini = configparser.ConfigParser(strict=False, interpolation=None)
    ini.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    ini.read(path)
    return ini


def test_mount_unit_mounts_as_systemd_mounts_it(ns: Namespace, tmp_path: Path) -> None:
    """systemd starts a .mount unit with ``mount What Where -t Type -o Options``."""
    m = unit(MOUNT_UNIT)["Mount"]
    store, mnt, log = new_store(tmp_path / "store"), tmp_path / "spool", tmp_path / "spoolfs.log"
    mnt.mkdir()
    pid = ns.mount(store, mnt, "-t", m["Type"], "-o", f"{m['Options']},log_file={log}",
                   log=log, mountpoint=mnt)
    seen = ns.findmnt(mnt)
    assert seen is not None and seen["FSTYPE"] == m["Type"] == "fuse.spoolfs", seen
    ns.ok("mkdir", mnt / "jobs")
    assert ns.ok("ls", mnt / "jobs").split() == sorted(STATES)
    assert ns.ok("umount", mnt) == ""  # what `systemctl stop` runs
    wait_gone(pid)
    assert ns.findmnt(mnt) is None


# --------------------------------------------------------------------------- Type=notify


class NotifySocket:
    """The service manager's end of sd_notify(3): a Unix datagram socket that also learns each
    sender's pid (SO_PASSCRED), as systemd does to apply NotifyAccess=main."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)

    def receive(self, timeout: float | None = 30.0) -> tuple[dict[str, str], int] | None:
        """One message as its assignments, and its sender's pid; None when none is waiting
        (``timeout=0``)."""
        self.sock.settimeout(timeout if not timeout else patience(timeout))
        try:
            data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except (BlockingIOError, TimeoutError):
            if timeout == 0:
                return None
            raise AssertionError(f"nothing on {self.address} within {timeout}s") from None
        sender = next(struct.unpack("3i", d)[0] for level, kind, d in ancillary
                      if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS)
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        return fields, sender

    def close(self) -> None:
        self.sock.close()


def test_foreground_daemon_notifies_ready_once_live_and_stopping_at_unmount(
        tmp_path: Path) -> None:
    store, mnt = new_store(tmp_path / "store"), tmp_path / "mnt"
    mnt.mkdir()
    listener = NotifySocket(str(tmp_path / "notify"))
    out = tmp_path / "stderr"
    with open(out, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "spoolfs", "-f", str(store), str(mnt)],
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err, cwd="/",
                                env={**os.environ, "NOTIFY_SOCKET": listener.address})
    try:
        got = listener.receive()
        assert got is not None
        # at READY=1 the mount is live: in the mount table, and answering
        live, listing = mounted(mnt), os.listdir(mnt)
        fields, sender = got
        assert fields.get("READY") == "1", (fields, out.read_text())
        assert live and [n for n in listing if not n.startswith(".")] == []
        assert fields["MAINPID"] == str(proc.pid) and sender == proc.pid, \
            "under NotifyAccess=main systemd only listens to the main process"
        assert fields["STATUS"] == f"mounted {store} on {mnt}"
        assert listener.receive(timeout=0) is None, "STOPPING=1 before anyone unmounted"

        res = run([sys.executable, "-m", "spoolfs", "umount", mnt])
        assert res.returncode == 0, res.stderr
        got = listener.receive()
        assert got is not None and got[0].get("STOPPING") == "1" and got[1] == proc.pid, got
        assert proc.wait(timeout=patience(15)) == 0
    finally:
        stop_foreground(proc, mnt)
        listener.close()


def test_forked_daemon_notifies_ready_with_its_pid_before_spoolfs_returns(
        mounter: MountFactory, store: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without -f the process systemd started exits: MAINPID names the daemon (which systemd
    accepts with NotifyAccess=all). An abstract socket name, as systemd uses, starts with @."""
    listener = NotifySocket(f"@spoolfs-test-{uuid.uuid4().hex}")
    monkeypatch.setenv("NOTIFY_SOCKET", listener.address)
    try:
        m = mounter(store, tmp_path / "mnt")  # `spoolfs STORE MNT` has returned
        got = listener.receive(timeout=0)
        assert got is not None, "READY=1 must be sent before spoolfs returns"
        fields, sender = got
        assert fields["READY"] == "1" and fields["MAINPID"] == str(m.pid) == str(sender)
        monkeypatch.delenv("NOTIFY_SOCKET")
        m.umount()
        got = listener.receive()
        assert got is not None and got[0] == {"STOPPING": "1", "STATUS": "unmounting"} \
            and got[1] == m.pid, got
    finally:
        listener.close()


# --------------------------------------------------------------------------- logs


def foreground(store: Path, mnt: Path, *args: str, env: dict[str, str] | None = None,
               stderr: Path) -> tuple[int, str]:
    """Mount with ``spoolfs -f``, make a queue and publish into it, unmount; returns the exit
    code and what the daemon wrote on stderr."""
    mnt.mkdir(exist_ok=True)
    with open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "spoolfs", "-f", str(store), str(mnt),
                                 *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, cwd="/", env={**os.environ, **(env or {})})
    try:
        wait_foreground_mount(proc, mnt, stderr)
        os.mkdir(mnt / "q")
        (mnt / "q" / "partial" / "m").write_text("hello\n")
        os.rename(mnt / "q" / "partial" / "m", mnt / "q" / "ready" / "m")
        res = run([sys.executable, "-m", "spoolfs", "umount", mnt])
        assert res.returncode == 0, res.stderr
        return proc.wait(timeout=patience(15)), stderr.read_text(errors="replace")
    finally:
        stop_foreground(proc, mnt)


def test_foreground_logs_to_stderr_at_the_chosen_level(tmp_path: Path) -> None:
    code, text = foreground(new_store(tmp_path / "store"), tmp_path / "mnt", "--log-level", "debug",
                            stderr=tmp_path / "debug.err")
    assert code == 0, text
    lines = text.splitlines()
    assert lines and all(LOG_LINE.match(line) for line in lines), text
    assert any(re.search(r" INFO spoolfs: mounted .* \(pid \d+\)$", line)
               for line in lines), text
    assert any(" DEBUG spoolfs" in line and "publish" in line for line in lines), text

    # as an fstab line would give it, with options for mount(8) and systemd that FUSE
    # would refuse: they are dropped
    code, text = foreground(new_store(tmp_path / "store2"), tmp_path / "mnt2", "-o",
                            "log_level=warning,defaults,noauto,nofail,_netdev,relatime,"
                            "x-systemd.requires=x.service,comment=spool", stderr=tmp_path / "w.err")
    assert code == 0, text
    assert not re.search(r" (INFO|DEBUG) ", text), f"log_level=warning let through:\n{text}"


def test_foreground_under_journald_logs_priorities_without_time_stamps(tmp_path: Path) -> None:
    """systemd names the journal stream it gave as stderr in JOURNAL_STREAM (device:inode)."""
    err = tmp_path / "journal"
    err.touch()
    st = err.stat()
    code, text = foreground(new_store(tmp_path / "store"), tmp_path / "mnt",
                            env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, stderr=err)
    assert code == 0, text
    lines = text.splitlines()
    assert any(re.fullmatch(r"<6>INFO spoolfs: mounted .* \(pid \d+\)", line)
               for line in lines), text
    assert all(re.match(r"<[2-7]>", line) for line in lines), text
    assert not any(line.startswith("<7>") for line in lines), "debug lines at level info"


def test_bad_spoolfs_mount_options_are_one_line_errors(tmp_path: Path) -> None:
    store = new_store(tmp_path / "store")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for args, says in ((["-o", "log_level=loud"], "log_level=loud"),
                       (["-o", "rw,queue"], "queue needs a value"),
                       (["--queue", "a", "-o", "queue=b"], "disagree")):
        res = run([sys.executable, "-m", "spoolfs", store, mnt, *args])
        line = one_line_error(subprocess.CompletedProcess(res.args, res.returncode,
                                                          res.stdout.encode(),
                                                          res.stderr.encode()))
        assert says in line, line
        assert not mounted(mnt)


# --------------------------------------------------------------------------- unit files


def exec_argv(value: str) -> list[str]:
    return shlex.split(value.lstrip("-@:+!"))


def test_units_say_what_they_should_and_systemd_analyze_verifies_them(tmp_path: Path) -> None:
    from spoolfs.cli.mount import parser, split_options

    svc = unit(SERVICE)["Service"]
    assert svc["Type"] == "notify"
    assert svc.get("NotifyAccess", "main") == "main", "-f: the main process notifies"
    start, stop = exec_argv(svc["ExecStart"]), exec_argv(svc["ExecStop"])
    assert start == [INSTALLED_SPOOLFS, "-f", "/var/lib/spoolfs", "/mnt/spool"]
    assert stop == [INSTALLED_SPOOLFS, "umount", "/mnt/spool"]
    args = parser().parse_args(start[1:])
    assert args.foreground and args.paths == ["/var/lib/spoolfs", "/mnt/spool"]

    ini = unit(MOUNT_UNIT)
    m = ini["Mount"]
    assert (m["What"], m["Where"], m["Type"]) == ("/var/lib/spoolfs", "/mnt/spool", "fuse.spoolfs")
    assert MOUNT_UNIT.name == m["Where"].strip("/").replace("/", "-") + ".mount"
    own, passed, ignored = split_options([m["Options"]])
    assert own.get("log_level") == "info" and "allow_other" in passed and not ignored
    # the fstab example says the same as the mount unit
    what, where, fstype, options, _, _ = fstab_example()
    assert (what, where, fstype) == (m["What"], m["Where"], m["Type"])
    own, passed, ignored = split_options([options])
    assert own == {"log_level": "info"} and passed == ["allow_other"] and ignored == ["nofail"]

    consumer = unit(CONSUMER_UNIT)
    assert MOUNT_UNIT.name in consumer["Unit"]["Requires"].split()
    assert MOUNT_UNIT.name in consumer["Unit"]["After"].split()
    cs = consumer["Service"]
    argv = exec_argv(cs["ExecStart"])
    assert argv[0] == INSTALLED_CONSUMER and argv[1:] == ["-c", "%i"]
    assert cs["KillMode"] == "mixed", "SIGTERM must reach consumer.sh alone"
    assert dict(kv.split("=", 1) for kv in shlex.split(cs["Environment"]))["SPOOL"] == \
        m["Where"]

    analyze = shutil.which("systemd-analyze")
    if analyze is None:  # systemd is not installed: the checks above are all there is
        return
    # `verify` insists that the commands exist: the copies run this installation's files
    copies = tmp_path / "units"
    copies.mkdir()
    program = spoolfs_program(tmp_path / "bin")
    for path in (SERVICE, MOUNT_UNIT, CONSUMER_UNIT):
        (copies / path.name).write_text(
            path.read_text().replace(INSTALLED_SPOOLFS, str(program))
            .replace(INSTALLED_CONSUMER, str(EXAMPLES / "consumer.sh")))
    names = ["spoolfs.service", "mnt-spool.mount", "spoolfs-consumer@w1.service"]
    res = run([analyze, "verify", *(copies / n for n in names)])
    about_units = [line for line in (res.stdout + res.stderr).splitlines()
                   if any(n.split("@")[0] in line for n in names)]
    assert res.returncode == 0 and about_units == [], res.stdout + res.stderr


def test_consumer_unit_command_line_consumes_from_the_mount(mount: Mount, tmp_path: Path) -> None:
    """The template's ExecStart and Environment, with %i = w1 and the spool this test's."""
    cs = unit(CONSUMER_UNIT)["Service"]
    env = dict(kv.split("=", 1) for kv in shlex.split(cs["Environment"]))
    env["SPOOL"] = str(mount.path)
    queue = mount.path / env["QUEUE"]
    queue.mkdir()
    for name in ("a", "b"):
        (queue / "partial" / name).write_text(f"{name}\n")
        os.rename(queue / "partial" / name, queue / "ready" / name)
    argv = [a.replace("%i", "w1") for a in exec_argv(cs["ExecStart"])]
    argv[0] = str(EXAMPLES / "consumer.sh")
    res = run([*argv, "--drain"], env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    assert sorted(res.stderr.splitlines()) == ["consumer w1: a -> success",
                                               "consumer w1: b -> success"]
    assert sorted(os.listdir(queue / "success")) == ["a", "b"]
