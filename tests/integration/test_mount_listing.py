"""``ls`` while the queue moves: a listing never repeats a name and never skips one that stayed.

pyfuse3's readdir contract (STYLE: offsets are stable cookies, not list positions): entries must
not be skipped or repeated while a directory changes. A big ``ready/`` is listed over and over
(unsorted, in readdir order, many READDIR requests per listing) while a consumer claims half of
it.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest

from helpers.procs import ok
from helpers.queues import Queue
from helpers.waiting import patience

pytestmark = pytest.mark.fuse

KEEP = 400
MOVE = 300


def test_listing_ready_while_claims_run(queue: Queue, tmp_path: Path) -> None:
    keep = [f"keep-{i:04d}" for i in range(KEEP)]
    move = [f"move-{i:04d}" for i in range(MOVE)]
    src = tmp_path / "src"
    src.mkdir()
    for n in keep + move:
        (src / n).write_bytes(n.encode())
    ok("cp", "-t", queue.partial, *(src / n for n in keep + move))
    ok("mv", "-t", queue.ready, *(queue.partial / n for n in keep + move))
    queue.consumer("c0")

    listings = tmp_path / "listings"
    stop = tmp_path / "stop"
    # `ls -f`: no sorting, so a repeated entry shows up as a repeated line
    lister = subprocess.Popen(
        ["bash", "-c", 'n=0; while [ ! -e "$1" ]; do n=$((n+1)); ls -f -- "$2" > "$3.$n"; done',
         "lister", str(stop), str(queue.ready), str(listings)],
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    claimer = subprocess.Popen(
        ["bash", "-c", 'cd "$1" && for f in ready/move-*; do mv -- "$f" working/c0/ || exit 1; done',
         "claimer", str(queue.path)],
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, err = claimer.communicate(timeout=patience(120))
        assert claimer.returncode == 0, err.decode(errors="replace")
    finally:
        stop.touch()
        _, lister_err = lister.communicate(timeout=patience(60))
    assert lister.returncode == 0, lister_err.decode(errors="replace")

    files = sorted(tmp_path.glob("listings.*"))
    assert len(files) >= 3, "the lister barely ran while the claims did"
    for f in files:
        names = [n for n in f.read_text().split("\n") if n and n not in (".", "..")]
        repeated = {n: k for n, k in Counter(names).items() if k > 1}
        assert not repeated, f"{f.name}: readdir repeated entries {list(repeated)[:10]}"
        missing = sorted(set(keep) - set(names))
        assert not missing, f"{f.name}: readdir skipped untouched entries {missing[:10]}"
        assert set(names) <= set(keep) | set(move), f"{f.name}: unknown names listed"

    # the movers all went to the consumer, exactly once
    assert sorted(p.name for p in (queue.working / "c0").iterdir()) == move
    assert sorted(p.name for p in queue.ready.iterdir()) == keep



def test_listings_come_out_oldest_first(queue: Queue) -> None:
    """A directory lists in entry order, read in pages: ``ls -f ready | head`` gives a FIFO
    consumer the oldest messages, however the names sort."""
    names = [f"{(i * 7919) % 1000:03d}-m" for i in range(600)]  # not in name order
    for n in names:
        queue.publish(n, n.encode())
    listed = subprocess.run(["ls", "-f", str(queue.ready)], check=True, capture_output=True,
                            text=True).stdout.split()
    assert [n for n in listed if n not in (".", "..")] == names
    head = subprocess.run(f"ls -f {queue.ready} | grep -v '^\\.' | head -3", shell=True,
                          check=True, capture_output=True, text=True).stdout.split()
    assert head == names[:3]
