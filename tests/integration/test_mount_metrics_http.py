"""``--metrics-listen`` as an admin uses it: ``curl`` shows counters (``_total``) and histograms
(``_bucket``) that move as messages go through, and ``/`` is a page a browser shows (Debian's
chromium, headless: its DOM and a phone-sized screenshot)."""

from __future__ import annotations

import os
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.mounts import Mount, MountFactory
from helpers.ports import free_port
from helpers.procs import fails, ok, spoolfs_cli
from helpers.queues import Queue
from helpers.waiting import patience, wait_until

pytestmark = pytest.mark.fuse

CHROMIUM = "/usr/bin/chromium"
#: headless, as root, on a machine whose network is closed: no background connections
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync")


@pytest.fixture
def served(mounter: MountFactory, tmp_path: Path) -> Iterator[tuple[Mount, str]]:
    port = free_port()
    m = mounter(tmp_path / "store", tmp_path / "mnt",
                extra=["--metrics-listen", f"127.0.0.1:{port}"])
    yield m, f"http://127.0.0.1:{port}"


def curl(url: str) -> str:
    res = subprocess.run(["curl", "-sS", "--max-time", "30", url], capture_output=True,
                         text=True, check=False)
    assert res.returncode == 0, res.stderr
    return res.stdout


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_and_histograms_move_as_messages_go_through(
        served: tuple[Mount, str], tmp_path: Path) -> None:
    m, base = served
    q = Queue.create(m.path, "orders", tmp_path / "scratch")
    before = samples(curl(f"{base}/metrics"))
    for name in ("a", "b", "c"):
        q.publish(name)
    q.claim("a", "c1")
    q.claim("b", "c1")
    ok("mv", str(q.working / "c1" / "a"), str(q.path / "success") + "/")
    ok("mv", str(q.working / "c1" / "b"), str(q.path / "error") + "/")
    fails("mv", str(q.ready / "c"), str(q.path / "success") + "/")  # EPERM: no transition
    text = curl(f"{base}/metrics")
    assert "_total{" in text and "_bucket{" in text
    after = samples(text)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("spoolfs_transitions_total", action="publish", queue="orders") == 3
    assert moved("spoolfs_transitions_total", action="claim", queue="orders") == 2
    assert moved("spoolfs_transitions_total", action="finish", queue="orders") == 2
    assert moved("spoolfs_fuse_errors_total", op="rename", errno="EPERM") == 1
    assert moved("spoolfs_fuse_request_seconds_bucket", op="rename", le="+Inf") >= 8
    assert moved("spoolfs_commit_seconds_bucket", le="+Inf") >= 7
    assert value(after, "spoolfs_messages", queue="orders", state="ready") == 1


def test_lease_expiries_retries_and_abandons_are_counted(served: tuple[Mount, str],
                                                         tmp_path: Path) -> None:
    m, base = served
    q = Queue.create(m.path, "jobs", tmp_path / "scratch")
    res = spoolfs_cli("queue", "set", str(q.path), "lease_timeout=1s", "max_attempts=2")
    assert res.returncode == 0, res.stderr
    q.publish("j")
    q.claim("j", "c1")  # attempt 1: its lease runs out, and it is retried
    wait_until(lambda: (q.ready / "j").exists(), timeout=patience(20),
               what="the expired claim to be retried")
    q.claim("j", "c1")  # attempt 2 of 2: abandoned when this lease runs out
    wait_until(lambda: (q.path / "error" / "j").exists(), timeout=patience(20),
               what="the message to be abandoned")
    found = samples(curl(f"{base}/metrics"))
    assert value(found, "spoolfs_lease_expiries_total", queue="jobs") == 2
    assert value(found, "spoolfs_retries_total", queue="jobs") == 1
    assert value(found, "spoolfs_abandoned_messages_total", queue="jobs") == 1
    assert value(found, "spoolfs_transitions_total", action="expire", queue="jobs") == 2


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"chromium-profile-{time.monotonic_ns()}"
    return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=patience(120), check=False,
                          env={**os.environ, "HOME": str(tmp_path)})


def test_the_status_page_shows_the_queue_in_a_browser(served: tuple[Mount, str],
                                                      tmp_path: Path) -> None:
    m, base = served
    q = Queue.create(m.path, "invoices", tmp_path / "scratch")
    for i in range(3):
        q.publish(f"inv-{i}")
    q.claim("inv-0", "billing-1")
    html = curl(f"{base}/")
    assert "<script" not in html.lower()
    assert "http://" not in html and "https://" not in html  # no external assets
    assert 'http-equiv="refresh"' in html and 'name="viewport"' in html

    res = _chromium(tmp_path, "--dump-dom", f"{base}/")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert "<h2>invoices</h2>" in dom
    assert "<td>ready/</td><td>2</td>" in dom and "<td>working/</td><td>1</td>" in dom
    assert "<td>billing-1</td><td>1</td>" in dom

    shot = tmp_path / "page.png"
    res = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=390,844",
                    "--hide-scrollbars", f"{base}/")
    assert res.returncode == 0, res.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert (width, height) == (390, 844)
    assert len(png) > 5000  # a page was drawn, not an empty canvas
