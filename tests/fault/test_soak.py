"""The lifecycle soak (DESIGN §4): 20 consumers, 5,000 messages, a random 10% of claims abandoned
by consumers killed with SIGKILL while holding the message. It must end with every message in
``success/`` exactly once, or abandoned in ``error/`` after ``max_attempts`` expiries — nothing
lost, nothing twice. Dead consumers are replaced, as a supervisor would.

The lease is short (the test is about leases) and a slow machine makes live consumers lose some
too: a consumer whose finish meets ENOENT counts a ``lost`` lease and goes on, and the checks
below account for every lease that ended, by whichever cause.

Sizes can be changed with SPOOLFS_SOAK_MESSAGES / SPOOLFS_SOAK_CONSUMERS; the figures are printed
and written to ``soak.json`` in the test's directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.mounts import Mount
from helpers.procs import spoolfs_cli
from helpers.queues import Queue
from helpers.waiting import wait_until

pytestmark = pytest.mark.fuse

MESSAGES = int(os.environ.get("SPOOLFS_SOAK_MESSAGES", "5000"))
CONSUMERS = int(os.environ.get("SPOOLFS_SOAK_CONSUMERS", "20"))
DIE = 0.10
LEASE = 2  # seconds
MAX_ATTEMPTS = 3
CONSUMER = Path(__file__).with_name("soak_consumer.py")


def body(i: int) -> bytes:
    b = b"message %d\n" % i + hashlib.sha256(b"%d" % i).hexdigest().encode() * (1 + i % 16)
    return b + b"\n" + hashlib.sha256(b).hexdigest().encode()


class Consumers:
    """Keeps CONSUMERS consumer processes alive; each death is counted and replaced."""

    def __init__(self, queue: Queue, logs: Path) -> None:
        self.queue, self.logs = queue, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.seed = 0
        self.killed = 0
        self.outputs: list[Path] = []
        self.output_of: dict[str, Path] = {}

    def start(self, consumer: str) -> None:
        self.seed += 1
        out = self.logs / f"{consumer}-{self.seed}.out"
        self.outputs.append(out)
        self.output_of[consumer] = out
        with open(out, "wb") as f:
            self.procs[consumer] = subprocess.Popen(
                [sys.executable, str(CONSUMER), str(self.queue.path), consumer, str(self.seed),
                 str(DIE)], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def tend(self) -> None:
        for c, p in list(self.procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            if rc == -signal.SIGKILL:
                self.killed += 1
                self.start(c)
            elif rc != 0:
                raise AssertionError(f"consumer {c} failed ({rc}): {self.output_of[c].read_text()}")
            else:
                self.start(c)  # idle for a while: keep the pool full while work remains

    def stop(self) -> None:
        for p in self.procs.values():
            p.kill()
        for p in self.procs.values():
            p.wait()

    def lines(self) -> list[tuple[str, str]]:
        out = []
        for path in self.outputs:
            for line in path.read_text(errors="replace").splitlines():
                word, _, name = line.partition(" ")
                if word in ("claimed", "done", "bad", "lost"):
                    out.append((word, name))
        return out


def test_soak_killed_consumers_lose_nothing(mount: Mount, tmp_path: Path) -> None:
    q = Queue.create(mount.path, "soak", tmp_path / "scratch")
    res = spoolfs_cli("queue", "set", q.path, f"lease_timeout={LEASE}s",
                      f"max_attempts={MAX_ATTEMPTS}")
    assert res.returncode == 0, res.stderr
    for c in range(CONSUMERS):
        q.consumer(f"c{c}")
    start = time.monotonic()
    for i in range(MESSAGES):
        name = f"m{i:05d}"
        with open(q.partial / name, "wb") as f:
            f.write(body(i))
        os.rename(q.partial / name, q.ready / name)
    published = time.monotonic()

    logs = tmp_path / "consumers"
    logs.mkdir()
    pool = Consumers(q, logs)
    try:
        for c in range(CONSUMERS):
            pool.start(f"c{c}")

        def settled() -> bool:
            pool.tend()
            error = os.listdir(q.error)
            return (len(os.listdir(q.success)) + len(error) == MESSAGES
                    and not os.listdir(q.ready) and all(_abandoned(q.error / n) for n in error))

        wait_until(settled, timeout=900, alive=mount.daemon_alive,
                   what=f"all {MESSAGES} messages to end in success/ or error/")
    finally:
        pool.stop()
    elapsed = time.monotonic() - published

    names = {f"m{i:05d}" for i in range(MESSAGES)}
    everywhere = [n for d in (q.partial, q.ready, q.success, q.error) for n in os.listdir(d)]
    for c in range(CONSUMERS):
        everywhere += os.listdir(q.working / f"c{c}")
    assert sorted(everywhere) == sorted(names), "a message was lost, renamed or duplicated"

    success, error = set(os.listdir(q.success)), set(os.listdir(q.error))
    for name in error:
        p = q.error / name
        assert os.getxattr(p, "user.spool.abandoned") == b"1", f"{name} in error/ not abandoned"
        assert os.getxattr(p, "user.spool.attempts") == str(MAX_ATTEMPTS).encode()
        assert os.getxattr(p, "user.spool.error") == b"lease expired"
    sample = sorted(success)[:: max(1, len(success) // 200)]
    for name in sample:
        assert (q.success / name).read_bytes() == body(int(name[1:])), f"{name} content changed"

    events = pool.lines()
    assert not [n for w, n in events if w == "bad"], "a consumer read wrong content"
    done = [n for w, n in events if w == "done"]
    assert sorted(done) == sorted(success), "success/ differs from what consumers finished"
    claims = sum(1 for w, _ in events if w == "claimed")
    lost = sum(1 for w, _ in events if w == "lost")
    histories = {n: os.getxattr((q.success if n in success else q.error) / n,
                                "user.spool.history").decode() for n in names}
    expiries = sum(h.count(" expire ") for h in histories.values())
    expired = [n for n, h in histories.items() if " expire " in h]
    figures = {
        "messages": MESSAGES, "consumers": CONSUMERS, "lease_s": LEASE,
        "max_attempts": MAX_ATTEMPTS, "claims": claims, "consumers_killed": pool.killed,
        "leases_lost_by_live_consumers": lost,
        "kill_rate": round(pool.killed / claims, 4), "lease_expiries": expiries,
        "messages_with_an_expired_lease": len(expired), "success": len(success), "abandoned": len(error),
        "publish_s": round(published - start, 1), "drain_s": round(elapsed, 1),
        "finished_per_s": round(MESSAGES / elapsed, 1),
    }
    (tmp_path / "soak.json").write_text(json.dumps(figures, indent=1))
    print("soak:", json.dumps(figures))
    # Each consumer died holding exactly one message, which only its lease brought back; every
    # other expiry is a lease a live consumer lost and reported.
    assert pool.killed > 0
    assert expiries == pool.killed + lost, (
        f"{pool.killed} consumers killed and {lost} leases lost, but {expiries} leases expired")
    assert len(success) + len(error) == MESSAGES


def _abandoned(p: Path) -> bool:
    """In ``error/`` for good: a message whose lease expired with attempts left goes back to
    ``ready/`` at its retry, so it is not settled there yet."""
    try:
        return os.getxattr(p, "user.spool.abandoned") == b"1"
    except OSError:  # gone meanwhile (its retry), or not abandoned
        return False
