"""The kernel answers what it may keep (issue: the fast path): names that do not exist, and the
bytes of published content, without a request to the daemon; and what the daemon changes
behind the kernel's back is dropped from its cache at once. Counted with the daemon's own
request counts (MOUNT/.spool/requests), never timed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers.mounts import Mount
from helpers.procs import spoolfs_cli
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
