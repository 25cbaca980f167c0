"""Removing a file now, its space freed where waiting holds nobody else up
(blobs/freeing.py): the name goes at once; a large file's blocks stay held by the descriptor
``detach`` returns until it is closed (the caller does so in a worker thread); a small one is
freed by a thread nobody waits for, and a file with another name keeps its blocks."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest

from spoolfs.blobs import freeing
from spoolfs.blobs.files import BlobDir


def test_a_large_file_is_gone_at_once_and_freed_at_the_close(tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(4 << 20))
    reader = os.open(f, os.O_RDONLY)
    os.fsync(reader)  # (its blocks allocated)
    os.close(reader)
    fd = freeing.detach(str(f))
    assert fd is not None and not f.exists()
    assert freeing.holds_space(fd) and os.fstat(fd).st_size == 4 << 20
    freeing.close_all([fd])
    assert freeing.detach(str(f)) is None  # no such file: nothing to do


def _closes_in(monkeypatch: pytest.MonkeyPatch) -> dict[int, str]:
    """Which thread closes each descriptor from now on."""
    real, seen = os.close, {}

    def close(fd: int) -> None:
        seen[fd] = threading.current_thread().name
        real(fd)

    monkeypatch.setattr(os, "close", close)
    return seen


def test_a_small_file_is_gone_at_once_and_freed_by_a_thread_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Freeing one block takes 0.2-0.4 ms where the file system discards: not on the
    caller's thread, and nobody waits for it."""
    small = tmp_path / "small"
    small.write_bytes(b"x" * 1000)
    freeing.CLOSER.drain()
    closes = _closes_in(monkeypatch)
    assert freeing.detach(str(small)) is None and not small.exists()
    freeing.CLOSER.drain()
    assert list(closes.values()) == ["spoolfs-closer"]
    empty = tmp_path / "empty"  # nothing to free: no descriptor
    empty.touch()
    assert freeing.detach(str(empty)) is None and not empty.exists()
    freeing.CLOSER.drain()
    assert len(closes) == 1


def test_the_last_close_of_a_removed_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """``close_small``: a file with a name, at once; a small removed one, by the closer; a
    large removed one is given back to be closed where its request waits."""
    fds = {}
    for name, size in (("linked", 1000), ("small", 1000), ("large", 1 << 20)):
        (tmp_path / name).write_bytes(b"x" * size)
        fds[name] = os.open(tmp_path / name, os.O_RDONLY)
        os.fsync(fds[name])
    os.unlink(tmp_path / "small")
    os.unlink(tmp_path / "large")
    closes = _closes_in(monkeypatch)
    assert freeing.close_small(fds["linked"]) is None
    assert closes == {fds["linked"]: threading.current_thread().name}
    assert freeing.close_small(fds["small"]) is None
    freeing.CLOSER.drain()
    assert closes[fds["small"]] == "spoolfs-closer"
    assert freeing.close_small(fds["large"]) == fds["large"]
    freeing.close_all([fds["large"]])


def test_a_closer_without_a_thread_closes_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    closer = freeing.Closer()
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    r, w = os.pipe()
    closer.close_soon(r)
    closer.close_soon(w)
    closer.drain()
    for fd in (r, w):
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_closer_behind_the_disk_holds_a_bounded_number(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A disk slower at freeing than files are removed: the closer holds at most ``limit``
    descriptors (each one counts against the open-files limit, and the disk guard sees their
    blocks freed only when closed); past that its caller closes at once, at the disk's pace,
    and the log says so once."""
    caplog.set_level(logging.INFO, logger="spoolfs.blobs.freeing")
    stuck, inline = threading.Event(), []
    real = os.close

    def close(fd: int) -> None:
        if threading.current_thread().name == "spoolfs-closer":
            stuck.wait(10)
        else:
            inline.append(fd)
        real(fd)

    monkeypatch.setattr(os, "close", close)
    closer = freeing.Closer(limit=3)
    pipes = [os.pipe() for _ in range(3)]
    fds = [fd for pair in pipes for fd in pair]
    for fd in fds:
        closer.close_soon(fd)
    assert inline == fds[3:]  # (the first is being closed, the next two wait: three held)
    stuck.set()
    closer.drain()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert sum("behind" in r.getMessage() for r in caplog.records) == 1
    later = os.pipe()
    for fd in later:  # room again
        closer.close_soon(fd)
    closer.drain()
    assert inline == fds[3:]


def test_other_names_keep_the_blocks(tmp_path: Path) -> None:

    staging, blob = tmp_path / "staging", tmp_path / "blob"
    staging.write_bytes(os.urandom(1 << 20))
    os.link(staging, blob)  # a published upload: its blob file is a link of it
    assert freeing.detach(str(staging)) is None  # only a name went
    assert blob.stat().st_size == 1 << 20


def test_a_reader_of_a_removed_file_holds_its_space(tmp_path: Path) -> None:
    """The last descriptor of a large removed file (a message removed while it was read)
    holds its space; one of a file that still has a name does not."""
    blobs = BlobDir(str(tmp_path / "blobs"))
    f = tmp_path / "m"
    f.write_bytes(os.urandom(1 << 20))
    reader = os.open(f, os.O_RDONLY)
    assert not freeing.holds_space(reader)
    held = freeing.detach(str(f))
    assert held is not None
    freeing.close_all([held])  # the reader still holds it
    assert freeing.holds_space(reader)
    freeing.close_all([reader])  # freed at that close
    assert blobs.detach(b"\0" * 32, 7) is None  # (a blob store's: none there)


def test_a_file_removed_meanwhile_or_no_descriptor_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Removed by another (gc, another daemon) between the look and the unlink: the
    descriptor is handed back if it now holds the file, closed if not. Out of descriptors:
    removed the plain way."""
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(1 << 20))
    real_unlink = os.unlink

    def raced(path: str) -> None:
        real_unlink(path)
        raise FileNotFoundError(path)
    monkeypatch.setattr(freeing.os, "unlink", raced)
    fd = freeing.detach(str(f))
    assert fd is not None and freeing.holds_space(fd)  # this descriptor is the file's last
    freeing.close_all([fd])
    monkeypatch.setattr(freeing.os, "unlink", real_unlink)

    f.write_bytes(os.urandom(1 << 20))

    def no_descriptors(*args: object, **kw: object) -> int:
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(freeing.os, "open", no_descriptors)
    assert freeing.detach(str(f)) is None and not f.exists()


def test_a_writers_lock_descriptor_that_holds_a_removed_file_is_closed_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``close_later``: closed in a thread of its own, and here when no thread can start."""
    import threading

    closed: list[str] = []
    real_close_all = freeing.close_all

    def close_all(fds: list[int]) -> None:
        closed.append(threading.current_thread().name)
        real_close_all(fds)
    monkeypatch.setattr(freeing, "close_all", close_all)
    for _ in range(2):
        (tmp_path / "f").write_bytes(b"x")
        freeing.close_later(os.open(tmp_path / "f", os.O_RDONLY))
    for _ in range(500):
        if len(closed) == 2:
            break
        threading.Event().wait(0.005)
    assert closed == ["spoolfs-freeing"] * 2

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    closed.clear()
    freeing.close_later(os.open(tmp_path / "f", os.O_RDONLY))
    assert closed == [threading.current_thread().name]
