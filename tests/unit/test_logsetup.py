"""Where a daemonized spoolfs logs: syslog, with the tag ``spoolfs[PID]:`` and the daemon
facility, so that ``journalctl -t spoolfs`` and syslog filters find its lines."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from spoolfs.cli import logsetup


@pytest.fixture
def restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in root.handlers:
            if h not in handlers:
                h.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def test_a_daemon_logs_to_syslog_as_spoolfs_with_its_pid(
        restored_logging: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "log")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(5)
    monkeypatch.setattr(logsetup, "SYSLOG", path)
    try:
        logsetup.setup("info", None, foreground=False)
        logging.getLogger("spoolfs.fuse.ops").info("refused rename(q/ready/a): ENOENT")
        logging.getLogger("spoolfs").debug("not at info")
        line = server.recv(4096).decode()
    finally:
        server.close()
    # <30>: facility daemon (3) * 8 + priority info (6); no second "spoolfs:" prefix
    assert line == f"<30>spoolfs[{os.getpid()}]: INFO refused rename(q/ready/a): ENOENT\x00"


def test_without_syslog_a_daemon_logs_nowhere_rather_than_failing(
        restored_logging: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logsetup, "SYSLOG", str(tmp_path / "absent"))
    logsetup.setup("info", None, foreground=False)
    assert [type(h) for h in logging.getLogger().handlers] == [logging.NullHandler]
