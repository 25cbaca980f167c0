"""Requests of an NFS server exporting the mount (``-o nfs_export``; docs/design.md, "Serving
NFS clients"): the server holds descriptors for its clients and closes them when it pleases, so a client's COMMIT or
rename publishes, and the server's descriptors hold no lease."""

from __future__ import annotations

import pytest

from helpers.spool import WHO, Q, content
from spoolfs.core.errors import NotFound, NotPermitted
from spoolfs.core.rules import State
from spoolfs.service.spool import Spool, Who

NFS = Who(0, 0, 4242, nfs=True)


async def test_a_created_file_is_found_by_the_server_only(env: tuple[Spool, Q]) -> None:
    """The server looks up what it just created in ready/; nobody else sees it yet."""
    spool, q = env
    e, h = await spool.create(q[State.READY], b"f", 0o644, NFS)
    found = await spool.find(q[State.READY], b"f", NFS)
    assert found is not None and found.id == e.id
    with pytest.raises(NotFound):
        await spool.find(q[State.READY], b"f", WHO)
    with pytest.raises(NotFound):
        await spool.find(q[State.READY], b"f")
    await spool.close(h, Who())


async def test_a_commit_publishes_what_the_server_created(env: tuple[Spool, Q]) -> None:
    spool, q = env
    e, h = await spool.create(q[State.READY], b"f", 0o644, NFS)
    spool.write(h, 0, b"all of it")
    assert spool.listdir(q[State.READY]) == []
    await spool.committed(h, NFS)
    assert spool.lookup(q[State.READY], b"f").id == e.id
    assert content(spool, e.id) == b"all of it"
    with pytest.raises(NotPermitted):  # a late write is refused, never lost
        spool.write(h, 9, b"more")
    await spool.close(h, Who())  # the server's close changes nothing
    assert content(spool, e.id) == b"all of it"


async def test_a_local_writer_keeps_the_upload_back_from_a_commit(
        env: tuple[Spool, Q]) -> None:
    spool, q = env
    e, h = await spool.create(q[State.READY], b"f", 0o644, NFS)
    local = await spool.open(e.id, True, False, WHO)
    spool.write(h, 0, b"x")
    await spool.committed(h, NFS)
    assert spool.listdir(q[State.READY]) == []
    await spool.close(local, WHO)
    assert spool.lookup(q[State.READY], b"f").id == e.id
    await spool.close(h, Who())


async def test_the_servers_close_publishes_a_file_never_committed(
        env: tuple[Spool, Q]) -> None:
    """A client made an empty file and never synced: it appears when the server lets go."""
    spool, q = env
    e, h = await spool.create(q[State.READY], b"empty", 0o644, NFS)
    await spool.close(h, Who())
    assert spool.lookup(q[State.READY], b"empty").id == e.id
    assert content(spool, e.id) == b""


async def test_a_rename_into_ready_publishes_at_once(env: tuple[Spool, Q]) -> None:
    """The server still holds the file it wrote in partial/: the client's rename publishes
    it all the same, and the server's later writes are refused."""
    spool, q = env
    e, h = await spool.create(q[State.PARTIAL], b"f", 0o644, NFS)
    spool.write(h, 0, b"done")
    await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, NFS)
    assert spool.lookup(q[State.READY], b"f").id == e.id
    assert content(spool, e.id) == b"done"
    with pytest.raises(NotPermitted):
        spool.write(h, 4, b"late")
    await spool.close(h, Who())
    assert content(spool, e.id) == b"done"


async def test_the_servers_descriptor_holds_no_lease(env: tuple[Spool, Q]) -> None:
    spool, q = env
    e, h = await spool.create(q[State.PARTIAL], b"f", 0o644, WHO)
    spool.write(h, 0, b"job")
    await spool.close(h, WHO)
    await spool.rename(q[State.PARTIAL], b"f", q[State.READY], b"f", 0, WHO)
    view = await spool.mkdir(q[State.WORKING], b"c1", 0o755, NFS)
    await spool.rename(q[State.READY], b"f", view.id, b"f", 0, NFS)
    served = await spool.open(e.id, False, False, NFS)
    assert not spool.holds(e.id)  # the lease runs out unless the client reads or touches
    local = await spool.open(e.id, False, False, WHO)
    assert spool.holds(e.id)
    await spool.close(local, WHO)
    await spool.close(served, Who())
    assert not spool.holds(e.id)


async def test_the_server_may_open_published_content_for_writing_but_not_write(
        env: tuple[Spool, Q]) -> None:
    """nfs-ganesha opens a file read-write to set its times (a client's touch of its claim):
    the open succeeds, a write through it is refused, the content never changes."""
    spool, q = env
    e, h = await spool.create(q[State.READY], b"f", 0o644, WHO)
    spool.write(h, 0, b"sealed")
    await spool.close(h, WHO)
    with pytest.raises(NotPermitted):
        await spool.open(e.id, True, False, WHO)  # a local writer is refused at open
    served = await spool.open(e.id, True, False, NFS)
    with pytest.raises(NotPermitted):
        spool.write(served, 0, b"changed")
    await spool.close(served, Who())
    assert content(spool, e.id) == b"sealed"


@pytest.mark.parametrize("how", ["ln", "batch"])
async def test_a_link_or_a_batch_publish_stops_the_servers_writes(
        env: tuple[Spool, Q], how: str) -> None:
    """``ln partial/f ready/g`` seals f, and ``mv partial/b1 ready/`` every file of b1: the
    server's descriptors on them write no more, as after a rename of f itself. A late write
    would land in the bytes the message's content was sealed from."""
    spool, q = env
    if how == "ln":
        e, h = await spool.create(q[State.PARTIAL], b"f", 0o644, NFS)
    else:
        b1 = await spool.mkdir(q[State.PARTIAL], b"b1", 0o755, WHO)
        e, h = await spool.create(b1.id, b"f", 0o644, NFS)
    spool.write(h, 0, b"all of it")
    if how == "ln":
        await spool.link(e.id, q[State.READY], b"g", WHO)
    else:
        await spool.rename(q[State.PARTIAL], b"b1", q[State.READY], b"b1", 0, WHO)
    with pytest.raises(NotPermitted):  # refused, never lost
        spool.write(h, 9, b"more")
    assert content(spool, e.id) == b"all of it"
    await spool.close(h, Who())
