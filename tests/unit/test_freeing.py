"""Removing a file now, its space freed where waiting holds nobody else up
(blobs/freeing.py): the name goes at once; a large file's blocks stay held by the descriptor
``detach`` returns until it is closed (the caller does so in a worker thread); a small one,
or a file with another name, is freed at once as before."""

from __future__ import annotations

import os
from pathlib import Path

from spoolfs.blobs import freeing
from spoolfs.blobs.files import BlobDir


def test_a_large_file_is_gone_at_once_and_freed_at_the_close(tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(4 << 20))
    os.fsync(os.open(f, os.O_RDONLY))  # (its blocks allocated)
    fd = freeing.detach(str(f))
    assert fd is not None and not f.exists()
    assert freeing.holds_space(fd) and os.fstat(fd).st_size == 4 << 20
    freeing.close_all([fd])
    assert freeing.detach(str(f)) is None  # no such file: nothing to do


def test_small_files_and_other_names_are_freed_at_once(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.write_bytes(b"x" * 1000)
    assert freeing.detach(str(small)) is None and not small.exists()

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
