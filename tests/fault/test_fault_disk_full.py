"""A full disk (DESIGN §6, §7, §11): ENOSPC at write time, new uploads refused, while claims and
finishes still commit so the queue can drain; nothing half-done, a clean fsck afterwards.

The store lives on a small tmpfs. The disk is filled through the mount itself (an upload into
``partial/`` that grows until the disk refuses it), or from outside, to the last byte, by a
filler file next to the store: then only the store's metadata reserve lets the queue drain.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.inspection import expect_errno, ls, read, xattr_text
from helpers.mounts import MountFactory, mounted
from helpers.procs import fails, ok, one_line_error, spoolfs_cli
from helpers.queues import Queue
from helpers.waiting import wait_until

pytestmark = pytest.mark.fuse

DISK_MIB = 128


#: on a disk filled to its last byte, MESSAGES messages are claimed and finished ROUNDS times
#: (failed to error/, retried by the daemon): 10,000 claims and 10,000 finishes
MESSAGES = 1_000
ROUNDS = 10


def _tmpfs(path: Path, mib: int) -> Iterator[Path]:
    path.mkdir()
    ok("mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "tmpfs", path)
    try:
        yield path
    finally:
        if mounted(path):
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path / "disk", DISK_MIB)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path / "tiny", 8)


def fill(disk: Path) -> None:
    """Take every free byte of ``disk`` (as root: the blocks reserved for root too) with one
    filler file, grown until the file system refuses, from outside any mount."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 20, 4096, 1):
            buf = b"\0" * chunk
            while True:
                try:
                    os.write(fd, buf)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bfree == 0, "the filler left space on the disk"


