"""Content outlives unlink while a descriptor holds it (POSIX; the pyfuse3 contract): an
upload in ``partial/`` removed while open keeps taking writes, and its size and bytes are
those of the writes, as on ext4."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from helpers.inspection import ls
from helpers.queues import Queue

pytestmark = pytest.mark.fuse

ALPHABET = b"abcdefghijklmnopqrstuvwxyz"


def test_write_after_unlink_is_kept(fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    path = q.partial / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.unlink(path)
        assert os.write(fd, ALPHABET) == 26
        assert os.fstat(fd).st_size == 26
        assert os.pread(fd, 100, 0) == ALPHABET
        assert os.write(fd, b"!") == 1
        assert os.fstat(fd).st_size == 27
        assert os.pread(fd, 100, 0) == ALPHABET + b"!"
    finally:
        os.close(fd)
    assert ls(q.partial) == []


def test_content_written_before_unlink_grows_after_it(fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    path = q.partial / "g"
    path.write_bytes(b"before ")
    fd = os.open(path, os.O_RDWR)
    try:
        os.unlink(path)
        assert os.pread(fd, 100, 0) == b"before "
        os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, b"after")
        assert os.fstat(fd).st_size == 12
        assert os.pread(fd, 100, 0) == b"before after"
    finally:
        os.close(fd)
