"""Watching the spool (DESIGN §7): ``spoolfs status``, its ``--check`` thresholds,
``MOUNT/.spool/status`` and ``.spool/metrics``, and the HTTP endpoint, against a spool built
to a known state."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.mounts import Mount, MountFactory
from helpers.ports import free_port
from helpers.procs import fails, ok, spoolfs_cli
from helpers.queues import Queue
from helpers.waiting import stretched, wait_until

pytestmark = pytest.mark.fuse


def qset(queue: Path, *settings: str) -> None:
    res = spoolfs_cli("queue", "set", str(queue), *settings)
    assert res.returncode == 0, res.stderr.decode()


def status(*args: str) -> tuple[int, str]:
    res = spoolfs_cli("status", *args)
    return res.returncode, res.stdout.decode() + res.stderr.decode()


def build(mount: Mount, tmp_path: Path) -> Queue:
    """q: 1 upload in partial, 3 in ready (1 under a staging name), c1 holding 2, 1 finished,
    2 in error (1 abandoned). The oldest ready message is published first, then we wait."""
    q = Queue.create(mount.path, "q", tmp_path / "scratch")
    qset(q.path, "max_attempts=1", "lease_timeout=1h")
    (q.partial / "up").write_bytes(b"u" * 10)
    for name in ("r1", "r2", "r3", "r4", "w1", "w2", "e1", "s1"):
        q.publish(name, b"x" * 100)
    (q.ready / ".staging").write_bytes(b"s" * 7)
    for name in ("w1", "w2", "e1", "s1"):
        q.claim(name, "c1")
    q.consumer("c2")
    q.finish("s1", "c1")
    q.finish("e1", "c1", to="error")
    ok("mv", q.ready / "r4", q.working / "c1/")
    ok("mv", q.working / "c1/r4", q.error)  # retry_errors off: final, not abandoned
    return q


def test_status_shows_every_field(mounter: MountFactory, tmp_path: Path) -> None:
    m = mounter(tmp_path / "store", tmp_path / "mnt")
    started = time.monotonic()
    build(m, tmp_path)
    time.sleep(1.2)
    snap = json.loads((m.path / ".spool/status").read_bytes())
    q = snap["queues"]["q"]
    states = q["states"]
    assert {s: states[s]["count"] for s in states} == \
        {"partial": 1, "ready": 4, "working": 2, "success": 1, "error": 2}
    assert states["ready"]["bytes"] == 3 * 100 + 7
    assert states["working"]["bytes"] == 200
    for s in ("ready", "working", "success", "error", "partial"):
        assert states[s]["oldest_age_s"] >= 1.0, s
    assert q["consumers"]["c1"]["in_flight"] == 2
    claimed_for_at_most = time.monotonic() - started
    assert 3600 - claimed_for_at_most - 1 <= q["consumers"]["c1"]["next_lease_end_s"] <= 3600
    c2 = q["consumers"]["c2"]
    assert 1.0 <= c2.pop("last_activity_age_s") <= time.monotonic() - started + 1
    assert c2 == {"in_flight": 0, "oldest_claim_age_s": None, "next_lease_end_s": None}
    # a view's last activity: the last claim into it or out of it
    assert q["consumers"]["c1"]["last_activity_age_s"] >= 1.0
    assert q["abandoned"] == 0  # explicit errors are final, not abandoned
    d = snap["disk"]
    assert 0 < d["free_bytes"] <= d["total_bytes"] and d["free_inodes"] > 0

    # The command shows the same, from the mount and from the store.
    rc, out = status(str(m.path), "--json")
    assert rc == 0
    assert json.loads(out)["queues"]["q"]["states"]["ready"]["count"] == 4
    rc, out = status(str(m.path))
    assert rc == 0 and "consumer c1: 2 in flight" in out and "disk:" in out
    m.umount()
    rc, out = status(str(m.store), "--json")
    assert rc == 0 and json.loads(out)["queues"]["q"]["states"]["error"]["count"] == 2
    rc, out = status(str(tmp_path))
    assert rc != 0 and "neither a spoolfs mount nor a store" in out


def test_the_oldest_ready_message_ignores_staging_names_and_ages(mount: Mount,
                                                                  tmp_path: Path) -> None:
    def attempt(gap: float) -> bool:
        """An upload under a staging name at least ``gap`` s old, then a fresh message: the
        oldest age must be the fresh one's (False when the machine took ``gap`` s or more to
        publish and read, so the two ages could not be told apart)."""
        q = Queue.create(mount.path, f"q{int(gap * 10)}", tmp_path / "scratch")
        (q.ready / ".not-yet").write_bytes(b"x")
        staged = time.monotonic()
        wait_until(lambda: time.monotonic() > staged + gap, timeout=gap + 1,
                   what="the staging name to age")
        publishing = time.monotonic()
        q.publish("fresh")
        ready = json.loads((mount.path / ".spool/status").read_bytes())["queues"][q.name]
        fresh_for_at_most = time.monotonic() - publishing
        if fresh_for_at_most >= gap:
            return False
        assert ready["states"]["ready"]["count"] == 2
        assert ready["states"]["ready"]["oldest_age_s"] <= fresh_for_at_most + 0.001, \
            "a staging name counted as claimable"
        return True

    stretched(1.5, attempt, what="a fresh message's age told apart from a staging name's")


@pytest.mark.parametrize("setting, problem", [
    ("max_age.partial=1s", "oldest in partial/"),
    ("max_age.ready=1s", "oldest in ready/"),
    ("max_age.working=1s", "oldest in working/"),
    ("max_error=1", "message(s) in error/"),
    ("max_working_per_consumer=1", "consumer c1 holds 2"),
    ("min_free=99%", "below min_free"),
])
def test_check_exit_codes(module_mount: Mount, tmp_path: Path, setting: str,
                          problem: str) -> None:
    name = "c" + str(abs(hash(setting)) % 10**6)
    q = Queue.create(module_mount.path, name, tmp_path / "scratch")
    qset(q.path, "max_attempts=1")
    (q.partial / "up").write_bytes(b"u")
    for n in ("r1", "w1", "w2", "e1", "e2"):
        q.publish(n)
    for n in ("w1", "w2", "e1", "e2"):
        q.claim(n, "c1")
    q.finish("e1", "c1", to="error")
    q.finish("e2", "c1", to="error")
    time.sleep(1.2)
    rc, out = status(str(module_mount.path), "--check")
    assert rc == 0 or name not in out, out  # nothing set on this queue yet
    qset(q.path, setting)
    rc, out = status(str(module_mount.path), "--check")
    level = "CRITICAL" if setting.startswith("min_free") else "WARNING"  # Nagios's codes
    assert rc == (2 if level == "CRITICAL" else 1), out
    lines = out.splitlines()
    assert lines[0].startswith(f"SPOOLFS {level} - "), out  # the summary line first
    assert any(ln.startswith(f"{level}: {name}: ") and problem in ln for ln in lines[1:]), out
    assert "QUEUE" not in out, "--check prints only what is crossed"
    qset(q.path, setting.split("=")[0] + "=" + ("auto" if setting.startswith("min_free") else "none"))


def test_metrics_parse_as_prometheus(mount: Mount, tmp_path: Path) -> None:
    build(mount, tmp_path)
    text = (mount.path / ".spool/metrics").read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("spoolfs_messages", (("queue", "q"), ("state", "ready")))] == 4
    assert samples[("spoolfs_messages", (("queue", "q"), ("state", "error")))] == 2
    assert samples[("spoolfs_consumer_in_flight", (("consumer", "c1"), ("queue", "q")))] == 2
    assert samples[("spoolfs_disk_free_bytes", ())] > 0
    assert ("spoolfs_oldest_age_seconds", (("queue", "q"), ("state", "ready"))) in samples
    fails("sh", "-c", f"echo x > {mount.path}/.spool/status")
    assert sorted(os.listdir(mount.path / ".spool")) == ["metrics", "requests", "status"]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_request_counters_and_latency_histograms_move(mount: Mount, tmp_path: Path) -> None:
    """Per FUSE operation the daemon counts requests and their time (counters, histograms),
    and commits and syncs (histograms): a message going through moves them."""
    q = Queue.create(mount.path, "q", tmp_path / "scratch")
    before = _samples((mount.path / ".spool/metrics").read_text())
    q.publish("m", b"x" * 10)
    q.claim("m", "c1")
    q.finish("m", "c1")
    after = _samples((mount.path / ".spool/metrics").read_text())

    def moved(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted(labels)))
        return after[key] - before.get(key, 0.0)

    assert moved("spoolfs_fuse_requests_total", ("op", "rename")) >= 3
    assert moved("spoolfs_fuse_requests_total", ("op", "create")) >= 1
    assert moved("spoolfs_fuse_request_seconds_count", ("op", "rename")) >= 3
    assert moved("spoolfs_fuse_request_seconds_bucket", ("le", "+Inf"), ("op", "rename")) >= 3
    assert moved("spoolfs_commit_seconds_count") >= 3
    assert moved("spoolfs_sync_seconds_count") >= 1, "publish, claim and finish are durable"
    assert moved("spoolfs_committed_requests_total") >= 3
    doc = json.loads((mount.path / ".spool/requests").read_text())
    assert doc["requests"]["rename"]["count"] >= 3 and doc["requests"]["rename"]["seconds"] > 0


def test_metrics_over_http(mounter: MountFactory, tmp_path: Path) -> None:
    port = free_port()
    m = mounter(tmp_path / "store", tmp_path / "mnt",
                extra=["--metrics-listen", f"127.0.0.1:{port}"])
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    q.publish("a")

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            return r.read().decode()

    text = wait_until(scrape, timeout=10, what="the metrics endpoint to answer")
    fams = {f.name for f in text_string_to_metric_families(text)}
    assert {"spoolfs_messages", "spoolfs_disk_free_bytes"} <= fams
    assert 'spoolfs_messages{queue="q",state="ready"} 1.0' in text
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
        assert json.loads(r.read())["queues"]["q"]["states"]["ready"]["count"] == 1
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=5)
    assert e.value.code == 404
    e.value.close()
