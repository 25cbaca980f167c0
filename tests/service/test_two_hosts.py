"""Two hosts of a store shared by several (DESIGN §6), each a spool with a local directory of
its own: an upload's bytes are in a staging file on the host that made it, until it is
published. Through another host it can be listed, renamed within ``partial/`` and removed,
but not read, written, resized, published or linked: that is refused (EREMOTE) and changes
nothing, where it used to publish an empty message and lose the bytes."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from helpers.spool import WHO, Q, content
from spoolfs.blobs.files import BlobDir, StagingDir
from spoolfs.core.errors import SpoolError
from spoolfs.core.rules import State
from spoolfs.service.spool import Spool
from spoolfs.store.registry import open_store
from spoolfs.store.site import Place


def _host(tmp_path: Path, name: str) -> Place:
    """A host's view of the shared store: the content shared, its local directory its own.
    (The metadata here is an embedded engine's file: the service's rules do not depend on
    the engine.)"""
    local = tmp_path / name
    local.mkdir()
    return Place(str(tmp_path / "meta"), BlobDir(str(tmp_path / "blobs")),
                 StagingDir(str(local / "staging")), str(local), False, str(tmp_path / "blobs"))


@asynccontextmanager
async def two_hosts(tmp_path: Path) -> AsyncIterator[tuple[Spool, Spool]]:
    (tmp_path / "meta").mkdir()
    stores = [open_store(str(tmp_path / "meta")) for _ in range(2)]
    spools = [Spool(s, _host(tmp_path, name)) for s, name in zip(stores, "ab", strict=True)]
    try:
        async with trio.open_nursery() as n:
            for s in spools:
                await n.start(s.committer.run)
            yield spools[0], spools[1]
            for s in spools:
                s.committer.close()
    finally:
        for st in stores:
            st.close()


def _remote(err: pytest.ExceptionInfo[SpoolError]) -> None:
    assert err.value.errno == errno.EREMOTE


async def test_an_upload_made_on_another_host_is_not_published_here(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as (a, b):
        q = Q(a, (await a.mkdir(1, b"q", 0o755, WHO)).id)
        e0, h0 = await b.create(q[State.PARTIAL], b"own", 0o644, WHO)  # B has files of its own
        await b.close(h0, WHO)
        e, h = await a.create(q[State.PARTIAL], b"up", 0o644, WHO)
        a.write(h, 0, b"written on host A")
        await a.close(h, WHO)

        with pytest.raises(SpoolError) as err:
            await b.rename(q[State.PARTIAL], b"up", q[State.READY], b"up", 0, WHO)
        _remote(err)
        with pytest.raises(SpoolError) as err:
            await b.link(e.id, q[State.READY], b"copy", WHO)
        _remote(err)
        for writable, truncate in ((False, False), (True, False), (True, True)):
            with pytest.raises(SpoolError) as err:
                await b.open(e.id, writable, truncate, WHO)
            _remote(err)
        with pytest.raises(SpoolError) as err:
            await b.setattr(e.id, size=0, who=WHO)
        _remote(err)
        with pytest.raises(SpoolError) as err:
            await b.setattr(e.id, mtime_ns=1, who=WHO)  # touch: the staging file's time
        _remote(err)
        assert not (tmp_path / "b/staging" / "0" / str(e.id)).exists()  # nothing made on B

        # a rename inside partial/ needs no bytes: it works from any host
        await b.rename(q[State.PARTIAL], b"up", q[State.PARTIAL], b"renamed", 0, WHO)
        await a.rename(q[State.PARTIAL], b"renamed", q[State.READY], b"up", 0, WHO)
        m = b.get(e.id)
        assert (m.state, m.hidden, m.staged) == (State.READY, False, False)
        assert content(b, e.id) == b"written on host A"

        # and removing another host's upload needs no bytes either
        e2, h2 = await a.create(q[State.PARTIAL], b"gone", 0o644, WHO)
        a.write(h2, 0, b"x")
        await a.close(h2, WHO)
        await b.unlink(q[State.PARTIAL], b"gone", WHO)
        assert a.r.get(e2.id) is None
