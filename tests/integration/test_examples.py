"""The shipped examples work as documented: ``mount-examples/producer.sh`` and ``consumer.sh``
against a real mount, and ``spoolfs.service`` as systemd reads it.

The daemon is started as an operator starts it, ``python -m spoolfs STORE MNT``; its log is
printed at teardown, which pytest shows only for a failing test.
"""

from __future__ import annotations

import configparser
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.mounts import new_store
from helpers.waiting import patience

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "mount-examples"
PRODUCER = EXAMPLES / "producer.sh"
CONSUMER = EXAMPLES / "consumer.sh"
UNIT = EXAMPLES / "spoolfs.service"

MESSAGES = 200
CONSUMERS = 3
TIMEOUT = 120.0


@dataclass
class Spool:
    store: Path
    path: Path
    log: Path

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"


def spoolfs(*args: str | Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``python -m spoolfs ARGS``. Output goes to files, not pipes: the forked daemon must not
    hold this call open until it exits."""
    argv = [sys.executable, "-m", "spoolfs", *map(str, args)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        res = subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                             timeout=patience(timeout), cwd="/")
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, res.returncode, out.read(), err.read())


def in_mount_table(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def exited(pid: int) -> bool:
    """True once the daemon is gone (reaping it if this process adopted it)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    timeout = patience(timeout)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[Spool]:
    s = Spool(new_store(tmp_path / "store"), tmp_path / "mnt", tmp_path / "spoolfs.log")
    s.path.mkdir()
    res = spoolfs(s.store, s.path, "--log-file", s.log)
    assert res.returncode == 0, f"mount failed: {res.stderr}\n{s.log_text()}"
    assert os.path.ismount(s.path), f"spoolfs returned before mounting\n{s.log_text()}"
    found = re.findall(r"\(pid (\d+)\)", s.log_text())
    pid = int(found[-1]) if found else None
    try:
        yield s
    finally:
        res = spoolfs("umount", s.path)
        if in_mount_table(s.path):
            subprocess.run(["fusermount3", "-u", "-z", str(s.path)], check=False,
                           capture_output=True)
        if pid is not None:
            wait_for(lambda: exited(pid), f"daemon {pid} to exit")
        print(f"---- {s.log} ----\n{s.log_text()}")
        assert res.returncode == 0, f"spoolfs umount failed: {res.stderr}"


def run(argv: list[str | Path], env: dict[str, str] | None = None,
        timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], check=False, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=patience(timeout),
                          env={**os.environ, **(env or {})})


