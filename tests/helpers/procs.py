"""Processes: run commands and the spoolfs CLI as users do, watch how they end, and
background shells and claimer loops that a test starts and stops.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from helpers.waiting import CMD_TIMEOUT, MOUNT_TIMEOUT, patience, wait_until

Arg = str | bytes | os.PathLike[str]
_EXIT_STATUS: dict[int, int] = {}


def become_subreaper() -> None:
    """Adopt orphaned descendants (the forked daemons) so their exit can be observed exactly."""
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_CHILD_SUBREAPER = 36
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def watch_daemon(pid: int) -> None:
    """Reap ``pid`` as soon as it exits, as init would (we are its subreaper).

    Without this a dead daemon stays a zombie of the test process, and a ``spoolfs umount`` that
    waits for the pid to vanish would wait for us while we wait for it. A status remembered
    for an earlier process of the same pid is forgotten.
    """
    _EXIT_STATUS.pop(pid, None)

    def reap() -> None:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return
        _EXIT_STATUS[pid] = status

    threading.Thread(target=reap, name=f"reap-{pid}", daemon=True).start()


def process_exited(pid: int) -> bool:
    """True once ``pid`` has exited (reaping it when it is our child or adopted orphan)."""
    try:
        wpid, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    else:
        if wpid == pid:
            _EXIT_STATUS[pid] = status
            return True
        return False
    if pid in _EXIT_STATUS:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def exit_status(pid: int) -> int | None:
    """The wait status of an exited daemon, when this process reaped it."""
    return _EXIT_STATUS.get(pid)


def describe_status(status: int | None) -> str:
    if status is None:
        return "unknown (not reaped here)"
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"


def run(argv: Sequence[Arg], *, input: bytes | None = None, cwd: Arg | None = None,
        timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess[bytes]:
    """Run a short-lived tool, capturing stdout and stderr as bytes."""
    return subprocess.run(list(argv), input=input, cwd=cwd, capture_output=True,
                          timeout=patience(timeout),
                          stdin=None if input is not None else subprocess.DEVNULL)


def _show(argv: Sequence[Arg]) -> str:
    return " ".join(repr(os.fsdecode(a)) if isinstance(a, bytes) else str(a) for a in argv)


def ok(*argv: Arg, input: bytes | None = None, cwd: Arg | None = None,
       timeout: float = CMD_TIMEOUT) -> bytes:
    """Run a tool that must succeed; return its stdout."""
    res = run(argv, input=input, cwd=cwd, timeout=timeout)
    assert res.returncode == 0, (
        f"`{_show(argv)}` exited {res.returncode}: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout


def fails(*argv: Arg, message: str | None = None, cwd: Arg | None = None) -> str:
    """Run a tool that must fail (non-zero exit), optionally with ``message`` in its stderr."""
    res = run(argv, cwd=cwd)
    err = res.stderr.decode(errors="replace")
    assert res.returncode != 0, f"`{_show(argv)}` succeeded but must fail"
    if message is not None:
        assert message in err, \
            f"`{_show(argv)}` failed, but stderr lacks {message!r}: {err.strip()}"
    return err


def spoolfs_cli(*args: Arg, timeout: float = MOUNT_TIMEOUT) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m spoolfs ARGS``.

    Output goes to anonymous files, not pipes: a daemon that inherits the parent's stdout must
    not keep this call waiting for EOF. The call returns when the spoolfs process itself exits.
    """
    argv = [sys.executable, "-m", "spoolfs", *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                             timeout=patience(timeout), cwd="/")
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, res.returncode, out.read(), err.read())


def one_line_error(res: subprocess.CompletedProcess[bytes]) -> str:
    """Assert the DESIGN §9 error shape: non-zero exit, exactly one clear line, no traceback."""
    err = res.stderr.decode(errors="replace")
    assert res.returncode != 0, f"expected a non-zero exit, got 0 (stderr: {err!r})"
    assert "Traceback" not in err, f"error printed a traceback instead of one line:\n{err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one line on stderr, got {len(lines)}:\n{err}"
    return lines[0]


