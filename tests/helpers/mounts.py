"""Mounts: a spoolfs daemon started as ``[sys.executable, "-m", "spoolfs", ...]``, its log,
its unmount; whether FUSE is usable at all.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from helpers.procs import (
    describe_status,
    exit_status,
    ok,
    process_exited,
    run,
    spoolfs_cli,
    watch_daemon,
)
from helpers.waiting import MOUNT_TIMEOUT, wait_until

PID_RE = re.compile(rb"\(pid (\d+)\)")


FUSECTL = "/sys/fs/fuse/connections"


def connection_of(path: Path) -> str | None:
    """The FUSE connection number (the mount's device minor) of a mount point."""
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
            if os.fsdecode(point) == target:
                return fields[2].decode().split(":")[1]
    return None


def abort_connection(conn: str, only_if_present: bool = False) -> None:
    """Abort a FUSE connection (fusectl): every request waiting on it fails with ENOTCONN.
    ``only_if_present``: a connection fusectl does not list has ended already."""
    if not os.path.isdir(os.path.join(FUSECTL, conn)):
        if only_if_present and os.path.isdir(os.path.join(FUSECTL)) and os.listdir(FUSECTL):
            return
        subprocess.run(["mount", "-t", "fusectl", "none", FUSECTL], capture_output=True)
    try:
        with open(os.path.join(FUSECTL, conn, "abort"), "w") as f:
            f.write("1")
    except FileNotFoundError:
        pass  # gone meanwhile


def mounted(path: Path) -> bool:
    """Whether ``path`` is in the mount table (also true for a dead FUSE mount, unlike ismount)."""
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            point = line.split()[4]
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), point)
            if os.fsdecode(point) == target:
                return True
    return False


#: The suite's processes mount and unmount under this lock, shared; a test that needs its
#: mount's device number back after a restart holds it alone (helpers/devices.py), so that no
#: other mount of the suite takes the number or frees one below it meanwhile.
MOUNTING_LOCK = Path(tempfile.gettempdir()) / "spoolfs-tests-mounting.lock"
_mounting_alone = False


