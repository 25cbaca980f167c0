"""Exactly-once claim (DESIGN §3): many shell consumers race ``mv ready/f working/cN/``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from helpers.inspection import ls
from helpers.procs import finish_claimers, ok, start_claimers
from helpers.queues import Queue, make_content

pytestmark = pytest.mark.fuse

MESSAGES = 320
CONSUMERS = 8


def publish_many(queue: Queue, names: list[str], srcdir: Path, size: int = 200) -> dict[str, bytes]:
    """Publish with two processes: ``cp -t partial/ ...`` then ``mv -t ready/ ...``."""
    srcdir.mkdir()
    contents = {}
    for name in names:
        contents[name] = make_content(name, size)
        (srcdir / name).write_bytes(contents[name])
    ok("cp", "-t", queue.partial, *(srcdir / n for n in names))
    ok("mv", "-t", queue.ready, *(queue.partial / n for n in names))
    return contents


def test_concurrent_shell_consumers_claim_each_file_once(queue: Queue, tmp_path: Path) -> None:
    names = [f"m{i:04d}" for i in range(MESSAGES)]
    contents = publish_many(queue, names, tmp_path / "src")
    assert ls(queue.ready) == names
    consumers = [f"c{i}" for i in range(CONSUMERS)]
    for c in consumers:
        queue.consumer(c)

    claims = finish_claimers(start_claimers([queue.path], consumers, tmp_path / "logs"))

    won = Counter(n for c in consumers for n in claims[c])
    duplicates = {n: k for n, k in won.items() if k > 1}
    assert not duplicates, f"claimed more than once: {duplicates}"
    assert set(won) == set(names), f"never claimed: {sorted(set(names) - set(won))[:20]}"
    assert ls(queue.ready) == []

    seen: Counter[str] = Counter()
    for c in consumers:
        view = ls(queue.working / c)
        assert view == sorted(claims[c]), f"working/{c} does not hold exactly what {c} claimed"
        seen.update(view)
        for name in view:
            assert (queue.working / c / name).read_bytes() == contents[name]
    assert all(k == 1 for k in seen.values())
    assert sorted(seen) == names
