"""The walk-through of DESIGN §1, step by step with real tools, checking ``ls`` after each step."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers.inspection import ls, read, sha256, visible, xattr_text
from helpers.mounts import Mount
from helpers.procs import ok
from helpers.queues import STATES, Queue, make_content

pytestmark = pytest.mark.fuse


def test_design_walkthrough(mount: Mount, tmp_path: Path) -> None:
    spool = mount.path
    assert visible(ls(spool)) == []

    ok("mkdir", spool / "orders")
    q = spool / "orders"
    assert visible(ls(spool)) == ["orders"]
    assert ls(q) == sorted(STATES), "mkdir of a queue must create exactly the five state dirs"
    for state in STATES:
        assert ls(q / state) == [], f"{state}/ of a new queue must be empty"

    data = make_content("batch.csv", 300_000)
    src = tmp_path / "batch.csv"
    src.write_bytes(data)

    ok("cp", src, q / "partial/")
    assert ls(q / "partial") == ["batch.csv"]
    assert ls(q / "ready") == []
    ino = os.stat(q / "partial/batch.csv").st_ino

    ok("mv", q / "partial/batch.csv", q / "ready/")
    assert ls(q / "partial") == []
    assert ls(q / "ready") == ["batch.csv"]
    assert os.stat(q / "ready/batch.csv").st_size == len(data)

    ok("mkdir", "-p", q / "working/w1")
    assert ls(q / "working") == ["w1"]
    assert ls(q / "working/w1") == []

    ok("mv", q / "ready/batch.csv", q / "working/w1/")
    assert ls(q / "ready") == []
    assert ls(q / "working/w1") == ["batch.csv"]
    assert read(q / "working/w1/batch.csv") == data
    ok("cmp", src, q / "working/w1/batch.csv")

    ok("mv", q / "working/w1/batch.csv", q / "success/")
    assert ls(q / "working/w1") == []
    assert ls(q / "working") == ["w1"]
    assert ls(q / "success") == ["batch.csv"]
    assert ls(q / "error") == []
    assert read(q / "success/batch.csv") == data

    st = os.stat(q / "success/batch.csv")
    assert st.st_size == len(data)
    assert st.st_ino == ino, "a rename (publish, claim, finish) must keep the inode number"
    assert xattr_text(q / "success/batch.csv", "user.spool.sha256").lower().removeprefix(
        "sha256:") == sha256(data)


def test_direct_publish_is_visible_when_cp_returns(queue: Queue, tmp_path: Path) -> None:
    """``cp x ready/`` is the safe direct publish of §1/§3: when cp has closed the file and
    exited 0, the message is in ready/ (a script's next command may claim it). Publishing only
    on the asynchronous FUSE RELEASE would also lose a publish error after cp reported success
    (the §6 argument against write-back)."""
    data = make_content("direct", 70_000)
    src = tmp_path / "direct"
    src.write_bytes(data)
    ok("cp", src, queue.ready)
    assert ls(queue.ready) == ["direct"]
    assert ls(queue.partial) == []
    queue.claim("direct")
    assert read(queue.working / "w1/direct") == data
    queue.finish("direct")
    assert read(queue.success / "direct") == data


def test_empty_message_round_trip(queue: Queue) -> None:
    queue.publish("empty", b"")
    queue.claim("empty")
    queue.finish("empty")
    assert os.stat(queue.success / "empty").st_size == 0
    assert read(queue.success / "empty") == b""


def test_upload_mtime_follows_writes_and_touch_and_survives_publish(queue: Queue) -> None:
    """`find partial -mmin +60` finds stale uploads: an upload's mtime is its last write (or
    touch), and the published message keeps it."""
    p = queue.partial / "m"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"a")
        first = os.stat(p).st_mtime_ns
        time.sleep(0.05)
        os.write(fd, b"b")
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.stat(p).st_mtime_ns > first, "a write did not move the upload's mtime"
    assert os.stat(p).st_size == 2
    ok("touch", "-m", "-d", "@1000000000", p)
    assert os.stat(p).st_mtime == 1_000_000_000
    ok("mv", p, queue.ready)
    assert os.stat(queue.ready / "m").st_mtime == 1_000_000_000
    assert find_older(queue.ready, minutes=60) == ["m"]


def find_older(d: Path, minutes: int) -> list[str]:
    out = ok("find", d, "-type", "f", "-mmin", f"+{minutes}", "-printf", "%f\\n")
    return out.decode().split()
