"""Batches (DESIGN §5) on a real mount: ``mkdir partial/b1``, fill it, ``mv partial/b1 ready/``
publishes the whole directory as ONE message, driven with real ``mkdir``/``cp -r``/``mv``/
``rm -r``/``find``/``cat``/``diff``/``getfattr`` processes.

- publish is all-or-nothing: a watcher running ``find ready -type f`` while a 50-file tree is
  published sees 0 or 50 files, never a part; the content arrives identical;
- claim, finish, release, lease expiry and retry move the batch as a unit; of several
  concurrent claimers exactly one wins each whole batch; ``user.spool.history`` on the batch
  directory tells its story;
- a published batch is immutable (create/append/truncate/mkdir/rename/rm inside → EPERM, nothing
  changed), yet ``rm -r`` discards it from working/, success/, error/ and partial/, never ready/;
- inside partial/ a batch is freely edited; files never move into or out of a batch (EPERM,
  never EXDEV, which would make ``mv`` copy);
- a file still open for writing keeps its batch from being published;
- reading files inside a claimed batch (or holding one open) keeps its lease;
- fan-out copies the whole tree into every subscriber; retention purges the whole tree;
- a batch survives a restart and a ``kill -9``; ``spoolfs fsck`` accepts a store with batches.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.inspection import blob_files, ls, read, snapshot, xattr_text
from helpers.mounts import Mount, MountFactory
from helpers.procs import (
    Procs,
    cli,
    fails,
    finish_claimers,
    ok,
    run,
    spoolfs_cli,
    start_claimers,
    wait_open,
)
from helpers.queues import Queue
from helpers.waiting import patience, wait_until

pytestmark = pytest.mark.fuse

EPERM = "Operation not permitted"
EXDEV = "Invalid cross-device link"
INLINE_MAX = 16 * 1024  # content above this goes to a blob file (DESIGN §6)
LEASE = 2  # seconds
SLOW = 20.0  # deadline for what the lifecycle timer does (it ticks every 0.5 s)
PURGE = 15.0  # deadline for a 1 s retention (swept every 5 s)
SPOOL = "user.spool."


# --------------------------------------------------------------------------- helpers


def make_tree(root: Path, n: int = 50, *, seed: int = 0) -> dict[str, bytes]:
    """A source tree outside the mount: ``n`` files spread over nested directories, a fifth of
    them over the inline limit (blob files), one with a space in its name. Returns
    relative path → content."""
    rnd = random.Random(seed)
    dirs = ["", "docs", "docs/deep/er", "img", "img/raw"]
    out: dict[str, bytes] = {}
    for i in range(n):
        d = dirs[i % len(dirs)]
        name = f"file {i:02d}.txt" if i == 7 else f"f{i:02d}.dat"
        rel = f"{d}/{name}" if d else name
        if i % 5 == 1:
            size = rnd.randrange(INLINE_MAX + 1, 120 * 1024)
        elif i % 5 == 2:
            size = rnd.randrange(1000, 8000)
        else:
            size = rnd.randrange(0, 300)
        data = f"{root.name}/{rel}\n".encode() + os.urandom(size)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        out[rel] = data
    return out


def files(root: Path) -> list[str]:
    """Every regular file under ``root``, relative, as ``find`` lists it."""
    out = ok("find", root, "-type", "f", "-printf", "%P\\0")
    return sorted(os.fsdecode(n) for n in out.split(b"\0") if n)


def digests(root: Path) -> str:
    """``sha256sum`` of every file under ``root`` (sorted relative paths)."""
    return ok("sh", "-c", "find . -type f -print0 | LC_ALL=C sort -z | xargs -0r sha256sum",
              cwd=root).decode()


def same_tree(src: Path, dst: Path) -> None:
    """``dst`` holds exactly ``src``: ``diff -r`` agrees and every file's sha256 matches."""
    res = run(["diff", "-r", src, dst])
    assert res.returncode == 0, (f"diff -r {src} {dst} differs:\n"
                                 f"{res.stdout.decode(errors='replace')}"
                                 f"{res.stderr.decode(errors='replace')}")
    assert digests(src) == digests(dst)


