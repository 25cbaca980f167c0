"""Early writeback of large uploads: every STEP bytes written through a handle, the kernel is
asked (in a thread of its own) to start writing the file back, and every SYNC_STEP to make it
durable so far, so that the fsync at publish has little left; small uploads are never asked
for, a hint that fails changes nothing, and a sync that fails is kept for the upload's seal."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from spoolfs.blobs import writeback
from spoolfs.blobs.running import REOPENED
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


class Syncs:
    def __init__(self, fail: bool = False) -> None:
        self.sizes: list[int] = []  # the file's size at each sync
        self.fail = fail

    def __call__(self, fd: int) -> None:
        self.sizes.append(os.fstat(fd).st_size)
        if self.fail:
            raise OSError(5, "Input/output error")


def _write(path: Path, total: int, wb: Writeback, monkeypatch: pytest.MonkeyPatch,
           key: str | None = None) -> int:
    """Write ``total`` bytes through a handle in 1 MiB writes; the file's inode."""
    monkeypatch.setattr(content, "WRITEBACK", wb)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    h = Handle(1, fd, None, writable=True, sealed=False)
    h.sync_key = key
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


def test_a_very_large_upload_is_made_durable_as_it_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SYNC_STEP, the stretch kicked is also synced (after its writeback started): the
    fsync at publish has at most SYNC_STEP left to make durable."""
    monkeypatch.setattr(content, "SYNC_STEP", 2 * STEP)
    rec, syncs = Recorder(), Syncs()
    done: list[object] = []  # each hint's end, and "sync", in the order the thread made them

    def hint(fd: int, off: int, length: int) -> None:
        rec(fd, off, length)
        done.append((off + length) // STEP)

    def sync(fd: int) -> None:
        syncs(fd)
        done.append("sync")

    wb = Writeback(hint, sync)
    _write(tmp_path / "big", 5 * STEP + MIB, wb, monkeypatch, key="k")
    assert done == [1, 2, "sync", 3, 4, "sync", 5]  # the last 1 STEP + 1 MiB left to publish
    assert not wb.sync_failed("k")


def test_an_upload_without_a_key_is_never_synced_early(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(content, "SYNC_STEP", STEP)
    syncs = Syncs()
    _write(tmp_path / "big", 3 * STEP, Writeback(Recorder(), syncs), monkeypatch)
    assert syncs.sizes == []


def test_a_failed_early_sync_is_kept_until_the_upload_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The kernel reports a writeback error to one fsync only; the seal opens the file after
    the early sync saw it, so the failure is kept for it, and for every later publish."""
    monkeypatch.setattr(content, "SYNC_STEP", STEP)
    before = len(os.listdir("/proc/self/fd"))
    wb = Writeback(Recorder(), Syncs(fail=True))
    _write(tmp_path / "big", 2 * STEP, wb, monkeypatch, key="k")
    assert wb.sync_failed("k") and wb.sync_failed("k")  # asked again: still failed
    assert not wb.sync_failed("other")
    assert "an early sync of k failed" in caplog.text
    assert len(os.listdir("/proc/self/fd")) == before
    assert wb.any_failed()
    wb.forget("k")
    assert not wb.sync_failed("k") and not wb.any_failed()
    # the file keeps the failure for a daemon started again, and writes leave the mark
    assert writeback.failed_before(os.stat(tmp_path / "big").st_mode)
    with open(tmp_path / "big", "r+b") as f:
        f.write(b"more")
    assert writeback.failed_before(os.stat(tmp_path / "big").st_mode)
    assert not writeback.failed_before(0o600 | REOPENED)  # the running hash's mark is another


def test_a_mark_that_cannot_be_set_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    writeback.mark_failed(w)  # closed: EBADF
    assert "could not be marked" in caplog.text


def test_the_answer_waits_for_the_syncs_still_under_way(tmp_path: Path) -> None:
    release, asked, answers = threading.Event(), threading.Event(), []

    def slow_failing_sync(fd: int) -> None:
        release.wait(10)
        raise OSError(5, "Input/output error")

    wb = Writeback(Recorder(), slow_failing_sync)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        wb.kick(fd, 0, MIB, "k")
    finally:
        os.close(fd)

    def ask() -> None:
        asked.set()
        answers.append(wb.sync_failed("k"))

    t = threading.Thread(target=ask)
    t.start()
    asked.wait(10)
    t.join(0.2)
    assert t.is_alive() and answers == []  # the sync is still under way
    release.set()
    t.join(10)
    assert answers == [True]


def test_a_failed_sync_of_the_seal_is_kept_too() -> None:
    wb = Writeback(Recorder(), Syncs())
    wb.failed("k")
    assert wb.sync_failed("k")


