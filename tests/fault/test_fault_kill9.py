"""kill -9 of the daemon under load (DESIGN §6, §11): nothing acknowledged is lost or duplicated.

Shell producers publish (``> partial/n`` then ``mv`` to ``ready/``) and record a name only after
``mv`` returned 0; shell consumers claim and finish and record each finish only after ``mv``
returned 0. The daemon is killed mid-load, the dead mount cleared with ``fusermount3 -u -z``,
and the store mounted again.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers.mounts import Mount, MountFactory
from helpers.procs import consumed_names, fails, ok, spoolfs_cli
from helpers.queues import Queue
from helpers.waiting import patience, wait_until
from spoolfs.blobs import writeback

pytestmark = pytest.mark.fuse

PRODUCER = r"""
cd "$1" || exit 2
id=$2 pad=$3 ack=$4 stop=$5
i=0
while [ ! -e "$stop" ]; do
  i=$((i+1)); n="p${id}_$i"
  { printf '%s\n' "$n"; cat "$pad"; } > "partial/$n" 2>/dev/null || continue
  mv -- "partial/$n" ready/ 2>/dev/null && printf '%s\n' "$n" >> "$ack"
done
"""

CONSUMER = r"""
shopt -s nullglob
cd "$1" || exit 2
c=$2 claims=$3 fins=$4 stop=$5
while [ ! -e "$stop" ]; do
  files=(ready/*)
  (( ${#files[@]} == 0 )) && { sleep 0.02; continue; }
  for f in "${files[@]}"; do
    [ -e "$stop" ] && break
    b=${f#ready/}
    mv -- "$f" "working/$c/" 2>/dev/null || continue
    printf '%s\n' "$b" >> "$claims"
    cat -- "working/$c/$b" > /dev/null 2>&1 || continue
    mv -- "working/$c/$b" success/ 2>/dev/null && printf '%s\n' "$b" >> "$fins"
  done
done
"""

PRODUCERS = 3
CONSUMERS = 3


class Load:
    """Shell producers and consumers on one queue, each round with fresh names and logs."""

    def __init__(self, queue: Queue, logs: Path, pad: Path, round_no: int) -> None:
        self.logs = logs
        self.stop = logs / f"stop-{round_no}"
        self.acks = [logs / f"published-{round_no}-{i}" for i in range(PRODUCERS)]
        self.claims = {f"c{i}": logs / f"claims-{round_no}-c{i}" for i in range(CONSUMERS)}
        self.fins = {f"c{i}": logs / f"finished-{round_no}-c{i}" for i in range(CONSUMERS)}
        self.procs: list[subprocess.Popen[bytes]] = []
        for i, ack in enumerate(self.acks):
            self._spawn(PRODUCER, queue.path, f"r{round_no}x{i}", pad, ack, self.stop)
        for c in self.claims:
            self._spawn(CONSUMER, queue.path, c, self.claims[c], self.fins[c], self.stop)

    def _spawn(self, script: str, *args: object) -> None:
        self.procs.append(subprocess.Popen(["bash", "-c", script, "load", *map(str, args)],
                                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))

    def published(self) -> set[str]:
        return {n for ack in self.acks for n in consumed_names(ack)}

    def finished(self) -> set[str]:
        return {n for f in self.fins.values() for n in consumed_names(f)}

    def claimed(self) -> dict[str, set[str]]:
        return {c: set(consumed_names(f)) for c, f in self.claims.items()}

    def halt(self) -> None:
        self.stop.touch()
        for p in self.procs:
            try:
                p.wait(timeout=patience(30))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                raise AssertionError("a load script hung after the daemon died") from None


def where_is_everything(q: Queue) -> dict[str, list[str]]:
    """name -> every place it is found (state or working/<consumer>)."""
    places: dict[str, list[str]] = {}
    for state in ("partial", "ready", "success", "error"):
        for n in os.listdir(q.path / state):
            places.setdefault(n, []).append(state)
    for entry in os.listdir(q.working):
        if (q.working / entry).is_dir():
            for n in os.listdir(q.working / entry):
                places.setdefault(n, []).append(f"working/{entry}")
        else:
            places.setdefault(entry, []).append("working")
    return places


def check_nothing_lost(q: Queue, pad: bytes, published: set[str], finished: set[str],
                       claimed: dict[str, set[str]]) -> None:
    places = where_is_everything(q)
    duplicated = {n: p for n, p in places.items() if len(p) > 1}
    assert not duplicated, f"messages in more than one place after kill -9: {duplicated}"
    lost = sorted(n for n in published if n not in places or places[n][0] == "partial")
    assert not lost, f"{len(lost)} acknowledged publishes lost: {lost[:20]}"
    unfinished = sorted(n for n in finished if places.get(n) != ["success"])
    assert not unfinished, \
        f"acknowledged finishes not in success/: {[(n, places.get(n)) for n in unfinished[:20]]}"
    for c, names in claimed.items():
        misplaced = sorted(n for n in names
                           if places.get(n) not in (["success"], [f"working/{c}"]))
        assert not misplaced, f"claims acknowledged to {c} now elsewhere: " \
            f"{[(n, places.get(n)) for n in misplaced[:20]]}"
    for n, (place,) in places.items():
        if place == "partial":
            continue  # an upload cut short by the kill may be incomplete: it was never published
        path = q.path / place / n
        expected = n.encode() + b"\n" + pad
        assert path.read_bytes() == expected, f"{place}/{n} has wrong content after kill -9"


def test_kill9_under_load_loses_and_duplicates_nothing(mounter: MountFactory, store: Path,
                                                       tmp_path: Path) -> None:
    m: Mount = mounter(store, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    for i in range(CONSUMERS):
        q.consumer(f"c{i}")
    pad_file = tmp_path / "pad"
    pad = os.urandom(8192)
    pad_file.write_bytes(pad)
    logs = tmp_path / "logs"
    logs.mkdir()

    published: set[str] = set()
    finished: set[str] = set()
    claimed: dict[str, set[str]] = {f"c{i}": set() for i in range(CONSUMERS)}
    for round_no in range(2):
        load = Load(q, logs, pad_file, round_no)
        try:
            wait_until(lambda: len(load.published()) >= 150 and len(load.finished()) >= 60,
                       timeout=60, alive=m.daemon_alive,
                       what="the load to publish 150 and finish 60 messages")
            m.kill9()
        finally:
            load.halt()
        published |= load.published()
        finished |= load.finished()
        for c, names in load.claimed().items():
            claimed[c] = (claimed[c] - finished) | names
        m.start()
        check_nothing_lost(q, pad, published, finished,
                           {c: names - finished for c, names in claimed.items()})

    # a clean unmount after recovery leaves a store fsck accepts
    m.umount()
    fsck = spoolfs_cli("fsck", str(store), timeout=120)
    assert fsck.returncode == 0, "fsck after kill -9 and recovery:\n" + \
        fsck.stdout.decode(errors="replace") + fsck.stderr.decode(errors="replace")


def test_kill9_while_writing_into_ready_never_publishes_a_torn_file(mounter: MountFactory,
                                                                    store: Path,
                                                                    tmp_path: Path) -> None:
    m: Mount = mounter(store, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    data = os.urandom(8 << 20)
    fds = []
    try:
        # writers holding files open: one direct publish into ready/, one upload in partial/
        fds.append(os.open(q.ready / "torn", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.write(fds[-1], data)
        fds.append(os.open(q.partial / "upload", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.write(fds[-1], data[:1 << 20])
        m.kill9()
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass  # ENOTCONN: the daemon is gone
    m.start()
    assert "torn" not in os.listdir(q.ready), "a file whose writer never closed it was published"
    for state in ("ready", "success", "error"):
        assert os.listdir(q.path / state) == []
    ok("ls", "-la", q.partial)
    m.umount()
    fsck = spoolfs_cli("fsck", str(store), timeout=120)
    assert fsck.returncode == 0, "fsck after kill -9 with open uploads:\n" + \
        fsck.stdout.decode(errors="replace") + fsck.stderr.decode(errors="replace")


@pytest.mark.parametrize("how", ["cp into ready", "mv partial to ready"])
def test_publish_survives_kill9_right_after_it_returned(mounter: MountFactory, store: Path,
                                                       tmp_path: Path,
                                                       how: str) -> None:
    """§6: when a publish returns success it survives kill -9. For ``cp x ready/`` the success
    is cp's exit 0 (its close returned), so the daemon may not defer the publish to the
    asynchronous FUSE RELEASE."""
    m: Mount = mounter(store, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    for i in range(3):
        name = f"m{i}"
        data = os.urandom(256 << 10)
        src = tmp_path / name
        src.write_bytes(data)
        if how == "cp into ready":
            ok("cp", src, q.ready)
        else:
            ok("cp", src, q.partial)
            ok("mv", q.partial / name, q.ready)
        m.kill9()
        m.start()
        assert name in os.listdir(q.ready), f"{how}: returned 0, lost by kill -9"
        assert (q.ready / name).read_bytes() == data


def test_kill9_of_the_writers_mount_never_shows_the_file_it_held_torn(
        mounter: MountFactory, store: Path, tmp_path: Path) -> None:
    """A file moved into ``ready/`` through mount A while its writer uses mount B waits for
    that writer's close. B's daemon killed meanwhile never lets it appear as it stands: it
    stays unseen, and the next mount's recovery moves it to ``partial/`` with its bytes."""
    a = mounter(store, tmp_path / "a")
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    b = mounter(store, tmp_path / "b")
    data = os.urandom(1 << 20)
    fd = os.open(b.path / "q/partial/up", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        wait_until(lambda: (q.partial / "up").exists(), timeout=2.0, alive=a.daemon_alive,
                   what="the upload to show in mount A")
        ok("mv", q.partial / "up", q.ready / "up")
        b.kill9()
    finally:
        try:
            os.close(fd)
        except OSError:
            pass  # ENOTCONN: the daemon is gone
    assert os.listdir(q.ready) == [], "a file whose writer never closed it was published"
    b.start()  # its recovery: the upload's writer is gone
    wait_until(lambda: os.listdir(q.partial) == ["up"], timeout=2.0, alive=a.daemon_alive,
               what="mount A to show the upload back in partial/")
    assert (q.partial / "up").read_bytes() == data
    assert os.listdir(q.ready) == []
    a.umount()
    b.umount()
    fsck = spoolfs_cli("fsck", str(store), timeout=120)
    assert fsck.returncode == 0, fsck.stdout.decode(errors="replace")


def test_an_upload_whose_sync_failed_is_not_published_by_the_next_daemon(
        mounter: MountFactory, store: Path, tmp_path: Path) -> None:
    """The kernel reports a lost writeback to one fsync only, so a daemon killed after a sync
    of an upload failed leaves the next one nothing to be told: the staging file keeps the
    failure in its mode (blobs/writeback.py). This machine cannot make its disk fail, so the
    mark a failed sync sets is set here by hand; the rest is real: a new daemon, `mv`, and a
    producer's retry, `cp` over the file (cut to nothing: written whole again), then `mv`."""
    m: Mount = mounter(store, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    src = tmp_path / "big"
    src.write_bytes(os.urandom(3 << 20))
    ok("cp", src, q.partial)
    (staged,) = [p for p in (store / "staging").rglob("*")
                 if p.is_file() and p.stat().st_size == 3 << 20]
    m.kill9()
    staged.chmod(staged.stat().st_mode | writeback.SYNC_FAILED)
    m.start()
    since = m.log_size()
    fails("mv", q.partial / "big", q.ready, message="Input/output error")
    assert os.listdir(q.ready) == []
    assert (q.partial / "big").stat().st_size == 3 << 20  # shown where it was, with its bytes
    assert "a sync of it failed" in m.log_text(since)
    fsck = spoolfs_cli("fsck", str(store), timeout=120)  # nothing damaged; the writer is told
    out = fsck.stdout.decode(errors="replace")
    assert fsck.returncode == 0 and "a sync of its content failed" in out, out
    ok("truncate", "-s", "1M", q.partial / "big")  # some of the bytes left: still refused
    fails("mv", q.partial / "big", q.ready, message="Input/output error")
    ok("cp", src, q.partial)
    ok("mv", q.partial / "big", q.ready)
    assert (q.ready / "big").read_bytes() == src.read_bytes()
