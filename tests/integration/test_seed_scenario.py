"""The seed-004 scenario (shared/seeds/004): files published by ``cp``, then 20 consumers over
two mounts (two daemons) of one store, each listing ``ready/``, testing each name with ``-e`` and
claiming it by ``mv`` into its own ``working/<c>/``; one daemon is killed with ``kill -9``
mid-run and mounted again. Every file ends in ``success/`` exactly once, none is lost, each
claim is won once, and ``spoolfs fsck`` finds the store clean.

CI runs it with ``SPOOLFS_SEED_FILES`` files (default 2,000 on the embedded store, 1,000 on
PostgreSQL + S3, where each step is a round trip to two servers); the seed's own size is 25,000.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from helpers.inspection import ls
from helpers.mounts import MountFactory
from helpers.procs import spoolfs_cli
from helpers.queues import Queue
from helpers.seed import start_consumers, wait_consumers
from helpers.waiting import patience, wait_until

pytestmark = pytest.mark.fuse

FILES = {"embedded": int(os.environ.get("SPOOLFS_SEED_FILES", "2000")),
         "postgresql+s3": int(os.environ.get("SPOOLFS_SEED_FILES", "1000"))}
CONSUMERS = 20
#: the seed's files are small records; every 50th is large enough to live in a blob file
LARGE_EVERY = 50


def _make_sources(src: Path, count: int) -> dict[str, str]:
    src.mkdir()
    digests = {}
    for i in range(count):
        name = f"rec{i:05d}.csv"
        body = f"id,{i}\n".encode() + os.urandom(100_000 if i % LARGE_EVERY == 0 else 200)
        (src / name).write_bytes(body)
        digests[name] = hashlib.sha256(body).hexdigest()
    return digests


def _count(path: Path) -> int:
    try:
        return len(os.listdir(path))
    except OSError:  # the mount is being restarted
        return 0


def _where(q: Path, name: str) -> list[tuple[str, str]]:
    """Every place ``name`` is found under the queue, with its history (for failure reports)."""
    out = []
    for p in q.rglob(name):
        try:
            hist = os.getxattr(p, "user.spool.history").decode(errors="replace")
        except OSError as e:
            hist = str(e)
        out.append((str(p.relative_to(q)), hist))
    return out


@pytest.fixture(params=["embedded", "postgresql+s3"])
def seed_store(request: pytest.FixtureRequest, store: Path, tmp_path: Path
               ) -> tuple[str, list[str], int]:
    """The store both daemons mount, what its first mount adds to the command line, and how
    many files: the embedded store, or a postgresql:// database with its content in S3."""
    if request.param == "embedded":
        return str(store), [], FILES["embedded"]
    return (request.getfixturevalue("pg_url"), ["--blobs", request.getfixturevalue("s3_url")],
            FILES[request.param])


def test_seed_scenario_two_daemons_one_killed(mounter: MountFactory,
                                              seed_store: tuple[str, list[str], int],
                                              tmp_path: Path) -> None:
    store, first, files = seed_store
    a = mounter(store, tmp_path / "a", extra=first)
    b = mounter(store, tmp_path / "b")
    qa = Queue.create(a.path, "q", tmp_path / "scratch")
    qb = b.path / "q"
    wait_until(lambda: (qb / "ready").is_dir(), timeout=5, alive=b.daemon_alive,
               what="the queue made through mount A to show in mount B")
    digests = _make_sources(tmp_path / "src", files)
    names = sorted(digests)
    done = tmp_path / "producer-done"
    limit = 600 + files * 0.1

    consumers = start_consumers([qa.path, qb], CONSUMERS, tmp_path / "logs", done, limit)
    # the producer: one cp of every file into ready/, through mount A (a directory's contents:
    # 25,000 names would not fit on one command line)
    producer = subprocess.Popen(["cp", "-r", f"{tmp_path / 'src'}/.", f"{qa.ready}/"],
                                stderr=subprocess.PIPE)
    try:
        # kill -9 mount B's daemon once about a third of the work is done, and mount it again
        wait_until(lambda: _count(qa.success) >= files // 3, timeout=limit,
                   alive=a.daemon_alive, what="a third of the files to reach success/")
        b.kill9()
        b.start()
        _, err = producer.communicate(timeout=patience(limit))
        assert producer.returncode == 0, f"cp exited {producer.returncode}: {err!r}"
        done.touch()  # the consumers may stop once ready/ is empty
        problems = wait_consumers(consumers, limit)
    finally:
        done.touch()
        for proc in (producer, *(c.proc for c in consumers)):  # a failure above leaves none
            if proc.poll() is None:                           # behind, nor their pipes
                proc.kill()
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
    assert not problems, "\n".join(problems)

    claims: Counter[str] = Counter()
    finished_held: set[str] = set()
    for c in consumers:
        claimed_here = set()
        for verb, name in c.lines():
            if verb == "claim":
                claims[name] += 1
                claimed_here.add(name)
            elif verb == "finish" and name not in claimed_here:
                finished_held.add(name)  # claimed by a mv whose answer the kill lost
    twice = sorted(n for n, k in claims.items() if k > 1)
    assert not twice, f"claimed more than once: {twice[:20]}"
    unlogged = set(names) - set(claims)
    # a claim without a log line is one whose mv was cut off by the kill: the consumer found
    # it in its own view afterwards; at most one per consumer on the killed mount
    odd = sorted(unlogged - finished_held)
    assert not odd and len(unlogged) <= CONSUMERS // 2, "\n".join(
        f"{n}: " + repr([(c.name, line) for c in consumers for line in c.lines() if line[1] == n])
        + f" found: {_where(qa.path, n)}" for n in odd[:5])

    for q in (qa.path, qb):
        assert ls(q / "success") == names
        assert ls(q / "ready") == [] and ls(q / "error") == [] and ls(q / "partial") == []
        assert all(ls(q / "working" / c.name) == [] for c in consumers)
    for n in names:  # the content each consumer got is the content published
        assert hashlib.sha256((qb / "success" / n).read_bytes()).hexdigest() == digests[n], n

    a.umount()
    b.umount()
    res = spoolfs_cli("fsck", store, timeout=patience(300))
    out = (res.stdout + res.stderr).decode(errors="replace")
    assert res.returncode == 0 and out.rstrip().endswith("fsck: clean"), out
