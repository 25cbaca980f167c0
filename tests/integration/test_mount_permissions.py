"""Who may enter the mount: with ``-o allow_other`` the kernel checks the modes the spool keeps
(default_permissions); without it FUSE lets only the mounting user in at all."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.inspection import ls, read
from helpers.mounts import MountFactory
from helpers.procs import fails, ok

pytestmark = pytest.mark.fuse

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_allow_other_enforces_the_modes(mounter: MountFactory, open_dir: Path,
                                        tmp_path: Path) -> None:
    m = mounter(tmp_path / "store", open_dir / "mnt", extra=["-o", "allow_other"])
    q = m.path / "q"
    os.mkdir(q)
    src = open_dir / "job"
    src.write_bytes(b"payload\n")
    src.chmod(0o644)

    assert ls(q / "ready") == []
    ok(*NOBODY, "ls", q / "ready")
    fails(*NOBODY, "cp", src, q / "ready/job", message="Permission denied")
    assert ls(q / "ready") == [], "a refused upload left something behind"

    ok("chmod", "0777", q / "ready")
    ok(*NOBODY, "cp", src, q / "ready/job")
    assert read(q / "ready/job") == b"payload\n"
    assert os.stat(q / "ready/job").st_uid == 65534


def test_without_allow_other_only_the_mounting_user_enters(mounter: MountFactory,
                                                           open_dir: Path,
                                                           tmp_path: Path) -> None:
    m = mounter(tmp_path / "store", open_dir / "mnt")
    os.mkdir(m.path / "q")
    ok("chmod", "0777", m.path / "q/ready")
    fails(*NOBODY, "ls", m.path / "q", message="Permission denied")
    ok("cp", "/etc/hostname", m.path / "q/ready/job")
    assert ls(m.path / "q/ready") == ["job"]


def test_a_write_by_an_unprivileged_user_clears_setuid_and_setgid(mounter: MountFactory,
                                                                  open_dir: Path,
                                                                  tmp_path: Path) -> None:
    """As on any file system: writing to a set-user-ID (or group-executable set-group-ID) file
    drops those bits unless the writer may keep them (CAP_FSETID), so that nobody can plant
    code into a program that runs with its owner's rights."""
    m = mounter(tmp_path / "store", open_dir / "mnt", extra=["-o", "allow_other"])
    q = m.path / "q"
    os.mkdir(q)
    ok("chmod", "0777", q / "partial")
    tool, kept = q / "partial/tool", q / "partial/kept"
    for f in (tool, kept):
        f.write_bytes(b"#!/bin/sh\n")
        os.chmod(f, 0o6777)
    ok(*NOBODY, "sh", "-c", f"echo 'echo planted' >> {tool}")
    assert stat.S_IMODE(os.stat(tool).st_mode) == 0o777
    assert read(tool) == b"#!/bin/sh\necho planted\n"
    with open(kept, "ab") as f:  # root keeps them
        f.write(b"true\n")
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o6777


def test_set_id_bits_go_at_any_write_or_truncation_that_may_not_keep_them(
        mounter: MountFactory, open_dir: Path, tmp_path: Path) -> None:
    """The kernel decides at each write, not at open: bits set while an unprivileged writer
    holds the file open go at its next write. Root of a user namespace of its own (``unshare
    -r``) holds CAP_FSETID only there, not over the mount, so it may not keep them; an open
    that truncates (``: > tool``) clears them as a write does."""
    m = mounter(tmp_path / "store", open_dir / "mnt", extra=["-o", "allow_other"])
    q = m.path / "q"
    os.mkdir(q)
    ok("chmod", "0777", q / "partial")
    held, nsroot, trunc = (q / "partial" / n for n in ("held", "nsroot", "trunc"))
    for f in (held, nsroot, trunc):
        f.write_bytes(b"#!/bin/sh\n")
        os.chmod(f, 0o777 if f == held else 0o6777)

    with subprocess.Popen(
            [*NOBODY, sys.executable, "-c",
             "import os, sys\n"
             f"fd = os.open({str(held)!r}, os.O_WRONLY | os.O_APPEND)\n"
             "os.write(fd, b'one\\n'); print('open', flush=True)\n"
             "sys.stdin.readline(); os.write(fd, b'two\\n'); os.close(fd)\n"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as writer:
        assert writer.stdout is not None and writer.stdin is not None
        try:
            assert writer.stdout.readline() == "open\n"
            os.chmod(held, 0o4777)  # while the writer holds it open
            writer.stdin.write("\n")
            writer.stdin.close()
            assert writer.wait(timeout=30) == 0
        finally:
            writer.kill()
    assert stat.S_IMODE(os.stat(held).st_mode) == 0o777
    assert read(held) == b"#!/bin/sh\none\ntwo\n"

    ok("unshare", "-r", "sh", "-c", f"echo 'echo planted' >> {nsroot}")
    assert stat.S_IMODE(os.stat(nsroot).st_mode) == 0o777

    ok(*NOBODY, "sh", "-c", f": > {trunc}")
    assert stat.S_IMODE(os.stat(trunc).st_mode) == 0o777
    assert read(trunc) == b""
