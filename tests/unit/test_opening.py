"""Opening a content file only when the kernel needs no disk to find it (blobs/opening.py),
against the real kernel: its dentry cache dropped, the path is left to a worker thread."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from pathlib import Path

import pytest

from spoolfs.blobs import opening


def _drop_dentries() -> None:
    with open("/proc/sys/vm/drop_caches", "w") as f:  # dentries and inodes (root, as in CI)
        f.write("2")


def test_a_cached_path_opens_and_an_uncached_one_is_left_to_the_caller(
        tmp_path: Path) -> None:
    path = tmp_path / "ab" / "cd" / "content"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"bytes")
    fd = opening.open_cached(str(path))
    assert fd is not None
    try:
        assert os.read(fd, 10) == b"bytes"
        assert os.get_inheritable(fd) is False  # as os.open's
    finally:
        os.close(fd)
    _drop_dentries()
    assert opening.open_cached(str(path)) is None  # its directories would be read
    os.stat(path)  # looked up again: in the cache
    fd = opening.open_cached(str(path))
    assert fd is not None
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
