"""Opening a content file only when the kernel needs no disk to find it (blobs/opening.py),
against the real kernel: a path it has not looked up since its file system was mounted is
left to the caller (a worker thread)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from spoolfs.blobs import opening


@contextmanager
def _file_system(tmp_path: Path) -> Iterator[Callable[[], Path]]:
    """A small ext4 file system of its own, mounted (root, as in CI); what it yields mounts it
    again, so that the kernel caches none of its paths, and returns where."""
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    with open(img, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)

    def again() -> Path:
        subprocess.run(["umount", str(mnt)], check=True)
        subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
        return mnt

    try:
        yield again
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_cached_path_opens_and_an_uncached_one_is_left_to_the_caller(
        tmp_path: Path) -> None:
    with _file_system(tmp_path) as mounted_again:
        path = tmp_path / "mnt" / "ab" / "cd" / "content"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"bytes")
        fd = opening.open_cached(str(path))
        assert fd is not None
        try:
            assert os.read(fd, 10) == b"bytes"
            assert os.get_inheritable(fd) is False  # as os.open's
        finally:
            os.close(fd)
        mounted_again()
        assert opening.open_cached(str(path)) is None  # its directories would be read
        os.stat(path)  # looked up: in the cache now
        fd = opening.open_cached(str(path))
        assert fd is not None
        try:
            assert os.read(fd, 10) == b"bytes"
        finally:
            os.close(fd)


def test_a_path_the_cache_knows_missing_is_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    assert not missing.exists()  # a negative entry in the cache now
    with pytest.raises(FileNotFoundError):
        opening.open_cached(str(missing))


def test_without_openat2_files_open_as_before_and_the_log_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "spoolfs.blobs.opening")
    monkeypatch.setattr(opening, "_syscall", lambda *args: -1)
    monkeypatch.setattr(ctypes, "get_errno", lambda: errno.ENOSYS)
    monkeypatch.setattr(opening, "_supported", True)
    (tmp_path / "f").write_bytes(b"x")
    for _ in range(2):
        fd = opening.open_cached(str(tmp_path / "f"))
        assert fd is not None
        os.close(fd)
    assert caplog.text.count("RESOLVE_CACHED is not available") == 1