def consumed_names(log: Path) -> list[str]:
    """Lines of a claim log written by a shell consumer."""
    if not log.exists():
        return []
    return [os.fsdecode(line) for line in log.read_bytes().split(b"\n") if line]

# A consumer as a shell user writes one: claim whatever ready/ lists with mv, log each win.
# Runs until ready/ looks empty (or LIMIT seconds pass: exit 3, so a livelock fails loudly).
CLAIM_LOOP = r"""
shopt -s nullglob
cd "$1" || exit 2
c=$2 log=$3 err=$4 limit=$5
while (( SECONDS < limit )); do
  files=(ready/*)
  (( ${#files[@]} == 0 )) && exit 0
  for f in "${files[@]}"; do
    mv -- "$f" "working/$c/" 2>>"$err" && printf '%s\n' "${f#ready/}" >> "$log"
  done
done
exit 3
"""


def start_claimers(queue_dirs: Sequence[Path], consumers: Sequence[str], logdir: Path,
                   limit: int = 120) -> list[tuple[str, subprocess.Popen[bytes], Path, Path]]:
    """Start one ``bash`` claim loop per consumer; consumer i uses ``queue_dirs[i % len]``."""
    logdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, c in enumerate(consumers):
        log, err = logdir / f"claims-{c}", logdir / f"errors-{c}"
        qdir = queue_dirs[i % len(queue_dirs)]
        p = subprocess.Popen(["bash", "-c", CLAIM_LOOP, "claim", str(qdir), c, str(log), str(err),
                              str(int(patience(limit)))],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
        procs.append((c, p, log, err))
    return procs


def finish_claimers(procs: list[tuple[str, subprocess.Popen[bytes], Path, Path]],
                    timeout: float = 150) -> dict[str, list[str]]:
    """Wait for the claim loops; return each consumer's claims and check losers saw ENOENT."""
    claims: dict[str, list[str]] = {}
    problems = []
    for c, p, log, err in procs:
        try:
            _, stderr = p.communicate(timeout=patience(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            problems.append(f"consumer {c} did not finish in {patience(timeout):g}s")
            continue
        if p.returncode != 0:
            problems.append(
                f"consumer {c} exited {p.returncode}: {stderr.decode(errors='replace')}")
        claims[c] = consumed_names(log)
        if err.exists():
            # A lost race is ENOENT (DESIGN §3: "the others get ENOENT"), nothing else.
            odd = [line for line in err.read_text(errors="replace").splitlines()
                   if "No such file or directory" not in line]
            if odd:
                problems.append(f"consumer {c} saw other errors than ENOENT: {odd[:5]}")
    assert not problems, "\n".join(problems)
    return claims


class Procs:
    """Background shells (each in its own process group), killed at teardown."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def sh(self, script: str, *args: object, cwd: Path) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["sh", "-c", script, "sh", *map(str, args)], cwd=cwd,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
        self.started.append(p)
        return p

    @staticmethod
    def kill(p: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate()

    def close(self) -> None:
        for p in self.started:
            if p.poll() is None:
                self.kill(p)
            else:
                p.communicate()


def wait_open(p: subprocess.Popen[bytes], path: Path) -> None:
    """Wait until process ``p`` (or a child of its shell) has ``path`` open, seen in /proc."""
    def holds() -> bool:
        if p.poll() is not None:
            err = p.stderr.read().decode(errors="replace") if p.stderr else ""
            raise AssertionError(f"process {p.pid} exited ({p.returncode}) before opening "
                                 f"{path}: {err}")
        for fd in os.listdir(f"/proc/{p.pid}/fd"):
            try:
                if os.readlink(f"/proc/{p.pid}/fd/{fd}") == str(path):
                    return True
            except FileNotFoundError:
                continue
        return False
    wait_until(holds, timeout=10, what=f"process {p.pid} to open {path}")


def cli(*args: object) -> str:
    """``spoolfs ARGS`` that must succeed; its stdout."""
    res = spoolfs_cli(*map(str, args))
    assert res.returncode == 0, (f"`spoolfs {' '.join(map(str, args))}` exited {res.returncode}: "
                                 f"{res.stderr.decode(errors='replace').strip()}")
    return res.stdout.decode()

