"""``spoolfs gc`` on a mounted store: it removes what crashes leave behind and nothing else, even
while publishes of identical content race with deletes (DESIGN §5-§6)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest

from helpers.inspection import ls, read, xattr_text
from helpers.mounts import Mount, MountFactory
from helpers.procs import one_line_error, spoolfs_cli
from helpers.queues import Queue
from helpers.waiting import patience, wait_until

pytestmark = pytest.mark.fuse

BIG = 40_000  # over the 16 KiB inline limit: content in blob files
ITERATIONS = 60


def blob_files(store: Path) -> list[Path]:
    return sorted(p for p in (store / "blobs").rglob("*") if p.is_file())


def gc(store: Path, *args: str) -> str:
    res = spoolfs_cli("gc", str(store), *args, timeout=60)
    out = res.stdout.decode(errors="replace")
    assert res.returncode == 0, out + res.stderr.decode(errors="replace")
    return out


def fsck_clean(store: Path) -> None:
    res = spoolfs_cli("fsck", str(store), timeout=60)
    out = res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")
    assert res.returncode == 0 and out.rstrip().endswith("fsck: clean"), out


def test_gc_removes_injected_orphans(mount: Mount, queue: Queue) -> None:
    store = mount.store
    big = queue.publish("big", os.urandom(BIG))
    small = queue.publish("small", b"small")
    queue.put("uploading", b"half")
    # what a crash leaves: a blob row nothing references (and its file), a blob file without
    # a row, a staging file without an upload
    data = os.urandom(BIG)
    sha = hashlib.sha256(data).digest()
    conn = sqlite3.connect(store / "meta.db", isolation_level=None)
    try:
        bid = conn.execute("INSERT INTO blobs (sha256, size, refcount, data) "
                           "VALUES (?, ?, 0, NULL)", (sha, len(data))).lastrowid
    finally:
        conn.close()
    row_file = store / "blobs" / sha.hex()[:2] / sha.hex()[2:4] / f"{sha.hex()}.{bid}"
    row_file.parent.mkdir(parents=True, exist_ok=True)
    row_file.write_bytes(data)
    loose = row_file.with_name(f"{sha.hex()}.{bid + 1000}")
    loose.write_bytes(data)
    staging = store / "staging" / f"{999999 >> 12:x}" / "999999"
    staging.parent.mkdir(exist_ok=True)
    staging.write_bytes(b"left over")

    out = gc(store)  # default grace: the fresh files stay, the row goes
    assert "removed 1 unreferenced blob row(s), 0 orphan blob file(s), 0 orphan staging " \
           "file(s)" in out and "2 orphan file(s) younger than the grace period left" in out, out
    assert not row_file.exists() and loose.exists() and staging.exists()

    out = gc(store, "--grace", "0", "-v")
    assert f"removed orphan blob file {loose}" in out and f"{staging}" in out, out
    assert "0 unreferenced blob row(s), 1 orphan blob file(s), 1 orphan staging file(s)" in out
    assert not loose.exists() and not staging.exists()

    # nothing live was touched, and the mount goes on
    assert gc(store, "--grace", "0").startswith("gc: removed 0 unreferenced blob row(s), 0 ")
    assert read(queue.ready / "big") == big and read(queue.ready / "small") == small
    assert read(queue.partial / "uploading") == b"half"
    queue.claim("big")
    fsck_clean(store)


def test_fsck_repair_while_mounted(mount: Mount, queue: Queue) -> None:
    """A message whose blob file is gone goes to error/ with the reason, seen through the
    mount; the rest of the queue is untouched and keeps working."""
    store = mount.store
    lost = queue.publish("lost", os.urandom(BIG))
    kept = queue.publish("kept", os.urandom(BIG))
    [victim] = (store / "blobs").glob(sha_path(lost))
    victim.unlink()

    res = spoolfs_cli("fsck", str(store), timeout=60)
    assert res.returncode == 1 and b"file missing" in res.stdout, res.stdout
    res = spoolfs_cli("fsck", str(store), "--repair", timeout=60)
    out = res.stdout.decode(errors="replace")
    assert res.returncode == 0, out + res.stderr.decode(errors="replace")
    assert "repaired: message" in out and "moved to error/ as 'lost'" in out, out
    assert out.rstrip().endswith("clean"), out

    wait_until(lambda: ls(queue.error) == ["lost"] and ls(queue.ready) == ["kept"], timeout=5,
               alive=mount.daemon_alive, what="the repaired message to show in error/")
    assert xattr_text(queue.error / "lost", "user.spool.error").startswith("content lost: ")
    assert read(queue.error / "lost") == b""
    assert read(queue.ready / "kept") == kept
    queue.claim("kept")
    queue.finish("kept")
    fsck_clean(store)


def sha_path(data: bytes) -> str:
    """A glob for the blob file of content ``data`` under STORE/blobs (whatever its id)."""
    h = hashlib.sha256(data).hexdigest()
    return f"{h[:2]}/{h[2:4]}/{h}.*"


def test_gc_of_something_that_is_no_store(tmp_path: Path) -> None:
    line = one_line_error(spoolfs_cli("gc", str(tmp_path / "nothing")))
    assert "is not a spoolfs store" in line
    assert not (tmp_path / "nothing").exists()


# Publish identical content and delete it again, as fast as the mount allows, checking that
# every publish reads back; a link now and then. The last publish of each worker stays.
WORKER = r"""
src=$1 dir=$2 tag=$3 n=$4
for ((i = 0; i < n; i++)); do
  f="$dir/ready/$tag-$i"
  cp -- "$src" "$f" || exit 10
  cmp -s -- "$src" "$f" || { echo "$f does not read back" >&2; exit 11; }
  if (( i % 5 == 4 )); then
    ln -- "$f" "$f.link" || exit 12
    rm -- "$f" || exit 13
    cmp -s -- "$src" "$f.link" || { echo "$f.link does not read back" >&2; exit 14; }
    rm -- "$f.link" || exit 15
  else
    rm -- "$f" || exit 13
  fi
