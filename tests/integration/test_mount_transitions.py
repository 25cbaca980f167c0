"""The allowed rows of DESIGN §3 beyond the main flow, and the ``user.spool.*`` metadata (§4)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.inspection import expect_errno, listxattr, ls, read, setxattr, sha256, xattr_text
from helpers.mounts import Mount
from helpers.procs import fails, ok
from helpers.queues import Queue

pytestmark = pytest.mark.fuse


@pytest.fixture
def q(fresh_queue: Callable[[], Queue]) -> Queue:
    return fresh_queue()


def spool_sha(path: Path) -> str:
    return xattr_text(path, "user.spool.sha256").lower().removeprefix("sha256:")


# ----------------------------------------------------------------- release, redrive, forward


def test_release_gives_a_claimed_message_back(q: Queue) -> None:
    data = q.publish("m")
    q.claim("m")
    ino = os.stat(q.working / "w1/m").st_ino
    ok("mv", q.working / "w1/m", q.ready)
    assert ls(q.ready) == ["m"]
    assert ls(q.working / "w1") == []
    assert read(q.ready / "m") == data
    assert os.stat(q.ready / "m").st_ino == ino
    q.claim("m", "w2")
    assert read(q.working / "w2/m") == data


def test_release_from_single_consumer_layout(q: Queue) -> None:
    """Files directly in working/ (no consumer dir) are claims too (§2)."""
    data = q.publish("m")
    ok("mv", q.ready / "m", q.working)
    assert ls(q.working) == ["m"]
    assert xattr_text(q.working / "m", "user.spool.state") == "working"
    ok("mv", q.working / "m", q.ready)
    assert ls(q.ready) == ["m"]
    ok("mv", q.ready / "m", q.working)
    ok("mv", q.working / "m", q.success)
    assert read(q.success / "m") == data


@pytest.mark.parametrize("finished", ["success", "error"])
def test_redrive_finished_message_to_ready(q: Queue, finished: str) -> None:
    data = q.publish("m")
    q.claim("m")
    q.finish("m", to=finished)
    ok("mv", q.path / finished / "m", q.ready)
    assert ls(q.path / finished) == []
    assert ls(q.ready) == ["m"]
    assert xattr_text(q.ready / "m", "user.spool.state") == "ready"
    q.claim("m")
    assert read(q.working / "w1/m") == data


@pytest.mark.parametrize("finished", ["success", "error"])
def test_forward_finished_message_to_next_queue(fresh_queue: Callable[[], Queue],
                                                finished: str) -> None:
    first, second = fresh_queue(), fresh_queue()
    data = first.publish("m", os.urandom(100_000))
    first.claim("m")
    first.finish("m", to=finished)
    ok("mv", first.path / finished / "m", second.ready)
    assert ls(first.path / finished) == []
    assert ls(second.ready) == ["m"]
    assert read(second.ready / "m") == data
    assert spool_sha(second.ready / "m") == sha256(data)
    second.claim("m")
    second.finish("m")
    assert read(second.success / "m") == data


def test_publish_into_another_queue(fresh_queue: Callable[[], Queue]) -> None:
    first, second = fresh_queue(), fresh_queue()
    data = first.put("m")
    ok("mv", first.partial / "m", second.ready)
    assert ls(first.partial) == []
    assert ls(second.ready) == ["m"]
    assert read(second.ready / "m") == data


def test_claim_and_finish_may_rename(q: Queue) -> None:
    """§3: ``ready/f → working/[c/]g`` and ``working/[c/]f → success/g``: the name may change."""
    data = q.publish("in.csv")
    q.consumer("w1")
    ok("mv", q.ready / "in.csv", q.working / "w1/processing.csv")
    assert ls(q.working / "w1") == ["processing.csv"]
    assert xattr_text(q.working / "w1/processing.csv", "user.spool.state") == "working"
    ok("mv", q.working / "w1/processing.csv", q.success / "done.csv")
    assert ls(q.success) == ["done.csv"]
    assert read(q.success / "done.csv") == data


def test_hand_over_between_consumer_views(q: Queue) -> None:
    data = q.publish("m")
    q.claim("m", "w1")
    q.consumer("w2")
    assert xattr_text(q.working / "w1/m", "user.spool.consumer") == "w1"
    ok("mv", q.working / "w1/m", q.working / "w2")
    assert ls(q.working / "w1") == []
    assert ls(q.working / "w2") == ["m"]
    assert xattr_text(q.working / "w2/m", "user.spool.consumer") == "w2"
    q.finish("m", "w2")
    assert read(q.success / "m") == data


# ----------------------------------------------------------------- plain renames


@pytest.mark.parametrize("where", ["partial", "ready", "working/w1", "success", "error"])
def test_rename_within_one_state_keeps_the_inode(q: Queue, where: str) -> None:
    data = q.put("a") if where == "partial" else q.publish("a")
    if where != "partial" and where != "ready":
        q.claim("a")
        if where != "working/w1":
            q.finish("a", to=where)
    d = q.path / where
    ino = os.stat(d / "a").st_ino
    ok("mv", d / "a", d / "b")
    assert ls(d) == ["b"]
    assert os.stat(d / "b").st_ino == ino
    assert read(d / "b") == data


def test_rename_queue_and_consumer_dirs(module_mount: Mount, q: Queue) -> None:
    data = q.publish("waiting")
    q.publish("taken")
    q.claim("taken", "w1")
    ino = os.stat(q.ready / "waiting").st_ino
    ok("mv", q.working / "w1", q.working / "w9")
    assert ls(q.working) == ["w9"]
    assert ls(q.working / "w9") == ["taken"]
    new = module_mount.path / f"{q.name}-renamed"
    ok("mv", q.path, new)
    assert q.name not in ls(module_mount.path)
    assert ls(new / "ready") == ["waiting"]
    assert os.stat(new / "ready/waiting").st_ino == ino
    assert read(new / "ready/waiting") == data
    ok("mv", new / "working/w9/taken", new / "success")
    assert ls(new / "success") == ["taken"]


# ----------------------------------------------------------------- unlink in every state


@pytest.mark.parametrize("state", ["partial", "ready", "working", "success", "error"])
def test_unlink_in_every_state(q: Queue, state: str) -> None:
    paths = q.populate()
    ok("rm", paths[state])
    assert not paths[state].exists()
    assert paths[state].name not in ls(paths[state].parent)
    for other, path in paths.items():
        if other != state:
            assert path.exists(), f"rm of the {state} message removed {path}"
    if state == "working":
        assert "w" not in ls(q.success) and "w" not in ls(q.error)


def test_unlinked_content_stays_readable_while_open(q: Queue) -> None:
    data = q.publish("m", os.urandom(300_000))
    with open(q.ready / "m", "rb") as f:
        head = f.read(1000)
        ok("rm", q.ready / "m")
        assert ls(q.ready) == []
        rest = f.read()
    assert head + rest == data


# ----------------------------------------------------------------- hard links (fan-out)


def test_hard_links_share_content_across_queues(fresh_queue: Callable[[], Queue]) -> None:
    a, b = fresh_queue(), fresh_queue()
    data = a.publish("m", os.urandom(200_000))
    ok("ln", a.ready / "m", a.ready / "copy")
    ok("ln", a.ready / "m", b.ready / "m")
    ok("ln", a.ready / "m", b.partial / "staged")
    assert ls(a.ready) == ["copy", "m"]
    assert ls(b.ready) == ["m"]
    for path in (a.ready / "copy", b.ready / "m", b.partial / "staged"):
        assert read(path) == data
    assert spool_sha(b.ready / "m") == sha256(data)

    # each link is its own message: consuming one leaves the others untouched
    a.claim("m")
    a.finish("m")
    ok("rm", a.success / "m")
    ok("rm", a.ready / "copy")
    assert read(b.ready / "m") == data
    ok("mv", b.partial / "staged", b.ready)
    b.claim("staged")
    assert read(b.working / "w1/staged") == data


def test_link_of_finished_message_forwards_a_copy(fresh_queue: Callable[[], Queue]) -> None:
    a, b = fresh_queue(), fresh_queue()
    data = a.publish("m")
    a.claim("m")
    a.finish("m")
    ok("ln", a.success / "m", b.ready / "m")
    assert ls(a.success) == ["m"]
    assert read(b.ready / "m") == data


def test_linked_messages_stay_immutable(q: Queue) -> None:
    data = q.publish("m")
    ok("ln", q.ready / "m", q.ready / "n")
    expect_errno(errno.EPERM, os.open, q.ready / "n", os.O_WRONLY)
    fails("truncate", "-s", "0", q.ready / "n", message="Operation not permitted")
    assert read(q.ready / "m") == data


@pytest.mark.parametrize("where", ["working", "working/w1", "success", "error"])
def test_link_into_working_success_error_is_eperm(q: Queue, where: str) -> None:
    """Linking creates a name, and nothing is created in these states (§3 create row)."""
    q.publish("m")
    q.consumer("w1")
    fails("ln", q.ready / "m", q.path / where / "m", message="Operation not permitted")
    expect_errno(errno.EPERM, os.link, q.ready / "m", q.path / where / "m")
    assert ls(q.ready) == ["m"]
    assert "m" not in ls(q.path / where)


# ----------------------------------------------------------------- metadata xattrs


def test_spool_xattrs_follow_the_lifecycle(q: Queue) -> None:
    data = q.publish("m", os.urandom(12_345))
    path = q.ready / "m"
    assert xattr_text(path, "user.spool.state") == "ready"
    assert xattr_text(path, "user.spool.size") == str(len(data))
    assert spool_sha(path) == sha256(data)
    assert int(xattr_text(path, "user.spool.attempts")) == 0
    names = listxattr(path, r"^user\.spool\.")
    assert {"user.spool.state", "user.spool.attempts", "user.spool.sha256",
            "user.spool.size"} <= names, names

    path = q.claim("m", "w1")
    assert xattr_text(path, "user.spool.state") == "working"
    assert xattr_text(path, "user.spool.consumer") == "w1"
    assert int(xattr_text(path, "user.spool.attempts")) == 1
    assert "user.spool.consumer" in listxattr(path, r"^user\.spool\.")

    ok("mv", path, q.ready)  # a release gives back the attempt its claim counted
    assert int(xattr_text(q.ready / "m", "user.spool.attempts")) == 0
    path = q.claim("m", "w2")
    assert int(xattr_text(path, "user.spool.attempts")) == 1
    assert xattr_text(path, "user.spool.consumer") == "w2"

    path = q.finish("m", "w2")
    assert xattr_text(path, "user.spool.state") == "success"
    assert xattr_text(path, "user.spool.size") == str(len(data))
    assert spool_sha(path) == sha256(data)


def test_error_reason_recorded_in_working_travels_to_error(q: Queue) -> None:
    q.publish("m")
    path = q.claim("m")
    setxattr(path, "user.spool.error", "bad input on line 3")
    assert xattr_text(path, "user.spool.error") == "bad input on line 3"
    path = q.finish("m", to="error")
    assert xattr_text(path, "user.spool.state") == "error"
    assert xattr_text(path, "user.spool.error") == "bad input on line 3"


def test_user_headers_set_in_partial_are_carried_to_success(q: Queue) -> None:
    q.put("m")
    setxattr(q.partial / "m", "user.foo", "bar")
    setxattr(q.partial / "m", "user.content-type", "text/csv; charset=utf-8")

    def headers(path: Path) -> tuple[str, str]:
        return xattr_text(path, "user.foo"), xattr_text(path, "user.content-type")

    expected = ("bar", "text/csv; charset=utf-8")
    ok("mv", q.partial / "m", q.ready)
    assert headers(q.ready / "m") == expected
    assert headers(q.claim("m")) == expected
    assert headers(q.finish("m")) == expected
    assert {"user.foo", "user.content-type"} <= listxattr(q.success / "m", r"^user\.")


def test_touch_in_working_is_the_heartbeat(q: Queue) -> None:
    q.publish("m")
    path = q.claim("m")
    ok("touch", path)
    ok("touch", "-c", path)
    assert ls(q.working / "w1") == ["m"]


def test_statfs_reports_the_store_free_space(module_mount: Mount) -> None:
    ok("df", "-P", module_mount.path)
    mnt = os.statvfs(module_mount.path)
    store = os.statvfs(module_mount.store)
    mnt_free = mnt.f_bavail * mnt.f_frsize
    store_free = store.f_bavail * store.f_frsize
    assert mnt_free > 0
    # the same disk, give or take a reserve the daemon keeps and writes by other processes
    assert abs(mnt_free - store_free) <= max(store_free // 10, 1 << 30), (mnt_free, store_free)