def actions(path: Path) -> list[str]:
    """The actions of ``user.spool.history``, oldest first."""
    return [line.split()[1] for line in xattr_text(path, SPOOL + "history").splitlines() if line]


def history_lines(path: Path) -> list[str]:
    return [line for line in xattr_text(path, SPOOL + "history").splitlines() if line]


def build_batch(q: Queue, name: str, src: Path) -> Path:
    """``cp -r SRC partial/NAME`` (cp makes NAME itself: the mkdir makes the batch)."""
    ok("cp", "-r", "--", src, q.partial / name)
    return q.partial / name


def publish_batch(q: Queue, name: str, src: Path) -> Path:
    build_batch(q, name, src)
    ok("mv", "--", q.partial / name, str(q.ready) + "/")
    return q.ready / name


def source(tmp_path: Path, label: str, n: int, seed: int = 0) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / label
    root.mkdir()
    return root, make_tree(root, n, seed=seed)


# --------------------------------------------------------------------------- 1. all or nothing


def test_batch_of_50_files_appears_all_or_nothing(module_mount: Mount,
                                                  fresh_queue: Callable[[], Queue],
                                                  tmp_path: Path) -> None:
    """``cp -r`` of a 50-file tree (nested dirs, files over 16 KiB) into partial/, then
    ``mv partial/b1 ready/`` while a watcher runs ``find ready -type f`` over and over: it sees
    0 or 50 files, never a part; the published tree is byte-identical to the source."""
    q = fresh_queue()
    src, tree = source(tmp_path, "src", 50)
    assert sum(len(d) > INLINE_MAX for d in tree.values()) >= 10
    build_batch(q, "b1", src)
    assert files(q.partial / "b1") == sorted(tree)
    assert ls(q.ready) == []

    counts: list[int] = []
    anomalies: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            res = run(["find", q.ready, "-type", "f"])
            if res.returncode != 0:
                anomalies.append(res.stderr.decode(errors="replace"))
            counts.append(len([x for x in res.stdout.split(b"\n") if x]))

    watcher = threading.Thread(target=watch, name="find-ready", daemon=True)
    watcher.start()
    try:
        wait_until(lambda: len(counts) >= 5, timeout=10, what="the watcher's first listings")
        ok("mv", "--", q.partial / "b1", str(q.ready) + "/")
        seen = len(counts)
        wait_until(lambda: len(counts) >= seen + 5, timeout=10,
                   what="the watcher's listings after the publish")
    finally:
        stop.set()
        watcher.join(timeout=patience(30))
    assert not anomalies, f"find failed while the batch was published: {anomalies[:3]}"
    partial_views = sorted({c for c in counts if c not in (0, 50)})
    assert not partial_views, (f"ready/ showed a part of the batch: {partial_views} files "
                               f"(counts seen: {counts})")
    assert counts[0] == 0 and counts[-1] == 50, counts

    assert ls(q.partial) == []
    assert ls(q.ready) == ["b1"]
    assert files(q.ready / "b1") == sorted(tree)
    same_tree(src, q.ready / "b1")
    assert xattr_text(q.ready / "b1", SPOOL + "state") == "ready"
    assert actions(q.ready / "b1") == ["upload", "publish"]


# --------------------------------------------------------------------------- 2. claim / finish


