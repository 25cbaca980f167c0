"""A private mount namespace for tests that run commands as an admin types them (mount(8),
README lines): mounts made there, and the tmpfs laid over directories such as /mnt or
/etc/ganesha, leave the machine's own files and mounts as they are.

mount(8) hands its helper no PATH: mount.fuse3 runs ``spoolfs`` through /bin/sh, which looks on
its default PATH, /usr/local/sbin first; a directory holding this installation's ``spoolfs`` is
bound over /usr/local/sbin (and a tmpfs over /run/mount, libmount's state).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from helpers.procs import process_exited
from helpers.waiting import patience

PID_RE = re.compile(r"\(pid (\d+)\)")


def daemon_pid(log: Path) -> int:
    found = PID_RE.findall(log.read_text(errors="replace")) if log.exists() else []
    assert found, f"no '(pid N)' line in {log}"
    return int(found[-1])


def run(argv: Sequence[str | Path], env: dict[str, str] | None = None,
        timeout: float = 60.0, cwd: str | Path = "/") -> subprocess.CompletedProcess[str]:
    """Run a command; output goes to files, not pipes, which a forked daemon would hold open."""
    args = [str(a) for a in argv]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        res = subprocess.run(args, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                             timeout=patience(timeout), env=env, cwd=cwd)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(args, res.returncode, out.read(), err.read())


def spoolfs_program(where: Path) -> Path:
    """A ``spoolfs`` in ``where`` that is this installation's: its console script, as the
    README installs it (``ln -s .venv/bin/spoolfs``), else ``python -m spoolfs``."""
    where.mkdir(parents=True, exist_ok=True)
    program = where / "spoolfs"
    script = Path(sys.executable).parent / "spoolfs"
    if os.access(script, os.X_OK):
        program.symlink_to(script)
    else:
        program.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m spoolfs "$@"\n')
        program.chmod(0o755)
    return program


NAMESPACE_SETUP = r"""
mkdir -p /usr/local/sbin /run/mount &&
mount --bind "$1" /usr/local/sbin &&
mount -t tmpfs -o mode=755 tmpfs /run/mount &&
shift && for d in "$@"; do mkdir -p "$d" && mount -t tmpfs -o mode=755 tmpfs "$d" || exit 1; done &&
echo ready && exec sleep 600
"""


class Namespace:
    """A private mount namespace where mount(8) finds this installation's ``spoolfs``, with
    an empty tmpfs over each of ``private`` (directories a test writes as root would)."""

    def __init__(self, bindir: Path, private: Sequence[str] = ()) -> None:
        spoolfs_program(bindir)
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--",
             "sh", "-c", NAMESPACE_SETUP, "namespace", str(bindir), *private],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.holder.stdout is not None and self.holder.stderr is not None
        line = self.holder.stdout.readline()
        if line != "ready\n":
            self.holder.kill()
            raise AssertionError(f"cannot set up a mount namespace: {self.holder.stderr.read()}")
        self.daemons: list[int] = []
        self.mountpoints: list[Path] = []

    def run(self, *argv: str | Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return run(["nsenter", "-t", str(self.holder.pid), "-m", "--", *argv], timeout=timeout)

    def shell(self, line: str, cwd: Path, timeout: float = 60.0
              ) -> subprocess.CompletedProcess[str]:
        """One line of shell, as a user types it, in ``cwd``."""
        return run(["nsenter", "-t", str(self.holder.pid), "-m", "--", "bash", "-c",
                    f"cd {shlex.quote(str(cwd))} && {line}"], timeout=timeout)

    def ok(self, *argv: str | Path) -> str:
        res = self.run(*argv)
        assert res.returncode == 0, f"{' '.join(map(str, argv))} exited {res.returncode}: " \
                                    f"{res.stderr.strip()}"
        return res.stdout

    def findmnt(self, path: Path) -> dict[str, str] | None:
        """The mount at ``path`` as this namespace sees it."""
        res = self.run("findmnt", "-n", "-P", "-o", "FSTYPE,SOURCE,OPTIONS", "--mountpoint",
                       path)
        if res.returncode != 0:
            return None
        return dict(re.findall(r'(\w+)="([^"]*)"', res.stdout))

    def mount(self, *argv: str | Path, log: Path, mountpoint: Path) -> int:
        """Run ``mount ARGV`` here; returns the pid of the daemon it started."""
        self.mountpoints.append(mountpoint)
        res = self.run("mount", *argv)
        log_text = log.read_text(errors="replace") if log.exists() else "(no log)"
        assert res.returncode == 0, f"mount exited {res.returncode}: {res.stderr}\n{log_text}"
        pid = daemon_pid(log)
        self.daemons.append(pid)
        return pid

    def close(self) -> None:
        try:
            for mnt in self.mountpoints:
                if self.findmnt(mnt) is not None:
                    self.run("umount", "-l", mnt)
            for pid in self.daemons:
                deadline = time.monotonic() + patience(15)
                while not process_exited(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not process_exited(pid):
                    os.kill(pid, signal.SIGKILL)
        finally:
            self.holder.kill()
            self.holder.wait()
            for stream in (self.holder.stdout, self.holder.stderr):
                if stream is not None:
                    stream.close()


