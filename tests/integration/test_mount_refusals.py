"""Every refusal row of DESIGN §3: the caller sees the errno, and nothing changed.

Each check is made twice where a tool can express it: with the tool users run (exit status and
message) and with the system call itself (exact errno). "Nothing changed" is a snapshot of the
whole queue tree (names, inodes, sizes, modes, content hashes) before and after.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers.inspection import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    RENAME_WHITEOUT,
    expect_errno,
    fallocate,
    ls,
    read,
    renameat2,
    snapshot,
)
from helpers.mounts import Mount
from helpers.procs import fails, ok
from helpers.queues import STATES, Queue

pytestmark = pytest.mark.fuse

EPERM_TEXT = "Operation not permitted"
PUBLISHED = ("ready", "working", "success", "error")


@contextmanager
def unchanged(*roots: Path) -> Iterator[None]:
    """Assert that the trees under ``roots`` look exactly the same after the block."""
    before = [snapshot(r) for r in roots]
    yield
    for root, b in zip(roots, before):
        after = snapshot(root)
        assert after == b, f"a refused operation changed {root}:\n before {b}\n after  {after}"


@pytest.fixture
def q(fresh_queue: Callable[[], Queue]) -> Queue:
    return fresh_queue()


@pytest.fixture
def messages(q: Queue) -> dict[str, Path]:
    """One message per state: partial/p, ready/r, working/w1/w, success/s, error/e."""
    return q.populate()


# ----------------------------------------------------------------- published content is immutable


@pytest.mark.parametrize("state", PUBLISHED)
def test_open_for_write_of_published_message_is_eperm(q: Queue, messages: dict[str, Path],
                                                      state: str, tmp_path: Path) -> None:
    path = messages[state]
    other = tmp_path / "other"
    other.write_bytes(b"other content\n")
    with unchanged(q.path):
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_APPEND,
                      os.O_WRONLY | os.O_TRUNC, os.O_RDWR | os.O_TRUNC):
            expect_errno(errno.EPERM, os.open, path, flags)
        fails("sh", "-c", 'echo more >> "$1"', "sh", path, message=EPERM_TEXT)
        fails("sh", "-c", ': > "$1"', "sh", path, message=EPERM_TEXT)
        fails("cp", other, path, message=EPERM_TEXT)


@pytest.mark.parametrize("state", PUBLISHED)
def test_truncate_of_published_message_is_eperm(q: Queue, messages: dict[str, Path],
                                                state: str) -> None:
    path = messages[state]
    with unchanged(q.path):
        fails("truncate", "-s", "0", path, message=EPERM_TEXT)
        fails("truncate", "-s", "+10", path, message=EPERM_TEXT)
        expect_errno(errno.EPERM, os.truncate, path, 0)
        expect_errno(errno.EPERM, os.truncate, path, 1 << 20)


@pytest.mark.parametrize("state", PUBLISHED)
def test_chmod_of_published_message_changes_only_its_mode(q: Queue, messages: dict[str, Path],
                                                          state: str) -> None:
    """Metadata is not content: chmod works in every state (tools set it after a copy)."""
    path = messages[state]
    data = read(path)
    ok("chmod", "0600", path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read(path) == data


def test_partial_upload_is_writable(q: Queue) -> None:
    """The counterpart of the rows above: partial/ is where writes, truncates and chmod go."""
    q.put("p", b"0123456789")
    path = q.partial / "p"
    ok("sh", "-c", 'echo more >> "$1"', "sh", path)
    assert read(path) == b"0123456789more\n"
    ok("truncate", "-s", "4", path)
    assert read(path) == b"0123"
    ok("chmod", "0600", path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


# ----------------------------------------------------------------- create where nothing is created


@pytest.mark.parametrize("where", ["working", "working/w1", "success", "error"])
def test_create_in_working_success_error_is_eperm(q: Queue, tmp_path: Path, where: str) -> None:
    q.consumer("w1")
    directory = q.path / where
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"from outside the mount\n")
    with unchanged(q.path):
        fails("touch", directory / "new", message=EPERM_TEXT)
        fails("cp", outside, directory, message=EPERM_TEXT)
        expect_errno(errno.EPERM, os.open, directory / "new", os.O_WRONLY | os.O_CREAT, 0o644)
        expect_errno(errno.EPERM, os.open, directory / "new",
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        # mv from outside the mount falls back to copy (EXDEV): the create must fail cleanly
        # and mv must keep its source.
        fails("mv", outside, directory, message=EPERM_TEXT)
    assert outside.read_bytes() == b"from outside the mount\n"


# ----------------------------------------------------------------- renames onto existing names


EEXIST_RENAMES = [
    # (source, target): both exist before the rename
    ("ready/a", "ready/b"),
    ("working/w1/a", "working/w1/b"),
    ("partial/a", "ready/b"),       # publish onto a waiting message
    ("ready/a", "working/w1/b"),    # claim onto an in-flight message
    ("working/w1/a", "working/w2/b"),  # hand-over onto an in-flight message
    ("working/w1/a", "ready/b"),    # release onto a waiting message
    ("success/a", "ready/b"),       # redrive onto a waiting message
    ("error/a", "ready/b"),
]


def _place(q: Queue, rel: str, data: bytes) -> None:
    """Create a message at ``rel`` (a path under the queue) through the normal transitions."""
    state, _, rest = rel.partition("/")
    name = rest.rsplit("/", 1)[-1]
    tmp = f"tmp-{name}-{state}-{rest.replace('/', '_')}"
    if state == "partial":
        q.put(name, data)
        return
    q.publish(tmp, data)
    if state == "ready":
        ok("mv", q.ready / tmp, q.path / rel)
        return
    consumer = rest.split("/")[0] if "/" in rest else "w1"
    q.claim(tmp, consumer)
    if state == "working":
        ok("mv", q.working / consumer / tmp, q.path / rel)
        return
    q.finish(tmp, consumer, to=state)
    ok("mv", q.path / state / tmp, q.path / rel)


@pytest.mark.parametrize("src,dst", EEXIST_RENAMES, ids=[f"{s}->{d}" for s, d in EEXIST_RENAMES])
def test_rename_onto_pending_message_is_eexist(q: Queue, src: str, dst: str) -> None:
    q.consumer("w1")
    q.consumer("w2")
    _place(q, src, b"source content\n")
    _place(q, dst, b"target content\n")
    with unchanged(q.path):
        expect_errno(errno.EEXIST, os.rename, q.path / src, q.path / dst)
        expect_errno(errno.EEXIST, renameat2, q.path / src, q.path / dst, RENAME_NOREPLACE)
        # mv tries RENAME_NOREPLACE, then a plain rename: both must refuse
        fails("mv", q.path / src, q.path / dst, message="File exists")
        fails("mv", "-f", q.path / src, q.path / dst, message="File exists")
    assert read(q.path / src) == b"source content\n"
    assert read(q.path / dst) == b"target content\n"


@pytest.mark.parametrize("finished", ["success", "error"])
def test_finish_onto_existing_finished_entry_replaces_it(q: Queue, finished: str) -> None:
    q.publish("old", b"old content\n")
    q.claim("old")
    q.finish("old", to=finished)
    ok("mv", q.path / finished / "old", q.path / finished / "a")
    q.publish("a", b"new content\n")
    q.claim("a")
    target = q.path / finished / "a"

    expect_errno(errno.EEXIST, renameat2, q.working / "w1/a", target, RENAME_NOREPLACE)
    assert read(target) == b"old content\n"

    ok("mv", q.working / "w1/a", q.path / finished)
    assert ls(q.path / finished) == ["a"]
    assert read(target) == b"new content\n"
    assert ls(q.working / "w1") == []


@pytest.mark.parametrize("finished", ["success", "error"])
def test_rename_within_finished_state_replaces(q: Queue, finished: str) -> None:
    for name in ("a", "b"):
        q.publish(name, f"{name} content\n".encode())
        q.claim(name)
        q.finish(name, to=finished)
    ino = os.stat(q.path / finished / "a").st_ino
    os.rename(q.path / finished / "a", q.path / finished / "b")
    assert ls(q.path / finished) == ["b"]
    assert read(q.path / finished / "b") == b"a content\n"
    assert os.stat(q.path / finished / "b").st_ino == ino


# ----------------------------------------------------------------- forbidden transitions


FORBIDDEN = [
    # (source state, target state, target in another queue?)
    ("partial", "working", False),
    ("partial", "success", False),
    ("partial", "error", False),
    ("ready", "success", False),
    ("ready", "error", False),
    ("ready", "partial", False),
    ("working", "partial", False),
    ("success", "working", False),
    ("error", "working", False),
    ("success", "partial", False),
    ("error", "partial", False),
    ("success", "error", False),
    ("error", "success", False),
    ("ready", "working", True),     # a claim is within one queue
    ("working", "success", True),   # so is a finish
    ("working", "error", True),
    ("working", "ready", True),     # and a release
    ("partial", "working", True),
]


@pytest.mark.parametrize("src_state,dst_state,other", FORBIDDEN,
                         ids=[f"{s}->{'other:' if o else ''}{d}" for s, d, o in FORBIDDEN])
def test_forbidden_transition_is_eperm_never_exdev(fresh_queue: Callable[[], Queue], src_state: str,
                                                   dst_state: str, other: bool) -> None:
    q = fresh_queue()
    target_q = fresh_queue() if other else q
    sources = q.populate()
    target_q.consumer("w1")
    src = sources[src_state]
    target_dir = target_q.path / ("working/w1" if dst_state == "working" else dst_state)
    roots = [q.path] if target_q is q else [q.path, target_q.path]
    with unchanged(*roots):
        expect_errno(errno.EPERM, os.rename, src, target_dir / src.name)
        expect_errno(errno.EPERM, renameat2, src, target_dir / src.name, RENAME_NOREPLACE)
        # EXDEV here would make mv copy and delete: a refusal turned into a duplicate
        err = fails("mv", src, target_dir, message=EPERM_TEXT)
        assert "cross-device" not in err
        fails("mv", src, target_dir / "renamed", message=EPERM_TEXT)


def test_mv_out_of_the_mount_copies_then_withdraws(q: Queue, messages: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """mv to another filesystem is copy + unlink; unlink of ready/ is a withdraw (§3)."""
    outside = tmp_path / "out"
    outside.mkdir()
    ok("mv", messages["ready"], outside)
    assert (outside / "r").read_bytes() == b"message r\n"
    assert "r" not in ls(q.ready)


# ----------------------------------------------------------------- mkdir, rmdir, directories


@pytest.mark.parametrize("where", ["ready", "success", "error", "working/w1", "."])
def test_mkdir_elsewhere_is_eperm(q: Queue, where: str) -> None:
    q.consumer("w1")
    base = q.path / where
    with unchanged(q.path):
        fails("mkdir", base / "sub", message=EPERM_TEXT)
        expect_errno(errno.EPERM, os.mkdir, base / "sub2")


@pytest.mark.parametrize("bad", ["has space", ".hidden", "x" * 65, "a:b", "é", "a\\b"])
def test_mkdir_of_invalid_queue_name_is_refused(module_mount: Mount, bad: str) -> None:
    """§2: queue names are 1–64 bytes of [A-Za-z0-9._-], not starting with '.'."""
    before = ls(module_mount.path)
    with pytest.raises(OSError):
        os.mkdir(module_mount.path / bad)
    assert ls(module_mount.path) == before


@pytest.mark.parametrize("bad", ["has space", ".hidden", "x" * 65, "a:b"])
def test_mkdir_of_invalid_consumer_name_is_refused(q: Queue, bad: str) -> None:
    with unchanged(q.path), pytest.raises(OSError):
        os.mkdir(q.working / bad)


@pytest.mark.parametrize("state", STATES)
def test_rmdir_of_state_dir_is_eperm(q: Queue, state: str) -> None:
    with unchanged(q.path):
        fails("rmdir", q.path / state, message=EPERM_TEXT)
        expect_errno(errno.EPERM, os.rmdir, q.path / state)


@pytest.mark.parametrize("state", STATES)
def test_rename_of_state_dir_is_eperm(q: Queue, state: str) -> None:
    with unchanged(q.path):
        fails("mv", q.path / state, q.path / f"{state}2", message=EPERM_TEXT)
        expect_errno(errno.EPERM, os.rename, q.path / state, q.path / f"{state}2")


def test_rmdir_of_non_empty_consumer_dir_is_enotempty(q: Queue) -> None:
    q.publish("m")
    q.claim("m")
    with unchanged(q.path):
        fails("rmdir", q.working / "w1", message="Directory not empty")
        expect_errno(errno.ENOTEMPTY, os.rmdir, q.working / "w1")


@pytest.mark.parametrize("state", STATES)
def test_rmdir_of_queue_with_a_message_is_enotempty(fresh_queue: Callable[[], Queue],
                                                    module_mount: Mount, state: str) -> None:
    q = fresh_queue()
    paths = q.populate()
    for other in STATES:
        if other != state:
            ok("rm", paths[other])
    if state != "working":
        ok("rmdir", q.working / "w1")
    with unchanged(q.path):
        fails("rmdir", q.path, message="Directory not empty")
        expect_errno(errno.ENOTEMPTY, os.rmdir, q.path)
    assert q.name in ls(module_mount.path)


def test_rmdir_of_empty_consumer_and_empty_queue(fresh_queue: Callable[[], Queue],
                                                 module_mount: Mount) -> None:
    q = fresh_queue()
    q.consumer("w1")
    ok("rmdir", q.working / "w1")
    assert ls(q.working) == []
    ok("rmdir", q.path)
    assert q.name not in ls(module_mount.path)


# ----------------------------------------------------------------- special files


@pytest.mark.parametrize("where", ["partial", "ready", "working/w1", "success", "error", "."])
def test_symlink_mknod_mkfifo_are_eperm(q: Queue, where: str) -> None:
    q.consumer("w1")
    directory = q.path / where
    with unchanged(q.path):
        fails("ln", "-s", "/etc/hostname", directory / "link", message=EPERM_TEXT)
        expect_errno(errno.EPERM, os.symlink, "/etc/hostname", directory / "link")
        fails("mkfifo", directory / "fifo", message=EPERM_TEXT)
        expect_errno(errno.EPERM, os.mkfifo, directory / "fifo")
        expect_errno(errno.EPERM, os.mknod, directory / "null", stat.S_IFCHR | 0o600,
                     os.makedev(1, 3))


def test_symlink_at_spool_root_is_eperm(module_mount: Mount) -> None:
    before = ls(module_mount.path)
    expect_errno(errno.EPERM, os.symlink, "/etc/hostname", module_mount.path / "link")
    assert ls(module_mount.path) == before


def test_fallocate_is_eopnotsupp(q: Queue) -> None:
    q.put("p", b"abc")
    path = q.partial / "p"
    fails("fallocate", "-l", "1M", path, message="Operation not supported")
    fd = os.open(path, os.O_RDWR)
    try:
        expect_errno(errno.EOPNOTSUPP, fallocate, fd, 0, 0, 1 << 20)
    finally:
        os.close(fd)
    assert read(path) == b"abc"


# ----------------------------------------------------------------- renameat2 flags


def test_rename_noreplace_is_supported(q: Queue) -> None:
    """mv tries RENAME_NOREPLACE first; it must do the transition, not fail with EINVAL."""
    view = q.consumer("w1")
    q.put("a", b"A\n")
    renameat2(q.partial / "a", q.ready / "a", RENAME_NOREPLACE)     # publish
    assert ls(q.ready) == ["a"]
    renameat2(q.ready / "a", q.ready / "b", RENAME_NOREPLACE)       # plain rename
    renameat2(q.ready / "b", view / "b", RENAME_NOREPLACE)          # claim
    renameat2(view / "b", q.success / "b", RENAME_NOREPLACE)        # finish
    assert ls(q.success) == ["b"]
    assert read(q.success / "b") == b"A\n"


@pytest.mark.parametrize("state", ["partial", "ready", "success"])
def test_rename_exchange_and_whiteout_are_einval(q: Queue, state: str) -> None:
    for name in ("a", "b"):
        if state == "partial":
            q.put(name, f"{name}\n".encode())
        else:
            q.publish(name, f"{name}\n".encode())
            if state == "success":
                q.claim(name)
                q.finish(name)
    d = q.path / state
    with unchanged(q.path):
        expect_errno(errno.EINVAL, renameat2, d / "a", d / "b", RENAME_EXCHANGE)
        expect_errno(errno.EINVAL, renameat2, d / "a", d / "c", RENAME_WHITEOUT)


# ----------------------------------------------------------------- names longer than 255 bytes


@pytest.mark.parametrize("length", [256, 300, 1024])
def test_name_longer_than_255_bytes_is_enametoolong(q: Queue, module_mount: Mount,
                                                    length: int) -> None:
    long = "n" * length
    q.put("a", b"a\n")
    with unchanged(q.path):
        fails("touch", q.partial / long, message="File name too long")
        expect_errno(errno.ENAMETOOLONG, os.open, q.partial / long,
                     os.O_WRONLY | os.O_CREAT, 0o644)
        expect_errno(errno.ENAMETOOLONG, os.rename, q.partial / "a", q.partial / long)
        expect_errno(errno.ENAMETOOLONG, os.stat, q.ready / long)
        expect_errno(errno.ENAMETOOLONG, os.mkdir, q.working / long)
    before = ls(module_mount.path)
    expect_errno(errno.ENAMETOOLONG, os.mkdir, module_mount.path / long)
    assert ls(module_mount.path) == before


def test_name_length_counts_bytes_not_characters(q: Queue) -> None:
    with unchanged(q.path):
        expect_errno(errno.ENAMETOOLONG, os.open, q.partial / ("é" * 128),
                     os.O_WRONLY | os.O_CREAT, 0o644)  # 256 bytes


def test_statfs_reports_255_byte_names(module_mount: Mount) -> None:
    assert os.statvfs(module_mount.path).f_namemax == 255