def test_claim_and_finish_move_the_whole_batch(module_mount: Mount,
                                              fresh_queue: Callable[[], Queue],
                                              tmp_path: Path) -> None:
    """``mv ready/b1 working/c1/`` takes every file, ``mv working/c1/b1 success/`` finishes all
    of it; the history on the batch directory lists upload, publish, claim, finish."""
    q = fresh_queue()
    src, tree = source(tmp_path, "src", 12)
    publish_batch(q, "b1", src)
    view = q.consumer("c1")

    ok("mv", "--", q.ready / "b1", str(view) + "/")
    assert ls(q.ready) == []
    assert ls(view) == ["b1"]
    same_tree(src, view / "b1")
    assert xattr_text(view / "b1", SPOOL + "state") == "working"
    assert xattr_text(view / "b1", SPOOL + "consumer") == "c1"
    assert xattr_text(view / "b1", SPOOL + "attempts") == "1"
    xattr_text(view / "b1", SPOOL + "lease_expires")  # a claimed batch has a lease
    assert read(view / "b1" / "docs" / "f01.dat") == tree["docs/f01.dat"]

    ok("mv", "--", view / "b1", str(q.success) + "/")
    assert ls(view) == []
    assert ls(q.success) == ["b1"]
    same_tree(src, q.success / "b1")
    assert xattr_text(q.success / "b1", SPOOL + "state") == "success"
    lines = history_lines(q.success / "b1")
    assert [line.split()[1] for line in lines] == ["upload", "publish", "claim", "finish"], lines
    assert " partial -> ready " in lines[1]
    assert " ready -> working/c1 " in lines[2]
    assert " working/c1 -> success " in lines[3]


def test_concurrent_claimers_each_win_whole_batches(module_mount: Mount,
                                                   fresh_queue: Callable[[], Queue],
                                                   tmp_path: Path) -> None:
    """Four shell loops race ``mv ready/* working/cN/`` over six batches: every batch is won by
    exactly one of them, whole (all its files in the winner's view, none anywhere else); the
    losers only ever see ENOENT."""
    q = fresh_queue()
    batches = [f"b{i}" for i in range(6)]
    srcs = {}
    for i, b in enumerate(batches):
        srcs[b], _ = source(tmp_path, f"src-{b}", 8, seed=i)
        build_batch(q, b, srcs[b])
    consumers = ["c1", "c2", "c3", "c4"]
    for c in consumers:
        q.consumer(c)
    # publish all, then let the claimers loose on a full ready/
    for b in batches:
        ok("mv", "--", q.partial / b, str(q.ready) + "/")
    procs = start_claimers([q.path], consumers, tmp_path / "claims", limit=60)
    claims = finish_claimers(procs, timeout=90)

    won = sorted(b for names in claims.values() for b in names)
    assert won == batches, f"each batch must be claimed exactly once: {claims}"
    assert ls(q.ready) == []
    for c in consumers:
        assert ls(q.working / c) == sorted(claims[c]), c
        for b in claims[c]:
            same_tree(srcs[b], q.working / c / b)
            assert xattr_text(q.working / c / b, SPOOL + "attempts") == "1"
            assert actions(q.working / c / b).count("claim") == 1


# --------------------------------------------------------------------------- 3. immutability


def test_published_batch_is_immutable_in_ready_and_working(module_mount: Mount,
                                                          fresh_queue: Callable[[], Queue],
                                                          tmp_path: Path) -> None:
    """In ready/ and working/, creating, appending, truncating, chmod, mkdir, renaming inside and
    removing files of a batch fail with EPERM and change nothing; ``rm -r`` of a batch waiting
    in ready/ fails as a whole. A batch is never made in ready/ directly (``cp -r`` fails)."""
    q = fresh_queue()
    src, tree = source(tmp_path, "src", 10)
    publish_batch(q, "b1", src)

    def refusals(b: Path) -> None:
        fails("touch", b / "new", message=EPERM)
        fails("touch", b / "docs" / "new", message=EPERM)
        fails("sh", "-c", 'echo more >> "$1"', "sh", b / "f00.dat", message=EPERM)
        fails("sh", "-c", 'echo new > "$1"', "sh", b / "docs" / "f01.dat", message=EPERM)
        fails("truncate", "-s", "0", b / "img" / "f03.dat", message=EPERM)
        fails("mkdir", b / "z", message=EPERM)
        fails("mv", "--", b / "f00.dat", b / "docs" / "moved.dat", message=EPERM)
        fails("mv", "--", b / "docs", b / "docs2", message=EPERM)
        fails("setfattr", "-n", "user.x", "-v", "1", b / "f00.dat", message=EPERM)

    before = snapshot(q.path)
    refusals(q.ready / "b1")
    fails("rm", "--", q.ready / "b1" / "f00.dat", message=EPERM)
    fails("rm", "--", q.ready / "b1" / "docs" / "deep" / "er" / "f02.dat", message=EPERM)
    fails("rm", "-r", "--", q.ready / "b1", message=EPERM)
    fails("rm", "-rf", "--", q.ready / "b1" / "img", message=EPERM)
    fails("rmdir", "--", q.ready / "b1" / "docs" / "deep" / "er")
    assert snapshot(q.path) == before, "a refused change in ready/ changed the batch"
    same_tree(src, q.ready / "b1")

    # a batch is made in partial/ only: cp -r into ready/ (mkdir there) is refused
    fails("cp", "-r", "--", src, q.ready / "b2", message=EPERM)
    assert ls(q.ready) == ["b1"]

    view = q.consumer("c1")
    ok("mv", "--", q.ready / "b1", str(view) + "/")
    before = snapshot(q.path)
    refusals(view / "b1")
    assert snapshot(q.path) == before, "a refused change in working/ changed the batch"
    same_tree(src, view / "b1")
    assert actions(view / "b1") == ["upload", "publish", "claim"]
    assert read(view / "b1" / "f00.dat") == tree["f00.dat"]


