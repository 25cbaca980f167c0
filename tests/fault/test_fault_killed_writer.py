"""A writer that did not finish never publishes (DESIGN §3, direct publish into ``ready/``).

Real producers are killed or fail mid-write: ``cp`` by SIGKILL, ``dd`` by SIGTERM, a shell or
Python exiting non-zero with the file still open. Each leaves its file an upload in
``partial/`` holding the bytes written so far; nothing appears in ``ready/``. Writers that end
well (a live ``cp`` closing, ``printf`` exiting 0) still publish.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.inspection import ls, read, xattr_text
from helpers.mounts import Mount
from helpers.procs import ok, run
from helpers.queues import Queue
from helpers.waiting import wait_until

pytestmark = pytest.mark.fuse

MB = 1 << 20


def staged_bytes(m: Mount) -> int:
    """Bytes in the store's staging files: what uploads hold so far (hidden ones included)."""
    total = 0
    for p in (m.store / "staging").rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except FileNotFoundError:
            continue
    return total


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1] \
                    == str(pid):
                found.append(int(p))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def wait_staged(m: Mount, at_least: int, writer: subprocess.Popen[bytes], since: int) -> None:
    """Wait until ``writer`` has written ``at_least`` bytes (the staging files held ``since``
    bytes before it started)."""
    def alive() -> None:
        if writer.poll() is not None:
            raise AssertionError(f"the writer exited ({writer.returncode}) before writing "
                                 f"{at_least} bytes")
    wait_until(lambda: staged_bytes(m) - since >= at_least, timeout=60, alive=alive,
               what=f"{at_least} bytes staged")


