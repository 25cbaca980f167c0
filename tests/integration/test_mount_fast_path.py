"""The kernel answers what it may keep (issue: the fast path): names that do not exist, and the
bytes of published content, without a request to the daemon; and what the daemon changes
behind the kernel's back is dropped from its cache at once. Counted with the daemon's own
request counts (MOUNT/.spool/requests), never timed."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import time
from pathlib import Path

import pytest

from helpers.mounts import Mount, MountFactory
from helpers.procs import ok, spoolfs_cli
from helpers.queues import Queue
from helpers.waiting import wait_until

pytestmark = pytest.mark.fuse


def counts(mount: Mount) -> dict[str, int]:
    doc = json.loads((mount.path / ".spool/requests").read_text())
    return {op: v["count"] for op, v in doc["requests"].items()}


class Requests:
    """Requests per operation since the last call, less those of reading the counts."""

    def __init__(self, mount: Mount) -> None:
        self.mount = mount
        self.last = counts(mount)
        self.own: dict[str, int] = {}
        self.own = self.since()

    def since(self) -> dict[str, int]:
        now = counts(self.mount)
        out = {op: now[op] - self.last.get(op, 0) - self.own.get(op, 0) for op in now}
        self.last = now
        return out


def test_an_absent_name_is_answered_by_the_kernel(mount: Mount, queue: Queue) -> None:
    """``[ -e ready/x ]`` over and over (the seed-004 consumer's test of a name another
    consumer took) reaches the daemon once, not every time."""
    requests = Requests(mount)
    for _ in range(50):
        assert not (queue.ready / "gone").exists()
    lookups = requests.since().get("lookup", 0)
    assert lookups <= 10, f"{lookups} lookups for 50 tests of one absent name"
    queue.publish("gone", b"back")  # a name made through the mount is seen at once
    assert (queue.ready / "gone").read_bytes() == b"back"


def test_published_content_is_read_from_the_page_cache(mount: Mount, queue: Queue) -> None:
    data = os.urandom(256 * 1024)
    queue.publish("big", data)
    assert (queue.ready / "big").read_bytes() == data
    requests = Requests(mount)
    for _ in range(5):
        assert (queue.ready / "big").read_bytes() == data
    reads = requests.since().get("read", 0)
    assert reads == 0, f"{reads} reads reached the daemon for content already read"


def test_a_message_the_lifecycle_brings_back_is_seen_at_once(mount: Mount, queue: Queue) -> None:
    """A name the kernel holds as absent reappears as soon as a lease expiry puts the message
    back in ready/ (the daemon drops the name from the kernel's cache), not a timeout later."""
    res = spoolfs_cli("queue", "set", str(queue.path), "lease_timeout=1s")
    assert res.returncode == 0, res.stderr.decode()
    queue.publish("m", b"work")
    queue.claim("m", "c1")
    assert not (queue.ready / "m").exists()  # now known to the kernel as absent
    wait_until(lambda: os.listdir(queue.working / "c1") == [], timeout=30,
               what="the lease to expire")
    wait_until(lambda: (queue.ready / "m").exists(), timeout=0.5,
               what="ready/m to be seen as soon as it is back")
    assert (queue.ready / "m").read_bytes() == b"work"


def test_a_listing_of_a_deep_directory_is_read_in_pages(mount: Mount, queue: Queue,
                                                        tmp_path: Path) -> None:
    """Opening a directory reads nothing; each READDIR reads one page from the store."""
    for i in range(1200):
        queue.put(f"p{i:04d}", b"x")
    requests = Requests(mount)
    with os.scandir(queue.partial) as it:
        first = next(it).name
    assert first == "p0000"
    assert requests.since().get("readdir", 0) <= 2
    assert len(os.listdir(queue.partial)) == 1200


def test_a_large_file_is_read_in_large_requests(mount: Mount, queue: Queue) -> None:
    """The kernel reads ahead 1 MiB at a time on a spoolfs mount (its default of 128 KiB
    made a 256 MiB read 2,048 requests, each paying the round trip to the daemon)."""
    device = os.stat(mount.path).st_dev
    bdi = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
    assert bdi.read_text().strip() == "1024"
    data = os.urandom(16 << 20)
    queue.publish("large", data)
    requests = Requests(mount)
    with open(queue.ready / "large", "rb") as f:
        assert f.read() == data
    reads = requests.since().get("read", 0)
    assert 16 <= reads <= 24, f"{reads} read requests for 16 MiB"


def test_an_upload_is_written_straight_to_the_daemon(mount: Mount, queue: Queue) -> None:
    """Writes into an upload reach the daemon as they are made, past the kernel's page cache:
    one copy of every byte fewer, and none of the ``security.capability`` lookups the kernel
    makes before each cached write (a round trip each). Those cached pages were dropped anyway
    once the kernel saw the upload's newer modification time."""
    requests = Requests(mount)
    with open(queue.partial / "up", "wb", buffering=0) as f:
        for i in range(8):
            f.write(bytes([65 + i]) * 4096)
        f.seek(0)
        f.write(b"head")
    got = requests.since()
    assert got.get("getxattr", 0) == 0, f"{got.get('getxattr')} xattr lookups for 9 writes"
    assert got.get("write", 0) == 9
    expected = b"head" + b"A" * 4092 + b"".join(bytes([65 + i]) * 4096 for i in range(1, 8))
    assert (queue.partial / "up").read_bytes() == expected
    os.rename(queue.partial / "up", queue.ready / "up")
    assert (queue.ready / "up").read_bytes() == expected


def test_a_write_made_while_the_upload_is_read_is_seen(mount: Mount, queue: Queue) -> None:
    """A reader of an upload in progress (``tail -f partial/log``) sees what the writer adds
    or overwrites at once, as it did when writes went through the kernel's page cache."""
    with open(queue.partial / "log", "wb", buffering=0) as w, \
            open(queue.partial / "log", "rb", buffering=0) as r:
        w.write(b"one\n")
        assert r.read() == b"one\n"
        w.write(b"two\n")
        assert r.read() == b"two\n"
        os.pwrite(w.fileno(), b"ONE\n", 0)
        assert os.pread(r.fileno(), 100, 0) == b"ONE\ntwo\n"


def _write_through_a_shared_mapping(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, len(data))
        with mmap.mmap(fd, len(data), mmap.MAP_SHARED) as m:
            m[:] = data
    finally:
        os.close(fd)


def test_an_upload_mapped_shared_for_writing_is_refused_clearly(mount: Mount,
                                                                queue: Queue) -> None:
    """What writing past the page cache costs: an upload cannot be mapped shared and written
    through the mapping (ENODEV, the kernel's answer); a private mapping, and a shared one of a
    published message, still work. ``-o shared_mmap`` lifts it (below)."""
    with pytest.raises(OSError) as refused:
        _write_through_a_shared_mapping(queue.partial / "mapped", b"mapped\n")
    assert refused.value.errno == errno.ENODEV
    assert (queue.partial / "mapped").read_bytes() == b"\0" * 7  # nothing lost or half-made
    (queue.partial / "mapped").write_bytes(b"private\n")
    with open(queue.partial / "mapped", "r+b") as f, \
            mmap.mmap(f.fileno(), 0, mmap.MAP_PRIVATE) as m:
        assert m[:] == b"private\n"
        m[:7] = b"changed"  # the process's own copy
    assert (queue.partial / "mapped").read_bytes() == b"private\n"
    queue.publish("pub", b"published\n")
    with open(queue.ready / "pub", "rb") as f, \
            mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ) as m:
        assert m[:] == b"published\n"


