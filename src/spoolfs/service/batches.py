"""Batches (DESIGN §5): a directory made in ``partial/`` is one message.

The batch root is a message row whose mode is a directory; what is inside are ``member`` rows
(files with content, directories) under it. Members never change state on their own: moving
the root moves the whole tree (children follow their parent), so a claim, finish, release,
retry or expiry takes the batch as a unit. Members may be created, written, renamed and removed
only while the batch is in ``partial/``; its files are sealed into blobs when it is published.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterator

from spoolfs.core.errors import IsADirectory, NotADirectory, NotEmpty, NotPermitted
from spoolfs.core.rules import State
from spoolfs.store.base import Entry, ReadTx, WriteTx

MEMBER = "member"

#: where members of a published batch may be removed: not in ready/, where a claim must
#: always take the whole batch
REMOVABLE = frozenset({State.PARTIAL, State.WORKING, State.SUCCESS, State.ERROR})


def is_batch(e: Entry) -> bool:
    return e.kind == "message" and stat.S_ISDIR(e.mode)


def is_dir(e: Entry) -> bool:
    return stat.S_ISDIR(e.mode)


def root_of(r: ReadTx, e: Entry) -> Entry:
    """The batch a member belongs to (a batch root is its own)."""
    while e.kind == MEMBER:
        assert e.parent is not None
        parent = r.get(e.parent)
        if parent is None:
            raise NotPermitted("the batch of this file is gone")
        e = parent
    return e


def check_mutable(r: ReadTx, e: Entry) -> Entry:
    """A member (or the root's contents) may change only while the batch is in partial/."""
    root = root_of(r, e)
    if root.state is not State.PARTIAL:
        raise NotPermitted("a published batch is immutable: its files change only in partial/")
    return root


def walk(r: ReadTx, root: Entry) -> Iterator[Entry]:
    """Every member under ``root``, parents before children."""
    todo = [root.id]
    while todo:
        for c in r.children(todo.pop()):
            yield c
            if is_dir(c):
                todo.append(c.id)


def copy_tree(tx: WriteTx, src: Entry, new_root: Entry, now: int) -> None:
    """Fan-out of a batch: the same members under ``new_root``, sharing each file's blob."""
    todo = [(src.id, new_root.id)]
    while todo:
        old_parent, new_parent = todo.pop()
        for c in tx.children(old_parent):
            copy = tx.insert(parent=new_parent, name=c.name, kind=MEMBER, queue=new_root.queue,
                             blob=c.blob, size=c.size, mode=c.mode, uid=c.uid, gid=c.gid,
                             mtime_ns=c.mtime_ns, ctime_ns=now, created_ns=now)
            if c.blob is not None:
                tx.blob_ref(c.blob, 1)
            if is_dir(c):
                todo.append((c.id, copy.id))


def delete_tree(tx: WriteTx, root: Entry,
                release: Callable[[WriteTx, Entry], None]) -> None:
    """Delete a batch's members, children first; ``release(tx, entry)`` drops each one's
    content. The caller deletes the root."""
    members = list(walk(tx, root))
    for m in reversed(members):
        tx.delete(m.id)  # the row first: the last reference may delete its blob row
        release(tx, m)


def check_replace(tx: ReadTx, src: Entry, old: Entry) -> None:
    """Renaming upload ``src`` onto upload ``old`` in ``partial/``, as rename(2) anywhere: a
    file never replaces a batch (EISDIR), a batch never a file (ENOTDIR), nor a batch that
    holds anything (ENOTEMPTY). Finished messages replace each other whole instead."""
    if is_dir(old) and not is_dir(src):
        raise IsADirectory(f"{old.name!r} is a batch")
    if is_dir(src) and not is_dir(old):
        raise NotADirectory(f"{old.name!r} is not a batch")
    if is_dir(old) and tx.has_children(old.id):
        raise NotEmpty(f"batch {old.name!r} is not empty")