def test_rm_r_discards_a_batch_outside_ready(module_mount: Mount,
                                            fresh_queue: Callable[[], Queue],
                                            tmp_path: Path) -> None:
    """``rm -r`` takes a whole batch away in working/ (discard), success/, error/ and partial/
    (abort); the content of its files is freed with it."""
    q = fresh_queue()
    src, tree = source(tmp_path, "src", 10, seed=7)
    big = [d for d in tree.values() if len(d) > INLINE_MAX]
    assert big
    view = q.consumer("c1")
    store = module_mount.store

    publish_batch(q, "w", src)
    assert all(blob_files(store, d) for d in big), "the batch's big files have blob files"
    ok("mv", "--", q.ready / "w", str(view) + "/")
    ok("rm", "-r", "--", view / "w")
    assert ls(view) == [] and ls(q.ready) == [] and ls(q.error) == []
    assert all(not blob_files(store, d) for d in big), "rm -r of the batch freed its content"

    for to in ("success", "error"):
        publish_batch(q, to, src)
        ok("mv", "--", q.ready / to, str(view) + "/")
        ok("mv", "--", view / to, str(q.state(to)) + "/")
        same_tree(src, q.state(to) / to)
        ok("rm", "-r", "--", q.state(to) / to)
        assert ls(q.state(to)) == [], to

    build_batch(q, "p", src)
    ok("rm", "-r", "--", q.partial / "p")
    for st in ("partial", "ready", "success", "error"):
        assert ls(q.state(st)) == [], st
    assert ls(view) == []
    assert all(not blob_files(store, d) for d in big)


# --------------------------------------------------------------------------- 4. partial/


def test_batch_is_freely_edited_in_partial(module_mount: Mount,
                                          fresh_queue: Callable[[], Queue],
                                          tmp_path: Path) -> None:
    """Inside partial/ a batch is an ordinary tree: mkdir, write, append, truncate, rename
    files and directories within it, rm and rm -r; the publish takes what it holds then."""
    q = fresh_queue()
    b = q.partial / "b1"
    ok("mkdir", b)
    ok("mkdir", "-p", b / "in" / "deep")
    ok("sh", "-c", 'printf one > "$1/a"; printf two > "$1/in/b"; printf three > "$1/in/deep/c"',
       "sh", b)
    ok("sh", "-c", 'printf " more" >> "$1/a"', "sh", b)
    big = os.urandom(3 * INLINE_MAX)
    bigsrc = tmp_path / "big"
    bigsrc.write_bytes(big)
    ok("cp", "--", bigsrc, b / "in" / "big")
    ok("mv", "--", b / "in" / "b", b / "in" / "deep" / "b2")  # into a subdirectory
    ok("mv", "--", b / "in" / "deep" / "c", b / "c")  # up to the top
    ok("mv", "--", b / "in" / "deep", b / "deeper")  # a directory renamed
    ok("mkdir", b / "gone")
    ok("touch", b / "gone" / "x", b / "tmp")
    ok("rm", "--", b / "tmp")
    ok("rm", "-r", "--", b / "gone")
    ok("sh", "-c", 'printf scratch > "$1/t"; truncate -s 3 "$1/t"', "sh", b)
    ok("mv", "--", bigsrc, b / "deeper" / "fromoutside")  # mv from outside the mount: a copy

    expect = {"a": b"one more", "c": b"three", "t": b"scr", "in/big": big,
              "deeper/b2": b"two", "deeper/fromoutside": big}
    assert files(b) == sorted(expect)
    ok("mv", "--", b, str(q.ready) + "/")
    assert files(q.ready / "b1") == sorted(expect)
    for rel, data in expect.items():
        assert read(q.ready / "b1" / rel) == data, rel
    assert not bigsrc.exists()


