"""The follower applies other daemons' changes (and only theirs) in order, from the last one
seen, and keeps going while the store is away."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio

from spoolfs.core.errors import StoreFailure
from spoolfs.service import follower
from spoolfs.service.follower import Follower


@dataclass
class Ch:
    seq: int
    entry_id: int
    origin: str
    parent: int | None = None
    name: bytes | None = None
    old_parent: int | None = None
    old_name: bytes | None = None


class Feed:
    origin = "me"

    def __init__(self) -> None:
        self.log: list[Ch] = []
        self.down = False
        self.asked: list[int] = []

    def last_change(self) -> int:
        if self.down:
            raise StoreFailure("database unreachable")
        return self.log[-1].seq if self.log else 0

    def changes_since(self, seq: int, limit: int = 1000) -> list[Ch]:
        if self.down:
            raise StoreFailure("database unreachable")
        self.asked.append(seq)
        return [c for c in self.log if c.seq > seq][:limit]

    def wait_changes(self, timeout: float) -> bool:
        return False


async def test_only_other_daemons_changes_are_applied_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follower, "PAGE", 2)  # in pages
    feed = Feed()
    feed.log.append(Ch(1, 10, "other", 5, b"old"))  # before the follower started: not replayed
    gone: list[tuple[int, bytes]] = []
    stale: list[list[int]] = []
    f = Follower(feed, lambda p, n: gone.append((p, n)), stale.append)
    f.seq = feed.last_change()
    feed.log += [Ch(2, 11, "other", 5, b"a"), Ch(3, 12, "me", 5, b"b"),
                 Ch(4, 11, "other", 6, b"a2", old_parent=5, old_name=b"a")]
    assert await f.catch_up() == 2
    assert set(gone) == {(5, b"a"), (6, b"a2")}  # where it was and where it is
    assert [i for ids in stale for i in ids] == [11, 11]
    # a page that came back short was the end: every commit notifies, and its wake-up is a
    # query, not two
    assert f.seq == 4 and feed.asked == [1, 3]
    assert await f.catch_up() == 0
    assert feed.asked == [1, 3, 4]
    assert f.seen == 2  # (counted once each, over two pages)


async def test_a_store_that_is_away_is_followed_again_from_the_last_change_seen() -> None:
    feed = Feed()
    gone: list[tuple[int, bytes]] = []
    f = Follower(feed, lambda p, n: gone.append((p, n)), lambda ids: None)
    f.seq = 0
    feed.down = True
    feed.log.append(Ch(1, 10, "other", 5, b"x"))
    async with trio.open_nursery() as n:
        await n.start(f.run)
        await trio.sleep(0.05)
        assert gone == []
        feed.down = False
        with trio.fail_after(10):
            while gone != [(5, b"x")]:
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
