"""``spoolfs bench``: the same workloads through a temporary spoolfs mount and through plain
directories on the same disk, interleaved round by round, with the ratio spoolfs/plain (DESIGN §10).

Workloads (``--only`` picks a subset, ``--all`` runs every one; ``--shell`` adds the shell one to
the default four):

- ``small``: the small-file cycle, create+write 1 KiB in partial/ -> publish -> claim -> read ->
  finish, with os-level calls; the plain side fsyncs the file and ready/ at publish.
- ``claims``: K consumer threads race to claim the same pre-published files with rename;
  every file must end up claimed exactly once (checked, non-zero exit if not).
- ``shell``: the small-file cycle as a shell script of real ``cp``/``mv``/``cat`` processes.
- ``large``: write an M MiB file in partial/ in 1 MiB writes, publish it, read it back twice.
- ``producers``, ``seed``, ``deep``: parallel writers into ready/, the seed-004 pattern over two
  mounts, the small-file cycle behind N waiting messages (cli/benchloads.py).

With ``small``, the FUSE requests each step of the cycle costs follow, by operation.

With ``--store postgresql://... --blobs s3://...|DIR`` a multi-host row follows: the small-file
cycle, the claims race and the seed-004 pattern on a spool of that store (in a fresh queue of
it, each round its own; the seed's consumers over two daemons of it, as over two hosts), side by
side with the embedded store's figures.

The figure of each workload is the median of its rounds. Nothing here is a pass/fail threshold.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from spoolfs.cli import benchloads
from spoolfs.cli.args import Parser, positive_int
from spoolfs.cli.exits import Exit
from spoolfs.core.errors import UserError
from spoolfs.runtime import pidfile

STATES = ("partial", "ready", "working", "success", "error")
WORKLOADS = ("small", "claims", "shell", "large", "producers", "seed", "deep")
SIDES = ("plain", "spoolfs")
# the main mount, the seed's second one, the deep cycle's empty store, the multi-host store
# and its second daemon (the seed's): none may be left mounted when the bench's directory goes
MOUNTS = ("mnt", "mnt2", "mnt-empty", "mnt-shared", "mnt-shared2")
SMALL_SIZE = 1024
CHUNK = 1 << 20
STEPS = ("write", "publish", "claim", "read", "finish")

DURABILITY = {
    "plain": "os.open+os.write, fsync(file) before close; rename partial/f -> ready/f, then "
             "fsync(ready/); claim and finish are plain renames without fsync. Large file: "
             "write + fsync(file) + rename + fsync(ready/). Shell: cp/mv, no fsync at all",
    "spoolfs": "whatever the daemon guarantees (publish durable before rename returns); "
               "the bench itself never calls fsync on the mount",
}

SHELL_CYCLE = r"""
set -e
src=$1 q=$2 n=$3 i=0
while [ "$i" -lt "$n" ]; do
  cp "$src" "$q/partial/f$i"
  mv "$q/partial/f$i" "$q/ready/"
  mv "$q/ready/f$i" "$q/working/c1/"
  cat "$q/working/c1/f$i" >/dev/null
  mv "$q/working/c1/f$i" "$q/success/"
  i=$((i + 1))
