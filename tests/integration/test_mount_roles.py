"""Roles (DESIGN §8): owner, group and mode of a queue's state dirs, set with chown/chmod, kept
in the store, and enforced for real processes of two unprivileged users: by the kernel with
``-o allow_other``, and by the daemon itself, root included, with ``-o strict_roles``.

The classic rule, as docs/design.md ("Roles") writes it: producers (group ``spoolproducers``)
upload into ``partial/`` and publish into ``ready/``; consumers (group ``spoolconsumers``)
claim from ``ready/`` and finish, release and redrive. ``spoolcons`` belongs to
``spoolconsumers`` only as a supplementary group, so every consumer step also shows that
supplementary groups count.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

import pytest

from helpers.inspection import ls, read
from helpers.mounts import MountFactory
from helpers.procs import fails, ok
from helpers.users import (
    AS_CONSUMER,
    AS_CONSUMER_ALONE,
    AS_PRODUCER,
    CONSUMER,
    CONSUMERS,
    DENIED,
    PRODUCER,
    PRODUCERS,
)

pytestmark = pytest.mark.fuse

def source(open_dir: Path, name: str) -> Path:
    """A file every user can read, for cp into the mount."""
    f = open_dir / name
    f.write_bytes(f"{name}\n".encode())
    f.chmod(0o644)
    return f


def classic_rule(q: Path) -> None:
    """The worked example of docs/design.md, as root."""
    ok("chown", f"root:{PRODUCERS}", q / "partial")
    ok("chmod", "2770", q / "partial")
    ok("chown", f"{PRODUCER}:{CONSUMERS}", q / "ready")
    ok("chmod", "0770", q / "ready")
    ok("chown", f"root:{CONSUMERS}", q / "working", q / "success", q / "error")
    ok("chmod", "2770", q / "working", q / "success", q / "error")


def owners(q: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for name in ("partial", "ready", "working", "success", "error"):
        st = os.stat(q / name)
        out[name] = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
    return out


def expected_owners() -> dict[str, tuple[int, int, int]]:
    prod, cons = grp.getgrnam(PRODUCERS).gr_gid, grp.getgrnam(CONSUMERS).gr_gid
    uid = pwd.getpwnam(PRODUCER).pw_uid
    return {"partial": (0o2770, 0, prod), "ready": (0o770, uid, cons),
            "working": (0o2770, 0, cons), "success": (0o2770, 0, cons),
            "error": (0o2770, 0, cons)}


def test_the_classic_rule_with_chown_and_chmod(users: None, mounter: MountFactory,
                                               open_dir: Path, tmp_path: Path) -> None:
    m = mounter(tmp_path / "store", open_dir / "mnt", extra=["-o", "allow_other"])
    q = m.path / "q"
    ok("mkdir", q)
    umask = os.umask(0)
    os.umask(umask)
    assert set(owners(q).values()) == {(0o777 & ~umask, 0, 0)}, \
        "a new queue's state dirs belong to whoever made it, with its umask"
    classic_rule(q)
    assert owners(q) == expected_owners()

    # the producer uploads and publishes, but cannot claim
    ok(*AS_PRODUCER, "cp", source(open_dir, "a"), q / "partial/a")
    assert os.stat(q / "partial/a").st_gid == grp.getgrnam(PRODUCERS).gr_gid, \
        "a file made in a setgid partial/ takes its group"
    ok(*AS_PRODUCER, "mv", q / "partial/a", q / "ready/a")
    ok(*AS_PRODUCER, "cp", source(open_dir, "b"), q / "ready/b")
    ok(*AS_PRODUCER, "cp", source(open_dir, "w"), q / "ready/w")
    ok(*AS_PRODUCER, "rm", q / "ready/w")  # withdraw
    fails(*AS_PRODUCER, "mkdir", q / "working/p1", message=DENIED)
    fails(*AS_PRODUCER, "mv", q / "ready/a", q / "working/", message=DENIED)
    assert ls(q / "ready") == ["a", "b"]

    # the consumer makes its view, claims, reads, finishes, redrives; it cannot upload
    ok(*AS_CONSUMER, "mkdir", q / "working/c1")
    st = os.stat(q / "working/c1")
    assert (st.st_uid, st.st_gid) == (pwd.getpwnam(CONSUMER).pw_uid,
                                      grp.getgrnam(CONSUMERS).gr_gid)
    assert st.st_mode & stat.S_ISGID, "a view made in a setgid working/ keeps the bit"
    ok(*AS_CONSUMER, "mv", q / "ready/a", q / "working/c1/")
    assert ok(*AS_CONSUMER, "cat", q / "working/c1/a") == b"a\n"
    ok(*AS_CONSUMER, "mv", q / "working/c1/a", q / "success/")
    ok(*AS_CONSUMER, "mv", q / "ready/b", q / "working/c1/")
    ok(*AS_CONSUMER, "mv", q / "working/c1/b", q / "error/")
    ok(*AS_CONSUMER, "mv", q / "error/b", q / "ready/")
    fails(*AS_CONSUMER, "cp", source(open_dir, "c"), q / "partial/c", message=DENIED)
    ok("cp", source(open_dir, "d"), q / "partial/d")  # root's upload: the consumer may not
    fails(*AS_CONSUMER, "mv", q / "partial/d", q / "ready/", message=DENIED)  # publish it
    assert ls(q / "partial") == ["d"]
    assert ls(q / "ready") == ["b"] and ls(q / "success") == ["a"]

    # nothing of it is a mount's memory: the roles are in the store
    m.restart()
    assert owners(q) == expected_owners()
    ok(*AS_PRODUCER, "cp", source(open_dir, "e"), q / "partial/e")
    ok(*AS_PRODUCER, "mv", q / "partial/e", q / "ready/")
    fails(*AS_PRODUCER, "mv", q / "ready/e", q / "working/", message=DENIED)
    ok(*AS_CONSUMER, "mv", q / "ready/e", q / "working/c1/")
    fails(*AS_CONSUMER, "mv", q / "partial/d", q / "ready/", message=DENIED)
    assert ls(q / "working/c1") == ["e"] and ls(q / "ready") == ["b"]


def test_supplementary_groups_grant_and_root_passes(users: None, mounter: MountFactory,
                                                     open_dir: Path, tmp_path: Path) -> None:
    """The kernel counts the caller's supplementary groups; root passes every mode check
    unless the mount has strict_roles (next test)."""
    m = mounter(tmp_path / "store", open_dir / "mnt", extra=["-o", "allow_other"])
    q = m.path / "q"
    ok("mkdir", q)
    classic_rule(q)
    ok(*AS_PRODUCER, "cp", source(open_dir, "a"), q / "ready/a")
    fails(*AS_CONSUMER_ALONE, "mkdir", q / "working/c1", message=DENIED)
    ok(*AS_CONSUMER, "mkdir", q / "working/c1")
    ok("chmod", "0700", q / "working/c1")  # the consumer's own, and root's
    fails(*AS_CONSUMER_ALONE, "mv", q / "ready/a", q / "working/c1/", message=DENIED)
    ok("mv", q / "ready/a", q / "working/c1/")  # root: CAP_DAC_OVERRIDE, the kernel allows
    assert ls(q / "working/c1") == ["a"]
    ok(*AS_CONSUMER, "mv", q / "working/c1/a", q / "success/")
    assert ls(q / "success") == ["a"]


def test_strict_roles_checks_root_too(users: None, mounter: MountFactory, open_dir: Path,
                                      tmp_path: Path) -> None:
    m = mounter(tmp_path / "store", open_dir / "mnt",
                extra=["-o", "allow_other,strict_roles"])
    q = m.path / "q"
    ok("mkdir", q)
    classic_rule(q)
    cons = grp.getgrnam(CONSUMERS).gr_gid

    # root is neither ready/'s owner nor in its group
    fails("cp", source(open_dir, "a"), q / "ready/a", message=DENIED)
    assert ls(q / "ready") == []
    assert "strict_roles: uid 0" in m.log_text()
    # root with the consumers' group among its supplementary groups: the daemon reads them
    # from /proc (a request carries only uid and gid)
    ok("setpriv", f"--groups={cons}", "cp", source(open_dir, "a"), q / "ready/a")
    assert ls(q / "ready") == ["a"]

    # the producer and the consumer work as with the kernel alone; the consumer's access
    # comes from a supplementary group too
    ok(*AS_PRODUCER, "cp", source(open_dir, "b"), q / "partial/b")
    ok(*AS_PRODUCER, "mv", q / "partial/b", q / "ready/b")
    fails(*AS_PRODUCER, "mv", q / "ready/b", q / "working/", message=DENIED)
    ok(*AS_CONSUMER, "mkdir", q / "working/c1")
    ok(*AS_CONSUMER, "mv", q / "ready/b", q / "working/c1/")
    fails(*AS_CONSUMER_ALONE, "mv", q / "ready/a", q / "working/c1/", message=DENIED)
    # working/c1 is the consumer's (mode 2755): not root's to finish or discard
    fails("mv", q / "working/c1/b", q / "success/", message=DENIED)
    fails("rm", q / "working/c1/b", message=DENIED)
    ok(*AS_CONSUMER, "mv", q / "working/c1/b", q / "success/")
    assert ls(q / "working/c1") == [] and read(q / "success/b") == b"b\n"

    # root stays the admin: chown and chmod are the kernel's, and it may open the queue
    ok("chmod", "0777", q / "ready")
    ok("cp", source(open_dir, "c"), q / "ready/c")
    assert ls(q / "ready") == ["a", "c"]

    # the sticky bit: only a name's owner or the directory's may remove it (EPERM, as the
    # kernel answers the others), root included
    ok("chmod", "1777", q / "ready")
    ok(*AS_PRODUCER, "cp", source(open_dir, "p"), q / "ready/p")
    fails(*AS_CONSUMER, "mv", q / "ready/p", q / "working/c1/", message="not permitted")
    fails("rm", q / "ready/p", message="not permitted")
    assert "may not remove others' names from sticky ready/" in m.log_text()
    ok(*AS_PRODUCER, "rm", q / "ready/p")
    assert ls(q / "ready") == ["a", "c"]


def test_whoever_holds_a_claim_may_heartbeat_annotate_and_finish(
        users: None, mounter: MountFactory, open_dir: Path, tmp_path: Path) -> None:
    """The producer's file, mode 0644, claimed by a consumer: the claim makes the consumer its
    owner, so the consumer's own heartbeat (``touch``) and failure note (``setfattr``) pass the
    kernel's checks; the producer's ownership would refuse both (EACCES)."""
    m = mounter(tmp_path / "store", open_dir / "mnt", extra=["-o", "allow_other"])
    q = m.path / "q"
    ok("mkdir", q)
    classic_rule(q)
    ok(*AS_PRODUCER, "cp", source(open_dir, "a"), q / "ready/a")
    assert os.stat(q / "ready/a").st_uid == pwd.getpwnam(PRODUCER).pw_uid
    ok(*AS_CONSUMER, "mkdir", q / "working/c1")
    ok(*AS_CONSUMER, "mv", q / "ready/a", q / "working/c1/")
    st = os.stat(q / "working/c1/a")
    assert (st.st_uid, st.st_gid) == (pwd.getpwnam(CONSUMER).pw_uid,
                                      grp.getgrnam(CONSUMERS).gr_gid), \
        "the claimer owns what it holds (the group of the setgid view)"
    lease = ok(*AS_CONSUMER, "getfattr", "-n", "user.spool.lease_expires", "--only-values",
               q / "working/c1/a")
    ok(*AS_CONSUMER, "touch", "-d", "@2000000000", q / "working/c1/a")  # owner only
    ok(*AS_CONSUMER, "touch", q / "working/c1/a")  # the heartbeat
    assert ok(*AS_CONSUMER, "getfattr", "-n", "user.spool.lease_expires", "--only-values",
              q / "working/c1/a") >= lease
    ok(*AS_CONSUMER, "setfattr", "-n", "user.spool.error", "-v", "bad row 3",
       q / "working/c1/a")
    ok(*AS_CONSUMER, "chmod", "0600", q / "working/c1/a")
    ok(*AS_CONSUMER, "mv", q / "working/c1/a", q / "error/")
    assert ok("getfattr", "-n", "user.spool.error", "--only-values", q / "error/a") == \
        b"bad row 3"
    assert os.stat(q / "error/a").st_uid == pwd.getpwnam(CONSUMER).pw_uid, \
        "the message keeps its last holder as owner"