def ls(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def getfattr(path: Path, name: str) -> str:
    res = run(["getfattr", "--absolute-names", "--only-values", "-n", name, path])
    assert res.returncode == 0, f"getfattr {name} {path}: {res.stderr}"
    return res.stdout


@pytest.mark.fuse
def test_producer_and_three_draining_consumers_finish_every_file_once(spool: Spool) -> None:
    queue = spool.path / "jobs"
    produced = run([PRODUCER], env={"SPOOL": str(spool.path), "QUEUE": "jobs",
                                    "COUNT": str(MESSAGES), "PREFIX": "msg", "BYTES": "300"})
    assert produced.returncode == 0, produced.stderr
    names = [f"msg-{i:06d}" for i in range(1, MESSAGES + 1)]
    assert produced.stdout.split() == names
    assert ls(queue / "partial") == []
    assert ls(queue / "ready") == names
    digests = {n: hashlib.sha256((queue / "ready" / n).read_bytes()).hexdigest() for n in names}

    procs = {
        f"c{i}": subprocess.Popen(
            [str(CONSUMER), "-s", str(spool.path), "-q", "jobs", "-c", f"c{i}", "--drain"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(CONSUMERS)
    }
    outputs = {}
    for c, p in procs.items():
        try:
            out, err = p.communicate(timeout=patience(TIMEOUT))
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            raise
        assert p.returncode == 0, f"consumer {c} exited {p.returncode}: {err}"
        outputs[c] = out

    # Each consumer printed one `sha256sum` line per message it processed.
    processed: Counter[str] = Counter()
    for c, out in outputs.items():
        for line in out.splitlines():
            digest, path = line.split(maxsplit=1)
            name = Path(path).name
            assert Path(path).parent.name == c, f"{c} processed a file outside its view: {line}"
            assert digest == digests[name], f"{name}: processed content differs from published"
            processed[name] += 1
    assert {n: k for n, k in processed.items() if k != 1} == {}, "processed more than once"
    assert sorted(processed) == names, "some messages were never processed"
    assert sum(1 for out in outputs.values() if out) >= 2, "one consumer did all the work"

    assert ls(queue / "success") == names
    assert ls(queue / "ready") == [] and ls(queue / "error") == []
    assert ls(queue / "working") == [], "a drained consumer leaves no view behind"
    for n in names[:: MESSAGES // 10]:
        assert getfattr(queue / "success" / n, "user.spool.sha256") == digests[n]
        assert getfattr(queue / "success" / n, "user.spool.attempts") == "1"


@pytest.mark.fuse
def test_failed_command_sends_the_message_to_error_with_its_reason(spool: Spool) -> None:
    published = run([PRODUCER, "-s", spool.path, "-q", "q", "-n", "4", "-p", "m"])
    assert published.returncode == 0, published.stderr
    fail_even = 'case $1 in *[02468]) exit 3;; esac; cat -- "$1" >/dev/null'
    res = run([CONSUMER, "-s", spool.path, "-q", "q", "-c", "w1", "-H", "0.1", "--drain",
               "--", "bash", "-c", fail_even, "cmd"])
    assert res.returncode == 0, res.stderr
    q = spool.path / "q"
    assert ls(q / "success") == ["m-000001", "m-000003"]
    assert ls(q / "error") == ["m-000002", "m-000004"]
    assert getfattr(q / "error" / "m-000002", "user.spool.error") == "bash exited 3"
    assert "m-000004 -> error" in res.stderr


@pytest.mark.fuse
def test_consumer_first_finishes_what_its_view_already_holds(spool: Spool) -> None:
    """A consumer that died mid-message left it in working/NAME/: the next run finishes it."""
    assert run([PRODUCER, "-s", spool.path, "-q", "q", "-n", "2", "-p", "m"]).returncode == 0
    q = spool.path / "q"
    (q / "working" / "w1").mkdir()
    os.rename(q / "ready" / "m-000001", q / "working" / "w1" / "m-000001")
    res = run([CONSUMER, "-s", spool.path, "-q", "q", "-c", "w1", "--drain", "--", "true"])
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == "consumer w1: m-000001 -> success"
    assert ls(q / "success") == ["m-000001", "m-000002"]


@pytest.mark.fuse
def test_producer_publishes_given_files_under_their_names(spool: Spool, tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    for name in ("a.csv", "b c.txt"):
        (src / name).write_text(f"{name}\n")
    res = run([PRODUCER, "-s", spool.path, "-q", "edi", src / "a.csv", src / "b c.txt"])
    assert res.returncode == 0, res.stderr
    assert ls(spool.path / "edi" / "ready") == ["a.csv", "b c.txt"]
    again = run([PRODUCER, "-s", spool.path, "-q", "edi", src / "a.csv"])
    assert again.returncode != 0 and "File exists" in again.stderr, \
        "a waiting message must never be replaced"


# ---- the systemd unit ---------------------------------------------------------------------


def unit() -> configparser.ConfigParser:
    ini = configparser.ConfigParser(strict=False, interpolation=None)
    ini.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    ini.read(UNIT)
    return ini


def exec_argv(value: str) -> list[str]:
    return shlex.split(value.lstrip("-@:+!"))


def test_systemd_unit_mounts_the_default_store_and_unmounts_with_spoolfs_umount(
        tmp_path: Path) -> None:
    ini = unit()
    assert set(ini.sections()) == {"Unit", "Service", "Install"}
    svc = ini["Service"]
    assert svc["Type"] == "notify", "spoolfs -f tells systemd READY=1 once mounted"
    start, stop = exec_argv(svc["ExecStart"]), exec_argv(svc["ExecStop"])
    assert Path(start[0]).name == "spoolfs" and Path(stop[0]).name == "spoolfs"
    assert start[1:] == ["-f", "/var/lib/spoolfs", "/mnt/spool"]
    assert stop[1:] == ["umount", "/mnt/spool"]
    from spoolfs.cli.mount import parser  # the command line the unit relies on parses
    args = parser().parse_args(start[1:])
    assert args.paths == ["/var/lib/spoolfs", "/mnt/spool"] and args.foreground
    assert ini["Install"]["WantedBy"] == "multi-user.target"
    for key in ("ExecStartPre", "ExecStopPost"):
        binary = exec_argv(svc[key])[0]
        assert os.access(binary, os.X_OK), f"{key}: {binary} is not on this machine"

    analyze = shutil.which("systemd-analyze")
    if analyze is not None:  # without systemd, the checks above are all there is
        verify(analyze, tmp_path)


def verify(analyze: str, tmp_path: Path) -> None:
    """``systemd-analyze verify``, which insists that ExecStart's binary exists: the copy
    verified points at this installation's ``spoolfs``."""
    installed = Path(sys.executable).parent / "spoolfs"
    if not os.access(installed, os.X_OK):
        installed = tmp_path / "spoolfs"
        installed.write_text("#!/bin/sh\nexit 0\n")
        installed.chmod(0o755)
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace("/usr/local/bin/spoolfs", str(installed)))
    res = run([analyze, "verify", copy])
    about_unit = [line for line in (res.stdout + res.stderr).splitlines() if copy.name in line]
    assert res.returncode == 0 and about_unit == [], res.stdout + res.stderr
