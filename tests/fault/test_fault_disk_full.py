"""A full disk (DESIGN §6, §7, §11): ENOSPC at write time, new uploads refused, while claims and
finishes still commit so the queue can drain; nothing half-done, a clean fsck afterwards.

The store lives on a small tmpfs; the disk is filled through the mount itself (an upload into
``partial/`` that grows until the disk refuses it).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import MountFactory, Queue, fails, ls, mounted, ok, read, spoolfs_cli

pytestmark = pytest.mark.fuse

DISK_MIB = 128


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    ok("mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m,mode=0755", "tmpfs", disk)
    try:
        yield disk
    finally:
        if mounted(disk):
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


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
    new = tmp_path / "new"
    new.write_bytes(b"x" * 200_000)
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
