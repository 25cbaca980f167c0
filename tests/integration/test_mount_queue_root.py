"""``spoolfs --queue NAME`` roots the mount at one queue (DESIGN §2): state dirs at the top."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from helpers.inspection import expect_errno, ls, read, visible
from helpers.mounts import MountFactory
from helpers.procs import fails, ok
from helpers.queues import STATES, Queue, make_content

pytestmark = pytest.mark.fuse


def test_queue_mount_shows_an_existing_queue_at_the_top(mounter: MountFactory, store: Path,
                                                        tmp_path: Path) -> None:
    whole = mounter(store, tmp_path / "spool")
    q = Queue.create(whole.path, "uploads", tmp_path / "scratch")
    waiting = q.publish("waiting.csv")
    whole.umount()

    top = mounter(store, tmp_path / "uploads", queue="uploads")
    assert visible(ls(top.path)) == sorted(STATES)
    assert ls(top.path / "ready") == ["waiting.csv"]
    assert read(top.path / "ready/waiting.csv") == waiting

    # the whole lifecycle at the top level
    src = tmp_path / "new.csv"
    src.write_bytes(data := make_content("new.csv", 50_000))
    ok("cp", src, top.path / "partial")
    ok("mv", top.path / "partial/new.csv", top.path / "ready")
    ok("mkdir", top.path / "working/w1")
    ok("mv", top.path / "ready/new.csv", top.path / "working/w1")
    assert read(top.path / "working/w1/new.csv") == data
    ok("mv", top.path / "working/w1/new.csv", top.path / "success")
    assert ls(top.path / "success") == ["new.csv"]
    top.umount()

    whole = mounter(store, tmp_path / "spool")
    assert ls(whole.path / "uploads/success") == ["new.csv"]
    assert read(whole.path / "uploads/success/new.csv") == data
    assert ls(whole.path / "uploads/ready") == ["waiting.csv"]


def test_queue_mount_of_a_new_store_creates_the_queue(mounter: MountFactory, store: Path,
                                                      tmp_path: Path) -> None:
    """A drop-in for an existing ``/var/lib/uploads/{partial,ready,...}`` layout starts empty."""
    top = mounter(store, tmp_path / "uploads", queue="uploads")
    assert visible(ls(top.path)) == sorted(STATES)
    src = tmp_path / "a"
    src.write_bytes(b"a\n")
    ok("cp", src, top.path / "ready")
    assert ls(top.path / "ready") == ["a"]


def test_queue_mount_top_level_is_the_queue_dir(mounter: MountFactory, store: Path,
                                                tmp_path: Path) -> None:
    top = mounter(store, tmp_path / "uploads", queue="uploads")
    fails("mkdir", top.path / "other", message="Operation not permitted")
    expect_errno(errno.EPERM, os.mkdir, top.path / "other")
    fails("touch", top.path / "file", message="Operation not permitted")
    fails("rmdir", top.path / "ready", message="Operation not permitted")
    assert visible(ls(top.path)) == sorted(STATES)
