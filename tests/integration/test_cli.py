"""The command line as an admin meets it: every command in ``spoolfs --help``, a version, a
mistyped command named as such, one-line errors with exit status 2, stores made on purpose
(``spoolfs format``), read-only commands that leave a store as it was, and ``status --check``
speaking Nagios."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path

import pytest

from helpers.mounts import Mount, MountFactory, mounted
from helpers.procs import spoolfs_cli
from helpers.queues import Queue
from spoolfs import __version__
from spoolfs.cli import COMMANDS
from spoolfs.cli.exits import Check, Exit


def run(*args: str) -> tuple[int, str, str]:
    res = spoolfs_cli(*args)
    return res.returncode, res.stdout.decode(), res.stderr.decode()


def test_help_lists_every_command_with_a_summary() -> None:
    rc, out, _ = run("--help")
    assert rc == Exit.OK
    section = out.split("\ncommands:\n")[1].split("\n\n")[0]
    listed = [line.split()[0] for line in section.splitlines()]
    assert listed == list(COMMANDS)
    assert "DESIGN" not in out and "``" not in out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_has_plain_help(command: str) -> None:
    rc, out, err = run(command, "--help")
    assert rc == Exit.OK, err
    assert out.startswith("usage: spoolfs"), out
    assert "DESIGN" not in out and "``" not in out and "§" not in out, out


def test_version() -> None:
    rc, out, _ = run("--version")
    assert (rc, out) == (Exit.OK, f"spoolfs {__version__}\n")


def test_a_mistyped_command_is_an_unknown_command(tmp_path: Path) -> None:
    rc, out, err = run("fsk", str(tmp_path))
    assert rc == Exit.USAGE
    assert out == "" and err.count("\n") == 1, err
    assert "unknown command 'fsk'" in err and "fsck" in err, err
    assert os.listdir(tmp_path) == [], "nothing was made"


def test_no_arguments_is_a_usage_error() -> None:
    rc, _, err = run()
    assert rc == Exit.USAGE and "usage: spoolfs" in err


@pytest.mark.parametrize("args", [
    ("status", "--watch", "-1"),
    ("status", "--watch", "soon"),
    ("status", "--check", "--json"),
    ("fsck", "/x", "--grace", "-5"),
    ("umount", "/x", "--timeout", "0"),
    ("bench", "--files", "0"),
    ("queue",),
    ("history",),
])
def test_bad_arguments_are_one_line_and_exit_2(args: tuple[str, ...]) -> None:
    rc, out, err = run(*args)
    assert rc == Exit.USAGE, (rc, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"spoolfs {args[0]}: ") and "--help" in err, err


def test_format_makes_a_store_once(tmp_path: Path) -> None:
    where = tmp_path / "a" / "store"
    rc, out, err = run("format", str(where))
    assert rc == Exit.OK, err
    assert (where / "meta.db").is_file() and "made store" in out
    rc, _, err = run("format", str(where))
    assert rc == Exit.FAILURE and "a store already" in err, err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("mine\n")
    rc, _, err = run("format", str(busy))
    assert rc == Exit.FAILURE and "not empty" in err, err
    assert os.listdir(busy) == ["x"]


def test_format_in_a_directory_made_beforehand_makes_it_private(tmp_path: Path) -> None:
    """``mkdir /srv/spool && spoolfs format /srv/spool``: the store is the owner's alone from
    the start, not only after the first mount has found it open and said so."""
    where = tmp_path / "store"
    where.mkdir(mode=0o755)
    os.chmod(where, 0o755)
    rc, _, err = run("format", str(where))
    assert rc == Exit.OK, err
    assert oct(os.stat(where).st_mode & 0o777) == oct(0o700)
    assert all(os.stat(p).st_mode & 0o077 == 0 for p in where.rglob("*"))


def test_format_in_a_directory_it_may_not_change_says_so(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from spoolfs.cli.format import make_store
    from spoolfs.core.errors import UserError

    where = tmp_path / "theirs"
    where.mkdir()

    def refused(path: str, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chmod", refused)
    with pytest.raises(UserError, match="cannot make it private to its owner: Operation not"):
        make_store(str(where))
    assert os.listdir(where) == []


@pytest.mark.fuse
def test_a_named_store_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    typo = tmp_path / "stroe"
    rc, _, err = run(str(typo), str(mnt))
    assert rc == Exit.FAILURE
    assert err.count("\n") == 1 and f"spoolfs format {typo}" in err, err
    assert not typo.exists() and not mounted(mnt)


def _digest(store: Path) -> dict[str, str]:
    """The store's files and their content (SQLite may make an empty log and its index to
    read a database in WAL mode: an empty log writes nothing)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.iterdir())
            if p.is_file() and not p.name.endswith("-shm")
            and not (p.name.endswith("-wal") and p.stat().st_size == 0)}


@pytest.mark.fuse
def test_read_only_commands_leave_the_store_as_it_was(mounter: MountFactory,
                                                      tmp_path: Path) -> None:
    m = mounter(tmp_path / "store", tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    q.publish("a")
    # beside the running daemon: status reads the store itself
    rc, out, err = run("status", str(m.store))
    assert rc == Exit.OK and "q" in out and "ready" in out, err
    m.umount()
    before = _digest(m.store)
    os.chmod(m.store / "meta.db", 0o400)  # read-only: any write would fail
    for args in (("status", str(m.store)), ("status", "--json", str(m.store)),
                 ("fsck", str(m.store))):
        rc, out, err = run(*args)
        assert rc == Exit.OK, (args, out, err)
    assert _digest(m.store) == before


def test_a_store_of_a_newer_schema_is_one_line(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert run("format", str(store))[0] == Exit.OK
    with sqlite3.connect(store / "meta.db") as db:
        db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    for args in (("status", str(store)), ("fsck", str(store))):
        rc, out, err = run(*args)
        assert rc == Exit.FAILURE, (args, out, err)
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert "schema version 99" in err and "upgrade spoolfs" in err, err
    rc, out, _ = run("status", "--check", str(store))
    assert rc == Check.UNKNOWN and out.startswith("SPOOLFS UNKNOWN - ") and out.count("\n") == 1


@pytest.mark.fuse
def test_check_prints_one_line_when_all_is_well(mount: Mount, queue: Queue) -> None:
    queue.publish("a")
    rc, out, err = run("status", "--check", str(mount.path))
    assert rc == Check.OK, out + err
    assert out.startswith("SPOOLFS OK - ") and out.count("\n") == 1, out


def test_check_of_nothing_is_unknown(tmp_path: Path) -> None:
    rc, out, _ = run("status", "--check", str(tmp_path / "nowhere"))
    assert rc == Check.UNKNOWN
    assert out.startswith("SPOOLFS UNKNOWN - ") and out.count("\n") == 1, out
