"""Everything survives ``spoolfs umount`` + mount: names, places, content, inode numbers (§6)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.inspection import ls, setxattr, snapshot, xattr_text
from helpers.mounts import Mount
from helpers.procs import ok, spoolfs_cli
from helpers.queues import Queue

pytestmark = pytest.mark.fuse


def test_state_survives_remount(mount: Mount, queue: Queue, tmp_path: Path) -> None:
    other = Queue.create(mount.path, "other", tmp_path / "scratch")
    queue.put("uploading", b"half an upload")
    setxattr(queue.partial / "uploading", "user.origin", "restart-test")
    queue.publish("waiting", os.urandom(70_000))
    queue.publish("taken", os.urandom(1000))
    queue.claim("taken", "w1")
    queue.consumer("idle")
    queue.publish("done", os.urandom(5000))
    queue.claim("done", "w2")
    queue.finish("done", "w2")
    queue.publish("failed")
    setxattr(queue.claim("failed"), "user.spool.error", "it broke")
    queue.finish("failed", to="error")
    other.publish("elsewhere", b"x" * 4096)
    ok("ln", queue.ready / "waiting", other.ready / "linked")

    before = snapshot(mount.path)
    attempts = xattr_text(queue.working / "w1/taken", "user.spool.attempts")

    mount.restart()

    after = snapshot(mount.path)
    messages = {k: v for k, v in before.items() if v[0] == "file"}
    assert {k: after.get(k) for k in messages} == messages, \
        "names, places, sizes, content or inode numbers changed across a remount"
    assert sorted(after) == sorted(before), "the tree gained or lost entries across a remount"
    assert ls(queue.working) == ["idle", "w1", "w2"]
    assert xattr_text(queue.working / "w1/taken", "user.spool.consumer") == "w1"
    assert xattr_text(queue.working / "w1/taken", "user.spool.attempts") == attempts
    assert xattr_text(queue.error / "failed", "user.spool.error") == "it broke"
    assert xattr_text(queue.partial / "uploading", "user.origin") == "restart-test"

    # and the queue still works after the restart
    queue.finish("taken", "w1")
    ok("mv", queue.partial / "uploading", queue.ready)
    queue.claim("uploading", "idle")
    assert ok("cat", queue.working / "idle/uploading") == b"half an upload"


def test_inode_numbers_are_not_reused(mount: Mount, queue: Queue) -> None:
    """§6: AUTOINCREMENT ids: a deleted message's inode number never comes back."""
    seen = set()
    for i in range(5):
        queue.publish(f"m{i}")
        seen.add(os.stat(queue.ready / f"m{i}").st_ino)
        ok("rm", queue.ready / f"m{i}")
    mount.restart()
    for i in range(5):
        queue.publish(f"n{i}")
        ino = os.stat(queue.ready / f"n{i}").st_ino
        assert ino not in seen, f"inode {ino} reused"
        seen.add(ino)


def test_files_a_crash_left_are_gone_once_unmounted(mount: Mount, queue: Queue) -> None:
    """Recovery removes the staging files a crash left above the highest id given before the
    mount serves, those at or below it and the blob files while it serves (their walks are
    long in a deep store), and an unmount waits for them: the store a clean unmount leaves
    passes fsck. An upload left in ``partial/`` keeps its file."""
    queue.publish("kept", os.urandom(70_000))
    (queue.partial / "half").write_bytes(b"an upload left in partial/")
    queue.publish("gone")
    gone = (queue.ready / "gone").stat().st_ino  # an id given, no row's any more
    ok("rm", queue.ready / "gone")
    mount.umount()
    orphan = mount.store / "blobs" / "07" / "07" / f"{'07' * 32}.999999"
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"a crash between the file and its row")
    staged = []
    for sid in (gone, 999_999):  # an id given, its row gone; one a power cut took back
        staged.append(mount.store / "staging" / f"{sid >> 12:x}" / str(sid))
        staged[-1].parent.mkdir(exist_ok=True)
        staged[-1].write_bytes(b"an upload whose row never committed")
    mount.start()
    assert (queue.ready / "kept").stat().st_size == 70_000
    mount.umount()
    assert not orphan.exists() and not any(f.exists() for f in staged)
    log = mount.log_text()
    assert "staging_orphans=1" in log  # 999999, before the mount served
    assert "staging files looked at in" in log and "blob file(s) looked at in" in log
    assert log.count(", 1 left by a crash removed") == 2  # the staging file, the blob file
    mount.start()
    assert (queue.partial / "half").read_bytes() == b"an upload left in partial/"
    mount.umount()
    res = spoolfs_cli("fsck", str(mount.store), timeout=120)
    assert res.returncode == 0, res.stdout.decode(errors="replace")