# --------------------------------------------------------------------------- 5. in and out


def test_files_never_move_into_or_out_of_a_batch(module_mount: Mount,
                                                fresh_queue: Callable[[], Queue],
                                                tmp_path: Path) -> None:
    """``mv partial/x partial/b1/``, ``mv partial/b1/f partial/`` (or to ready/, or into another
    batch), a batch into a batch, ``ln`` into a batch: all EPERM, never EXDEV (which would make
    ``mv`` fall back to a copy), and nothing changes."""
    q = fresh_queue()
    q.put("x", b"loose message\n")
    ok("mkdir", q.partial / "b1", q.partial / "b2", q.partial / "b1" / "sub")
    ok("sh", "-c", 'printf f > "$1/b1/f"; printf g > "$1/b1/sub/g"; printf h > "$1/b2/h"', "sh",
       q.partial)
    q.publish("r", b"ready message\n")

    def refused(*argv: object) -> None:
        err = fails(*argv, message=EPERM)  # type: ignore[arg-type]
        assert EXDEV not in err, err

    before = snapshot(q.path)
    refused("mv", "--", q.partial / "x", str(q.partial / "b1") + "/")
    refused("mv", "--", q.partial / "x", q.partial / "b1" / "sub" / "x")
    refused("mv", "--", q.partial / "b1" / "f", str(q.partial) + "/")
    refused("mv", "--", q.partial / "b1" / "sub" / "g", q.partial / "g")
    refused("mv", "--", q.partial / "b1" / "f", str(q.ready) + "/")
    refused("mv", "--", q.partial / "b1" / "sub", str(q.partial) + "/")
    refused("mv", "--", q.partial / "b1" / "f", str(q.partial / "b2") + "/")
    refused("mv", "--", q.partial / "b2", str(q.partial / "b1") + "/")
    refused("ln", "--", q.partial / "x", q.partial / "b1" / "x")
    refused("ln", "--", q.ready / "r", q.partial / "b1" / "r")
    assert snapshot(q.path) == before

    # once published: out of the batch is refused as well, from ready/ and from working/
    ok("mv", "--", q.partial / "b1", str(q.ready) + "/")
    before = snapshot(q.path)
    refused("mv", "--", q.ready / "b1" / "f", str(q.ready) + "/")
    refused("mv", "--", q.ready / "r", str(q.ready / "b1") + "/")
    assert snapshot(q.path) == before
    view = q.consumer("c1")
    ok("mv", "--", q.ready / "b1", str(view) + "/")
    before = snapshot(q.path)
    refused("mv", "--", view / "b1" / "f", str(view) + "/")
    refused("mv", "--", view / "b1" / "sub" / "g", str(q.success) + "/")
    assert snapshot(q.path) == before

    # mv from outside the mount into a published batch: the copy fallback is refused cleanly
    outside = tmp_path / "outside"
    outside.write_bytes(b"outside\n")
    refused("mv", "--", outside, str(view / "b1") + "/")
    assert outside.read_bytes() == b"outside\n"
    assert snapshot(q.path) == before
    assert files(view / "b1") == ["f", "sub/g"]


