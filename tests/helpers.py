"""Helpers for the real-mount tests: run spoolfs and the shell tools, wait by polling.

Everything here drives the mount the way users do: the daemon is started as
``[sys.executable, "-m", "spoolfs", ...]`` and the tree is changed by real ``mv``/``cp``/``ln``
processes. Python ``os`` calls are used only where a process cannot express the check (an exact
errno, ``renameat2`` flags, holding a file open across a rename).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

STATES = ("partial", "ready", "working", "success", "error")
PID_RE = re.compile(rb"\(pid (\d+)\)")
#: How many times slower than a quiet developer machine this one may be (SPOOLFS_TEST_SLOW;
#: CI at a load average of 20 on 2 cores needs about 5). Every deadline a test waits for is
#: multiplied by it: a deadline only bounds how long a broken test takes to fail, never how long
#: a passing one takes, so the default is generous.
SLOW = float(os.environ.get("SPOOLFS_TEST_SLOW", "5"))
CMD_TIMEOUT = 60.0
MOUNT_TIMEOUT = 30.0

Arg = str | bytes | os.PathLike[str]


# --------------------------------------------------------------------------- waiting


def patience(seconds: float) -> float:
    """A deadline of ``seconds`` on a quiet machine, stretched for this one (see ``SLOW``)."""
    return seconds * SLOW


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float = 10.0,
    what: str = "condition",
    alive: Callable[[], None] | None = None,
) -> T:
    """Poll ``predicate`` until it returns a truthy value and return that value.

    ``timeout`` is what a quiet machine needs; the deadline is ``patience(timeout)``.

    ``alive`` is called between polls and should raise when something the wait depends on has
    died (so a dead daemon fails the test at once instead of after the deadline).
    """
    timeout = patience(timeout)
    deadline = time.monotonic() + timeout
    interval = 0.002
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None:
            alive()
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
        interval = min(interval * 2, 0.05)


def stretched(first: float, attempt: Callable[[float], bool], *, what: str,
              tries: int = 3) -> None:
    """Run a scenario whose premise is "these steps fit in a span of time" (a lease, a
    duplicates window), with a span 4 times longer each time the machine was too slow for it.

    ``attempt(span)`` sets the span up on fresh objects, runs its steps and returns False when
    they took longer than the span (before it concludes anything that depends on the span),
    True once it has checked everything. The checks stay exact; only the span adapts.
    """
    span = first
    for _ in range(tries):
        if attempt(span):
            return
        span *= 4
    raise AssertionError(f"{what}: the steps never fitted in the span, up to {span / 4:g}s")


# --------------------------------------------------------------------------- processes

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
    waits for the pid to vanish would wait for us while we wait for it.
    """
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


# --------------------------------------------------------------------------- mounts


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
        self.path.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_size()
        self._pid = None
        res = spoolfs_cli(*self.argv, timeout=timeout)
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
        _EXIT_STATUS.pop(pid, None)
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
        """The daemon's pid, from the ``spoolfs: mounted ... (pid N)`` line of its log."""
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
        """SIGKILL the daemon, then clear the dead mount with ``fusermount3 -u -z``."""
        pid = self.pid
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: process_exited(pid), timeout=10, what=f"daemon {pid} to die")
        ok("fusermount3", "-u", "-z", str(self.path))
        Mount.live.discard(self)
        wait_until(lambda: not mounted(self.path), timeout=10, what=f"{self.path} to unmount")

    def close(self) -> None:
        """Teardown: unmount by any means and make sure the daemon is gone."""
        if self not in Mount.live and not mounted(self.path):
            return
        pid = self._pid if self._pid is not None else self._find_pid()
        try:
            spoolfs_cli("umount", str(self.path), timeout=20)
        except subprocess.TimeoutExpired:
            pass
        if mounted(self.path):
            run(["fusermount3", "-u", "-z", str(self.path)])
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


# --------------------------------------------------------------------------- queues


