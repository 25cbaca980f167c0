"""The store and the daemon's own files are private to the user running spoolfs: directories
0700, files 0600. The store holds every small message inline in ``meta.db`` and every other
one in ``blobs/``, and the whole history; no other local user may read any of it.

New files are made private where they are created (and the daemon's umask is 077 besides);
``tighten`` fixes a store made by older versions, once: after it the store directory itself is
0700, and a store whose directory is 0700 is only checked at its top level, so that mounting a
store of millions of blobs does not walk them all."""

from __future__ import annotations

import os
import stat

from spoolfs.core.errors import UserError

DIR_MODE = 0o700
FILE_MODE = 0o600
UMASK = 0o077


def _tighten_one(path: str, st: os.stat_result, out: list[str]) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if mode & UMASK:
        os.chmod(path, mode & ~UMASK, follow_symlinks=False)
        out.append(f"{path} {mode:04o}->{mode & ~UMASK:04o}")


def _tighten_tree(path: str, out: list[str], deep: bool) -> None:
    with os.scandir(path) as it:
        for e in it:
            if e.is_symlink():
                continue  # its mode means nothing; what it points to is not ours to change
            _tighten_one(e.path, e.stat(follow_symlinks=False), out)
            if deep and e.is_dir(follow_symlinks=False):
                _tighten_tree(e.path, out, deep)


def tighten(store_dir: str) -> list[str]:
    """Remove group and other access from the store and what it holds; returns what changed
    (``path old->new`` each). Walks the whole tree only when the store directory itself was
    open to others (a store older than this rule)."""
    out: list[str] = []
    st = os.lstat(store_dir)
    _tighten_one(store_dir, st, out)
    _tighten_tree(store_dir, out, deep=bool(out))
    return out


def private_dir(path: str) -> str:
    """``path`` as a directory only this user can use: made 0700 when missing; refused when it
    is a symbolic link or someone else's (another user could then read or plant files in it).
    """
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise UserError(f"cannot make {path}: {e.strerror or e}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UserError(f"{path} is not a directory of uid {os.geteuid()}: refusing to use it")
    if stat.S_IMODE(st.st_mode) & UMASK:
        os.chmod(path, DIR_MODE)
    return path
