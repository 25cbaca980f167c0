"""Only content is immutable: mode, owner and times of a message change in every state, as the
kernel's permission checks allow, so that ordinary tools that set them after the copy
(``shutil.move``, ``install -m``, ``cp -p``/``-a``) report the publish that worked as done.
Replacing a name in ``partial/`` is an upload's business (``sed -i``); a pending message is
never replaced. Times behave as POSIX says: atime apart from mtime, ctime on every change."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.inspection import expect_errno, ls, read, renameat2
from helpers.procs import ok
from helpers.queues import Queue

pytestmark = pytest.mark.fuse


@pytest.fixture
def q(fresh_queue: Callable[[], Queue]) -> Queue:
    return fresh_queue()

RENAME_NOREPLACE = 1
T = 1_900_000_000


def outside(tmp_path: Path, name: str, data: bytes, mode: int = 0o640) -> Path:
    f = tmp_path / name
    f.write_bytes(data)
    f.chmod(mode)
    os.utime(f, ns=(T * 10**9, T * 10**9))
    return f


def test_shutil_move_and_copy_into_ready_report_success(q: Queue, tmp_path: Path) -> None:
    src = outside(tmp_path, "moved", b"moved\n")
    subprocess.run([sys.executable, "-c", "import shutil, sys; shutil.move(*sys.argv[1:])",
                    src, q.ready], check=True)  # copy2, then unlink: no PermissionError
    assert not src.exists(), "shutil.move finished: the source is gone, no duplicate left"
    st = os.stat(q.ready / "moved")
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_mtime_ns == T * 10**9
    assert read(q.ready / "moved") == b"moved\n"
    shutil.copy(outside(tmp_path, "copied", b"c\n"), q.ready)
    shutil.copy2(outside(tmp_path, "copied2", b"c2\n"), q.ready)
    assert ls(q.ready) == ["copied", "copied2", "moved"]


def test_install_and_cp_preserve_into_ready(q: Queue, tmp_path: Path) -> None:
    src = outside(tmp_path, "f", b"f\n", 0o600)
    ok("install", "-m", "644", src, q.ready)
    assert stat.S_IMODE(os.stat(q.ready / "f").st_mode) == 0o644
    ok("cp", "-p", src, q.ready / "g")
    st = os.stat(q.ready / "g")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_mtime_ns == T * 10**9


def test_metadata_changes_in_every_state_content_stays_immutable(q: Queue) -> None:
    places = q.populate()
    for state, path in places.items():
        ok("chmod", "0600", path)
        ok("chown", "0:0", path)
        ok("touch", "-m", "-d", f"@{T}", path)
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_mtime_ns == T * 10**9, state
        if state != "partial":
            expect_errno(errno.EPERM, open, path, "r+b")
            expect_errno(errno.EPERM, os.truncate, path, 0)


def test_sed_i_in_partial_replaces_the_upload(q: Queue) -> None:
    q.put("f", b"hello world\n")
    ok("sed", "-i", "s/world/spool/", q.partial / "f")
    assert read(q.partial / "f") == b"hello spool\n"
    assert ls(q.partial) == ["f"]
    ok("mv", q.partial / "f", q.ready / "f")
    assert read(q.ready / "f") == b"hello spool\n"


def test_pending_messages_are_never_replaced(q: Queue) -> None:
    q.put("a", b"a\n")
    q.put("b", b"b\n")
    expect_errno(errno.EEXIST, renameat2, q.partial / "a", q.partial / "b", RENAME_NOREPLACE)
    q.publish("r1")
    q.publish("r2")
    expect_errno(errno.EEXIST, os.rename, q.ready / "r1", q.ready / "r2")
    q.claim("r1")
    q.claim("r2")
    expect_errno(errno.EEXIST, os.rename, q.consumer() / "r1", q.consumer() / "r2")
    os.rename(q.partial / "a", q.partial / "b")
    assert ls(q.partial) == ["b"] and read(q.partial / "b") == b"a\n"


def test_cp_a_of_a_directory_into_partial_makes_a_batch(q: Queue, tmp_path: Path) -> None:
    src = tmp_path / "batch"
    (src / "sub").mkdir(parents=True)
    (src / "one").write_bytes(b"1\n")
    (src / "sub" / "two").write_bytes(b"2\n")
    (src / "one").chmod(0o600)
    src.chmod(0o750)
    ok("cp", "-a", src, q.partial)
    assert stat.S_IMODE(os.stat(q.partial / "batch").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(q.partial / "batch" / "one").st_mode) == 0o600
    ok("mv", q.partial / "batch", q.ready)
    assert read(q.ready / "batch" / "sub" / "two") == b"2\n"


@pytest.mark.parametrize("where", ["partial", "ready"])
def test_atime_is_kept_apart_from_mtime(q: Queue, where: str) -> None:
    q.put("f", b"x\n") if where == "partial" else q.publish("f", b"x\n")
    path = q.state(where) / "f"
    mtime = os.stat(path).st_mtime_ns
    ok("touch", "-a", "-d", f"@{T}", path)
    st = os.stat(path)
    assert (st.st_atime_ns, st.st_mtime_ns) == (T * 10**9, mtime)


def _tick_past(ctime_ns: int, probe: Path) -> None:
    """Wait until the kernel's file clock (coarse: a few ms a tick) has passed ``ctime_ns``,
    shown by a probe file's change time, so that the next change must show a later one."""
    while True:
        os.utime(probe)
        if os.stat(probe).st_ctime_ns > ctime_ns:
            return


