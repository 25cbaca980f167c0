"""Inspecting a mount or a store: listings, contents, extended attributes, whole-tree
snapshots, exact errnos, and system calls no shell tool makes (``renameat2``, ``fallocate``).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from helpers.procs import Arg, ok


def ls(path: Arg) -> list[str]:
    """The entries ``ls -A`` shows, sorted (NUL-separated, so any name survives)."""
    out = ok("ls", "-A", "--zero", "--", path)
    return sorted(os.fsdecode(n) for n in out.split(b"\0") if n)


def visible(names: Iterable[str]) -> list[str]:
    return sorted(n for n in names if not n.startswith("."))


def read(path: Arg) -> bytes:
    """File content as ``cat`` reads it."""
    return ok("cat", "--", path)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def getxattr(path: Arg, name: str) -> bytes:
    """``getfattr --only-values``: the raw value."""
    return ok("getfattr", "--absolute-names", "--only-values", "-n", name, "--", path)


def xattr_text(path: Arg, name: str) -> str:
    return getxattr(path, name).decode().strip()


def listxattr(path: Arg, pattern: str = "-") -> set[str]:
    """Attribute names ``getfattr -m PATTERN`` lists."""
    out = ok("getfattr", "--absolute-names", "-m", pattern, "--", path).decode()
    return {line for line in out.splitlines() if line and not line.startswith("#")}


def setxattr(path: Arg, name: str, value: str) -> None:
    ok("setfattr", "-n", name, "-v", value, "--", path)


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Everything observable about a tree: per entry its kind, inode, size, mode and content hash.

    Used to prove that a refused operation changed nothing.
    """
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if ".spool" in dirnames:  # live control files (§7), not part of the queue state
            dirnames.remove(".spool")
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in dirnames:
            out[os.path.join(rel, name)] = ("dir",)
        for name in filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            with open(full, "rb") as f:
                digest = sha256(f.read())
            out[os.path.join(rel, name)] = ("file", st.st_ino, st.st_size, st.st_mode, digest)
    return out


def expect_errno(code: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> OSError:
    """Call ``fn`` and assert it fails with exactly ``code``."""
    what = f"{getattr(fn, '__name__', fn)}{args!r}"
    try:
        fn(*args, **kwargs)
    except OSError as e:
        got = errno.errorcode.get(e.errno or 0, str(e.errno))
        assert e.errno == code, f"{what}: expected {errno.errorcode[code]}, got {got} ({e})"
        return e
    raise AssertionError(f"{what} succeeded, expected {errno.errorcode[code]}")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_uint]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
RENAME_WHITEOUT = 4


def renameat2(src: Arg, dst: Arg, flags: int) -> None:
    """``renameat2(2)`` (os.rename cannot pass flags)."""
    if _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(src), None, os.fsdecode(dst))


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """``fallocate(2)`` itself: glibc's posix_fallocate would emulate it by writing zeros."""
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def blob_files(store: Path, data: bytes) -> list[str]:
    """The blob files of the store that hold ``data`` (content over the inline limit)."""
    return sorted(p.name for p in (store / "blobs").rglob(sha256(data) + "*"))

