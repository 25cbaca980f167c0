"""The store, the log and the pid file are private to the user running spoolfs (directories
0700, files 0600): another local user reads no message, no history, no log. A store made open
by an older version is fixed at mount, with one log line. Nothing goes to a fixed path in /tmp.
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import MountFactory, Queue, fails, make_content, ok

pytestmark = pytest.mark.fuse

USER = "spoolpriv"
AS_USER = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups"]


@pytest.fixture(scope="module")
def other_user() -> Iterator[str]:
    """An unprivileged local user, made for these tests and removed after them."""
    if subprocess.run(["getent", "passwd", USER], capture_output=True).returncode != 0:
        ok("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "-U", USER)
    try:
        yield USER
    finally:
        subprocess.run(["userdel", USER], capture_output=True)
        subprocess.run(["groupdel", USER], capture_output=True)


def too_open(root: Path) -> list[str]:
    """Paths under ``root`` (itself included) that give group or others any access."""
    found = []
    for p in [root, *root.rglob("*")]:
        st = p.lstat()
        if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
            found.append(f"{p} {stat.S_IMODE(st.st_mode):04o}")
    return found


def fill(q: Queue) -> None:
    """A small message (inline in meta.db), a big one (a blob file) and an upload (staging)."""
    q.publish("small", b"small secret\n")
    q.publish("big", make_content("big", 300_000))
    q.put("upload", make_content("upload", 200_000))


def test_a_new_store_and_log_are_private(mounter: MountFactory, open_dir: Path,
                                         other_user: str) -> None:
    m = mounter(open_dir / "store", open_dir / "mnt")
    fill(Queue.create(m.path, "q", open_dir / "scratch"))
    assert (m.store / "meta.db").exists() and list((m.store / "blobs").rglob("*.*"))
    assert too_open(m.store) == []
    assert stat.S_IMODE(m.log.stat().st_mode) == 0o600
    key = str(m.path.resolve()).strip("/").replace("%", "%25").replace("/", "%2F")
    pid = Path("/run/spoolfs") / f"{key}.pid"
    assert [stat.S_IMODE(p.stat().st_mode) for p in (pid, pid.parent)] == [0o600, 0o700]
    for f in (m.store / "meta.db", *(m.store / "blobs").rglob("*.*")):
        fails(*AS_USER, "cat", f, message="Permission denied")
    assert not Path(f"/tmp/spoolfs-{os.getuid()}").exists()


def test_an_open_store_is_tightened_at_mount(mounter: MountFactory, open_dir: Path,
                                             other_user: str) -> None:
    log = open_dir / "spoolfs.log"
    m = mounter(open_dir / "store", open_dir / "mnt", extra=["--log-file", str(log)])
    m.log = log
    fill(Queue.create(m.path, "q", open_dir / "scratch"))
    m.umount()
    ok("chmod", "-R", "go+rX", m.store)  # as an older version left it: 0755 and 0644
    log.chmod(0o644)
    assert too_open(m.store)
    m.start()
    assert too_open(m.store) == []
    assert stat.S_IMODE(log.stat().st_mode) & 0o007 == 0, "the log stays readable by all"
    lines = [line for line in m.log_text().splitlines() if "was open to other users" in line]
    assert len([line for line in lines if str(m.store) in line]) == 1, lines
    for f in (m.store / "meta.db", *(m.store / "blobs").rglob("*.*"), log):
        fails(*AS_USER, "cat", f, message="Permission denied")
    m.umount()
    m.start()  # a private store is left as it is, and says nothing
    assert len([line for line in m.log_text().splitlines()
                if "was open to other users" in line]) == len(lines)


def _python_for(user: str) -> list[str]:
    """An interpreter ``user`` may run, with this test run's packages on its path (the test
    run's own may sit under /root, which other users cannot enter)."""
    for exe in (sys.executable, "/usr/bin/python3"):
        if subprocess.run([*AS_USER, exe, "-c", ""], capture_output=True).returncode == 0:
            return [exe]
    raise AssertionError(f"no Python interpreter that {user} may run")


def test_a_user_without_xdg_runtime_dir_keeps_pid_files_in_the_store(open_dir: Path,
                                                                     other_user: str) -> None:
    """The pid file place of a user without $XDG_RUNTIME_DIR (a FUSE mount by that user
    needs /dev/fuse open to all, so the place is checked in that user's own process): inside
    the store, private, found again from the mount point alone; never /tmp/spoolfs-UID."""
    home = open_dir / "user"
    home.mkdir()
    os.chown(home, pwd_uid(other_user), -1)
    store, mnt = home / "store", home / "mnt"
    script = (
        "import os, sys\n"
        "from spoolfs import runtime\n"
        "pf = runtime.pidfile(sys.argv[1], sys.argv[2])\n"
        "open(pf, 'w').write('4242\\n')\n"
        "print(pf)\n")
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    os.makedirs(store, exist_ok=True)
    os.chown(store, pwd_uid(other_user), -1)
    res = subprocess.run([*AS_USER, *_python_for(other_user), "-c", script, str(mnt),
                          str(store)], env=env, capture_output=True, text=True, cwd="/")
    assert res.returncode == 0, res.stderr
    pf = Path(res.stdout.strip())
    assert pf.parent == store / "run", pf
    assert stat.S_IMODE(pf.parent.stat().st_mode) == 0o700 and pf.parent.stat().st_uid == \
        pwd_uid(other_user)
    assert not Path(f"/tmp/spoolfs-{pwd_uid(other_user)}").exists()


def pwd_uid(user: str) -> int:
    return pwd.getpwnam(user).pw_uid
