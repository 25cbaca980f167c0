"""``spoolfs bench``'s workloads of many processes and deep queues, and its request counts.

- ``producers``: P writer threads create files directly in ready/, as ``cp`` does (a stat of the
  name, open O_CREAT|O_TRUNC, write, close); the plain side fsyncs each file before its close.
- ``seed``: the seed-004 pattern. F files are published, then K consumers, real ``bash``
  processes split over two mounts of one store, each list ready/, test every name with ``-e``
  and claim it with ``mv`` into a view of their own, then move it to success/.
- ``deep``: the small-file cycle in a queue whose ready/ already holds N messages, while another
  queue holds N more (``--depth N``), beside the same cycle on an empty store (cli/bench.py);
  then a consumer's look at that ready/ (``listing``: its first name, every name, a claim right
  after), the daemon's memory, and a new mount of the deep store.
- request counts: the FUSE requests each step of the small-file cycle costs, read from
  ``MOUNT/.spool/requests`` between the steps (the cost of reading it measured and taken off).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

SEED_CONSUMER = r"""
q=$1 mine=$2
shopt -s nullglob
files=("$q"/ready/*)
for f in "${files[@]}"; do
  n=${f##*/}
  [ -e "$q/ready/$n" ] || continue
  mv -- "$q/ready/$n" "$mine/" 2>/dev/null || continue
  mv -- "$mine/$n" "$q/success/"
done
"""

WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def cp_like(path: str, data: bytes, fsync: bool) -> None:
    """What ``cp SRC path`` does to its destination (coreutils: a stat, then open, write)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, WRITE, 0o644)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def in_threads(count: int, work: Callable[[int], None]) -> float:
    """Run ``work(i)`` for i in range(count) in as many threads; the wall-clock seconds taken.
    A failure in any thread is raised here."""
    failures: list[BaseException] = []
    barrier = threading.Barrier(count + 1)

    def one(i: int) -> None:
        barrier.wait()
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            failures.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if failures:
        raise failures[0]
    return elapsed


def producers(ready: str, files: int, writers: int, fsync: bool) -> tuple[float, list[str]]:
    """``writers`` threads share ``files`` files; (files per second, problems)."""
    data = os.urandom(1024)

    def work(w: int) -> None:
        for i in range(w, files, writers):
            cp_like(os.path.join(ready, f"p{i:07d}"), data, fsync)

    elapsed = in_threads(writers, work)
    listed = len(os.listdir(ready))
    problems = [] if listed == files else [f"{ready} lists {listed} files, not {files}"]
    return files / elapsed, problems