done
"""


class BenchError(Exception):
    """A workload did something wrong (not merely slowly)."""


# Ctrl-C sets this flag and the workloads stop at the next file boundary: an interrupt raised
# inside a blocking call on the mount could leave an fd open, and the mount busy. A second
# Ctrl-C interrupts at once.
_stop = threading.Event()


def check_stop() -> None:
    if _stop.is_set():
        raise KeyboardInterrupt


def _on_sigint(signum: int, frame: object) -> None:
    if _stop.is_set():
        raise KeyboardInterrupt
    _stop.set()
    progress("interrupted: stopping at the next file, then unmounting (Ctrl-C again to force)")


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    _stop.clear()
    old = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
        check_stop()
    finally:
        signal.signal(signal.SIGINT, old)


# --------------------------------------------------------------------------- the two sides


@dataclass(frozen=True)
class Queue:
    path: str

    def state(self, name: str) -> str:
        return os.path.join(self.path, name)

    def consumer(self, c: int) -> str:
        return os.path.join(self.path, "working", f"c{c}")


@dataclass(frozen=True)
class Side:
    """One side of the comparison: a root where every round makes a fresh queue."""

    name: str
    root: str
    fsync: bool  # the plain side fsyncs at publish; the spool side leaves durability to the daemon
    second: str = ""  # a second mount of the same store (the plain side: the same root)
    store: str = ""  # the spoolfs side: its store, for a new mount of it (the deep workload)
    log: str = ""  # and its daemon's log

    def queue(self, name: str, consumers: int = 1) -> Queue:
        q = Queue(os.path.join(self.root, name))
        os.mkdir(q.path)  # on the mount this makes the state dirs too
        for state in STATES:
            if not os.path.isdir(q.state(state)):
                os.mkdir(q.state(state))
        for c in range(1, consumers + 1):
            os.mkdir(q.consumer(c))
        return q


def write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL


@contextlib.contextmanager
def opened(path: str, flags: int, wanted: bool = True) -> Iterator[int]:
    """An fd closed however the block ends (an fd left open would keep the mount busy)."""
    fd = os.open(path, flags, 0o644) if wanted else -1
    try:
        yield fd
    finally:
        if fd >= 0:
            os.close(fd)


def dir_fd(path: str, wanted: bool) -> contextlib.AbstractContextManager[int]:
    return opened(path, os.O_RDONLY | os.O_DIRECTORY, wanted)


def put(q: Queue, name: str, data: bytes) -> None:
    """Write ``partial/name`` and publish it into ready/ (untimed set-up, so no fsync)."""
    src, dst = os.path.join(q.state("partial"), name), os.path.join(q.state("ready"), name)
    with opened(src, NEW) as fd:
        write_all(fd, data)
    os.rename(src, dst)


# --------------------------------------------------------------------------- workloads


@dataclass
class Round:
    rate: float
    extra: dict[str, Any] = field(default_factory=dict)


def cycle_steps(q: Queue, fsync: bool, ready_fd: int, prefix: str = "f"
                ) -> list[tuple[str, Callable[[int], None]]]:
    """The small-file cycle's steps for file number i: write in partial/, publish, claim, read
    (and check), finish. The plain side fsyncs the file and ready/ at publish."""
    base = os.urandom(SMALL_SIZE)
    partial, ready, work, success = (q.state("partial"), q.state("ready"), q.consumer(1),
                                     q.state("success"))

    def data(i: int) -> bytes:
        return b"%08d" % i + base[8:]

    def write(i: int) -> None:
        with opened(os.path.join(partial, f"{prefix}{i:06d}"), NEW) as fd:
            write_all(fd, data(i))
            if fsync:
                os.fsync(fd)

    def publish(i: int) -> None:
        name = f"{prefix}{i:06d}"
        os.rename(os.path.join(partial, name), os.path.join(ready, name))
        if fsync:
            os.fsync(ready_fd)

    def claim(i: int) -> None:
        name = f"{prefix}{i:06d}"
        os.rename(os.path.join(ready, name), os.path.join(work, name))

    def read(i: int) -> None:
        name = f"{prefix}{i:06d}"
        with opened(os.path.join(work, name), os.O_RDONLY) as fd:
            got = os.read(fd, 2 * SMALL_SIZE)
        if got != data(i):
            raise BenchError(f"{work}/{name}: read {len(got)} bytes, not what was written")

    def finish(i: int) -> None:
        name = f"{prefix}{i:06d}"
        os.rename(os.path.join(work, name), os.path.join(success, name))

    return list(zip(STEPS, (write, publish, claim, read, finish), strict=True))


def small_cycle(q: Queue, n: int, fsync: bool, prefix: str = "f") -> Round:
    """The cycle file by file, timing each step; the rate is files per wall-clock second."""
    spent = dict.fromkeys(STEPS, 0.0)
    clock = time.perf_counter
    with dir_fd(q.state("ready"), fsync) as ready_fd:
        steps = cycle_steps(q, fsync, ready_fd, prefix)
        start = clock()
        for i in range(n):
            check_stop()
            for step, fn in steps:
                t0 = clock()
                fn(i)
                spent[step] += clock() - t0
        elapsed = clock() - start
    return Round(n / elapsed, {"steps_us": {s: round(t / n * 1e6, 1) for s, t in spent.items()}})


def requests_per_step(side: Side, n: int = 50) -> dict[str, dict[str, float]]:
    """The FUSE requests each step of the small-file cycle costs, by operation (spoolfs side)."""
    q = side.queue(f"requests-{os.getpid()}")
    with dir_fd(q.state("ready"), side.fsync) as ready_fd:
        return benchloads.count_cycle(side.root, q.path, n, cycle_steps(q, side.fsync, ready_fd))


def claims(q: Queue, n: int, consumers: int) -> Round:
    """Pre-publish n files, then K threads scan the same names in the same order and claim with
    rename into their own view; ENOENT is a lost race. Rate: claims per second."""
    names = [f"m{i:06d}" for i in range(n)]
    for i, name in enumerate(names):
        check_stop()
        put(q, name, b"%08d\n" % i)
    ready = q.state("ready")
    won: list[list[str]] = [[] for _ in range(consumers)]
    lost = [0] * consumers

    def consume(c: int) -> None:
        dst = q.consumer(c + 1)
        for name in names:
            if _stop.is_set():
                return
            try:
                os.rename(os.path.join(ready, name), os.path.join(dst, name))
            except FileNotFoundError:
                lost[c] += 1
            else:
                won[c].append(name)

    try:
        elapsed = benchloads.in_threads(consumers, consume)
    except Exception as e:
        raise BenchError(f"a consumer failed: {e!r}") from e
    check_stop()
    problems = verify_claims(q, names, won)
    if sum(lost) + sum(map(len, won)) != n * consumers:
        problems.append(f"{sum(lost)} lost + {sum(map(len, won))} won != {n} x {consumers} tries")
    return Round(n / elapsed, {"lost_races": sum(lost), "wins": [len(w) for w in won],
                               "problems": problems})


def verify_claims(q: Queue, names: list[str], won: list[list[str]]) -> list[str]:
    """Every file claimed exactly once, by what the consumers saw and by what the tree shows."""
    counts = Counter(name for w in won for name in w)
    problems = [f"{name} claimed {k} times" for name, k in counts.items() if k > 1]
    problems += [f"{name} never claimed" for name in names if name not in counts]
    for c, mine in enumerate(won, start=1):
        if sorted(os.listdir(q.consumer(c))) != sorted(mine):
            problems.append(f"{q.consumer(c)} does not list exactly the files c{c} claimed")
    if os.listdir(q.state("ready")):
        problems.append(f"{q.state('ready')} is not empty after every file was claimed")
    return problems[:20]


def shell_cycle(q: Queue, n: int, src: str) -> Round:
    """The cycle as one sh loop of cp, mv, mv, cat, mv processes (5 per file)."""
    start = time.perf_counter()
    res = subprocess.run(["sh", "-c", SHELL_CYCLE, "sh", src, q.path, str(n)],
                         check=False, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    check_stop()  # Ctrl-C reaches sh too
    if res.returncode != 0:
        raise BenchError(f"shell cycle failed in {q.path}: {res.stderr.strip()[-500:]}")
    return Round(n / elapsed)


def large_file(q: Queue, mib: int, fsync: bool) -> Round:
    """Write+publish an M MiB file in 1 MiB writes, then read it twice from ready/. Rate: write
    MiB/s; the read rates are in ``extra`` (the second from the page cache where the side keeps
    one)."""
    buf = bytearray(os.urandom(CHUNK))
    src, dst = os.path.join(q.state("partial"), "big"), os.path.join(q.state("ready"), "big")
    with dir_fd(q.state("ready"), fsync) as ready_fd:
        start = time.perf_counter()
        with opened(src, NEW) as fd:
            for i in range(mib):
                check_stop()
                buf[:8] = i.to_bytes(8, "big")
                write_all(fd, buf)
            if fsync:
                os.fsync(fd)
        os.rename(src, dst)
        if fsync:
            os.fsync(ready_fd)
        written = time.perf_counter()
    rates = []
    for _ in range(2):  # right after writing, then again (warm: the page cache, if kept)
        t0 = time.perf_counter()
        total = 0
        with opened(dst, os.O_RDONLY) as fd:
            while chunk := os.read(fd, CHUNK):
                check_stop()
                total += len(chunk)
        rates.append(mib / (time.perf_counter() - t0))
        if total != mib * CHUNK:
            raise BenchError(f"{dst}: read back {total} bytes of {mib * CHUNK}")
    return Round(mib / (written - start), {"read": rates[0], "warm_read": rates[1]})


# --------------------------------------------------------------------------- running rounds


@dataclass
class Result:
    label: str
    unit: str
    rounds: dict[str, list[Round]] = field(default_factory=lambda: {s: [] for s in SIDES})

    def median(self, side: str, key: str | None = None) -> float:
        return statistics.median(r.rate if key is None else r.extra[key] for r in self.rounds[side])

    def summary(self, key: str | None = None) -> dict[str, Any]:
        plain, spool = self.median("plain", key), self.median("spoolfs", key)
        return {"label": self.label, "unit": self.unit, "plain": round(plain, 1),
                "spoolfs": round(spool, 1), "ratio": round(spool / plain, 3) if plain else None,
                "rounds": {s: [round(r.rate if key is None else r.extra[key], 1)
                               for r in self.rounds[s]] for s in SIDES}}


def run_rounds(result: Result, sides: dict[str, Side], rounds: int, tag: str,
               one: Callable[[Side, str], Round],
               beside: tuple[Result, Callable[[Side, str], Round]] | None = None) -> Result:
    """Alternate plain, spoolfs, plain, spoolfs ...; each round in a fresh queue. ``beside``:
    a second workload run next to this one on each side in every round, the two taking turns
    to go first."""
    runs = [(result, one)] + ([beside] if beside else [])
    for r in range(rounds):
        for name in SIDES:
            for res, fn in runs if r % 2 == 0 else runs[::-1]:
                check_stop()
                progress(f"{res.label}: round {r + 1}/{rounds}, {name}")
                res.rounds[name].append(fn(sides[name], f"{tag}-r{r}"))
    return result


def run_workloads(args: argparse.Namespace, sides: dict[str, Side], scratch: str
                  ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    k = args.consumers
    if "small" in args.only:
        res = run_rounds(Result("small-file cycle", "files/s"), sides, args.rounds, "small",
                         lambda s, q: small_cycle(s.queue(q), args.files, s.fsync))
        out["small"] = res.summary()
        out["small"]["steps_us"] = {s: median_steps(res.rounds[s]) for s in SIDES}
    if "claims" in args.only:
        res = run_rounds(Result(f"claims, {k} consumers", "claims/s"), sides, args.rounds,
                         "claims", lambda s, q: claims(s.queue(q, k), args.files, k))
        out["claims"] = res.summary()
        for key in ("lost_races", "wins"):
            out["claims"][key] = {s: [r.extra[key] for r in res.rounds[s]] for s in SIDES}
        out["claims"]["problems"] = [p for s in SIDES for r in res.rounds[s]
                                     for p in r.extra["problems"]]
        out["claims"]["verified"] = not out["claims"]["problems"]
    if "shell" in args.only:
        src = os.path.join(scratch, "shell-src")
        with open(src, "wb") as f:
            f.write(os.urandom(SMALL_SIZE))
        res = run_rounds(Result("shell cp/mv cycle", "files/s"), sides, args.rounds, "shell",
                         lambda s, q: shell_cycle(s.queue(q), args.shell_files, src))
        out["shell"] = res.summary()
    if "large" in args.only:
        res = run_rounds(Result(f"large write {args.large_mb} MiB", "MiB/s"), sides, args.rounds,
                         "large", lambda s, q: large_file(s.queue(q), args.large_mb, s.fsync))
        out["large_write"] = res.summary()
        out["large_read"] = res.summary("read") | {"label": f"large read {args.large_mb} MiB"}
        out["large_read_warm"] = res.summary("warm_read") | {
            "label": f"large read again (warm) {args.large_mb} MiB"}
    for writers in (4, 16) if "producers" in args.only else ():
        def produce(s: Side, q: str, w: int = writers) -> Round:
            return checked(benchloads.producers(s.queue(q).state("ready"), args.files, w,
                                                s.fsync))

        res = run_rounds(Result(f"parallel producers, {writers}", "files/s"), sides, args.rounds,
                         f"prod{writers}", produce)
        out[f"producers_{writers}"] = res.summary() | problems_of(res)
    if "seed" in args.only:
        k = args.seed_consumers
        res = run_rounds(Result(f"seed-004 pattern, {k} consumers", "files/s"), sides,
                         args.rounds, "seed", lambda s, q: checked(benchloads.seed(
                             [s.queue(q).path, os.path.join(s.second, q)], args.seed_files, k)))
        out["seed"] = res.summary() | problems_of(res)
    if "deep" in args.only:
        out["deep"] = deep_cycle(args, sides, scratch)
    return out


def deep_cycle(args: argparse.Namespace, sides: dict[str, Side], scratch: str
               ) -> dict[str, Any]:
    """The small-file cycle in a queue behind ``--depth`` waiting messages (and as many in
    another queue), and in the same rounds the cycle on an empty store: a second mount of a
    new store, and an empty plain directory. The two alternate round by round, so the change
    with depth is not the machine's change over the run. The waiting messages are written back
    to disk before the first round: the set-up's write-back is not the cycle's cost."""
    empty_mnt = os.path.join(scratch, "mnt-empty")
    empty = {"plain": Side("plain", os.path.join(scratch, "plain-empty"), True),
             "spoolfs": Side("spoolfs", empty_mnt, False)}
    for d in (empty_mnt, empty["plain"].root):
        os.mkdir(d)
    mount(os.path.join(scratch, "store-empty"), empty_mnt,
          os.path.join(scratch, "daemon-empty.log"))
    try:
        for side in sides.values():  # once: the waiting messages stay for every round
            progress(f"putting {args.depth:,} waiting messages in two queues, {side.name}")
            for name in ("deep-other", "deep"):
                benchloads.fill(side.queue(name).state("ready"), args.depth)
        progress(f"writing the waiting messages back to disk: "
                 f"{benchloads.write_back():.0f} s")
        bare = Result("small-file cycle, empty store", "files/s")
        full = run_rounds(
            Result(f"small-file cycle, {args.depth:,} waiting", "files/s"), sides, args.rounds,
            "deep", lambda s, q: small_cycle(Queue(os.path.join(s.root, "deep")), args.files,
                                             s.fsync, prefix=q),
            beside=(bare, lambda s, q: small_cycle(empty[s.name].queue(q), args.files, s.fsync)))
    finally:
        unmount(empty_mnt)  # if it stays, bench() tries again and says so
    return full.summary() | {"empty": bare.summary(), "change": {
        s: round(full.median(s) / bare.median(s) - 1, 3) for s in SIDES},
        "listing": deep_listing(sides)}


def deep_listing(sides: dict[str, Side]) -> dict[str, Any]:
    """After the deep rounds, a consumer's look at the deep ready/ on each side: the first
    name, the whole listing, a claim right after."""
    out: dict[str, Any] = {}
    for name, side in sides.items():
        check_stop()
        progress(f"listing the deep queue, {name}")
        q = Queue(os.path.join(side.root, "deep"))
        out[name] = benchloads.listing(q.state("ready"), q.consumer(1))
    return out


def deep_daemon(spool: Side) -> dict[str, Any]:
    """The daemon that held the deep queue through the run: its memory now and at its peak
    since mounted (every workload run included); then how long a new mount of the deep store
    takes, as an operator would unmount and mount it (the page cache stays warm). Last thing
    in a run: the second mount of the same store (the seed's) goes first, so that the new
    daemon is the store's only one."""
    rss, peak = benchloads.memory_mib(_pid_of(spool.root))
    check_stop()
    progress("mounting the deep store again")
    for mnt in dict.fromkeys((spool.second, spool.root)):
        if not unmount(mnt):
            raise BenchError(f"cannot unmount {mnt} to mount the deep store again")
    start = time.perf_counter()
    try:
        mount(spool.store, spool.root, spool.log)
    except UserError as e:
        raise BenchError(str(e)) from e
    took = time.perf_counter() - start
    pid = _pid_of(spool.root)
    return {"rss_mib": rss, "peak_mib": peak, "mount_s": round(took, 3), "mount_pid": pid,
            "rss_after_mount_mib": benchloads.memory_mib(pid)[0]}


def _pid_of(mnt: str) -> int:
    """``daemon_pid``, or a bench error: the daemon's memory cannot be read without it."""
    pid = daemon_pid(mnt)
    if not pid:
        raise BenchError(f"no daemon pid for {mnt} (its pid file is gone)")
    return pid


def checked(outcome: tuple[float, list[str]]) -> Round:
    rate, problems = outcome
    return Round(rate, {"problems": problems})


def problems_of(res: Result) -> dict[str, Any]:
    problems = [p for s in SIDES for r in res.rounds[s] for p in r.extra["problems"]]
    return {"problems": problems, "verified": not problems}


def run_multihost(args: argparse.Namespace, shared: Side, embedded: Side,
                  only: tuple[str, ...]) -> dict[str, Any]:
    """Of the small-file cycle, the claims race and the seed-004 pattern, those in ``only``
    and ``args.only``, on the shared store, interleaved round by round with the embedded
    one's: (embedded, shared, ratio shared/embedded) per workload. The seed's consumers are
    split over two mounts of each store (``Side.second``): two daemons of the shared one, as
    on two hosts."""
    k = args.consumers
    out: dict[str, Any] = {}
    sides = {"embedded": embedded, "shared": shared}

    def small(s: Side, q: str) -> Round:
        return small_cycle(s.queue(q), args.files, False)

    def race(s: Side, q: str) -> Round:
        return claims(s.queue(q, k), args.files, k)

    def seed(s: Side, q: str) -> Round:
        return checked(benchloads.seed([s.queue(q).path, os.path.join(s.second, q)],
                                       args.seed_files, args.seed_consumers))

    workloads: list[tuple[str, str, str, Callable[[Side, str], Round]]] = [
        ("small", "small-file cycle", "files/s", small),
        ("claims", f"claims, {k} consumers", "claims/s", race),
        ("seed", f"seed-004, {args.seed_consumers} consumers", "files/s", seed)]
    for key, label, unit, one in workloads:
        if key not in args.only or key not in only:
            continue
        rates: dict[str, list[Round]] = {n: [] for n in sides}
        for r in range(args.rounds):
            for name, side in sides.items():
                check_stop()
                progress(f"multi-host {label}: round {r + 1}/{args.rounds}, {name}")
                rates[name].append(one(side, f"bench{os.getpid()}-{key}-{name}-r{r}"))
        e = statistics.median(x.rate for x in rates["embedded"])
        sh = statistics.median(x.rate for x in rates["shared"])
        out[key] = {"label": label, "unit": unit, "embedded": round(e, 1), "shared": round(sh, 1),
                    "ratio": round(sh / e, 3) if e else None}
        if key != "small":  # each round checked every file: claimed (or finished) once
            problems = [p for n in sides for x in rates[n] for p in x.extra["problems"]]
            out[key]["verified"] = not problems
            out[key]["problems"] = problems
    return out


def median_steps(rounds: list[Round]) -> dict[str, float]:
    return {s: statistics.median(r.extra["steps_us"][s] for r in rounds) for s in STEPS}


# --------------------------------------------------------------------------- the mount


def mount(store: str, mnt: str, log: str, extra: tuple[str, ...] = ()) -> int:
    """Mount like an operator does (a new store directory is made first, as with
    ``spoolfs format``); returns the daemon's pid (0 if unknown)."""
    from spoolfs.store.registry import store_layout
    from spoolfs.store.site import is_url

    if not is_url(store) and not store_layout(store).is_store():
        from spoolfs.cli.format import make_store

        make_store(store)
    # stderr to a file, not a pipe: the forked daemon must not hold our pipe open.
    with tempfile.TemporaryFile() as err:
        res = subprocess.run([sys.executable, "-m", "spoolfs", store, mnt, "--log-file", log,
                              *extra],
                             check=False, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        err.seek(0)
        message = err.read().decode(errors="replace").strip()
    if res.returncode != 0:
        raise UserError(f"bench: cannot mount a temporary spool: {message}")
    return daemon_pid(mnt)


def daemon_pid(mnt: str) -> int:
    """The pid of the daemon serving ``mnt`` (0 if unknown)."""
    try:
        with open(pidfile(mnt)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def unmount(mnt: str) -> bool:
    """Unmount and wait for the daemon; a second Ctrl-C does not interrupt this."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the umount process
    try:
        for _ in range(3):
            if not os.path.ismount(mnt):
                return True
            res = subprocess.run([sys.executable, "-m", "spoolfs", "umount", mnt],
                                 check=False, capture_output=True, text=True)
            if res.returncode == 0:
                return True
            progress(f"umount {mnt}: {res.stderr.strip()}; retrying")
            time.sleep(1.0)
        return not os.path.ismount(mnt)
    finally:
        signal.signal(signal.SIGINT, old)


def filesystem_of(path: str) -> str:
    """The type of the filesystem holding ``path`` (longest mount point prefix in /proc/mounts)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                mp = parts[1].replace("\\040", " ")
                if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
                    best, kind = mp, parts[2]
    except OSError:
        pass
    return kind


def check_space(base: str, args: argparse.Namespace) -> None:
    """Large files are kept until the end (both sides, every round): make sure they fit."""
    need = ((2 * args.rounds * args.large_mb if "large" in args.only else 0) + 64) * CHUNK
    st = os.statvfs(base)
    if st.f_bavail * st.f_frsize < 2 * need:
        raise UserError(f"bench: {base} has less than {2 * need // CHUNK} MiB free")


def tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------- output


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def fmt(value: float, unit: str) -> str:
    return f"{value:,.0f} {unit}" if value >= 100 else f"{value:,.1f} {unit}"


def render(report: dict[str, Any]) -> str:
    rows = [f"{'workload':<28}{'plain':>18}{'spoolfs':>18}{'ratio':>9}"]
    for r in report["results"].values():
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        rows.append(f"{r['label']:<28}{fmt(r['plain'], r['unit']):>18}"
                    f"{fmt(r['spoolfs'], r['unit']):>18}{ratio:>9}")
    res = report["results"]
    if "small" in res:
        steps = res["small"]["steps_us"]
        rows.append("\nsmall-file cycle, µs per file per step (median round), plain / spoolfs:")
        rows.append("  " + "   ".join(f"{s} {steps['plain'][s]:.0f} / {steps['spoolfs'][s]:.0f}"
                                      for s in STEPS))
    if "requests_per_step" in report:
        rows.append("\nsmall-file cycle, FUSE requests per file per step (spoolfs):")
        for step, ops in report["requests_per_step"].items():
            shown = ", ".join(f"{op} {k:g}" for op, k in ops.items())
            rows.append(f"  {step:<8} {sum(ops.values()):5.1f}  ({shown})")
    if "deep" in res:
        d, e = res["deep"], res["deep"]["empty"]
        rows.append("\nthe same cycle on an empty store, in the same rounds: " + ", ".join(
            f"{side} {fmt(e[side], e['unit'])}" for side in SIDES))
        rows.append(f"  {d['label']} against it: " + ", ".join(
            f"{side} {d['change'][side]:+.0%}" for side in SIDES))
        ls = d["listing"]
        rows.append(f"the deep ready/ listed, plain / spoolfs: first name "
                    f"{ls['plain']['first_name_ms']:.1f} / {ls['spoolfs']['first_name_ms']:.1f} "
                    f"ms, a claim right after the listing {ls['plain']['claim_ms']:.1f} / "
                    f"{ls['spoolfs']['claim_ms']:.1f} ms,")
        rows.append(f"  every name ({ls['plain']['names']:,} / {ls['spoolfs']['names']:,}) "
                    f"{fmt(ls['plain']['names_per_s'], 'names/s')} / "
                    f"{fmt(ls['spoolfs']['names_per_s'], 'names/s')}")
        daemon = d.get("daemon")
        if daemon:
            rows.append(f"  spoolfs daemon: {daemon['rss_mib']:.0f} MiB resident at the end, "
                        f"{daemon['peak_mib']:.0f} MiB at most since mounted; the deep store "
                        f"mounts again in {daemon['mount_s']:.2f} s "
                        f"({daemon['rss_after_mount_mib']:.0f} MiB)")
    for key in [k for k, r in res.items() if k != "claims" and not r.get("verified", True)]:
        rows.append(f"\n{res[key]['label']}: PROBLEMS: " + "; ".join(res[key]["problems"]))
    if "claims" in res:
        c = res["claims"]
        rows.append("\nclaims: every consumer tries every file in the same order; wins per "
                    f"consumer, by round: plain {c['wins']['plain']}, "
                    f"spoolfs {c['wins']['spoolfs']}"
                    "; every file claimed exactly once: "
                    + ("yes" if c["verified"] else "NO: " + "; ".join(c["problems"])))
    mh = report.get("multihost")
    if mh:
        rows.append(f"\nmulti-host: {mh['store']} with content in {mh['blobs']}, side by side "
                    "with the embedded store:")
        rows.append(f"{'workload':<28}{'embedded':>18}{'multi-host':>18}{'ratio':>9}")
        for r in mh["results"].values():
            ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
            rows.append(f"{r['label']:<28}{fmt(r['embedded'], r['unit']):>18}"
                        f"{fmt(r['shared'], r['unit']):>18}{ratio:>9}")
        for r in [r for r in mh["results"].values() if not r.get("verified", True)]:
            rows.append(f"\n{r['label']} (multi-host row): PROBLEMS: "
                        + "; ".join(r["problems"]))
    fs = report["filesystem"]
    memory = " (in memory, not a disk!)" if fs["type"] in ("tmpfs", "ramfs") else ""
    rows.append(f"\nfilesystem: {fs['type']}{memory} at {report['dir']}; plain dirs and store "
                + ("on the same filesystem" if fs["same"] else "on DIFFERENT filesystems"))
    for side in SIDES:
        rows.append(f"durability, {side}: {report['durability'][side]}")
    rows.append(f"figures: median of {report['rounds']} interleaved rounds; the large file is "
                "read right after writing, then again (caches not dropped)")
    return "\n".join(rows)


# --------------------------------------------------------------------------- command


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="spoolfs bench", description="Compare spoolfs with plain directories on "
               "the same disk: the same workloads through a temporary mount and through plain "
               "directories, reported as ratios.")
    p.add_argument("--dir", help="where the temporary store, mount and plain dirs go "
                   "(default: a new directory under /var/tmp)")
    p.add_argument("--files", type=positive_int, default=2000,
                   help="files in the small-file cycle and "
                   "the claims race (default 2000)")
    p.add_argument("--consumers", type=positive_int, default=4,
                   help="concurrent consumers (default 4)")
    p.add_argument("--shell", action="store_true", help="also run the shell cp/mv cycle")
    p.add_argument("--shell-files", type=positive_int, default=200,
                   help="files in the shell cycle "
                   "(default 200)")
    p.add_argument("--large-mb", type=positive_int, default=256,
                   help="size of the large file in MiB "
                   "(default 256)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="rounds per side (default 3)")
    p.add_argument("--only", action="append", choices=WORKLOADS,
                   help="run only this workload (repeatable)")
    p.add_argument("--all", action="store_true", help="run every workload")
    p.add_argument("--seed-files", type=positive_int, default=5000,
                   help="files in the seed-004 pattern "
                   "(default 5000)")
    p.add_argument("--seed-consumers", type=positive_int, default=10,
                   help="consumers in the seed-004 "
                   "pattern, split over two mounts (default 10)")
    p.add_argument("--depth", type=positive_int, default=100_000,
                   help="messages waiting in ready/ (and "
                   "in another queue) for the deep small-file cycle (default 100000)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--store", metavar="postgresql://...",
                   help="also run the small-file cycle, the claims race and (when it runs) "
                   "the seed-004 pattern on this multi-host store (in fresh queues of it; the "
                   "seed's consumers over two daemons of it), side by side with the embedded "
                   "store")
    p.add_argument("--blobs", metavar="s3://BUCKET/PREFIX|DIR",
                   help="with --store: where its content is (needed at its first mount)")
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.all:
        args.only = list(WORKLOADS)
    elif not args.only:
        args.only = ["small", "claims", "large", "producers"] + (["shell"] if args.shell else [])
    if args.blobs and not args.store:
        raise UserError("bench: --blobs goes with --store", Exit.USAGE)
    if args.store:
        from spoolfs.store.site import is_url

        if not is_url(args.store):
            raise UserError("bench: --store takes a multi-host store's URL (postgresql://...)",
                            Exit.USAGE)
    parent = os.path.abspath(args.dir or "/var/tmp")
    if not os.path.isdir(parent):
        raise UserError(f"bench: {parent} is not a directory", Exit.USAGE)
    base = tempfile.mkdtemp(prefix="spoolfs-bench-", dir=parent)
    try:
        return bench(args, base)
    finally:
        if any(os.path.ismount(os.path.join(base, m)) for m in MOUNTS):
            progress(f"the mount is still there; left {base} in place")
        else:
            shutil.rmtree(base, ignore_errors=True)


def remove_queue(path: str) -> None:
    """Remove a queue the bench made in someone's store, with everything in it (best effort:
    what cannot go is reported)."""
    for state in STATES:
        d = os.path.join(path, state)
        for name in os.listdir(d) if os.path.isdir(d) else []:
            p = os.path.join(d, name)
            try:
                if os.path.isdir(p):
                    for f in os.listdir(p):
                        os.unlink(os.path.join(p, f))
                    os.rmdir(p)
                else:
                    os.unlink(p)
            except OSError as e:
                progress(f"cleanup: {p}: {e.strerror}")
    try:
        os.rmdir(path)
    except OSError as e:
        progress(f"cleanup: {path}: {e.strerror}")


def bench_multihost(args: argparse.Namespace, base: str, embedded: Side) -> dict[str, Any]:
    """Mount the multi-host store beside the embedded one and run its row."""
    from spoolfs.store.site import shown

    extra = ("--blobs", args.blobs) if args.blobs else ()
    mounted: list[str] = []

    def mount_shared(name: str) -> str:
        mnt = os.path.join(base, name)
        os.mkdir(mnt)
        try:
            mount(args.store, mnt, os.path.join(base, f"daemon-{name[4:]}.log"), extra)
        except UserError as e:
            raise BenchError(str(e)) from e
        mounted.append(mnt)
        return mnt

    try:
        mnt = mount_shared("mnt-shared")
        made = os.listdir(mnt)
        try:
            results = run_multihost(args, Side("shared", mnt, False), embedded,
                                    ("small", "claims"))
            if "seed" in args.only:  # its second host: a second daemon, for the seed alone
                second = mount_shared("mnt-shared2")
                results |= run_multihost(args, Side("shared", mnt, False, second), embedded,
                                         ("seed",))
        finally:
            for q in sorted(set(os.listdir(mnt)) - set(made)):  # the queues this run made
                remove_queue(os.path.join(mnt, q))
    finally:
        for m in reversed(mounted):
            if not unmount(m):
                print(f"spoolfs bench: could not unmount {m}", file=sys.stderr)
    return {"store": shown(args.store), "blobs": args.blobs or "(recorded in the store)",
            "mounts": len(mounted), "results": results}


def bench(args: argparse.Namespace, base: str) -> int:
    store, mnt, plain, log, mnt2, log2 = (
        os.path.join(base, n)
        for n in ("store", "mnt", "plain", "daemon.log", "mnt2", "daemon2.log"))
    for d in (store, mnt, plain):
        os.mkdir(d)
    check_space(base, args)
    report: dict[str, Any] = {
        "dir": base, "rounds": args.rounds, "durability": DURABILITY,
        "filesystem": {"type": filesystem_of(plain),
                       "same": os.stat(plain).st_dev == os.stat(store).st_dev},
    }
    try:
        with deferred_interrupts():
            report["daemon_pid"] = mount(store, mnt, log)
            progress(f"spoolfs mounted on {mnt} (daemon pid {report['daemon_pid']}); plain dirs "
                     f"in {plain}; {report['filesystem']['type']}")
            sides = {"plain": Side("plain", plain, True, plain),
                     "spoolfs": Side("spoolfs", mnt, False, mnt, store, log)}
            if "seed" in args.only:  # the seed's consumers are split over two mounts
                os.mkdir(mnt2)
                mount(store, mnt2, log2)
                sides["spoolfs"] = Side("spoolfs", mnt, False, mnt2, store, log)
            report["results"] = run_workloads(args, sides, base)
            if "small" in args.only:
                report["requests_per_step"] = requests_per_step(sides["spoolfs"])
            if args.store:
                report["multihost"] = bench_multihost(args, base, sides["spoolfs"])
            if "deep" in args.only:  # last: it mounts the store again
                report["results"]["deep"]["daemon"] = deep_daemon(sides["spoolfs"])
    except (OSError, BenchError) as e:
        print(f"spoolfs bench: {e}", file=sys.stderr)
        print(f"daemon log ({log}), last lines:\n{tail(log)}", file=sys.stderr)
        return 1
    finally:
        stuck = [m for m in (os.path.join(base, m) for m in MOUNTS)
                 if os.path.isdir(m) and not unmount(m)]
        unmounted = not stuck
        if stuck:
            print(f"spoolfs bench: could not unmount {', '.join(stuck)}", file=sys.stderr)
    verified = all(r.get("verified", True) for r in report["results"].values())
    verified = verified and all(r.get("verified", True) for r in report.get(
        "multihost", {}).get("results", {}).values())
    report["ok"] = verified and unmounted
    print(json.dumps(report, indent=2) if args.json else render(report))
    if not verified:
        print("spoolfs bench: a check failed: a file was not claimed, or not finished, exactly "
              "once (see the report)", file=sys.stderr)
    return 0 if report["ok"] else 1
