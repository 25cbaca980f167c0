"""Directories and attributes behave as on a plain file system where tools expect it: a
directory's times move when names come and go, its link count counts its subdirectories,
removing a missing attribute is ENODATA, an impossible size is EFBIG (ext4 as reference)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.inspection import ls, read
from helpers.mounts import Mount, MountFactory
from helpers.procs import fails, ok
from helpers.queues import Queue
from helpers.waiting import wait_until

pytestmark = pytest.mark.fuse


def times(p: Path) -> tuple[int, int]:
    st = os.stat(p)
    return st.st_mtime_ns, st.st_ctime_ns


def moved(*dirs: Path) -> Callable[[], None]:
    """Remember the times of ``dirs``; the returned check waits until every one has moved
    (mtime and ctime). A directory's attributes may be cached by the kernel for a second, so
    changes made by the lifecycle or another daemon show within that: poll, never sleep."""
    before = {d: times(d) for d in dirs}

    def check() -> None:
        for d, (m, c) in before.items():
            wait_until(lambda: (t := times(d))[0] > m and t[1] > c,
                       what=f"the times of {d} to move from {m}, {c}")
    return check


def test_directory_times_move_when_names_come_and_go(fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    check = moved(q.partial)
    q.put("a")
    check()
    check = moved(q.partial, q.ready)
    ok("mv", q.partial / "a", q.ready / "a")  # publish
    check()
    check = moved(q.ready)
    ok("cp", q.source(b"direct\n"), q.ready / "d")  # a hidden upload appearing is an addition
    check()
    check = moved(q.working)
    w1 = q.consumer("w1")
    check()
    check = moved(q.ready, w1)
    q.claim("a")
    check()
    check = moved(w1, q.success)
    q.finish("a")
    check()
    check = moved(q.ready, q.ready)
    ok("mv", q.ready / "d", q.ready / "d2")  # a plain rename inside one directory
    check()
    check = moved(q.ready)
    ok("rm", q.ready / "d2")
    check()
    check = moved(q.working)
    ok("rmdir", w1)
    check()
    check = moved(q.partial)
    ok("mkdir", q.partial / "b")
    check()
    check = moved(q.partial / "b")
    ok("cp", q.source(b"member\n"), q.partial / "b" / "f")
    check()


def test_a_hidden_upload_changes_ready_only_when_it_appears(
        fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    before = times(q.ready)
    with open(q.ready / "slow", "wb") as f:
        f.write(b"not yet\n")
        f.flush()
        assert times(q.ready) == before, "ready/ changed for a file nobody may see yet"
    wait_until(lambda: times(q.ready)[0] > before[0], what="ready/ to change on publish")


def test_lifecycle_moves_change_directory_times(fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    q.publish("m")
    ok("setfattr", "-n", "user.spool.policy.lease_timeout", "-v", "1s", q.path)
    ok("setfattr", "-n", "user.spool.policy.max_attempts", "-v", "1", q.path)
    w1 = q.claim("m").parent
    check = moved(w1, q.error)
    wait_until(lambda: "m" in ls(q.error), what="the lease to expire", timeout=30)
    check()


def test_another_daemons_changes_move_directory_times(mounter: MountFactory, store: Path,
                                                      tmp_path: Path) -> None:
    a = mounter(store, tmp_path / "a")
    b = mounter(store, tmp_path / "b")
    qa = Queue.create(a.path, "q", tmp_path / "scratch")
    qb = Queue(b.path / "q", tmp_path / "scratch")
    check = moved(qb.ready)
    qa.publish("m")
    check()


def test_directory_link_count_counts_subdirectories(module_mount: Mount,
                                                   fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    ok("mkdir", "-p", q.partial / "b" / "sub")
    assert os.stat(q.partial / "b").st_nlink == 3  # ext4: ., its entry in partial/, sub/..
    assert os.stat(q.partial / "b" / "sub").st_nlink == 2
    assert os.stat(q.path).st_nlink == 2 + 5  # its five state directories
    q.consumer("w1")
    q.consumer("w2")
    assert os.stat(q.working).st_nlink == 2 + 2
    ok("mv", q.partial / "b", q.ready / "b")
    assert os.stat(q.ready).st_nlink == 1  # not counted (it may hold millions): find looks in
    queues = [n for n in os.listdir(module_mount.path) if (module_mount.path / n).is_dir()]
    assert os.stat(module_mount.path).st_nlink == 2 + len(queues)
    ok("mv", q.ready / "b", q.working / "w1" / "b")
    assert os.stat(q.working / "w1").st_nlink == 3
    found = ok("find", q.path, "-name", "sub").decode()
    assert found.strip().endswith("w1/b/sub"), found


def test_removing_an_attribute_that_is_not_there_is_enodata(
        module_mount: Mount, fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    ok("mkdir", q.partial / "b")
    ok("cp", q.source(b"member\n"), q.partial / "b" / "f")
    for path in (module_mount.path, q.path, q.ready, q.consumer("w1"), q.partial / "b" / "f"):
        out = fails("setfattr", "-x", "user.foo", path)
        assert "No such attribute" in out, (path, out)
    out = fails("setfattr", "-x", "trusted.foo", q.partial / "b" / "f")
    assert "Operation not supported" in out, out


def test_rmdir_of_a_queue_with_only_an_empty_consumer_view(module_mount: Mount,
                                                           fresh_queue: Callable[[], Queue]
                                                           ) -> None:
    q = fresh_queue()
    q.consumer("w1")
    ok("rmdir", q.path)
    assert q.name not in ls(module_mount.path)
    ok("mkdir", q.path)  # the name is free again, with a fresh set of states
    assert sorted(ls(q.path)) == ["error", "partial", "ready", "success", "working"]
    assert ls(q.working) == []


def test_truncate_beyond_the_largest_file_is_efbig(fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    data = q.put("f")
    out = fails("truncate", "-s", "999999999999999", q.partial / "f")
    assert "File too large" in out, out
    assert read(q.partial / "f") == data


def test_nested_directories_in_a_batch_travel_with_it(fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    ok("mkdir", "-p", q.partial / "b" / "sub" / "sub2")
    ok("cp", q.source(b"deep\n"), q.partial / "b" / "sub" / "sub2" / "f")
    ok("mv", q.partial / "b", q.ready / "b")
    q.claim("b")
    assert read(q.working / "w1" / "b" / "sub" / "sub2" / "f") == b"deep\n"
    fails("mkdir", q.working / "w1" / "b" / "sub" / "late")  # published: immutable
    q.finish("b")
    assert read(q.success / "b" / "sub" / "sub2" / "f") == b"deep\n"
