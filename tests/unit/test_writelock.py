"""The writers' lock of an upload's staging file and the mark of a publish left to its
writers (blobs/writelock.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from spoolfs.blobs import writelock
from spoolfs.blobs.files import StagingDir
from spoolfs.service.writers import WriterLocks


def test_a_shared_lock_keeps_a_seal_out_until_let_go(tmp_path: Path) -> None:
    assert writelock.supported(str(tmp_path))
    path = tmp_path / "up"
    writer = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    sealer = os.open(path, os.O_RDWR)
    try:
        assert writelock.share(writer)
        assert not writelock.take(sealer)
        writelock.let_go(writer)
        assert writelock.take(sealer)
        assert not writelock.share(writer)
    finally:
        os.close(writer)
        os.close(sealer)


def test_the_mark_of_a_publish_left_to_writers_outlives_their_writes(tmp_path: Path) -> None:
    """Set by path (the renaming daemon has no descriptor of the file), seen through any
    descriptor; a write, a cut or the other marks leave it, and it changes no permission
    the file's owner relies on."""
    assert writelock.keeps_left_marks(str(tmp_path))
    path = tmp_path / "up"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"first")
        assert not writelock.left_to_writers(fd)
        writelock.leave_to_writers(str(path))
        writelock.leave_to_writers(str(path))  # (twice: the same)
        os.write(fd, b"second")
        os.ftruncate(fd, 3)
        os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | stat.S_ISVTX)
        assert writelock.left_to_writers(fd)
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o777 == 0o640
    finally:
        os.close(fd)


def test_a_daemon_looks_at_an_upload_only_where_a_rename_marked_it(tmp_path: Path) -> None:
    """Where staging files keep the mark, a writer's close looks at its upload's row only
    once a rename left it the publish; where they would not, always. A rename of an upload
    whose staging file is not here (another host's) marks nothing and fails nothing."""
    staging = StagingDir(str(tmp_path / "staging"))
    locks = WriterLocks(staging)
    fd = staging.create(7)
    try:
        assert locks.marks and not locks.may_be_left(fd)
        locks.leave(7)
        assert locks.may_be_left(fd)
        locks.leave(8)  # no file: nothing to mark
        assert locks.may_be_left(None)
        locks.marks = False
        other = staging.create(9)
        try:
            assert locks.may_be_left(other)
        finally:
            os.close(other)
    finally:
        os.close(fd)