# --------------------------------------------------------------------------- 6. open writer


def test_batch_with_a_file_open_for_writing_is_not_published(module_mount: Mount,
                                                            fresh_queue: Callable[[], Queue],
                                                            tmp_path: Path,
                                                            procs: Procs) -> None:
    """A shell holding ``exec 3>partial/b1/f`` keeps the batch from being published (EPERM,
    still whole in partial/, keeps writing); once it closes, the publish goes through with
    everything it wrote."""
    q = fresh_queue()
    b = q.partial / "b1"
    ok("mkdir", b)
    ok("sh", "-c", 'printf done > "$1/other"', "sh", b)
    go = tmp_path / "go"
    writer = procs.sh('exec 3>"$1"; printf "first\\n" >&3; '
                      'while [ ! -e "$2" ]; do sleep 0.02; done; '
                      'printf "second\\n" >&3; exec 3>&-', b / "f", go, cwd=q.path)
    wait_open(writer, b / "f")

    err = fails("mv", "--", b, str(q.ready) + "/", message=EPERM)
    assert EXDEV not in err
    assert ls(q.ready) == []
    assert ls(b) == ["f", "other"]
    assert xattr_text(b, SPOOL + "state") == "partial"

    go.touch()
    _, stderr = writer.communicate(timeout=patience(10))
    assert writer.returncode == 0, stderr.decode(errors="replace")
    ok("mv", "--", b, str(q.ready) + "/")
    assert ls(q.partial) == []
    assert read(q.ready / "b1" / "f") == b"first\nsecond\n"
    assert read(q.ready / "b1" / "other") == b"done"
    assert actions(q.ready / "b1") == ["upload", "publish"]


# --------------------------------------------------------------------------- 7. lease


def test_lease_of_a_batch(module_mount: Mount, fresh_queue: Callable[[], Queue],
                          tmp_path: Path, procs: Procs) -> None:
    """With ``lease_timeout=2s``: a consumer holding a file of its claimed batch open keeps the
    batch past the lease; killed with ``kill -9``, the whole batch goes back to ready/ after the
    lease (every file there, attempts 1, history expire + retry). Claimed again, a ``cat`` loop
    over its files keeps it for twice the lease; when the loop stops it expires again."""
    q = fresh_queue()
    cli("queue", "set", q.path, f"lease_timeout={LEASE}s")
    src, tree = source(tmp_path, "src", 12, seed=3)
    publish_batch(q, "b1", src)
    view = q.consumer("c1")
    alive = module_mount.daemon_alive

    held = view / "b1" / "img" / "f03.dat"
    consumer = procs.sh('mv -- ready/b1 working/c1/ || exit 1; exec 3<"$1"; exec sleep 600',
                        held, cwd=q.path)
    wait_open(consumer, held)
    assert xattr_text(view / "b1", SPOOL + "attempts") == "1"
    deadline = time.monotonic() + 1.75 * LEASE
    while time.monotonic() < deadline:  # held open: never expires
        assert ls(view) == ["b1"], "a batch with a file held open lost its lease"
        assert ls(q.ready) == [] and ls(q.error) == []
        time.sleep(0.2)

    procs.kill(consumer)  # kill -9: its descriptor closes, the lease runs from now
    wait_until(lambda: ls(q.ready) == ["b1"], timeout=SLOW, alive=alive,
               what="the batch of the killed consumer back in ready/")
    assert ls(view) == [] and ls(q.error) == []
    same_tree(src, q.ready / "b1")
    assert xattr_text(q.ready / "b1", SPOOL + "attempts") == "1"
    assert xattr_text(q.ready / "b1", SPOOL + "error") == "lease expired"
    assert actions(q.ready / "b1") == ["upload", "publish", "claim", "expire", "retry"]

    # claimed again: a cat loop reading its files keeps it
    ok("mv", "--", q.ready / "b1", str(view) + "/")
    assert xattr_text(view / "b1", SPOOL + "attempts") == "2"
    reader = procs.sh('while :; do find working/c1/b1 -type f -exec cat {} + >/dev/null; '
                      'sleep 0.2; done', cwd=q.path)
    deadline = time.monotonic() + 2.25 * LEASE
    while time.monotonic() < deadline:
        assert reader.poll() is None, reader.communicate()[1].decode(errors="replace")
        assert ls(view) == ["b1"], "a batch being read lost its lease"
        time.sleep(0.2)
    procs.kill(reader)
    same_tree(src, view / "b1")

    # with no reader it expires again (so it was the reading that kept it)
    wait_until(lambda: ls(q.ready) == ["b1"], timeout=SLOW, alive=alive,
               what="the batch back in ready/ after the reader stopped")
    assert xattr_text(q.ready / "b1", SPOOL + "attempts") == "2"
    same_tree(src, q.ready / "b1")