def test_ctime_moves_on_write_truncate_and_o_trunc(q: Queue, tmp_path: Path) -> None:
    path = q.partial / "f"
    probe = tmp_path / "probe"
    probe.touch()
    changes = [("write", lambda fd: os.write(fd, b"more")),
               ("ftruncate", lambda fd: os.ftruncate(fd, 1)),
               ("truncate", lambda fd: os.truncate(path, 0)),
               ("O_TRUNC", lambda fd: os.close(os.open(path, os.O_WRONLY | os.O_TRUNC)))]
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        before = os.fstat(fd).st_ctime_ns
        for what, change in changes:
            _tick_past(before, probe)
            change(fd)
            ctime = os.stat(path).st_ctime_ns
            assert ctime > before, f"ctime did not move on {what}"
            before = ctime
    finally:
        os.close(fd)


def test_a_file_and_a_batch_never_replace_each_other_in_partial(q: Queue) -> None:
    """As rename(2) on any file system: a file onto a directory is EISDIR, a directory onto a
    file ENOTDIR, a directory onto a non-empty one ENOTEMPTY; nothing is lost."""
    q.put("f", b"f\n")
    os.mkdir(q.partial / "b")
    (q.partial / "b" / "inside").write_bytes(b"in\n")
    os.mkdir(q.partial / "empty")
    expect_errno(errno.EISDIR, os.rename, q.partial / "f", q.partial / "b")
    expect_errno(errno.ENOTDIR, os.rename, q.partial / "b", q.partial / "f")
    expect_errno(errno.ENOTEMPTY, os.rename, q.partial / "empty", q.partial / "b")
    assert read(q.partial / "b" / "inside") == b"in\n" and read(q.partial / "f") == b"f\n"
    os.rename(q.partial / "b", q.partial / "empty")
    assert ls(q.partial) == ["empty", "f"]
    assert read(q.partial / "empty" / "inside") == b"in\n"


def test_ctime_of_a_direct_publish_is_when_it_appeared(q: Queue) -> None:
    path = q.ready / "f"
    with open(path, "wb") as f:
        f.write(b"x\n")
    st = os.stat(path)
    assert st.st_ctime_ns >= st.st_mtime_ns, "ctime went back to the upload's creation"
