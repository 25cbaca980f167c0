"""The bench's claims race on plain directories: every file claimed once, every lost race
counted, and a consumer that fails (not a lost race) fails the workload with its error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spoolfs.cli.bench import BenchError, Side, claims


def test_every_file_is_claimed_once_and_every_other_try_is_a_lost_race(tmp_path: Path) -> None:
    side = Side("plain", str(tmp_path), fsync=False)
    q = side.queue("q", consumers=3)
    result = claims(q, 60, 3)
    assert result.rate > 0
    assert result.extra["problems"] == []
    assert sum(result.extra["wins"]) == 60
    assert result.extra["lost_races"] == 60 * 2
    assert os.listdir(q.state("ready")) == []


def test_a_consumer_that_fails_fails_the_race(tmp_path: Path) -> None:
    side = Side("plain", str(tmp_path), fsync=False)
    q = side.queue("q", consumers=2)
    os.rmdir(q.consumer(2))
    Path(q.consumer(2)).write_bytes(b"not a directory")  # its renames: ENOTDIR
    with pytest.raises(BenchError, match="a consumer failed: NotADirectoryError"):
        claims(q, 10, 2)