# --------------------------------------------------------------------------- 8. fan-out


def test_fanout_copies_the_whole_batch(module_mount: Mount, fresh_queue: Callable[[], Queue],
                                      tmp_path: Path) -> None:
    """A batch published into a topic with ``fanout=s1,s2`` lands whole in both subscribers'
    ready/ (the topic keeps it in success/), sharing content: each big file has one blob file,
    and discarding one subscriber's copy leaves the other intact."""
    topic, s1, s2 = fresh_queue(), fresh_queue(), fresh_queue()
    cli("queue", "set", topic.path, f"fanout={s1.name},{s2.name}")
    src, tree = source(tmp_path, "src", 15, seed=11)
    big = [d for d in tree.values() if len(d) > INLINE_MAX]
    build_batch(topic, "b1", src)
    ok("mv", "--", topic.partial / "b1", str(topic.ready) + "/")

    assert ls(topic.ready) == []
    assert ls(topic.success) == ["b1"]
    for sub in (s1, s2):
        assert ls(sub.ready) == ["b1"], sub
        same_tree(src, sub.ready / "b1")
        assert xattr_text(sub.ready / "b1", SPOOL + "state") == "ready"
        assert "fanout" in actions(sub.ready / "b1")
    same_tree(src, topic.success / "b1")
    store = module_mount.store
    assert all(len(blob_files(store, d)) == 1 for d in big), "fan-out shares content"

    view = s1.consumer("c1")
    ok("mv", "--", s1.ready / "b1", str(view) + "/")
    ok("rm", "-r", "--", view / "b1")
    assert ls(view) == []
    same_tree(src, s2.ready / "b1")
    same_tree(src, topic.success / "b1")
    assert all(len(blob_files(store, d)) == 1 for d in big)


# --------------------------------------------------------------------------- 9. retention