def seed(queue_dirs: list[str], files: int, consumers: int) -> tuple[float, list[str]]:
    """Publish ``files`` into the first queue dir's ready/ (untimed), then run the consumers,
    consumer i on ``queue_dirs[i % n]``; (files per second, problems)."""
    q0 = queue_dirs[0]
    data = os.urandom(1024)
    for i in range(files):
        cp_like(os.path.join(q0, "ready", f"s{i:07d}"), data, False)
    views = []
    for c in range(consumers):
        q = queue_dirs[c % len(queue_dirs)]
        view = os.path.join(q, "working", f"seed{c:02d}")
        os.mkdir(view)
        views.append((q, view))
    start = time.perf_counter()
    procs = [subprocess.Popen(["bash", "-c", SEED_CONSUMER, "consumer", q, view],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for q, view in views]
    problems = []
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            problems.append(f"a consumer exited {p.returncode}: {err.decode(errors='replace')}")
    elapsed = time.perf_counter() - start
    done = Counter(os.listdir(os.path.join(q0, "success")))
    if len(done) != files:
        problems.append(f"{len(done)} of {files} files reached success/")
    left = [n for _, v in views for n in os.listdir(v)] + os.listdir(os.path.join(q0, "ready"))
    if left:
        problems.append(f"{len(left)} files left in ready/ or a view")
    return files / elapsed, problems[:20]


def fill(ready: str, n: int, writers: int = 8) -> None:
    """Put ``n`` small files in ``ready`` (untimed set-up)."""
    data = b"waiting\n"

    def work(w: int) -> None:
        for i in range(w, n, writers):
            cp_like(os.path.join(ready, f"w{i:08d}"), data, False)

    in_threads(writers, work)


def listing(ready: str, claim_to: str) -> dict[str, Any]:
    """What a consumer of a deep queue does: read the first name of ``ready`` (``ls -f | head
    -1``: open the directory, read once), then every name (``ls -f``), then claim that first
    name into ``claim_to`` with a rename. Each timed, in ms; the listing in names per second,
    from the open on."""
    clock = time.perf_counter
    start = clock()
    with os.scandir(ready) as it:
        first = next(it).name
        got_first = clock()
        names = 1 + sum(1 for _ in it)
    listed = clock()
    os.rename(os.path.join(ready, first), os.path.join(claim_to, first))
    claimed = clock()
    return {"first": first, "first_name_ms": round((got_first - start) * 1e3, 3),
            "names": names, "names_per_s": round(names / (listed - start), 1),
            "claim_ms": round((claimed - listed) * 1e3, 3)}


def memory_mib(pid: int) -> tuple[float, float]:
    """A process's resident memory now and at its peak (``VmRSS``, ``VmHWM``), in MiB."""
    with open(f"/proc/{pid}/status", "rb") as f:
        fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)

    def mib(key: bytes) -> float:
        return round(int(fields[key].split()[0]) / 1024, 1)  # "VmRSS:  30740 kB"

    return mib(b"VmRSS"), mib(b"VmHWM")


WRITTEN_BACK_KIB = 4096  # what a quiet machine's other writers keep dirty


def write_back(limit_s: float = 300.0) -> float:
    """The end of an untimed set-up: ``sync``, then wait until the kernel holds (nearly) no
    dirty or in-flight pages, at most ``limit_s``. Returns the seconds it took."""
    start = time.monotonic()
    os.sync()
    while unwritten_kib() > WRITTEN_BACK_KIB and time.monotonic() - start < limit_s:
        time.sleep(0.5)
    return time.monotonic() - start


def unwritten_kib() -> int:
    """``Dirty`` + ``Writeback`` of /proc/meminfo."""
    with open("/proc/meminfo") as f:
        return sum(int(line.split()[1]) for line in f
                   if line.startswith(("Dirty:", "Writeback:")))


class RequestCounter:
    """FUSE requests per operation since the last call, from ``MOUNT/.spool/requests``; what
    reading that file itself costs is measured once and taken off."""

    def __init__(self, mount: str) -> None:
        self.path = os.path.join(mount, ".spool", "requests")
        self.last = self._read()
        self.cost: Counter[str] = Counter()
        self.cost = self.delta()  # one read's own requests

    def _read(self) -> Counter[str]:
        with open(self.path) as f:
            doc: dict[str, Any] = json.load(f)
        return Counter({op: v["count"] for op, v in doc["requests"].items()})

    def delta(self) -> Counter[str]:
        now = self._read()
        out = now - self.last - self.cost
        self.last = now
        return +out


def count_cycle(mount: str, queue: str, n: int, step_fns: list[tuple[str, Callable[[int], None]]]
                ) -> dict[str, dict[str, float]]:
    """Run ``n`` cycles of ``step_fns`` one step at a time, counting each step's requests; per
    step, the mean requests per file by operation."""
    counter = RequestCounter(mount)
    totals: dict[str, Counter[str]] = {step: Counter() for step, _ in step_fns}
    for i in range(n):
        for step, fn in step_fns:
            counter.delta()
            fn(i)
            totals[step] += counter.delta()
    return {step: {op: round(k / n, 2) for op, k in sorted(c.items())}
            for step, c in totals.items()}
