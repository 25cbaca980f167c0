"""Batches (DESIGN §5) on a real store, without a kernel; every test ends with fsck clean."""

from __future__ import annotations

import os

import pytest

from helpers.spool import WHO, Q, content
from spoolfs.core.errors import Exists, NotEmpty, NotPermitted
from spoolfs.core.rules import State
from spoolfs.service.content import INLINE_MAX
from spoolfs.service.spool import Spool

BIG = os.urandom(INLINE_MAX + 100)


async def member(spool: Spool, d: int, name: bytes, data: bytes) -> int:
    e, h = await spool.create(d, name, 0o644, WHO)
    spool.write(h, 0, data)
    await spool.close(h, WHO)
    return e.id


async def build(spool: Spool, q: Q, name: bytes = b"b1") -> tuple[int, dict[bytes, bytes]]:
    root = await spool.mkdir(q[State.PARTIAL], name, 0o755, WHO)
    sub = await spool.mkdir(root.id, b"sub", 0o755, WHO)
    files = {b"a": b"small", b"big": BIG}
    await member(spool, root.id, b"a", files[b"a"])
    await member(spool, sub.id, b"big", files[b"big"])
    return root.id, files


def tree(spool: Spool, d: int, prefix: bytes = b"") -> dict[bytes, bytes]:
    out = {}
    for e in spool.listdir(d):
        if e.mode & 0o040000:
            out.update(tree(spool, e.id, prefix + e.name + b"/"))
        else:
            out[prefix + e.name] = content(spool, e.id)
    return out


async def test_a_batch_moves_as_one_message(env: tuple[Spool, Q]) -> None:
    spool, q = env
    root, _ = await build(spool, q)
    await spool.rename(q[State.PARTIAL], b"b1", q[State.READY], b"b1", 0, WHO)
    published = tree(spool, root)
    assert published == {b"a": b"small", b"sub/big": BIG}
    assert all(not e.staged for e in spool.listdir(root))  # sealed at publish
    w = await spool.mkdir(q[State.WORKING], b"w", 0o755, WHO)
    await spool.rename(q[State.READY], b"b1", w.id, b"b1", 0, WHO)
    b = spool.get(root)
    assert b.state is State.WORKING and b.attempts == 1 and b.lease_ns is not None
    await spool.rename(w.id, b"b1", q[State.SUCCESS], b"b1", 0, WHO)
    assert tree(spool, root) == published
    assert [h[1] for h in spool.r.history(root)] == ["upload", "publish", "claim", "finish"]


async def test_a_published_batch_is_immutable(env: tuple[Spool, Q]) -> None:
    spool, q = env
    root, _ = await build(spool, q)
    await spool.rename(q[State.PARTIAL], b"b1", q[State.READY], b"b1", 0, WHO)
    a = spool.lookup(root, b"a")
    with pytest.raises(NotPermitted):
        await spool.create(root, b"new", 0o644, WHO)
    with pytest.raises(NotPermitted):
        await spool.open(a.id, True, False, WHO)
    with pytest.raises(NotPermitted):
        await spool.mkdir(root, b"d", 0o755, WHO)
    with pytest.raises(NotPermitted):  # pending: a claim must take all of it
        await spool.unlink(root, b"a", WHO)
    with pytest.raises(NotPermitted):
        await spool.rename(root, b"a", root, b"b", 0, WHO)
    with pytest.raises(NotPermitted):
        await spool.link(a.id, q[State.PARTIAL], b"x", WHO)
    assert tree(spool, root) == {b"a": b"small", b"sub/big": BIG}


async def test_files_stay_in_their_batch(env: tuple[Spool, Q]) -> None:
    spool, q = env
    root, _ = await build(spool, q)
    loose = await member(spool, q[State.PARTIAL], b"loose", b"x")
    with pytest.raises(NotPermitted):
        await spool.rename(q[State.PARTIAL], b"loose", root, b"loose", 0, WHO)
    with pytest.raises(NotPermitted):
        await spool.rename(root, b"a", q[State.PARTIAL], b"a", 0, WHO)
    sub = spool.lookup(root, b"sub")
    await spool.rename(root, b"a", sub.id, b"a2", 0, WHO)  # within the batch: fine
    with pytest.raises(Exists):
        await spool.mkdir(root, b"sub", 0o755, WHO)
    assert spool.get(loose).state is State.PARTIAL
    assert tree(spool, root) == {b"sub/a2": b"small", b"sub/big": BIG}


async def test_an_open_file_holds_back_the_publish(env: tuple[Spool, Q]) -> None:
    spool, q = env
    root = await spool.mkdir(q[State.PARTIAL], b"b1", 0o755, WHO)
    e, h = await spool.create(root.id, b"f", 0o644, WHO)
    spool.write(h, 0, b"half")
    with pytest.raises(NotPermitted, match="open for writing"):
        await spool.rename(q[State.PARTIAL], b"b1", q[State.READY], b"b1", 0, WHO)
    await spool.close(h, WHO)
    await spool.rename(q[State.PARTIAL], b"b1", q[State.READY], b"b1", 0, WHO)
    assert content(spool, e.id) == b"half"


async def test_rm_r_takes_a_batch_apart_and_frees_content(env: tuple[Spool, Q]) -> None:
    spool, q = env
    root, _ = await build(spool, q)
    await spool.rename(q[State.PARTIAL], b"b1", q[State.READY], b"b1", 0, WHO)
    w = await spool.mkdir(q[State.WORKING], b"w", 0o755, WHO)
    await spool.rename(q[State.READY], b"b1", w.id, b"b1", 0, WHO)
    with pytest.raises(NotEmpty):
        await spool.rmdir(w.id, b"b1", WHO)
    sub = spool.lookup(root, b"sub")
    await spool.unlink(sub.id, b"big", WHO)
    await spool.rmdir(root, b"sub", WHO)
    await spool.unlink(root, b"a", WHO)
    await spool.rmdir(w.id, b"b1", WHO)
    assert spool.listdir(w.id) == []
    assert list(spool.content.blobs.walk()) == []
    assert spool.r.history(root)[-1][1] == "discard"


async def test_fan_out_and_replacement_of_a_batch(env: tuple[Spool, Q]) -> None:
    spool, q = env
    sub = Q(spool, (await spool.mkdir(1, b"sub", 0o755, WHO)).id)
    await spool.setxattr(spool.get(q.id), b"user.spool.policy.fanout", b"sub", WHO)
    root, _ = await build(spool, q)
    await spool.rename(q[State.PARTIAL], b"b1", q[State.READY], b"b1", 0, WHO)
    copy = spool.lookup(sub[State.READY], b"b1")
    assert tree(spool, copy.id) == tree(spool, root) == {b"a": b"small", b"sub/big": BIG}
    assert spool.lookup(q[State.SUCCESS], b"b1").id == root
    # A finished batch replaced by a newer one under the same name goes with all its files.
    w = await spool.mkdir(sub[State.WORKING], b"w", 0o755, WHO)
    for _ in range(2):
        await spool.rename(q[State.SUCCESS], b"b1", q[State.READY], b"b1", 0, WHO)  # replay
        name = b"b1" if spool.r.lookup(sub[State.READY], b"b1") else b"b1.~1~"
        await spool.rename(sub[State.READY], name, w.id, b"b1", 0, WHO)
        await spool.rename(w.id, b"b1", sub[State.SUCCESS], b"b1", 0, WHO)
    assert [e.name for e in spool.listdir(sub[State.SUCCESS])] == [b"b1"]
