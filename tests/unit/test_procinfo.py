"""Reading how a process ends from /proc (fuse/procinfo.py), on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from helpers.nfs import port_2049
from helpers.waiting import wait_until
from spoolfs.fuse import procinfo


def test_a_name_with_spaces_and_parentheses_does_not_shift_the_fields(tmp_path: Path) -> None:
    odd = tmp_path / "a) R 1 (b"  # the command name shows as this in /proc/PID/stat
    odd.symlink_to("/bin/sleep")
    p = subprocess.Popen([str(odd), "600"])
    try:
        wait_until(lambda: Path(f"/proc/{p.pid}/comm").read_text().strip() == odd.name,
                   what="sleep to run under its odd name")
        fields = procinfo._fields(p.pid)
        assert fields is not None and fields[1] == str(os.getpid())  # its parent: us
        assert procinfo.exit_status(p.pid) is None  # running
        assert procinfo.child_unfinished(os.getpid()) is None  # no child is ending
        assert procinfo.opener_unfinished(p.pid) is None
    finally:
        p.kill()
        p.wait()


def test_a_gone_process_tells_nothing() -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    assert procinfo.exit_status(p.pid) is None
    assert procinfo.process_of(p.pid) == p.pid


def test_statuses_read_as_people_say_them() -> None:
    assert procinfo.describe(signal.SIGKILL) == "was killed by SIGKILL"
    assert procinfo.describe(signal.SIGTERM | 0x80) == "was killed by SIGTERM"  # core dumped
    assert procinfo.describe(3 << 8) == "exited with status 3"


def test_a_thread_belongs_to_its_process() -> None:
    tids: list[int] = []
    seen = threading.Event()
    done = threading.Event()

    def thread() -> None:
        tids.append(threading.get_native_id())
        seen.set()
        done.wait()

    t = threading.Thread(target=thread)
    t.start()
    try:
        seen.wait()
        assert tids[0] != os.getpid()
        assert procinfo.process_of(tids[0]) == os.getpid()
    finally:
        done.set()
        t.join()


def test_holds_finds_a_descriptor_on_an_inode_and_passes_over_pipes(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x")
    ino = f.stat().st_ino
    assert not procinfo.holds(os.getpid(), ino)
    r, w = os.pipe()  # a pipe's link is not a path: never read further
    fd = os.open(f, os.O_RDONLY)
    try:
        assert procinfo.holds(os.getpid(), ino)
        assert not procinfo.holds(os.getpid(), ino + 1_000_000)
    finally:
        os.close(fd)
        os.close(r)
        os.close(w)
    assert not procinfo.holds(os.getpid(), ino)
    assert not procinfo.holds(2**22 + 12345, ino), "a process that is gone holds nothing"


def _named(tmp_path: Path, name: str) -> subprocess.Popen[bytes]:
    exe = tmp_path / name
    exe.symlink_to("/bin/sleep")
    p = subprocess.Popen([str(exe), "600"])
    wait_until(lambda: Path(f"/proc/{p.pid}/comm").read_text().strip() == name,
               what=f"sleep to run as {name}")
    return p


def test_the_nfs_server_is_known_by_its_process_name(tmp_path: Path) -> None:
    """``-o nfs_export`` treats requests of nfs-ganesha as the server's; a user process
    calling itself ``nfsd`` is not the kernel's (those are kernel threads)."""
    # a process named ganesha.nfsd: an NFS test would take it for a server on port 2049
    with port_2049():
        server, impostor = _named(tmp_path, "ganesha.nfsd"), _named(tmp_path, "nfsd")
        try:
            assert procinfo.nfs_server(server.pid)
            assert not procinfo.nfs_server(impostor.pid)
            assert not procinfo.nfs_server(os.getpid())
            assert not procinfo.nfs_server(2 ** 22 + 1)  # no such process
            seen: list[bool] = []
            t = threading.Thread(target=lambda: seen.append(procinfo.nfs_server(
                threading.get_native_id())))
            t.start()
            t.join()
            assert seen == [False]  # a thread is judged by its process
        finally:
            for p in (server, impostor):
                p.kill()
                p.wait()


def test_a_descriptor_closed_while_its_fdinfo_is_read_is_passed_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc answers ENOENT to the read of an fdinfo file whose descriptor has just closed
    (seen under load, ending a close in EIO): that descriptor holds nothing."""
    f = tmp_path / "f"
    f.write_bytes(b"x")
    real_read = os.read

    def read(fd: int, n: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}").startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory")
        return real_read(fd, n)

    with open(f, "rb"):
        monkeypatch.setattr(os, "read", read)
        assert procinfo.holds(os.getpid(), f.stat().st_ino) is False


@pytest.mark.parametrize("size", [0, 100, procinfo._CHUNK, 2 * procinfo._CHUNK + 7])
def test_a_file_is_read_whole_however_its_reads_fall(tmp_path: Path, size: int) -> None:
    f = tmp_path / "f"
    f.write_bytes(os.urandom(size))
    assert procinfo._read(str(f)) == f.read_bytes()


def test_a_stopped_process_reads_the_same_by_descriptor_as_through_a_file(
        monkeypatch: pytest.MonkeyPatch) -> None:
    p = subprocess.Popen(["sleep", "600"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        wait_until(lambda: (procinfo._fields(p.pid) or ["?"])[0] == "T", what="sleep to stop")
        stat = f"/proc/{p.pid}/stat"  # nothing in it moves while the process is stopped
        assert procinfo._read(stat) == Path(stat).read_bytes()
        monkeypatch.setattr(procinfo, "_CHUNK", 64)  # many reads for one file
        assert procinfo._read(stat) == Path(stat).read_bytes()
        status = procinfo._read(f"/proc/{p.pid}/status")  # SigQ, say, may move: its start
        assert status.startswith(b"Name:\tsleep\n") and b"\nTgid:\t%d\n" % p.pid in status
        assert status.endswith(b"\n") and len(status) > 64 * 4
        assert procinfo.process_of(p.pid) == p.pid
    finally:
        p.kill()
        p.wait()
