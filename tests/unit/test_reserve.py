"""The metadata reserve (store/reserve.py): released when the disk is nearly full, made again
only with room to spare, shared by every daemon of a store through the one file."""

from __future__ import annotations

from pathlib import Path

import pytest

from spoolfs.store.reserve import Reserve

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