@contextmanager
def mounting(alone: bool = False) -> Iterator[None]:
    """Hold ``MOUNTING_LOCK``: shared, or ``alone``. Inside a hold alone, a nested hold is
    the same one."""
    global _mounting_alone
    if _mounting_alone:
        yield
        return
    fd = os.open(MOUNTING_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        _mounting_alone = alone
        yield
    finally:
        _mounting_alone = False
        os.close(fd)


def new_store(path: Path) -> Path:
    """A new, empty store at ``path``, made as an operator makes one (``spoolfs format``)."""
    made = spoolfs_cli("format", str(path))
    assert made.returncode == 0, made.stderr.decode(errors="replace")
    return path


class Mount:
    """One spoolfs daemon, started like an operator starts it (``spoolfs STORE MNT``)."""

    #: mounts that are currently up; the failure-report hook shows their logs
    live: set[Mount] = set()

    def __init__(self, store: Path, path: Path, log: Path, *, queue: str | None = None,
                 extra: Sequence[str] = ()) -> None:
        self.store = store
        self.path = path
        self.log = log
        self.queue = queue
        self.extra = list(extra)
        self._pid: int | None = None
        self._log_offset = 0
        self.last_stderr = ""  # what the last mount command said on stderr

    def __repr__(self) -> str:
        return f"Mount({self.store} on {self.path})"

    @property
    def argv(self) -> list[str]:
        argv = [str(self.store), str(self.path), "--log-file", str(self.log), "--log-level",
                "debug"]
        if self.queue is not None:
            argv += ["--queue", self.queue]
        return argv + self.extra

    def start(self, timeout: float = MOUNT_TIMEOUT) -> Mount:
        """Mount; returns once the daemon's parent has exited 0 and the mount is ready."""
        if not mounted(self.path):  # a dead mount there answers ENOTCONN: spoolfs detaches it
            self.path.mkdir(parents=True, exist_ok=True)
        if ":" not in str(self.store) and not (Path(self.store) / "meta.db").exists():
            new_store(self.store)
        self._log_offset = self.log_size()
        self._pid = None
        with mounting():
            res = spoolfs_cli(*self.argv, timeout=timeout)
        self.last_stderr = res.stderr.decode(errors="replace")
        if res.returncode != 0:
            if mounted(self.path):
                Mount.live.add(self)  # so teardown still removes it
            raise AssertionError(
                f"`spoolfs {' '.join(self.argv)}` exited {res.returncode}\n"
                f"stderr: {res.stderr.decode(errors='replace')}\nlog:\n{self.log_tail()}")
        Mount.live.add(self)
        assert os.path.ismount(self.path), (
            f"mount command returned 0 but {self.path} is not a mount point yet\n{self.log_tail()}")
        pid = self._find_pid()
        if pid is not None:
            self._adopt(pid)
        return self

    def _adopt(self, pid: int) -> None:
        self._pid = pid
        watch_daemon(pid)

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except FileNotFoundError:
            return 0

    def log_text(self, since: int = 0) -> str:
        try:
            data = self.log.read_bytes()
        except FileNotFoundError:
            return ""
        if len(data) < since:  # the daemon truncated the log: show all of it
            since = 0
        return data[since:].decode(errors="replace")

    def log_tail(self, since: int = 0, lines: int = 200) -> str:
        text = self.log_text(since).splitlines()
        cut = "" if len(text) <= lines else f"[... {len(text) - lines} earlier lines]\n"
        tail = "\n".join(line if len(line) <= 500 else line[:500] + " [...]"
                         for line in text[-lines:])
        return cut + tail

    def _find_pid(self) -> int | None:
        try:
            data = self.log.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) < self._log_offset:
            self._log_offset = 0
        found = PID_RE.findall(data[self._log_offset:])
        return int(found[-1]) if found else None

    @property
    def pid(self) -> int:
        """The daemon's pid, from the ``mounted ... (pid N)`` line of its log."""
        if self._pid is None:
            self._adopt(wait_until(self._find_pid, timeout=5.0,
                                   what=f"a '(pid N)' line in {self.log}"))
        assert self._pid is not None
        return self._pid

    def daemon_alive(self) -> None:
        """Raise if the daemon has died (for ``wait_until(alive=...)``)."""
        if self._pid is not None and process_exited(self._pid):
            raise AssertionError(f"spoolfs daemon {self._pid} died: "
                                 f"{describe_status(exit_status(self._pid))}\n{self.log_tail()}")

    def umount(self, timeout: float = MOUNT_TIMEOUT) -> subprocess.CompletedProcess[bytes]:
        """``spoolfs umount``; asserts success, and waits until the daemon has exited."""
        pid = self.pid
        with mounting():
            res = spoolfs_cli("umount", str(self.path), timeout=timeout)
        assert res.returncode == 0, (f"spoolfs umount exited {res.returncode}: "
                                     f"{res.stderr.decode(errors='replace')}\n{self.log_tail()}")
        Mount.live.discard(self)
        assert not mounted(self.path), f"{self.path} still mounted after spoolfs umount"
        wait_until(lambda: process_exited(pid), timeout=timeout, what=f"daemon {pid} to exit")
        return res

    def restart(self) -> Mount:
        self.umount()
        return self.start()

    def kill9(self) -> None:
        """SIGKILL the daemon, then clear the dead mount with ``fusermount3 -u -z``.

        A daemon killed while one of its threads was in the kernel sending an invalidation
        can leave that thread waiting for a directory lock held by a request that waits for
        the dead daemon: the connection then outlives the process, and requests hang. As an
        operator would, abort the connection through fusectl then."""
        pid = self.pid
        conn = connection_of(self.path)
        os.kill(pid, signal.SIGKILL)
        try:
            wait_until(lambda: process_exited(pid), timeout=5, what=f"daemon {pid} to die")
        except AssertionError:
            if conn is None:
                raise
            # shown with a failure: the dead daemon's connections (to a database) stayed open
            print(f"daemon {pid} still there 5 s after SIGKILL: aborting its FUSE connection",
                  file=sys.stderr)
            abort_connection(conn)
            wait_until(lambda: process_exited(pid), timeout=10, what=f"daemon {pid} to die")
        ok("fusermount3", "-u", "-z", str(self.path))
        Mount.live.discard(self)
        if conn is not None:
            # A thread of the daemon stuck in the kernel keeps the connection alive after the
            # process is reaped: processes whose cwd is in the detached mount would hang on it.
            # Aborting a connection that already ended does nothing.
            abort_connection(conn, only_if_present=True)
        wait_until(lambda: not mounted(self.path), timeout=10, what=f"{self.path} to unmount")

    def close(self) -> None:
        """Teardown: unmount by any means and make sure the daemon is gone."""
        if self not in Mount.live and not mounted(self.path):
            return
        conn = connection_of(self.path)
        pid = self._pid if self._pid is not None else self._find_pid()
        try:
            spoolfs_cli("umount", str(self.path), timeout=20)
        except subprocess.TimeoutExpired:
            pass
        if mounted(self.path):
            run(["fusermount3", "-u", "-z", str(self.path)])
        if mounted(self.path) and conn is not None:
            abort_connection(conn)  # a dead daemon's connection held by a stuck thread
        Mount.live.discard(self)
        if pid is not None:
            try:
                wait_until(lambda: process_exited(pid), timeout=10, what="daemon exit")
            except AssertionError:
                os.kill(pid, signal.SIGKILL)
                wait_until(lambda: process_exited(pid), timeout=10, what="killed daemon exit")
        if mounted(self.path):
            raise AssertionError(f"could not unmount {self.path}")

#: ``mounter(store=None, path=None, *, queue=None, extra=(), start=True) -> Mount`` (conftest)
MountFactory = Callable[..., Mount]


def fuse_problems() -> list[str]:
    """What keeps real mounts from working here (empty when FUSE is usable)."""
    problems = []
    if not os.path.exists("/dev/fuse"):
        problems.append("/dev/fuse is missing")
    elif not os.access("/dev/fuse", os.R_OK | os.W_OK):
        problems.append("/dev/fuse is not readable and writable")
    if shutil.which("fusermount3") is None:
        problems.append("fusermount3 is not on PATH")
    for tool in ("getfattr", "setfattr", "fallocate"):
        if shutil.which(tool) is None:
            problems.append(f"{tool} is not on PATH")
    return problems


def wait_foreground_mount(proc: subprocess.Popen[bytes], mnt: Path, output: Path) -> None:
    """Wait until ``spoolfs -f`` (``proc``, writing to ``output``) has mounted ``mnt``."""
    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"spoolfs -f exited {proc.returncode}: "
                                 f"{output.read_text(errors='replace')}")
        return os.path.ismount(mnt)
    wait_until(up, timeout=30, what="spoolfs -f to mount")


def stop_foreground(proc: subprocess.Popen[bytes], mnt: Path) -> None:
    """Make sure a ``spoolfs -f`` a test started is gone, and its mount with it."""
    if proc.poll() is None:
        if mounted(mnt):
            run(["fusermount3", "-u", "-z", mnt])
        proc.kill()
        proc.wait()

