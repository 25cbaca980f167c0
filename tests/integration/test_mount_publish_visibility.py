"""``ready/`` only ever shows complete files (DESIGN §3: safe direct publish, dot staging).

A watcher lists and stats ``ready/`` as fast as it can while a large file is copied in: whenever
the name is visible, it must already have its full size.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from helpers.inspection import ls, read
from helpers.procs import fails, ok
from helpers.queues import Queue, make_content
from helpers.waiting import patience, wait_until

pytestmark = pytest.mark.fuse

BIG = 50 << 20


class Watcher:
    """A thread that lists and stats one name in a directory until stopped."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self.sizes: list[int] = []
        self.names_seen: set[str] = set()
        self.rounds = 0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=patience(30))

    def _run(self) -> None:
        target = self.directory / self.name
        try:
            while not self._stop.is_set():
                names = os.listdir(self.directory)
                self.names_seen.update(names)
                if self.name in names:
                    self.sizes.append(os.stat(target).st_size)
                try:
                    self.sizes.append(os.stat(target).st_size)
                except FileNotFoundError:
                    pass
                self.rounds += 1
        except BaseException as e:  # reported by the test
            self.failure = e


def test_cp_into_ready_is_never_visible_incomplete(queue: Queue, tmp_path: Path) -> None:
    data = os.urandom(BIG)
    src = tmp_path / "big"
    src.write_bytes(data)
    target = queue.ready / "big"
    stopfile = tmp_path / "stop"
    lslog = tmp_path / "ls.log"
    # A second watcher as a shell user would write it: `ls -ln ready/` in a loop.
    with open(lslog, "wb") as out:
        shell = subprocess.Popen(["bash", "-c", 'while [ ! -e "$1" ]; do ls -ln -- "$2"; done',
                                  "watch", str(stopfile), str(queue.ready)],
                                 stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            with Watcher(queue.ready, "big") as watcher:
                ok("cp", src, queue.ready, timeout=120)
                wait_until(lambda: target.exists(), timeout=2,
                           what="ready/big to appear after cp closed it")
                # keep watching the published file for a few more rounds
                rounds = watcher.rounds
                wait_until(lambda: watcher.rounds > rounds + 3 or watcher.failure, timeout=10,
                           what="the watcher to run")
        finally:
            stopfile.touch()
            shell.wait(timeout=patience(30))

    assert watcher.failure is None, f"watcher failed: {watcher.failure!r}"
    assert watcher.rounds > 10, "the watcher barely ran during the copy"
    assert watcher.names_seen <= {"big"}, f"ready/ showed other names: {watcher.names_seen}"
    partial_sizes = sorted({s for s in watcher.sizes if s != BIG})
    assert not partial_sizes, f"ready/big was visible with incomplete sizes {partial_sizes[:10]}"
    assert watcher.sizes, "the watcher never saw the published file"

    shell_sizes = set()
    for line in lslog.read_text(errors="replace").splitlines():
        fields = line.split()
        if len(fields) >= 9 and fields[-1] == "big":
            shell_sizes.add(int(fields[4]))
        elif fields and fields[0] not in ("total",):
            raise AssertionError(f"unexpected `ls -ln ready/` line: {line!r}")
    assert shell_sizes <= {BIG}, f"`ls -ln` showed ready/big with sizes {sorted(shell_sizes)}"

    assert os.stat(target).st_size == BIG
    ok("cmp", src, target)


def test_rename_while_writer_holds_file_publishes_on_last_close(queue: Queue) -> None:
    """§3: publish while a writer still holds the file: it appears when the writer closes."""
    first, second = make_content("held", 100_000), os.urandom(100_000)
    fd = os.open(queue.partial / "held", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, first)
        ok("mv", queue.partial / "held", queue.ready / "held")
        assert "held" not in ls(queue.partial)
        assert "held" not in ls(queue.ready), "published while its writer still held it open"
        fails("stat", queue.ready / "held", message="No such file or directory")
        os.write(fd, second)
    finally:
        os.close(fd)
    wait_until(lambda: "held" in ls(queue.ready), timeout=2,
               what="ready/held to appear once its writer closed it")
    assert read(queue.ready / "held") == first + second


def test_a_name_looked_up_while_hidden_is_found_as_soon_as_it_appears(queue: Queue) -> None:
    """A lookup of a hidden upload answers ENOENT, and the kernel keeps that answer a while
    (negative entries are cached): the publish at its writer's close, which ``close`` waits
    for, must take it back, or a consumer's ``stat`` and ``mv`` right after fail."""
    data = make_content("hidden", 10_000)
    for name in ("claimed", "stated"):
        fd = os.open(queue.partial / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            ok("mv", queue.partial / name, queue.ready / name)
            fails("stat", queue.ready / name, message="No such file or directory")
        finally:
            os.close(fd)
    view = queue.consumer("w1")
    ok("mv", queue.ready / "claimed", view)
    assert os.stat(queue.ready / "stated").st_size == len(data)
    assert read(view / "claimed") == data


def test_file_being_written_into_ready_cannot_be_claimed(queue: Queue) -> None:
    queue.consumer("w1")
    data = make_content("slow", 50_000)
    fd = os.open(queue.ready / "slow", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data[:1000])
        fails("mv", queue.ready / "slow", queue.working / "w1/",
              message="No such file or directory")
        assert ls(queue.working / "w1") == []
        os.write(fd, data[1000:])
    finally:
        os.close(fd)
    wait_until(lambda: "slow" in ls(queue.ready), timeout=2, what="ready/slow to appear")
    queue.claim("slow")
    assert read(queue.working / "w1/slow") == data


def test_dot_name_in_ready_is_staging_and_rename_publishes(queue: Queue, tmp_path: Path) -> None:
    view = queue.consumer("w1")
    data = make_content("x", 200_000)
    src = tmp_path / "x"
    src.write_bytes(data)

    ok("cp", src, queue.ready / ".x")
    assert os.stat(queue.ready / ".x").st_size == len(data)
    assert [n for n in ls(queue.ready) if not n.startswith(".")] == []

    err = fails("mv", queue.ready / ".x", view)
    assert "Invalid cross-device link" not in err
    assert ls(view) == [], "a staging name was claimed"
    assert os.stat(queue.ready / ".x").st_size == len(data), "the refused claim changed .x"

    ok("mv", queue.ready / ".x", queue.ready / "x")
    assert "x" in ls(queue.ready)
    assert ".x" not in ls(queue.ready)
    assert read(queue.ready / "x") == data
    queue.claim("x")
    assert read(view / "x") == data


def test_rsync_style_staging_with_chmod_and_touch(queue: Queue, tmp_path: Path) -> None:
    """rsync writes ``.name.XXXXXX``, sets mode and mtime on it, then renames it into place."""
    data = make_content("report.pdf", 10_000)
    src = tmp_path / "report.pdf"
    src.write_bytes(data)
    staging = queue.ready / ".report.pdf.Ab12Cd"
    ok("cp", src, staging)
    ok("chmod", "0640", staging)
    ok("touch", "-m", "-d", "@1000000000", staging)
    ok("mv", staging, queue.ready / "report.pdf")
    assert [n for n in ls(queue.ready) if not n.startswith(".")] == ["report.pdf"]
    assert read(queue.ready / "report.pdf") == data