def test_full_disk_refuses_uploads_but_queue_still_drains(small_disk: Path,
                                                          mounter: MountFactory,
                                                          tmp_path: Path) -> None:
    # (small_disk comes first so that it is torn down after the mount that uses it)
    store = small_disk / "store"
    m = mounter(store, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    contents = {}
    for i in range(4):
        contents[f"m{i}"] = q.publish(f"m{i}")
    q.claim("m0")
    q.claim("m1")

    # Fill the disk with an upload: the writer must see ENOSPC from write(), not EIO, and not
    # a success that is lost later.
    res = subprocess.run(["dd", "if=/dev/zero", f"of={q.partial / 'fill'}", "bs=1M",
                          f"count={DISK_MIB * 2}", "status=none"], capture_output=True,
                         timeout=120)
    assert res.returncode != 0, "writing twice the disk's size into partial/ succeeded"
    assert b"No space left on device" in res.stderr, res.stderr.decode(errors="replace")
    m.daemon_alive()

    # New uploads are refused, and a refused direct publish never shows up in ready/.
    # (Larger than dd's blocks: what its last refused block left free stays above the floor.)
    new = tmp_path / "new"
    new.write_bytes(b"x" * 2_000_000)
    fails("cp", new, q.ready / "new", message="No space left on device")
    assert "new" not in ls(q.ready)

    # Claims and finishes still commit: the queue can drain.
    q.claim("m2")
    q.finish("m0")
    q.finish("m1", to="error")
    q.finish("m2")
    assert ls(q.success) == ["m0", "m2"]
    assert ls(q.error) == ["m1"]
    assert read(q.success / "m0") == contents["m0"]
    ok("rm", q.ready / "m3")  # withdrawing frees space too

    # Freeing the disk makes uploads work again.
    ok("rm", q.partial / "fill")
    ok("cp", new, q.ready / "new")
    assert read(q.ready / "new") == new.read_bytes()

    m.umount()
    fsck = spoolfs_cli("fsck", str(store), timeout=120)
    assert fsck.returncode == 0, "fsck after a full disk:\n" + \
        fsck.stdout.decode(errors="replace") + fsck.stderr.decode(errors="replace")


def test_disk_filled_from_outside_still_drains_through_the_reserve(small_disk: Path,
                                                                   mounter: MountFactory,
                                                                   tmp_path: Path) -> None:
    store = small_disk / "store"
    m = mounter(store, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    view = q.consumer("w1")
    # A second daemon on the same store, with a queue of its own: the reserve is one per store.
    other = mounter(store, tmp_path / "other")
    q2 = Queue.create(other.path, "q2", tmp_path / "scratch2")
    # Seeded before the disk fills: messages written straight into ready/ (a safe direct
    # publish), and an upload waiting in partial/.
    names = [f"m{i}" for i in range(MESSAGES)]
    for name in names:
        (q.ready / name).write_bytes(f"message {name}\n".encode())
        if len(name) == 2:
            (q2.ready / name).write_bytes(b"other\n")
    q.put("upload", b"not yet published\n")
    # Each message fails ROUNDS times, sent back to ready/ by the daemon's lifecycle (which
    # must commit on the full disk too), then stays in error/ as abandoned.
    res = spoolfs_cli("queue", "set", str(q.path), "retry_errors=on", f"max_attempts={ROUNDS}")
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    assert xattr_text(q.path, "user.spool.policy.max_attempts") == str(ROUNDS)

    fill(small_disk)

    # Uploads and publishes are refused with ENOSPC...
    new = q.source(b"new content\n")
    fails("cp", new, q.ready / "new", message="No space left on device")
    fails("mv", q.partial / "upload", q.ready / "upload", message="No space left on device")

    # ...while every claim and finish commits: a few by real mv processes, the rest by the
    # same rename(2) calls made in a loop (20,000 processes would take minutes).
    claims = finishes = 0
    for name in names[:3]:
        ok("mv", q.ready / name, f"{view}/")
        ok("mv", view / name, f"{q.error}/")
        claims, finishes = claims + 1, finishes + 1
    for rnd in range(ROUNDS):
        if rnd:
            wait_until(lambda: len(os.listdir(q.ready)) == MESSAGES, timeout=120,
                       what=f"round {rnd}'s retries", alive=m.daemon_alive)
        for name in names[3:] if rnd == 0 else names:
            os.rename(q.ready / name, view / name)
            claims += 1
            os.rename(view / name, q.error / name)
            finishes += 1
        if rnd == ROUNDS // 2:  # meanwhile, the other daemon drains its queue
            for name in ls(q2.ready):
                os.rename(q2.ready / name, q2.working / name)
                os.rename(q2.working / name, q2.error / name)
    m.daemon_alive()
    other.daemon_alive()
    assert len(ls(q2.error)) == 10 and ls(q2.ready) == []
    assert (claims, finishes) == (MESSAGES * ROUNDS, MESSAGES * ROUNDS)
    assert ls(q.ready) == [] and ls(view) == []
    assert sorted(ls(q.error)) == sorted(names)
    assert read(q.error / names[-1]) == f"message {names[-1]}\n".encode()
    assert xattr_text(q.error / names[-1], "user.spool.abandoned") == "1"

    # The reserve that let them commit is not space for uploads.
    expect_errno(errno.ENOSPC, os.rename, q.partial / "upload", q.ready / "upload")
    fails("cp", new, q.partial / "new", message="No space left on device")
    assert ls(q.partial) == ["upload"]
    fails("cp", new, q2.ready / "new", message="No space left on device")

    other.umount()
    m.umount()
    fsck = spoolfs_cli("fsck", str(store), timeout=120)
    assert fsck.returncode == 0, "fsck after the drain:\n" + \
        fsck.stdout.decode(errors="replace") + fsck.stderr.decode(errors="replace")

    # The disk filled again to the last byte: the store's tools and a new mount either work
    # (the reserve's space) or say in one line that the disk is full; never a traceback.
    fill(small_disk)
    for tool in (("status", str(store)), ("gc", str(store)), ("fsck", str(store))):
        res = spoolfs_cli(*tool, timeout=120)
        if res.returncode != 0:
            assert "disk is full" in one_line_error(res), tool
    again = mounter(store, tmp_path / "mnt2", start=False)
    again.path.mkdir()
    res = spoolfs_cli(*again.argv)
    if res.returncode == 0:  # torn down by the mounter, should an assertion fail first
        assert sorted(ls(again.path / "q" / "error")) == sorted(names)
        again.umount()
    else:
        assert "disk is full" in one_line_error(res)


def test_a_store_mounts_on_a_full_disk_with_its_reserve_and_says_so_without(
        tiny_disk: Path, mounter: MountFactory, tmp_path: Path) -> None:
    # (tiny_disk comes first so that it is torn down after the mount that uses it)
    old = tiny_disk / "old"
    m = mounter(old, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    q.publish("m")
    m.umount()
    assert (old / "reserve").stat().st_blocks > 0, "the daemon made no reserve"

    # With its reserve, the store mounts on a full disk, and the queue drains.
    fill(tiny_disk)
    m.start()
    q.claim("m")
    q.finish("m")
    fails("cp", q.source(b"new\n"), q.ready / "new", message="No space left on device")
    m.umount()

    # Without (spent, or a store from before the reserve; or a new store): one line.
    (old / "reserve").unlink()
    fill(tiny_disk)  # what the daemon's log gave back at unmount
    line = one_line_error(spoolfs_cli("format", str(tiny_disk / "new")))
    assert "disk is full" in line, line
    mnt = tmp_path / "mnt-old"
    mnt.mkdir()
    res = spoolfs_cli(str(old), str(mnt))
    assert not mounted(mnt)
    line = one_line_error(res)
    assert "disk is full" in line, line
    for tool in ("status", "gc", "fsck"):
        line = one_line_error(spoolfs_cli(tool, str(old)))
        assert "disk is full" in line, (tool, line)
