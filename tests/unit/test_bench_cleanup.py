"""The bench removes its temporary directory only when none of its mounts is left in it:
a mount that would not go (the multi-host store's included) keeps the directory, so nothing
is removed through it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from spoolfs.cli import bench as bench_mod


@pytest.mark.parametrize("stuck", bench_mod.MOUNTS)
def test_a_mount_left_behind_keeps_the_directory(tmp_path: Path, stuck: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []

    def fake_bench(args: argparse.Namespace, base: str) -> int:
        os.mkdir(os.path.join(base, stuck))
        Path(base, stuck, "a message").write_bytes(b"kept")
        made.append(base)
        return 1

    monkeypatch.setattr(bench_mod, "bench", fake_bench)
    monkeypatch.setattr(os.path, "ismount", lambda p: os.path.basename(p) == stuck)
    assert bench_mod.run(["--dir", str(tmp_path)]) == 1
    assert Path(made[0], stuck, "a message").read_bytes() == b"kept"


def test_without_mounts_the_directory_goes(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_mod, "bench", lambda args, base: 0)
    assert bench_mod.run(["--dir", str(tmp_path)]) == 0
    assert list(tmp_path.iterdir()) == []
