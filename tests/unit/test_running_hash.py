"""The SHA-256 of an upload hashed while it is written (blobs/running.py): used only when every
byte was hashed as the file stands, else it gives way to hashing the whole file."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.waiting import wait_until
from spoolfs.blobs import running as running_module
from spoolfs.blobs.running import REOPENED, STEP, RunningHash, keeps_marks, mark_reopened


@pytest.fixture
def staged(tmp_path: Path) -> Iterator[tuple[str, int]]:
    path = str(tmp_path / "7")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    yield path, fd
    os.close(fd)


def write(fd: int, running: RunningHash, off: int, data: bytes) -> None:
    assert os.pwrite(fd, data, off) == len(data)
    running.wrote(off, len(data))


def digest(fd: int, running: RunningHash) -> tuple[bytes, int] | None:
    return running.digest(fd, os.fstat(fd))


@pytest.fixture
def rest_hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Where the hash at the end started reading the file (0: nothing was hashed ahead)."""
    starts: list[int] = []
    whole = running_module.hash_file

    def spy(fd: int, h: object = None, off: int = 0) -> tuple[bytes, int]:
        starts.append(off)
        return whole(fd, h, off)  # type: ignore[arg-type]

    monkeypatch.setattr(running_module, "hash_file", spy)
    return starts


def test_a_file_written_front_to_back_is_hashed_while_it_is_written(
        staged: tuple[str, int], rest_hashed: list[int]) -> None:
    path, fd = staged
    data = os.urandom(5 * STEP + 123)
    running = RunningHash(path)
    at = 0
    for size in (100, STEP - 100, 3 * STEP, 4096, STEP - 4096, 123):  # any sizes
        write(fd, running, at, data[at:at + size])
        at += size
    assert at == len(data)
    wait_until(lambda: running._hashed == 5 * STEP, what="the thread to reach the tail")
    assert digest(fd, running) == (hashlib.sha256(data).digest(), len(data))
    assert rest_hashed == [5 * STEP]  # only the tail was left
    assert digest(fd, running) is None  # used up


def test_a_small_upload_starts_no_thread(staged: tuple[str, int]) -> None:
    path, fd = staged
    running = RunningHash(path)
    write(fd, running, 0, b"x" * (STEP - 1))
    assert running._thread is None
    assert digest(fd, running) is None  # nothing hashed ahead: hashed whole at publish


@pytest.mark.parametrize("off", [0, STEP, 3 * STEP + 1], ids=["rewrite", "middle", "hole"])
def test_a_write_not_at_the_end_breaks_it(staged: tuple[str, int], off: int) -> None:
    path, fd = staged
    running = RunningHash(path)
    write(fd, running, 0, os.urandom(3 * STEP))
    write(fd, running, off, b"changed")
    assert running.broken and digest(fd, running) is None


def test_a_file_marked_reopened_is_not_trusted(staged: tuple[str, int]) -> None:
    """Another daemon of the store writes the file without telling this one's hash: it marks
    the file first."""
    path, fd = staged
    running = RunningHash(path)
    write(fd, running, 0, os.urandom(3 * STEP))
    other = os.open(path, os.O_RDWR)
    try:
        mark_reopened(other)
        os.pwrite(other, b"changed", STEP)
    finally:
        os.close(other)
    assert os.stat(path).st_mode & REOPENED
    assert not running.broken and digest(fd, running) is None


def test_a_file_cut_behind_its_back_breaks_it(staged: tuple[str, int]) -> None:
    path, fd = staged
    running = RunningHash(path)
    write(fd, running, 0, os.urandom(STEP))
    os.ftruncate(fd, 10)
    running.end += 2 * STEP  # as a write at the end would, without its bytes
    running.wrote(running.end, 0)
    wait_until(lambda: running.broken, what="the thread to find the file short")
    assert digest(fd, running) is None


def test_an_idle_thread_ends_and_a_later_write_starts_another(
        staged: tuple[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    path, fd = staged
    monkeypatch.setattr(running_module, "IDLE_S", 0.01)
    running = RunningHash(path)
    data = os.urandom(4 * STEP)
    write(fd, running, 0, data[:2 * STEP])
    first = running._thread
    wait_until(lambda: running._thread is None, what="the idle thread to end")
    assert first is not None and running._hashed == 2 * STEP
    write(fd, running, 2 * STEP, data[2 * STEP:])
    assert running._thread not in (None, first)
    wait_until(lambda: running._hashed == 4 * STEP, what="the second thread to hash")
    assert digest(fd, running) == (hashlib.sha256(data).digest(), len(data))


def test_a_dropped_hash_stops_its_thread(staged: tuple[str, int]) -> None:
    path, fd = staged
    running = RunningHash(path)
    write(fd, running, 0, os.urandom(8 * STEP))
    thread = running._thread
    assert thread is not None
    running.drop()
    thread.join(10)
    assert not thread.is_alive() and digest(fd, running) is None


def test_a_file_cut_after_it_was_hashed_is_hashed_again(
        staged: tuple[str, int], rest_hashed: list[int]) -> None:
    path, fd = staged
    running = RunningHash(path)
    write(fd, running, 0, os.urandom(3 * STEP))
    wait_until(lambda: running._hashed == 3 * STEP, what="the upload hashed ahead")
    os.ftruncate(fd, 2 * STEP)  # unseen by the hash
    assert digest(fd, running) is None


def test_another_file_at_the_path_is_not_the_one_hashed(
        staged: tuple[str, int], tmp_path: Path) -> None:
    path, fd = staged
    running = RunningHash(path)
    data = os.urandom(2 * STEP)
    write(fd, running, 0, data)
    wait_until(lambda: running._hashed == 2 * STEP, what="the upload hashed ahead")
    os.unlink(path)
    other = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.pwrite(other, data[:STEP] + b"x" * STEP, 0)
        assert running.digest(other, os.fstat(other)) is None
    finally:
        os.close(other)


def test_no_thread_to_be_had_leaves_the_write_done_and_the_hash_to_publish(
        staged: tuple[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    path, fd = staged

    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refused)
    running = RunningHash(path)
    write(fd, running, 0, os.urandom(2 * STEP))
    assert running.broken and running._thread is None and digest(fd, running) is None


def test_a_directory_that_keeps_the_mark(tmp_path: Path) -> None:
    assert keeps_marks(str(tmp_path))
    assert os.listdir(tmp_path) == []  # the probe left nothing
    assert not keeps_marks(str(tmp_path / "missing"))