def test_cp_killed_by_sigkill_leaves_its_bytes_in_partial(
        module_mount: Mount, fresh_queue: Callable[[], Queue], tmp_path: Path) -> None:
    q = fresh_queue()
    # cp reads a FIFO fed here: it is stopped exactly after the first megabyte.
    fifo = tmp_path / "source"
    os.mkfifo(fifo)
    before = staged_bytes(module_mount)
    cp = subprocess.Popen(["cp", "--", str(fifo), str(q.ready / "big")],
                          stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = os.urandom(MB)
    with open(fifo, "wb") as feed:
        feed.write(first)
        feed.flush()
        wait_staged(module_mount, MB, cp, before)
        cp.send_signal(signal.SIGKILL)
        assert cp.wait(timeout=60) == -signal.SIGKILL
    assert ls(q.ready) == []
    assert ls(q.partial) == ["big"]
    assert read(q.partial / "big") == first
    assert "killed by SIGKILL" in xattr_text(q.partial / "big", "user.spool.history")
    assert "killed by SIGKILL" in module_mount.log_text()


def test_dd_terminated_leaves_its_bytes_in_partial(
        module_mount: Mount, fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    before = staged_bytes(module_mount)
    dd = subprocess.Popen(["dd", "if=/dev/zero", f"of={q.ready / 'out'}", "bs=64k"],
                          stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_staged(module_mount, 2 * MB, dd, before)
    dd.send_signal(signal.SIGTERM)
    assert dd.wait(timeout=60) == -signal.SIGTERM
    assert ls(q.ready) == []
    data = read(q.partial / "out")
    assert len(data) >= 2 * MB and data == bytes(len(data))
    assert "killed by SIGTERM" in xattr_text(q.partial / "out", "user.spool.history")


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_shell_exiting_non_zero_leaves_partial(fresh_queue: Callable[[], Queue],
                                               shell: str) -> None:
    """dash opens ``> ready/f`` itself and runs the command as its child; bash opens it in
    the child: either way the failed command's end decides."""
    q = fresh_queue()
    res = run([shell, "-c", "sh -c 'printf x; exit 1' > ready/f"], cwd=q.path)
    assert res.returncode == 1
    assert ls(q.ready) == []
    assert read(q.partial / "f") == b"x"
    assert "exited with status 1" in xattr_text(q.partial / "f", "user.spool.history")


def test_command_of_a_shell_killed_mid_write_leaves_partial(
        module_mount: Mount, fresh_queue: Callable[[], Queue]) -> None:
    """``producer > ready/out`` run by dash: the shell holds the file and restores its own
    stdout after the command was killed; that close is not a finished write."""
    q = fresh_queue()
    before = staged_bytes(module_mount)
    sh = subprocess.Popen(["sh", "-c", "dd if=/dev/zero bs=64k > ready/out; true"], cwd=q.path,
                          stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_staged(module_mount, MB, sh, before)
    dd = children(sh.pid)
    assert len(dd) == 1
    os.kill(dd[0], signal.SIGKILL)
    assert sh.wait(timeout=60) == 0
    assert ls(q.ready) == []
    data = read(q.partial / "out")
    assert len(data) >= MB and data == bytes(len(data))
    assert "SIGKILL" in xattr_text(q.partial / "out", "user.spool.history")


def python_writer_leaves_x_in_partial(q: Queue, script: str, status: int) -> None:
    """Run ``script`` writing ``x`` into ``ready/f``; it exits ``status``: ``f`` is left in
    ``partial/``."""
    res = run(["python3", "-c", script, str(q.ready / "f")])
    assert res.returncode == status
    assert ls(q.ready) == []
    assert read(q.partial / "f") == b"x"


def test_python_os_exit_3_leaves_partial(fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    script = ("import os, sys; f = open(sys.argv[1], 'w'); f.write('x'); f.flush(); "
              "os._exit(3)")
    python_writer_leaves_x_in_partial(q, script, 3)


def test_thread_of_a_failing_process_leaves_partial(fresh_queue: Callable[[], Queue]) -> None:
    """FUSE names the thread that opened the file, which may be gone before the process's
    last thread closes it: the process's end decides."""
    q = fresh_queue()
    script = ("import os, sys, threading, time\n"
              "files = []\n"
              "def writer():\n"
              "    files.append(open(sys.argv[1], 'w'))\n"
              "    files[0].write('x'); files[0].flush()\n"
              "t = threading.Thread(target=writer)\n"
              "t.start(); t.join()\n"
              # the opening thread is gone from /proc, its file still open
              "while os.path.exists(f'/proc/self/task/{t.native_id}'):\n"
              "    time.sleep(0.01)\n"
              "os._exit(4)\n")
    python_writer_leaves_x_in_partial(q, script, 4)


def test_writers_that_finish_still_publish(fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    src = q.source(b"copied\n")
    ok("cp", "--", str(src), str(q.ready / "copied"))
    ok("sh", "-c", "/usr/bin/printf x > ready/external", cwd=q.path)
    ok("sh", "-c", "printf y > ready/builtin", cwd=q.path)
    assert ls(q.ready) == ["builtin", "copied", "external"]
    assert read(q.ready / "copied") == b"copied\n"
    assert read(q.ready / "external") == b"x"
    assert read(q.ready / "builtin") == b"y"
    assert ls(q.partial) == []


def test_child_writing_after_its_killed_parent_writes_into_partial(
        fresh_queue: Callable[[], Queue]) -> None:
    """The opener's end decides; a child that inherited the descriptor keeps writing into
    the upload, which is in partial/ by then."""
    q = fresh_queue()
    script = ("import os, sys, time\n"
              "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)\n"
              "os.write(fd, b'parent ')\n"
              "r, w = os.pipe()\n"
              "if os.fork() == 0:\n"
              "    os.close(w)\n"
              "    os.read(r, 1)\n"  # until the parent is gone
              "    os.write(fd, b'child')\n"
              "    os._exit(0)\n"
              "os._exit(5)\n")
    res = run(["python3", "-c", script, str(q.ready / "f")])
    assert res.returncode == 5
    wait_until(lambda: read(q.partial / "f") == b"parent child" if ls(q.partial) else False,
               timeout=30, what="the child's bytes in partial/f")
    assert ls(q.ready) == []


def test_writer_killed_at_100_random_points_never_publishes_a_short_file(
        module_mount: Mount, fresh_queue: Callable[[], Queue], tmp_path: Path) -> None:
    """The acceptance test of the issue: SIGKILL of a 50 MB ``cp`` into ``ready/`` at 100
    random points; ``ready/`` shows the whole file or nothing, ``partial/`` a prefix."""
    q = fresh_queue()
    data = os.urandom(50 * MB)
    src = tmp_path / "source"
    src.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    dst = q.ready / "big"

    def check_round(i: int) -> None:
        names = ls(q.ready)
        if names:
            assert names == ["big"], f"round {i}: ready/ holds {names}"
            assert dst.stat().st_size == len(data), \
                f"round {i}: ready/big has {dst.stat().st_size} of {len(data)} bytes"
            assert hashlib.sha256(dst.read_bytes()).hexdigest() == digest, f"round {i}"
            ok("rm", "--", str(dst))
        for name in ls(q.partial):
            part = (q.partial / name).read_bytes()
            assert data.startswith(part), f"round {i}: partial/{name} is not a prefix"
            ok("rm", "--", str(q.partial / name))

    # One full copy gives the span over which the kill points are spread (no assertion on it).
    start = time.monotonic()
    ok("cp", "--", str(src), str(dst))
    span = time.monotonic() - start
    check_round(-1)

    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    killed_mid_copy = 0
    for i in range(100):
        cp = subprocess.Popen(["cp", "--", str(src), str(dst)], stdin=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0, span * 1.1))
        cp.send_signal(signal.SIGKILL)
        if cp.wait(timeout=120) == -signal.SIGKILL:
            killed_mid_copy += 1
        check_round(i)

    assert killed_mid_copy > 0
    ok("cp", "--", str(src), str(dst))
    assert ls(q.ready) == ["big"]
    assert hashlib.sha256(dst.read_bytes()).hexdigest() == digest
    assert ls(q.partial) == []