def test_with_shared_mmap_an_upload_is_written_through_a_mapping(mounter: MountFactory,
                                                                 tmp_path: Path) -> None:
    m = mounter(tmp_path / "store", tmp_path / "mnt", extra=["-o", "shared_mmap"])
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    _write_through_a_shared_mapping(q.partial / "mapped", b"mapped\n")
    os.rename(q.partial / "mapped", q.ready / "mapped")
    assert (q.ready / "mapped").read_bytes() == b"mapped\n"


def staging_files(store: Path) -> set[int]:
    return {int(f.name) for f in (store / "staging").glob("*/*") if f.name.isdigit()}


def test_uploads_take_staging_files_made_ahead(mounter: MountFactory, store: Path,
                                               tmp_path: Path) -> None:
    """A create makes no file on the daemon's event loop: it takes one made ahead (its times
    those of the create, as a new file's are); unmount removes the files not taken, and the
    next mount those a kill -9 left."""
    mount = mounter(store, tmp_path / "mnt")
    queue = Queue.create(mount.path, "q", tmp_path / "scratch")
    wait_until(lambda: len(staging_files(store)) >= 2, what="staging files made ahead")
    ahead = staging_files(store)
    time.sleep(0.05)  # the files made ahead are older than the upload that takes one
    os.utime(tmp_path)
    before = os.stat(tmp_path).st_mtime_ns  # now, by the clock file times come from
    fd = os.open(queue.partial / "a", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    a = os.stat(queue.partial / "a")
    assert a.st_ino in ahead and a.st_mtime_ns >= before and a.st_ctime_ns >= before
    for i in range(100):  # creates in a row find files made ahead, in the order made
        (queue.partial / f"f{i:03d}").write_bytes(b"made ahead\n")
    ids = [os.stat(queue.partial / f"f{i:03d}").st_ino for i in range(100)]
    assert ids == sorted(ids) and ids[0] > a.st_ino
    assert len(set(ids) & staging_files(store)) == 100
    uploads = staging_files(store) & ({a.st_ino} | set(ids))

    mount.umount()
    assert staging_files(store) == uploads  # the files not taken are gone
    mount.start()
    wait_until(lambda: len(staging_files(store) - uploads) >= 2,
               what="staging files made ahead")
    killed = staging_files(store) - uploads
    mount.kill9()
    assert staging_files(store) >= killed  # left behind, held by nobody now
    mount.start()  # their ids were given: walked once the mount serves
    wait_until(lambda: not staging_files(store) & killed,
               what="recovery's removal of the killed daemon's files")
    assert (queue.partial / "f099").read_bytes() == b"made ahead\n"
    mount.umount()
    assert staging_files(store) == uploads


@pytest.mark.parametrize("rewrite", [False, True], ids=["cp", "cp-then-dd"])
def test_a_large_upload_is_addressed_by_what_it_holds(mount: Mount, queue: Queue,
                                                      tmp_path: Path, rewrite: bool) -> None:
    """A large upload is hashed while ``cp`` writes it (publishing then hashes only the rest);
    rewritten in place before its ``mv`` (``dd conv=notrunc``), it is hashed again whole."""
    data = bytearray(os.urandom(8 << 20))
    ok("cp", queue.source(bytes(data)), queue.partial / "big")
    if rewrite:
        patch = tmp_path / "patch"
        patch.write_bytes(b"d" * 4096)
        ok("dd", f"if={patch}", f"of={queue.partial / 'big'}", "bs=4096", "seek=5",
           "conv=notrunc", "status=none")
        data[5 * 4096:6 * 4096] = b"d" * 4096
    ok("mv", queue.partial / "big", queue.ready / "big")
    digest = hashlib.sha256(data).hexdigest()
    assert ok("getfattr", "--only-values", "-n", "user.spool.sha256",
              queue.ready / "big").decode() == digest
    assert ok("sha256sum", queue.ready / "big").decode().split()[0] == digest
