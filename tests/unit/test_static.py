"""The static checks, run with the suite so that CI (.ci/run) fails on either: ruff on the
sources and the tests (rules in pyproject.toml), mypy --strict on the sources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _check(*argv: str) -> None:
    res = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(argv)} failed:\n{res.stdout}{res.stderr}"


def test_ruff_is_clean() -> None:
    _check("ruff", "check", "--no-cache", "src", "tests")


def test_mypy_strict_is_clean() -> None:
    _check("mypy", "--strict", "src")
