"""The metadata reserve (store/reserve.py): released when the disk is nearly full, made again
only with room to spare, shared by every daemon of a store through the one file."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from spoolfs.core.errors import StoreFull
from spoolfs.store.reserve import Reserve
from spoolfs.store.sqlite import open_store

MiB = 1 << 20
SIZE = 8 * MiB  # a file system of 64 MiB: the reserve is an eighth of it


class Disk:
    """What statvfs reports to the reserves of one store, the reserve file's own blocks
    taken into account (the file is real, on the test's disk)."""

    def __init__(self, free: int) -> None:
        self.free = free  # free bytes besides the reserve file

    def attach(self, r: Reserve, monkeypatch: pytest.MonkeyPatch) -> Reserve:
        monkeypatch.setattr(r, "_statvfs", lambda: (self.free - r.held(), 64 * MiB))
        return r


@pytest.fixture
def two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Disk, Reserve, Reserve]:
    disk = Disk(free=40 * MiB)
    return disk, disk.attach(Reserve(str(tmp_path)), monkeypatch), \
        disk.attach(Reserve(str(tmp_path)), monkeypatch)


def test_made_once_and_seen_by_every_daemon(two: tuple[Disk, Reserve, Reserve]) -> None:
    _disk, a, b = two
    assert a.size() == SIZE and not a.in_place() and not b.in_place()
    assert a.restore()
    assert a.in_place() and b.in_place()
    assert b.restore()  # already there: nothing more allocated
    assert a.held() == SIZE


def test_released_once_when_nearly_full_and_not_before(two: tuple[Disk, Reserve, Reserve]
                                                       ) -> None:
    disk, a, b = two
    assert a.restore()
    disk.free = SIZE + a.low_water()  # just at the mark: kept
    assert not a.release_if_low() and a.in_place()
    disk.free = SIZE + a.low_water() - 1
    assert a.release_if_low()
    assert not b.release_if_low()  # the other daemon finds nothing left to free
    assert not a.in_place() and not b.in_place() and a.held() == 0


def test_made_again_only_with_room_to_spare(two: tuple[Disk, Reserve, Reserve]) -> None:
    disk, a, b = two
    disk.free = SIZE + a.low_water()  # room for the reserve, not for the margin after it
    assert not b.restore() and not b.allows_uploads()
    disk.free = SIZE + 2 * a.low_water()
    assert b.restore() and a.allows_uploads()
    assert not a.release_if_low()  # made again, it is not released by the next commit


class FullAtCommit:
    """The writer connection of a store whose disk fills up between a batch's statements and
    its COMMIT (another program took the last blocks): SQLite answers SQLITE_FULL."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT":
            e = sqlite3.OperationalError("database or disk is full")
            e.sqlite_errorcode = sqlite3.SQLITE_FULL  # type: ignore[attr-defined]
            raise e
        return self.conn.execute(sql, *args)


def test_a_commit_that_finds_the_disk_full_is_enospc_and_frees_the_reserve(tmp_path: Path
                                                                          ) -> None:
    store = open_store(str(tmp_path))
    try:
        reserve = store.reserve
        assert reserve is not None and reserve.restore()
        real = store._wconn
        store._wconn = FullAtCommit(real)  # type: ignore[assignment]
        with pytest.raises(StoreFull) as refused:
            store.run_batch([lambda tx: tx.set_policy(1, {"min_free": "0"})], durable=True)
        assert refused.value.errno == errno.ENOSPC
        assert reserve.held() == 0, "the reserve was kept although the disk is full"
        store._wconn = real
        assert store.reader().policies() == {}, "a refused commit left a change"
        store.run_batch([lambda tx: tx.set_policy(1, {"min_free": "0"})], durable=True)
        assert store.reader().policies() == {1: {"min_free": "0"}}
    finally:
        store.close()
