"""Fuzz: every operation on every kind of path of a real mount gets an answer, never EIO.

EIO means "the store failed"; anything the daemon refuses must carry its own errno (DESIGN §3)
and a log line, never an internal error. One mount serves the whole fuzz; before each example
the tree is brought back to one entry of every kind (root, queues, state dirs, consumer views,
messages in every state, batches and their members, ``.spool/`` files), then a short sequence
of system calls runs on paths drawn from it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.mounts import Mount

pytestmark = pytest.mark.fuse

#: paths relative to the mount: one of every kind, plus names that do not exist yet
PATHS = (
    "", ".spool", ".spool/status", ".spool/metrics", "q", "q2",
    "q/partial", "q/ready", "q/working", "q/success", "q/error", "q/working/c",
    "q/partial/p", "q/partial/b", "q/partial/b/f", "q/partial/b/d", "q/partial/b/d/g",
    "q/ready/r", "q/ready/.st", "q/ready/rb", "q/ready/rb/f", "q/working/c/w", "q/working/cb",
    "q/working/cb/f", "q/success/s", "q/error/e", "q2/ready",
    "new", "q/new", "q/partial/new", "q/ready/new", "q/working/new", "q/working/c/new",
    "q/success/new", "q/partial/b/new", "q/partial/b/d/new", "q/ready/rb/new", "q2/partial/new",
    "q3", "q3/working/c", "q3/working/c/new",
)  # fmt: skip
XATTRS = (b"user.foo", b"user.spool.error", b"user.spool.state",
          b"user.spool.policy.max_attempts", b"user.spool.policy.nonsense", b"trusted.foo",
          b"security.foo", b"system.posix_acl_access")
VALUES = (b"", b"1", b"x" * 300)
OPEN_FLAGS = (os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC,
              os.O_WRONLY | os.O_CREAT, os.O_RDWR | os.O_CREAT | os.O_EXCL,
              os.O_WRONLY | os.O_CREAT | os.O_TRUNC, os.O_RDONLY | os.O_DIRECTORY,
              os.O_WRONLY | os.O_APPEND)
SIZES = (0, 7, 1 << 20, 999999999999999)  # a sparse terabyte would take hours to publish
TIMES = (None, (0, 0), (1_900_000_000, 1_900_000_000))


def _open_close(path: str, flags: int) -> None:
    fd = os.open(path, flags, 0o644)
    try:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            os.write(fd, b"fuzz\n")
        else:
            os.read(fd, 10) if not flags & os.O_DIRECTORY else None
    finally:
        os.close(fd)


path = st.sampled_from(PATHS)
ops = st.one_of(
    st.tuples(st.just("setxattr"), path, st.sampled_from(XATTRS), st.sampled_from(VALUES)),
    st.tuples(st.just("getxattr"), path, st.sampled_from(XATTRS)),
    st.tuples(st.just("removexattr"), path, st.sampled_from(XATTRS)),
    st.tuples(st.just("listxattr"), path),
    st.tuples(st.just("rmdir"), path),
    st.tuples(st.just("mkdir"), path),
    st.tuples(st.just("rename"), path, path),
    st.tuples(st.just("unlink"), path),
    st.tuples(st.just("link"), path, path),
    st.tuples(st.just("open"), path, st.sampled_from(OPEN_FLAGS)),
    st.tuples(st.just("truncate"), path, st.sampled_from(SIZES)),
    st.tuples(st.just("pwrite"), path, st.sampled_from(SIZES)),
    st.tuples(st.just("chmod"), path, st.sampled_from((0o755, 0o600, 0o4777))),
    st.tuples(st.just("utime"), path, st.sampled_from(TIMES)),
    st.tuples(st.just("stat"), path),
)


def _pwrite(path: str, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"at an offset\n", offset)
    finally:
        os.close(fd)


#: what each drawn operation calls, with its paths made absolute
CALLS: dict[str, Callable[..., Any]] = {
    "setxattr": os.setxattr, "getxattr": os.getxattr, "removexattr": os.removexattr,
    "listxattr": os.listxattr, "rmdir": os.rmdir, "mkdir": os.mkdir, "rename": os.rename,
    "unlink": os.unlink, "link": os.link, "open": _open_close, "truncate": os.truncate,
    "pwrite": _pwrite, "chmod": os.chmod, "utime": os.utime, "stat": os.lstat,
}


def run_op(root: Path, op: tuple[Any, ...]) -> None:
    name, *args = op
    CALLS[name](*(str(root / a) if isinstance(a, str) else a for a in args))


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def rebuild(root: Path) -> None:
    """Bring back whatever an earlier example removed or moved away (os calls only: cheap)."""
    q = root / "q"
    steps: list[tuple[Path, Callable[[], None]]] = [
        (q, lambda: os.mkdir(q)),
        (root / "q2", lambda: os.mkdir(root / "q2")),
        (q / "working/c", lambda: os.mkdir(q / "working/c")),
        (root / "q3", lambda: os.mkdir(root / "q3")),  # a queue with nothing but a view
        (root / "q3/working/c", lambda: os.mkdir(root / "q3/working/c")),
        (q / "partial/p", lambda: _write(q / "partial/p", b"p\n")),
        (q / "partial/b", lambda: os.mkdir(q / "partial/b")),
        (q / "partial/b/f", lambda: _write(q / "partial/b/f", b"f\n")),
        (q / "partial/b/d", lambda: os.mkdir(q / "partial/b/d")),
        (q / "partial/b/d/g", lambda: _write(q / "partial/b/d/g", b"g\n")),
        (q / "ready/r", lambda: _write(q / "ready/r", b"r\n")),
        (q / "ready/.st", lambda: _write(q / "ready/.st", b"st\n")),
        (q / "ready/rb", lambda: _batch(q, "rb")),
        (q / "working/c/w", lambda: _claimed(q, "w", q / "working/c/w")),
        (q / "working/cb", lambda: _claimed(q, "cb", q / "working/cb", batch=True)),
        (q / "success/s", lambda: _finished(q, "s", "success")),
        (q / "error/e", lambda: _finished(q, "e", "error")),
    ]
    for path, make in steps:
        if not os.path.lexists(path):
            try:
                make()
            except OSError as e:  # the name's parent was turned into something else
                assert e.errno != errno.EIO, f"rebuilding {path}: {e}"


def _batch(q: Path, name: str) -> None:
    tmp = q / "partial" / f"{name}.tmp"
    os.mkdir(tmp)
    _write(tmp / "f", b"member\n")
    os.rename(tmp, q / "ready" / name)


def _claimed(q: Path, name: str, to: Path, batch: bool = False) -> None:
    if batch:
        _batch(q, f"{name}.src")
    else:
        _write(q / "ready" / f"{name}.src", b"claimed\n")
    os.rename(q / "ready" / f"{name}.src", to)


def _finished(q: Path, name: str, state: str) -> None:
    _claimed(q, f"{name}.c", q / "working/c" / f"{name}.c")
    os.rename(q / "working/c" / f"{name}.c", q / state / name)


@pytest.fixture(scope="module")
def fuzz_mount(module_mount: Mount) -> Mount:
    rebuild(module_mount.path)
    return module_mount


@settings(max_examples=1000, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=8))
def test_no_operation_gives_eio(fuzz_mount: Mount, sequence: list[tuple[Any, ...]]) -> None:
    root = fuzz_mount.path
    rebuild(root)
    since = fuzz_mount.log_size()
    for op in sequence:
        try:
            run_op(root, op)
        except OSError as e:
            assert e.errno != errno.EIO, f"{op}: EIO ({e}) after {sequence}"
    log = fuzz_mount.log_text(since=since)
    assert "Traceback" not in log and "internal error" not in log, \
        f"{sequence} made the daemon log an internal error:\n{log}"


def test_every_history_row_of_the_fuzz_is_a_row_of_the_table(fuzz_mount: Mount) -> None:
    """Whatever path moved a message during the fuzz (runs after it, on its store), its history
    action and target are a row of the transition table: no mover spells its own."""
    import sqlite3

    from spoolfs.core import transitions
    from spoolfs.core.rules import Action, State

    conn = sqlite3.connect(f"file:{fuzz_mount.store / 'meta.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT DISTINCT action, dst FROM history").fetchall()
    finally:
        conn.close()
    assert len({a for a, _ in rows}) >= 5, f"the fuzz moved too little to tell: {rows}"
    for action, dst in rows:
        to = State(dst.split("/")[0]) if dst is not None else None
        transitions.transition(Action(action), to)  # KeyError: no such row
