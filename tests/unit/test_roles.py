"""Roles (service/roles.py): the POSIX permission rules the daemon applies with -o strict_roles,
root included, and the setgid inheritance of new entries."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from dataclasses import dataclass

import pytest

from spoolfs.core.errors import AccessDenied, NotPermitted
from spoolfs.daemon import fuse_options
from spoolfs.service.roles import (
    CAP_FSETID,
    READ,
    SEARCH,
    STRICT_ROLES,
    WRITE,
    Caller,
    Gate,
    allowed,
    inherit,
    keeps_setid,
    may_change,
    may_remove,
    proc_groups,
    setid_bits,
)

PROD, CONS, ROOT = 1001, 1002, 0
PRODUCERS, CONSUMERS = 2001, 2002


@dataclass
class Dir:  # the fields of an Entry that roles reads
    mode: int
    uid: int
    gid: int
    name: bytes = b"ready"
    id: int = 10


def d(perm: int, uid: int = ROOT, gid: int = ROOT) -> Dir:
    return Dir(stat.S_IFDIR | perm, uid, gid)


def test_one_class_applies_owner_then_group_then_others() -> None:
    producer = Caller(PROD, PRODUCERS)
    assert allowed(0o750, PROD, PRODUCERS, producer, READ | WRITE | SEARCH)
    assert allowed(0o070, ROOT, PRODUCERS, Caller(CONS, PRODUCERS), WRITE | SEARCH)
    # the owner gets the owner's bits only, even when the group's would allow more
    assert not allowed(0o570, PROD, PRODUCERS, producer, WRITE)
    # a member of the group gets the group's bits, even when the others' would allow more
    assert not allowed(0o707, ROOT, PRODUCERS, Caller(PROD, PRODUCERS), WRITE)
    assert allowed(0o707, ROOT, PRODUCERS, Caller(CONS, CONSUMERS), WRITE | SEARCH)
    assert not allowed(0o705, ROOT, PRODUCERS, Caller(CONS, CONSUMERS), WRITE)
    # write without search is not enough to change a directory
    assert not may_change(d(0o720, gid=PRODUCERS), producer)  # type: ignore[arg-type]


def test_supplementary_groups_count_and_root_has_no_override() -> None:
    ready = d(0o770, PROD, CONSUMERS)
    assert not may_change(ready, Caller(CONS, CONS))  # type: ignore[arg-type]
    assert may_change(ready, Caller(CONS, CONS, frozenset({CONSUMERS})))  # type: ignore[arg-type]
    assert not may_change(ready, Caller(ROOT, ROOT))  # type: ignore[arg-type]
    assert may_change(ready, Caller(ROOT, ROOT, frozenset({CONSUMERS})))  # type: ignore[arg-type]
    assert may_change(d(0o755), Caller(ROOT, ROOT))  # type: ignore[arg-type]


def test_sticky_directories_let_only_the_owners_remove() -> None:
    shared = d(0o1777)
    cons = Caller(CONS, CONSUMERS)
    assert may_remove(shared, CONS, cons)  # type: ignore[arg-type]
    assert not may_remove(shared, PROD, cons)  # type: ignore[arg-type]
    assert may_remove(d(0o1777, uid=CONS), PROD, cons)  # type: ignore[arg-type]
    assert may_remove(d(0o0777), PROD, cons)  # type: ignore[arg-type]
    assert not may_remove(d(0o1755), CONS, cons)  # type: ignore[arg-type]


def test_setgid_directories_hand_down_their_group() -> None:
    working = d(0o2770, gid=CONSUMERS)
    assert inherit(working, CONS, 0o755, is_dir=True) == (CONSUMERS, 0o2755)  # type: ignore[arg-type]
    assert inherit(working, CONS, 0o644, is_dir=False) == (CONSUMERS, 0o644)  # type: ignore[arg-type]
    plain = d(0o770, gid=CONSUMERS)
    assert inherit(plain, PRODUCERS, 0o40755, is_dir=True) == (PRODUCERS, 0o755)  # type: ignore[arg-type]


def test_groups_of_a_process_come_from_proc() -> None:
    me = os.getpid()
    assert proc_groups(me, os.getuid(), os.getgid()) == frozenset(os.getgroups())
    # another process's ids (a reused pid): no groups, which can only refuse
    assert proc_groups(me, os.getuid() + 1, os.getgid()) == frozenset()
    assert proc_groups(0, 0, 0) == frozenset()
    assert proc_groups(2**22 + 12345, 0, 0) == frozenset()


class Reader:
    def __init__(self, *entries: tuple[int, Dir | None, dict[bytes, Dir]]) -> None:
        self.dirs = {i: e for i, e, _ in entries}
        self.children = {i: c for i, _, c in entries}

    def get(self, i: int) -> Dir | None:
        return self.dirs.get(i)

    def lookup(self, parent: int, name: bytes) -> Dir | None:
        return self.children.get(parent, {}).get(name)


def test_gate_refuses_with_eacces_and_says_why() -> None:
    ready, working = d(0o770, PROD, CONSUMERS), d(0o1770, ROOT, CONSUMERS)
    working.name = b"working"
    gate = Gate(Reader((1, ready, {b"job": Dir(0o100644, PROD, PRODUCERS)}),  # type: ignore[arg-type]
                       (2, working, {b"theirs": Dir(0o100644, 4242, CONSUMERS)})))
    gate.check(PROD, PRODUCERS, 0, change=(1,))
    with pytest.raises(AccessDenied) as refused:
        gate.check(ROOT, ROOT, 0, change=(1,))
    assert refused.value.errno == errno.EACCES
    assert "ready/" in refused.value.hint and "0770" in refused.value.hint
    with pytest.raises(AccessDenied):  # claiming needs write on ready/ as well
        gate.check(PROD, PRODUCERS, 0, change=(2,), remove=((1, b"job"),))
    with pytest.raises(NotPermitted) as sticky:  # sticky working/: not someone else's
        gate.check(CONS, CONSUMERS, 0, remove=((2, b"theirs"),))
    assert sticky.value.errno == errno.EPERM, "the kernel's errno for the sticky bit"
    gate.check(4242, CONSUMERS, 0, remove=((2, b"theirs"),))
    gate.check(CONS, CONSUMERS, 0, remove=((2, b"missing"), (99, b"x")), change=(99,))


def test_strict_roles_is_the_daemons_option_and_turns_the_kernels_checks_on() -> None:
    opts = fuse_options("/s", [STRICT_ROLES])
    assert STRICT_ROLES not in opts
    assert "default_permissions" in opts
    assert STRICT_ROLES not in fuse_options("/s", ["allow_other", STRICT_ROLES])


def test_a_write_clears_the_set_id_bits_the_kernel_clears() -> None:
    assert setid_bits(0o4755) == stat.S_ISUID
    assert setid_bits(0o6755) == stat.S_ISUID | stat.S_ISGID
    assert setid_bits(0o2745) == 0  # set-group-ID without group execute: not a privilege
    assert setid_bits(0o1777) == 0


def test_who_may_keep_the_set_id_bits() -> None:
    assert keeps_setid(os.getpid(), os.getuid()) is (os.geteuid() == 0)  # root: CAP_FSETID
    assert not keeps_setid(2**22 + 12345, PROD)  # no such process: only root may
    assert keeps_setid(2**22 + 12345, ROOT)


def test_root_of_a_user_namespace_of_its_own_may_not_keep_them() -> None:
    """``unshare -r`` gives a full effective set, held in the new namespace only: the kernel
    asks for CAP_FSETID in the initial one."""
    with subprocess.Popen(["unshare", "-r", "sh", "-c", "echo up; read x"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None and p.stdin is not None
        try:
            assert p.stdout.readline() == "up\n"
            with open(f"/proc/{p.pid}/status") as f:
                caps = next(ln for ln in f if ln.startswith("CapEff:"))
            assert int(caps.split()[1], 16) >> CAP_FSETID & 1  # held, in its own namespace
            assert not keeps_setid(p.pid, ROOT)
        finally:
            p.stdin.close()
            p.wait(timeout=10)
