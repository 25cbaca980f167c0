"""Early writeback of large uploads: every STEP bytes written through a handle, the kernel is
asked (in a thread of its own) to start writing the file back, so that the fsync at publish has
little left; small uploads are never asked for, and a hint that fails changes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spoolfs.blobs import writeback
from spoolfs.blobs.writeback import STEP, Writeback
from spoolfs.service import content
from spoolfs.service.content import Handle

MIB = 1 << 20


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.inodes: list[int] = []
        self.ranges: list[tuple[int, int]] = []
        self.fail = fail

    def __call__(self, fd: int, off: int, length: int) -> None:
        self.inodes.append(os.fstat(fd).st_ino)
        self.ranges.append((off, length))
        if self.fail:
            raise OSError(5, "no")


def _write(path: Path, total: int, wb: Writeback, monkeypatch: pytest.MonkeyPatch) -> int:
    """Write ``total`` bytes through a handle in 1 MiB writes; the file's inode."""
    monkeypatch.setattr(content, "WRITEBACK", wb)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    h = Handle(1, fd, None, writable=True, sealed=False)
    chunk = b"x" * MIB
    for off in range(0, total, MIB):
        assert h.write(off, chunk) == MIB
    ino = os.fstat(fd).st_ino
    h.close()
    wb.drain()
    return ino


def test_a_large_upload_is_written_back_while_it_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    ino = _write(tmp_path / "big", 2 * STEP + 3 * MIB, Writeback(rec), monkeypatch)
    assert rec.inodes == [ino, ino]
    assert rec.ranges == [(0, STEP), (STEP, STEP)]  # each stretch once, as it is completed
    assert (tmp_path / "big").stat().st_size == 2 * STEP + 3 * MIB


def test_a_small_upload_is_left_to_the_kernel(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    _write(tmp_path / "small", STEP - MIB, Writeback(rec), monkeypatch)
    assert rec.inodes == []


def test_a_hint_that_fails_loses_nothing_and_leaks_no_descriptor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(fail=True)
    before = len(os.listdir("/proc/self/fd"))
    _write(tmp_path / "big", 2 * STEP, Writeback(rec), monkeypatch)
    assert len(rec.inodes) == 2
    assert len(os.listdir("/proc/self/fd")) == before
    assert (tmp_path / "big").read_bytes() == b"x" * (2 * STEP)


def test_the_kernel_takes_the_hint(tmp_path: Path) -> None:
    start = writeback._libc_sync_file_range()
    assert start is not None  # Linux: sync_file_range(2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"y" * MIB)
        start(fd, 0, MIB)
    finally:
        os.close(fd)
