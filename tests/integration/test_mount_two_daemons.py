"""Two daemons on one embedded store (DESIGN §6): each sees the other's changes within about a
second, and the store, not a kernel cache, decides who wins a claim."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from helpers.inspection import ls, read
from helpers.mounts import MountFactory
from helpers.procs import fails, finish_claimers, ok, start_claimers
from helpers.queues import Queue
from helpers.waiting import patience, wait_until

pytestmark = pytest.mark.fuse

PROPAGATION = 2.0  # DESIGN §6: "within about a second"; some slack for a loaded machine


def test_changes_in_one_mount_show_in_the_other(mounter: MountFactory, store: Path,
                                                tmp_path: Path) -> None:
    a = mounter(store, tmp_path / "spool")
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    b = mounter(store, tmp_path / "q", queue="q")
    top = Queue(b.path, tmp_path / "scratch")  # the same queue, seen through the --queue mount

    data = q.publish("m1")
    wait_until(lambda: ls(top.ready) == ["m1"], timeout=PROPAGATION, alive=b.daemon_alive,
               what="a publish through mount A to show in mount B")
    assert read(top.ready / "m1") == data

    ok("mkdir", top.working / "w1")
    wait_until(lambda: ls(q.working) == ["w1"], timeout=PROPAGATION, alive=a.daemon_alive,
               what="a consumer dir made in B to show in A")

    ok("mv", top.ready / "m1", top.working / "w1")
    wait_until(lambda: ls(q.ready) == [] and ls(q.working / "w1") == ["m1"],
               timeout=PROPAGATION, alive=a.daemon_alive,
               what="a claim through B to show in A")
    # A second claim through the other mount loses, whatever A's kernel cache still believes.
    fails("mv", q.path / "ready/m1", q.working / "w1")

    ok("mv", q.working / "w1/m1", q.success)
    wait_until(lambda: ls(top.success) == ["m1"] and ls(top.working / "w1") == [],
               timeout=PROPAGATION, alive=b.daemon_alive,
               what="a finish through A to show in B")
    assert read(top.success / "m1") == data


def test_claim_race_across_two_mounts(mounter: MountFactory, store: Path, tmp_path: Path) -> None:
    a = mounter(store, tmp_path / "a")
    b = mounter(store, tmp_path / "b")
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    names = [f"m{i:04d}" for i in range(200)]
    src = tmp_path / "src"
    src.mkdir()
    for n in names:
        (src / n).write_bytes(n.encode() + b"\n")
    ok("cp", "-t", q.partial, *(src / n for n in names))
    ok("mv", "-t", q.ready, *(q.partial / n for n in names))
    consumers = [f"c{i}" for i in range(8)]
    for c in consumers:
        q.consumer(c)
    qb = b.path / "q"
    wait_until(lambda: ls(qb / "working") == sorted(consumers)
               and ls(qb / "ready") == names, timeout=PROPAGATION, alive=b.daemon_alive,
               what="mount B to see the published files and consumer dirs")

    # even consumers claim through mount A, odd ones through mount B
    claims = finish_claimers(start_claimers([q.path, qb], consumers, tmp_path / "logs"))

    won = Counter(n for c in consumers for n in claims[c])
    duplicates = {n: k for n, k in won.items() if k > 1}
    assert not duplicates, f"claimed more than once across two mounts: {duplicates}"
    assert set(won) == set(names), f"never claimed: {sorted(set(names) - set(won))[:20]}"

    for spool in (q.path, qb):
        def settled(spool: Path = spool) -> bool:
            return all(ls(spool / "working" / c) == sorted(claims[c]) for c in consumers) \
                and ls(spool / "ready") == []
        wait_until(settled, timeout=PROPAGATION, what=f"{spool} to show every claim where it won")
    for c in consumers:
        for n in claims[c]:
            assert (q.working / c / n).read_bytes() == n.encode() + b"\n"


# Each racer renames every file at the same planned instant (CLOCK_MONOTONIC is system-wide),
# so the renames of one file from different processes arrive within microseconds. `mv`'s own
# stat-then-rename rarely loses inside the rename itself; this does, every time.
RACER = r"""
import json, os, sys, time
srcdir, dstdir, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
start, step = float(sys.argv[4]), float(sys.argv[5])
out = {}
for i, name in enumerate(names):
    at = start + i * step
    while (left := at - time.monotonic()) > 0.002:
        time.sleep(left - 0.002)
    while time.monotonic() < at:
        pass
    try:
        os.rename(os.path.join(srcdir, name), os.path.join(dstdir, name))
        out[name] = "won"
    except OSError as e:
        out[name] = e.errno