done
cp -- "$src" "$dir/ready/$tag-last" || exit 16
"""


def test_gc_racing_identical_publishes_never_loses_a_blob(mounter: MountFactory, store: Path,
                                                          tmp_path: Path) -> None:
    a = mounter(store, tmp_path / "spool")
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    b = mounter(store, tmp_path / "qroot", queue="q")  # a second daemon on the same store
    # pairs of workers, one on each mount, publish the same content: with a pair, often
    # neither holds a message, so the blob's last reference goes and the next publish of
    # the same content makes a new blob, while the old one's file is being removed
    groups = 3
    contents = [os.urandom(BIG) for _ in range(groups)]
    sources = [q.source(c) for c in contents]
    dirs = [q.path, b.path]
    workers = 2 * groups
    procs = [subprocess.Popen(["bash", "-c", WORKER, "worker", str(sources[i // 2]),
                               str(dirs[i % 2]), f"w{i}", str(ITERATIONS)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
             for i in range(workers)]

    # collectors: `spoolfs gc --grace 0` over and over, and the same in-process, faster
    stop = threading.Event()
    runs: list[str] = []
    failures: list[str] = []

    def cli_loop() -> None:
        while not stop.is_set():
            res = spoolfs_cli("gc", str(store), "--grace", "0", timeout=60)
            if res.returncode != 0:
                failures.append(res.stderr.decode(errors="replace"))
            runs.append(res.stdout.decode(errors="replace"))

    def inproc_loop() -> None:
        from spoolfs.service import gc as service_gc
        while not stop.is_set():
            try:
                service_gc.collect(str(store), grace_ns=0)
            except Exception as e:  # reported below
                failures.append(repr(e))
            time.sleep(0.005)

    threads = [threading.Thread(target=cli_loop), threading.Thread(target=inproc_loop)]
    for t in threads:
        t.start()
    try:
        errors = []
        for i, p in enumerate(procs):
            _, err = p.communicate(timeout=patience(120))
            if p.returncode != 0:
                errors.append(f"worker {i} exited {p.returncode}: {err.decode(errors='replace')}")
        assert not errors, "\n".join(errors)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert not failures, failures
    assert len(runs) >= 2, "gc did not run while the workers published"

    names = [f"w{i}-last" for i in range(workers)]
    wait_until(lambda: ls(q.ready) == sorted(names), timeout=5, alive=a.daemon_alive,
               what="both mounts' last publishes in ready/")
    for i, n in enumerate(names):
        assert read(q.ready / n) == contents[i // 2]
        assert read(b.path / "ready" / n) == contents[i // 2]
    gc(store, "--grace", "0")
    assert len(blob_files(store)) == groups, blob_files(store)  # a pair shares one blob
    b.umount()
    a.umount()
    conn = sqlite3.connect(store / "meta.db")
    try:
        (made,), = conn.execute("SELECT seq FROM sqlite_sequence WHERE name='blobs'")
    finally:
        conn.close()
    assert made > groups + 5, f"only {made} blobs were made: the race was hardly exercised"
    fsck_clean(store)
