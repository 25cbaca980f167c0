"""Roles (DESIGN §8): who may change a state directory, decided by its owner, group and mode.

An admin sets the roles with plain ``chown``/``chmod`` on a queue's state directories; the
spool keeps them with the entries. With ``-o allow_other`` the kernel enforces them
(``default_permissions``) for every caller except root, whose CAP_DAC_OVERRIDE passes every
check. ``-o strict_roles`` makes the daemon check too, for every caller, root included: the
POSIX rules below, with the caller's uid and gid from the request and its supplementary groups
from ``/proc/PID/status`` (a FUSE request carries no groups).

The daemon checks what changes a directory (create, mkdir, link, rename, unlink, rmdir): write
and search permission on each directory changed, and the sticky bit. Reading, and ``chown``/
``chmod`` (owner or root), stay the kernel's.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spoolfs.core.errors import AccessDenied, NotPermitted

if TYPE_CHECKING:
    from spoolfs.store.base import Entry, ReadTx

#: mount option: the daemon itself checks the modes, for every caller including root
STRICT_ROLES = "strict_roles"

READ, WRITE, SEARCH = 4, 2, 1


@dataclass(frozen=True, slots=True)
class Caller:
    uid: int
    gid: int
    groups: frozenset[int] = field(default_factory=frozenset)

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups


def allowed(mode: int, uid: int, gid: int, caller: Caller, want: int) -> bool:
    """Whether ``caller`` has all of ``want`` (READ|WRITE|SEARCH bits) on an object with this
    mode and owner. One class applies, as in POSIX: the owner's bits for the owner (even when
    the group's or others' would allow more), else the group's for a member of its group, else
    the others'. No capability overrides them: root is checked like anyone."""
    if caller.uid == uid:
        bits = mode >> 6
    elif caller.in_group(gid):
        bits = mode >> 3
    else:
        bits = mode
    return bits & want == want


def may_change(d: Entry, caller: Caller) -> bool:
    """Add, remove or rename names in directory ``d``: write and search permission."""
    return allowed(d.mode, d.uid, d.gid, caller, WRITE | SEARCH)


def may_remove(d: Entry, victim_uid: int, caller: Caller) -> bool:
    """Remove (or rename away, or replace) an entry owned by ``victim_uid`` from ``d``: in a
    sticky directory only the entry's owner or the directory's may."""
    if not may_change(d, caller):
        return False
    return not d.mode & stat.S_ISVTX or caller.uid in (d.uid, victim_uid)


def inherit(parent: Entry, gid: int, mode: int, is_dir: bool) -> tuple[int, int]:
    """Group and permission bits of a new entry in ``parent`` (``mode`` as asked, after the
    umask): in a setgid directory it takes the directory's group, and a new directory keeps
    the setgid bit, so that consumer views made in a setgid ``working/`` belong to its group."""
    mode &= 0o7777
    if parent.mode & stat.S_ISGID:
        gid = parent.gid
        if is_dir:
            mode |= stat.S_ISGID
    return gid, mode


#: the capability that lets a writer keep a file's set-user-ID and set-group-ID bits
CAP_FSETID = 4
#: the inode number of the initial user namespace (the kernel's PROC_USER_INIT_INO)
INIT_USER_NS = 0xEFFFFFFD


def setid_bits(mode: int) -> int:
    """The bits a write by an unprivileged process clears, as the kernel's FUSE module clears
    them for a cached write: the set-user-ID bit, and the set-group-ID bit of a
    group-executable file. (Local file systems also clear a set-group-ID bit without group
    execute when the writer is outside the file's group; FUSE leaves it, and so does this.)"""
    bits = mode & stat.S_ISUID
    if mode & stat.S_ISGID and mode & stat.S_IXGRP:
        bits |= stat.S_ISGID
    return bits


def _status(pid: int) -> dict[str, str] | None:
    """The fields of ``/proc/PID/status`` by name, or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    except OSError:
        return None


def keeps_setid(pid: int, uid: int) -> bool:
    """Whether process ``pid`` (of user ``uid``) may write to a set-user-ID file and keep the
    bit: CAP_FSETID in its effective set (``/proc/PID/status``), held in the initial user
    namespace, where the kernel asks for it (root of a namespace of its own, ``unshare -r``,
    holds it only there). When the status cannot be read, root may and nobody else; when the
    namespace cannot be, nobody may."""
    try:
        caps = int((_status(pid) or {})["CapEff"], 16)
    except (KeyError, ValueError):
        return uid == 0
    if not caps >> CAP_FSETID & 1:
        return False
    try:
        return os.stat(f"/proc/{pid}/ns/user").st_ino == INIT_USER_NS
    except OSError:
        return False


def proc_groups(pid: int, uid: int, gid: int) -> frozenset[int]:
    """The supplementary groups of process (thread) ``pid``, from ``/proc/PID/status``. Empty
    when it cannot be read, or when that process's file system ids are not the request's (it
    exited and the pid was reused): missing groups can only refuse, never allow."""
    if pid <= 0 or (lines := _status(pid)) is None:
        return frozenset()
    try:
        uids, gids = lines["Uid"].split(), lines["Gid"].split()
        if int(uids[3]) != uid or int(gids[3]) != gid:  # real, effective, saved, fs
            return frozenset()
        return frozenset(int(g) for g in lines["Groups"].split())
    except (KeyError, IndexError, ValueError):
        return frozenset()


class Gate:
    """``-o strict_roles``: the daemon's own check in front of every request that changes a
    directory. Raises ``AccessDenied`` (EACCES), or ``NotPermitted`` (EPERM) for the sticky
    bit, as the kernel does; a name or directory it cannot find is left to the service, which
    answers ENOENT."""

    def __init__(self, reader: ReadTx) -> None:
        self.r = reader

    def check(self, uid: int, gid: int, pid: int, change: tuple[int, ...] = (),
              remove: tuple[tuple[int, bytes], ...] = ()) -> None:
        """``change``: directories a name is added to; ``remove``: (directory, name) pairs
        whose name goes away or is replaced (when it exists)."""
        caller = Caller(uid, gid, proc_groups(pid, uid, gid))
        for d_id in change:
            d = self.r.get(d_id)
            if d is not None and not may_change(d, caller):
                raise AccessDenied(self._why(caller, d, "write"))
        for d_id, name in remove:
            d = self.r.get(d_id)
            if d is None:
                continue
            victim = self.r.lookup(d_id, name)  # none: the service answers ENOENT
            if victim is None:
                continue
            if not may_change(d, caller):
                raise AccessDenied(self._why(caller, d, "write"))
            if not may_remove(d, victim.uid, caller):  # EPERM, as the kernel answers
                raise NotPermitted(self._why(caller, d, "remove others' names from sticky"))

    @staticmethod
    def _why(caller: Caller, d: Entry, what: str) -> str:
        return (f"strict_roles: uid {caller.uid} (gid {caller.gid}, groups "
                f"{sorted(caller.groups) or '-'}) may not {what} {d.name.decode(errors='replace')}/"
                f" (mode {stat.S_IMODE(d.mode):04o}, owner {d.uid}:{d.gid})")