def test_a_sync_that_fails_unexpectedly_ends_nothing(tmp_path: Path) -> None:
    """Whatever a sync raises, the thread goes on (the next kicks, and the seals waiting for
    them, would wait for ever), and the upload counts as not synced."""
    calls: list[int] = []

    def odd(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise ValueError("unexpected")

    wb = Writeback(Recorder(), odd)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        wb.kick(fd, 0, MIB, "a")
        wb.kick(fd, MIB, MIB, "b")
    finally:
        os.close(fd)
    assert wb.sync_failed("a") and not wb.sync_failed("b") and len(calls) == 2


def test_no_thread_to_be_had_leaves_the_sync_to_the_publish(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of threads: the kick is dropped (the publish's fsync does its work); nothing is
    counted as under way that nobody would ever run, so a publish never waits for it, and no
    descriptor is left behind. The next kick with threads to be had starts one."""
    real_start = threading.Thread.start

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    syncs = Syncs()
    wb = Writeback(Recorder(), syncs)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        before = len(os.listdir("/proc/self/fd"))
        monkeypatch.setattr(threading.Thread, "start", no_thread)
        wb.kick(fd, 0, MIB, "k")
        assert len(os.listdir("/proc/self/fd")) == before
        answers: list[bool] = []
        t = threading.Thread(target=lambda: answers.append(wb.sync_failed("k")))
        real_start(t)
        t.join(5)
        assert answers == [False]
        monkeypatch.setattr(threading.Thread, "start", real_start)
        wb.kick(fd, 0, MIB, "k")
        assert not wb.sync_failed("k") and syncs.sizes == [0]
    finally:
        os.close(fd)


def test_a_file_cut_to_nothing_is_no_longer_marked(tmp_path: Path) -> None:
    """The bytes a failed sync may have lost are gone with a cut to nothing: the file is
    written whole again, and its own seal syncs it."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 100)
        writeback.mark_failed(fd)
        wb = Writeback(Recorder(), Syncs())
        wb.failed("k")
        os.ftruncate(fd, 10)
        writeback.cut_to_nothing(fd, "k", wb)  # not nothing: still marked
        assert writeback.failed_before(os.fstat(fd).st_mode) and wb.sync_failed("k")
        os.ftruncate(fd, 0)
        writeback.cut_to_nothing(fd, "k", wb)
        assert not writeback.failed_before(os.fstat(fd).st_mode) and not wb.sync_failed("k")
        assert os.fstat(fd).st_mode & 0o7777 == 0o600
    finally:
        os.close(fd)


def test_the_kicks_of_an_upload_removed_meanwhile_write_nothing(tmp_path: Path) -> None:
    """An upload removed while its kicks wait (a producer that gives up on a large file):
    its pages are not written back nor synced (up to 64 MiB each, for nothing), and no
    failure is kept for it."""
    release = threading.Event()
    hints, syncs = Recorder(), Syncs(fail=True)

    def first_waits(fd: int, off: int, length: int) -> None:
        if not hints.ranges:
            release.wait(10)
        hints(fd, off, length)

    wb = Writeback(first_waits, syncs)
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    gone = os.open(tmp_path / "gone", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        wb.kick(other, 0, MIB)  # holds the thread
        wb.kick(gone, 0, MIB, "gone")
        os.unlink(tmp_path / "gone")
        release.set()
        assert not wb.sync_failed("gone")
        wb.drain()
    finally:
        os.close(other)
        os.close(gone)
    assert hints.ranges == [(0, MIB)] and syncs.sizes == []


def test_a_mark_that_cannot_be_cleared_leaves_the_cut_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        writeback.mark_failed(fd)
        wb = Writeback(Recorder(), Syncs())
        wb.failed("k")

        def refused(fd: int, mode: int) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "fchmod", refused)
        writeback.cut_to_nothing(fd, "k", wb)  # no exception: the cut stands, refused still
        assert wb.sync_failed("k") and writeback.failed_before(os.fstat(fd).st_mode)
        assert "could not be cleared" in caplog.text
    finally:
        os.close(fd)


def _slow_failing(release: threading.Event) -> Callable[[int], None]:
    """A sync that waits for ``release``, then fails as a lost writeback does."""
    def sync(fd: int) -> None:
        release.wait(10)
        raise OSError(5, "Input/output error")
    return sync


def _kicks(wb: Writeback, path: Path, *steps: Callable[[int], None]) -> None:
    """Each step given the file's descriptor in turn (kicks, and what happens between)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for step in steps:
            step(fd)
    finally:
        os.close(fd)


def test_a_failure_of_a_key_forgotten_while_its_sync_ran_is_not_kept(tmp_path: Path) -> None:
    """The upload went while its sync was under way (``forget``): the sync's failure, when it
    comes, is not kept, and the key is asked about no more."""
    release = threading.Event()
    wb = Writeback(Recorder(), _slow_failing(release))
    _kicks(wb, tmp_path / "f", lambda fd: wb.kick(fd, 0, MIB, "k"),
           lambda fd: wb.kick(fd, MIB, MIB, "k"))
    assert wb.any_pending()
    wb.forget("k")
    release.set()
    wb.drain()
    assert not wb.any_failed() and not wb.any_pending() and not wb.sync_failed("k")
    _kicks(wb, tmp_path / "f", lambda fd: wb.kick(fd, 0, MIB, "k"))  # used again: watched
    wb.drain()
    assert wb.sync_failed("k")


def test_a_sync_queued_after_forget_still_counts(tmp_path: Path) -> None:
    """``forget`` at a cut to nothing: only the syncs of the bytes before it are let go; a
    sync kicked after it, while those still wait, keeps its failure."""
    release = threading.Event()
    wb = Writeback(Recorder(), _slow_failing(release))
    _kicks(wb, tmp_path / "f", lambda fd: wb.kick(fd, 0, MIB, "k"),  # the bytes before the cut
           lambda fd: wb.forget("k"), lambda fd: wb.kick(fd, 0, MIB, "k"))  # written again
    release.set()
    wb.drain()
    assert wb.sync_failed("k")
