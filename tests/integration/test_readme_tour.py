"""The README's 60-second tour is a real run: its commands are run here, in order, in one
shell, on a real mount, and what they print must be what the README shows (times and pids
aside). ``SPOOLFS_WRITE_TOUR=1`` writes this run's output into the README instead."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.mounts import MountFactory
from helpers.waiting import patience

pytestmark = pytest.mark.fuse

README = Path(__file__).resolve().parents[2] / "README.md"
HEADING = "## A 60-second tour"
MOUNT = "/mnt/spool"
MARK = "@@tour-step@@"


def tour_block(text: str) -> tuple[int, int]:
    """Where the tour's console block starts and ends (its lines, fences excluded)."""
    start = text.index("```console\n", text.index(HEADING)) + len("```console\n")
    return start, text.index("```\n", start)


def steps(block: str) -> list[tuple[str, list[str]]]:
    """(command line as shown, the lines it prints) for each ``$`` line."""
    out: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            out.append((line, []))
        else:
            out[-1][1].append(line)
    return out


def normal(lines: list[str]) -> list[str]:
    """Times and pids vary from run to run; nothing else may."""
    def one(line: str) -> str:
        line = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", "<time>", line)
        return re.sub(r"pid=\d+", "pid=<pid>", line)
    return [one(ln) for ln in lines]


def run_tour(shown: list[str], mnt: Path, scratch: Path) -> list[list[str]]:
    script = ["exec 2>&1", "shopt -s expand_aliases", "alias ls='ls -C -T 0 -w 100'"]  # as on a tty
    for line in shown:
        # /tmp/ of the tour is this run's own scratch directory
        script += [f"echo {MARK}", line[2:].replace("/tmp/", f"{scratch}/").replace(MOUNT,
                                                                                     str(mnt))]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               TMPDIR=str(scratch), LC_ALL="C.UTF-8")
    res = subprocess.run(["bash", "-c", "\n".join(script)], capture_output=True, text=True,
                         env=env, cwd=str(scratch), timeout=patience(60))
    printed = res.stdout.split(f"{MARK}\n")[1:]
    assert len(printed) == len(shown), res.stdout
    return [p.splitlines() for p in printed]


def test_the_readme_tour_is_what_a_real_run_prints(mounter: MountFactory, tmp_path: Path) -> None:
    text = README.read_text()
    start, end = tour_block(text)
    tour = steps(text[start:end])
    m = mounter(tmp_path / "store", tmp_path / "mnt")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    got = run_tour([cmd for cmd, _ in tour], m.path, scratch)
    got = [[ln.replace(str(m.path), MOUNT) for ln in lines] for lines in got]
    if os.environ.get("SPOOLFS_WRITE_TOUR") == "1":
        block = "".join(cmd + "\n" + "".join(ln + "\n" for ln in lines)
                        for (cmd, _), lines in zip(tour, got, strict=True))
        README.write_text(text[:start] + block + text[end:])
        return
    for (cmd, shown), real in zip(tour, got, strict=True):
        assert normal(real) == normal(shown), (
            f"the README's tour is stale at `{cmd}`: a real run prints\n" + "\n".join(real)
            + "\n(SPOOLFS_WRITE_TOUR=1 writes a real run into the README)")