print(json.dumps(out))
"""


@pytest.mark.parametrize("mounts", [1, 2])
def test_simultaneous_claims_have_exactly_one_winner(mounter: MountFactory, store: Path,
                                                     tmp_path: Path,
                                                     mounts: int) -> None:
    spools = [mounter(store, tmp_path / f"m{i}") for i in range(mounts)]
    q = Queue.create(spools[0].path, "q", tmp_path / "scratch")
    names = [f"r{i:03d}" for i in range(60)]
    for n in names:
        q.put(n, n.encode())
    ok("mv", "-t", q.ready, *(q.partial / n for n in names))
    racers = 4
    for r in range(racers):
        q.consumer(f"c{r}")
    views = [s.path / "q" for s in spools]
    wait_until(lambda: all(ls(v / "ready") == names and len(ls(v / "working")) == racers
                           for v in views), timeout=PROPAGATION, what="all mounts to agree")

    start = time.monotonic() + 1.0
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(views[r % mounts] / "ready"),
                               str(views[r % mounts] / "working" / f"c{r}"), json.dumps(names),
                               repr(start), "0.01"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(racers)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=patience(60))
        assert p.returncode == 0, err.decode(errors="replace")
        results.append(json.loads(out))

    for n in names:
        outcomes = [res[n] for res in results]
        winners = [r for r, o in enumerate(outcomes) if o == "won"]
        assert len(winners) == 1, f"{n}: {len(winners)} winners, outcomes {outcomes}"
        losers = [errno.errorcode.get(o, o) for o in outcomes if o != "won"]
        assert all(o == "ENOENT" for o in losers), f"{n}: losers saw {losers} (must be ENOENT)"
    for v in views:
        def settled(v: Path = v) -> bool:
            return all(ls(v / "working" / f"c{r}")
                       == sorted(n for n in names if results[r][n] == "won")
                       for r in range(racers))
        wait_until(settled, timeout=PROPAGATION, what=f"{v} to show each file in its winner's view")


def test_upload_in_progress_shows_its_size_in_the_other_mount(mounter: MountFactory, store: Path,
                                                              tmp_path: Path) -> None:
    """An upload's size is its staging file's: a second daemon sees it grow while it is
    written, without a transaction per write."""
    a = mounter(store, tmp_path / "a")
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    b = mounter(store, tmp_path / "b")
    fd = os.open(q.partial / "up", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"x" * 1000)
        wait_until(lambda: (b.path / "q/partial/up").exists() and
                   os.stat(b.path / "q/partial/up").st_size == 1000,
                   timeout=PROPAGATION, alive=b.daemon_alive,
                   what="mount B to show partial/up with 1000 bytes")
        os.write(fd, b"y" * 500)
        wait_until(lambda: os.stat(b.path / "q/partial/up").st_size == 1500,
                   timeout=PROPAGATION, alive=b.daemon_alive,
                   what="mount B to show partial/up grown to 1500 bytes")
    finally:
        os.close(fd)
    ok("mv", q.partial / "up", q.ready / "up")
    assert read(b.path / "q/ready/up") == b"x" * 1000 + b"y" * 500


def test_a_large_upload_rewritten_through_the_other_mount_is_addressed_by_what_it_holds(
        mounter: MountFactory, store: Path, tmp_path: Path) -> None:
    """A's daemon hashes a large upload while ``cp`` writes it; B's daemon rewrites part of
    it (``dd conv=notrunc``) before A's ``mv`` publishes it. The message's address is the
    SHA-256 of what it holds, not of what A saw written."""
    a = mounter(store, tmp_path / "a")
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    b = mounter(store, tmp_path / "b")
    data = bytearray(os.urandom(8 << 20))
    ok("cp", q.source(bytes(data)), q.partial / "big")
    patch = tmp_path / "patch"
    patch.write_bytes(b"B" * (1 << 20))
    theirs = b.path / "q/partial/big"
    wait_until(lambda: theirs.exists(), timeout=PROPAGATION, alive=b.daemon_alive,
               what="the upload to show in mount B")
    ok("dd", f"if={patch}", f"of={theirs}", "bs=1M", "seek=2", "conv=notrunc", "status=none")
    data[2 << 20:3 << 20] = b"B" * (1 << 20)
    ok("mv", q.partial / "big", q.ready / "big")
    digest = hashlib.sha256(data).hexdigest()
    assert ok("getfattr", "--only-values", "-n", "user.spool.sha256",
              q.ready / "big").decode() == digest
    assert ok("sha256sum", q.ready / "big").decode().split()[0] == digest


def test_a_file_published_through_one_mount_while_written_through_the_other_appears_whole(
        mounter: MountFactory, store: Path, tmp_path: Path) -> None:
    """DESIGN §3: a file moved into ``ready/`` while a writer still holds it open appears
    when that writer closes, complete, also when the writer uses another mount of the store.
    Until then nothing may seal it: ``ln`` of it is refused (EPERM), as through its own mount."""
    a = mounter(store, tmp_path / "a")
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    b = mounter(store, tmp_path / "b")
    fd = os.open(b.path / "q/partial/up", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"first ")
        wait_until(lambda: (q.partial / "up").exists(), timeout=PROPAGATION,
                   alive=a.daemon_alive, what="the upload to show in mount A")
        fails("ln", q.partial / "up", q.ready / "copy", message="Operation not permitted")
        ok("mv", q.partial / "up", q.ready / "up")
        assert ls(q.ready) == [] and ls(q.partial) == []  # not before its writer closes
        os.write(fd, b"second")
    finally:
        os.close(fd)
    wait_until(lambda: ls(q.ready) == ["up"], timeout=PROPAGATION, alive=a.daemon_alive,
               what="the file to appear in A's ready/ once its writer through B closed")
    assert read(q.ready / "up") == b"first second"
    assert ok("getfattr", "--only-values", "-n", "user.spool.sha256",
              q.ready / "up").decode() == hashlib.sha256(b"first second").hexdigest()
