"""The store directory is its owner's alone: it holds every message's content and the whole
history, so nobody else may read it (DESIGN §6).

A new store is made 0700 and everything in it 0600 (files) or 0700 (directories), whatever
the process umask. A store made by an older spoolfs, or opened up by hand, is tightened when a
daemon mounts it: the store directory first (once it is 0700 nothing beneath it can be reached
by others), then every entry beneath it, with one log line saying how many changed.
"""

from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
OTHERS = 0o077  # group and other bits: none may be set anywhere in a store


def make_store_dir(store_dir: str) -> None:
    """Create ``store_dir`` (and missing parents, with the usual modes) owner-only."""
    parent = os.path.dirname(os.path.abspath(store_dir))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(store_dir, DIR_MODE)
    except FileExistsError:
        return
    os.chmod(store_dir, DIR_MODE)  # the umask may have taken bits from a mode it cannot add


def make_private_dir(path: str) -> None:
    """``os.makedirs`` for a directory inside a store: owner-only."""
    os.makedirs(path, DIR_MODE, exist_ok=True)


def tighten(store_dir: str) -> int:
    """Take every group and other permission off ``store_dir`` and what it holds, if the store
    directory has any (a store this module made never has). Returns how many entries changed;
    logs one line when any did."""
    st = os.stat(store_dir)
    if not st.st_mode & OTHERS:
        return 0
    os.chmod(store_dir, stat.S_IMODE(st.st_mode) & ~OTHERS)
    changed = 1
    for dirpath, dirs, files in os.walk(store_dir):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            try:
                mode = os.lstat(p).st_mode
                if stat.S_ISLNK(mode) or not mode & OTHERS:
                    continue
                os.chmod(p, stat.S_IMODE(mode) & ~OTHERS)
            except FileNotFoundError:  # removed meanwhile (another daemon's GC)
                continue
            changed += 1
    log.warning("store %s was open to other users: took group and other permissions off %d "
                "entries (the store is now its owner's alone)", store_dir, changed)
    return changed
