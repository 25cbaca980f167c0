"""Fixtures shared by the real-mount tests of this directory."""

from __future__ import annotations

import fcntl
import subprocess
from collections.abc import Iterator

import pytest

from helpers.procs import ok
from helpers.users import GROUPS, LOCK, USERS, exists


@pytest.fixture(scope="module")
def users() -> Iterator[None]:
    """Create the users and groups (idempotent); remove them at the end, unless another test
    run still uses them (each holds a shared lock while it runs)."""
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for g in GROUPS:
            if not exists("group", g):
                ok("groupadd", "--system", g)
        for name, primary, extra in USERS:
            if not exists("passwd", name):
                ok("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                   "-g", primary, *(["-G", extra] if extra else []), name)
            ok("usermod", "-g", primary, "-G", extra, name)
        fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            yield
        finally:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another test run still uses them: it removes them
            for name, _, _ in USERS:
                subprocess.run(["userdel", name], capture_output=True)
            for g in GROUPS:
                subprocess.run(["groupdel", g], capture_output=True)
