"""Group commit (DESIGN §6): concurrent requests share one commit; failures stay their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from spoolfs.core.errors import NotFound
from spoolfs.service.committer import Committer
from spoolfs.store.sqlite import open_store


def _touch(entry_id: int):  # type: ignore[no-untyped-def]
    def fn(tx):  # type: ignore[no-untyped-def]
        if not tx.update(entry_id, mtime_ns=1):
            raise NotFound(f"no entry {entry_id}")
        return entry_id
    return fn


async def test_concurrent_requests_share_one_commit(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    committer = Committer(store)
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            results[i] = await committer.submit(_touch(1 if i % 3 else 999))
        except NotFound as e:
            results[i] = e

    async with trio.open_nursery() as n:
        await n.start(committer.run)
        async with trio.open_nursery() as clients:
            for i in range(12):
                clients.start_soon(one, i)
        committer.close()
    assert committer.requests == 12
    assert committer.batches < 12, "no two concurrent requests shared a commit"
    for i in range(12):
        if i % 3:
            assert results[i] == 1
        else:
            assert isinstance(results[i], NotFound), "a failed request must fail alone"
    with pytest.raises(Exception, match="shutting down"):
        await committer.submit(_touch(1))
    store.close()