class Queue:
    """Paths of one queue plus the shell steps of its lifecycle (each step a real process)."""

    def __init__(self, path: Path, scratch: Path) -> None:
        self.path = path
        self.scratch = scratch
        self.name = path.name
        scratch.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"Queue({self.path})"

    @classmethod
    def create(cls, parent: Path, name: str, scratch: Path) -> Queue:
        ok("mkdir", str(parent / name))
        return cls(parent / name, scratch)

    @property
    def partial(self) -> Path:
        return self.path / "partial"

    @property
    def ready(self) -> Path:
        return self.path / "ready"

    @property
    def working(self) -> Path:
        return self.path / "working"

    @property
    def success(self) -> Path:
        return self.path / "success"

    @property
    def error(self) -> Path:
        return self.path / "error"

    def state(self, name: str) -> Path:
        return self.path / name

    def consumer(self, name: str = "w1") -> Path:
        """The consumer view ``working/NAME`` (``mkdir`` registers it)."""
        view = self.working / name
        if not view.exists():
            ok("mkdir", str(view))
        return view

    def source(self, data: bytes) -> Path:
        """A file outside the mount holding ``data`` (what ``cp`` copies in)."""
        fd, name = tempfile.mkstemp(dir=self.scratch, prefix="src-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return Path(name)

    def put(self, name: str, data: bytes | None = None) -> bytes:
        """Upload into ``partial/`` with ``cp``."""
        data = make_content(name) if data is None else data
        ok("cp", "--", str(self.source(data)), str(self.partial / name))
        return data

    def publish(self, name: str, data: bytes | None = None) -> bytes:
        """``cp`` into ``partial/``, then ``mv`` to ``ready/``."""
        data = self.put(name, data)
        ok("mv", "--", str(self.partial / name), str(self.ready / name))
        return data

    def claim(self, name: str, consumer: str = "w1") -> Path:
        view = self.consumer(consumer)
        ok("mv", "--", str(self.ready / name), str(view) + "/")
        return view / name

    def finish(self, name: str, consumer: str = "w1", to: str = "success") -> Path:
        ok("mv", "--", str(self.working / consumer / name), str(self.state(to)) + "/")
        return self.state(to) / name

    def populate(self) -> dict[str, Path]:
        """One message in every state: partial/p, ready/r, working/w1/w, success/s, error/e."""
        self.put("p", b"partial content\n")
        for name in ("r", "w", "s", "e"):
            self.publish(name, f"message {name}\n".encode())
        self.claim("w")
        for name, to in (("s", "success"), ("e", "error")):
            self.claim(name)
            self.finish(name, to=to)
        return {"partial": self.partial / "p", "ready": self.ready / "r",
                "working": self.working / "w1" / "w", "success": self.success / "s",
                "error": self.error / "e"}


def make_content(name: str | bytes, size: int = 0) -> bytes:
    """Distinct content for a message: its name, then ``size`` random bytes."""
    head = os.fsencode(name) + b"\n"
    return head + os.urandom(size)


# --------------------------------------------------------------------------- inspection


def ls(path: Arg) -> list[str]:
    """The entries ``ls -A`` shows, sorted (NUL-separated, so any name survives)."""
    out = ok("ls", "-A", "--zero", "--", path)
    return sorted(os.fsdecode(n) for n in out.split(b"\0") if n)


def visible(names: Iterable[str]) -> list[str]:
    return sorted(n for n in names if not n.startswith("."))


def read(path: Arg) -> bytes:
    """File content as ``cat`` reads it."""
    return ok("cat", "--", path)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def getxattr(path: Arg, name: str) -> bytes:
    """``getfattr --only-values``: the raw value."""
    return ok("getfattr", "--absolute-names", "--only-values", "-n", name, "--", path)


def xattr_text(path: Arg, name: str) -> str:
    return getxattr(path, name).decode().strip()


def listxattr(path: Arg, pattern: str = "-") -> set[str]:
    """Attribute names ``getfattr -m PATTERN`` lists."""
    out = ok("getfattr", "--absolute-names", "-m", pattern, "--", path).decode()
    return {line for line in out.splitlines() if line and not line.startswith("#")}


def setxattr(path: Arg, name: str, value: str) -> None:
    ok("setfattr", "-n", name, "-v", value, "--", path)


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Everything observable about a tree: per entry its kind, inode, size, mode and content hash.

    Used to prove that a refused operation changed nothing.
    """
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if ".spool" in dirnames:  # live control files (§7), not part of the queue state
            dirnames.remove(".spool")
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in dirnames:
            out[os.path.join(rel, name)] = ("dir",)
        for name in filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            with open(full, "rb") as f:
                digest = sha256(f.read())
            out[os.path.join(rel, name)] = ("file", st.st_ino, st.st_size, st.st_mode, digest)
    return out


def expect_errno(code: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> OSError:
    """Call ``fn`` and assert it fails with exactly ``code``."""
    what = f"{getattr(fn, '__name__', fn)}{args!r}"
    try:
        fn(*args, **kwargs)
    except OSError as e:
        got = errno.errorcode.get(e.errno or 0, str(e.errno))
        assert e.errno == code, f"{what}: expected {errno.errorcode[code]}, got {got} ({e})"
        return e
    raise AssertionError(f"{what} succeeded, expected {errno.errorcode[code]}")


# --------------------------------------------------------------------------- raw syscalls

_libc = ctypes.CDLL(None, use_errno=True)
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_uint]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
RENAME_WHITEOUT = 4


def renameat2(src: Arg, dst: Arg, flags: int) -> None:
    """``renameat2(2)`` (os.rename cannot pass flags)."""
    if _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(src), None, os.fsdecode(dst))


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """``fallocate(2)`` itself: glibc's posix_fallocate would emulate it by writing zeros."""
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# --------------------------------------------------------------------------- environment


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


def consumed_names(log: Path) -> list[str]:
    """Lines of a claim log written by a shell consumer."""
    if not log.exists():
        return []
    return [os.fsdecode(line) for line in log.read_bytes().split(b"\n") if line]



# --------------------------------------------------------------------------- shell consumers

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


def blob_files(store: Path, data: bytes) -> list[str]:
    """The blob files of the store that hold ``data`` (content over the inline limit)."""
    return sorted(p.name for p in (store / "blobs").rglob(sha256(data) + "*"))