def test_retention_purges_the_whole_batch(mounter: MountFactory, store: Path,
                                         tmp_path: Path) -> None:
    """``success_retention=1s``: a finished batch is purged with all its files and their
    content. (Its own mount: a purge that keeps failing must not spill into other tests.)"""
    m = mounter(store, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    cli("queue", "set", q.path, "success_retention=1s")
    src, tree = source(tmp_path, "src", 10, seed=5)
    big = [d for d in tree.values() if len(d) > INLINE_MAX]
    publish_batch(q, "b1", src)
    view = q.consumer("c1")
    ok("mv", "--", q.ready / "b1", str(view) + "/")
    ok("mv", "--", view / "b1", str(q.success) + "/")
    assert all(blob_files(store, d) for d in big)
    wait_until(lambda: ls(q.success) == [], timeout=PURGE, alive=m.daemon_alive,
               what="the finished batch purged")
    # its files go just after the purge's commit, which a listing may see first
    wait_until(lambda: all(not blob_files(store, d) for d in big), timeout=SLOW,
               alive=m.daemon_alive, what="purging the batch freed its content")


def test_finishing_onto_a_finished_batch_replaces_it(module_mount: Mount,
                                                     fresh_queue: Callable[[], Queue],
                                                     tmp_path: Path) -> None:
    """DESIGN §3: a rename onto an existing name in success/ replaces the older finished entry
    (its content is released). A second batch ``b1`` finished onto ``success/b1`` replaces the
    first one whole."""
    q = fresh_queue()
    old_src, old_tree = source(tmp_path, "old", 6, seed=21)
    new_src, _ = source(tmp_path, "new", 6, seed=22)
    old_big = [d for d in old_tree.values() if len(d) > INLINE_MAX]
    view = q.consumer("c1")
    for src in (old_src, new_src):
        publish_batch(q, "b1", src)
        ok("mv", "--", q.ready / "b1", str(view) + "/")
        ok("mv", "--", view / "b1", str(q.success) + "/")
        same_tree(src, q.success / "b1")
    assert ls(view) == []
    assert ls(q.success) == ["b1"]
    same_tree(new_src, q.success / "b1")
    assert all(not blob_files(module_mount.store, d) for d in old_big), \
        "the replaced batch's content is released"


# --------------------------------------------------------------------------- 10. restart


def test_batches_survive_restart_and_kill9(mounter: MountFactory, store: Path,
                                          tmp_path: Path) -> None:
    """After ``spoolfs umount`` and a new mount: a batch in ready/ is intact (files, history,
    attempts), one being built in partial/ is still there and publishable, a claimed one is
    still claimed. A batch published before a ``kill -9`` of the daemon is intact too."""
    m = mounter(store, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    src, _ = source(tmp_path, "src", 20, seed=1)
    src2, _ = source(tmp_path, "src2", 6, seed=2)
    publish_batch(q, "b1", src)
    publish_batch(q, "b2", src2)
    view = q.consumer("c1")
    ok("mv", "--", q.ready / "b2", str(view) + "/")
    build_batch(q, "b3", src2)
    hist = history_lines(q.ready / "b1")

    m.restart()
    assert ls(q.ready) == ["b1"]
    same_tree(src, q.ready / "b1")
    assert history_lines(q.ready / "b1") == hist
    assert xattr_text(q.ready / "b1", SPOOL + "attempts") == "0"
    assert ls(view) == ["b2"]
    same_tree(src2, view / "b2")
    assert ls(q.partial) == ["b3"]
    same_tree(src2, q.partial / "b3")
    ok("mv", "--", q.partial / "b3", str(q.ready) + "/")
    same_tree(src2, q.ready / "b3")

    ok("mv", "--", q.ready / "b1", str(view) + "/")  # claimable as a whole after the restart
    same_tree(src, view / "b1")
    ok("mv", "--", view / "b1", str(q.ready) + "/")  # release

    m.kill9()
    m.start()
    assert ls(q.ready) == ["b1", "b3"]
    same_tree(src, q.ready / "b1")
    same_tree(src2, q.ready / "b3")
    assert actions(q.ready / "b1") == ["upload", "publish", "claim", "release"]


# --------------------------------------------------------------------------- 11. fsck


def test_fsck_accepts_a_store_with_batches(mounter: MountFactory, store: Path,
                                          tmp_path: Path) -> None:
    """``spoolfs fsck STORE`` on a store holding batches in every state (and a fanned-out copy)
    finds nothing wrong."""
    m = mounter(store, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    sub = Queue.create(m.path, "sub", tmp_path / "scratch")
    src, _ = source(tmp_path, "src", 8, seed=9)
    build_batch(q, "building", src)
    publish_batch(q, "waiting", src)
    view = q.consumer("c1")
    for name, to in (("claimed", None), ("done", "success"), ("failed", "error")):
        publish_batch(q, name, src)
        ok("mv", "--", q.ready / name, str(view) + "/")
        if to:
            ok("mv", "--", view / name, str(q.state(to)) + "/")
    cli("queue", "set", q.path, "fanout=sub")
    publish_batch(q, "fanned", src)
    assert ls(sub.ready) == ["fanned"]
    m.umount()

    res = spoolfs_cli("fsck", store)
    out = res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")
    assert res.returncode == 0 and "fsck: clean" in out, f"fsck of a store with batches:\n{out}"
