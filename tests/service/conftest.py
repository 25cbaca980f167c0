"""Fixtures of the service tests: a spool on a store in ``tmp_path`` with a queue ``q``.

Every service test also checks that each history row it writes comes from a row of the
transition table, written through the one helper that applies it (``service/moves.py``): a
mover that spelled its own field changes would write its history elsewhere."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.spool import WHO, Q, running
from spoolfs.core import transitions
from spoolfs.core.rules import Action, State
from spoolfs.service import moves
from spoolfs.service.spool import Spool
from spoolfs.store.base import WriteTx


@pytest.fixture
async def daemons(tmp_path: Path) -> AsyncIterator[tuple[Spool, Spool, Q]]:
    """Daemons A and B of one embedded store, as two mounts of it are, and its queue ``q``."""
    async with running(tmp_path) as a, running(tmp_path) as b:
        yield a, b, Q(a, (await a.mkdir(1, b"q", 0o755, WHO)).id)


@pytest.fixture(params=["sqlite", "memory"])
async def env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Spool, Q]]:
    """The service's rules hold on every engine: each test of ``env`` runs on the embedded
    engine and on the in-memory one."""
    async with running(tmp_path, request.param) as spool:
        qe = await spool.mkdir(1, b"q", 0o755, WHO)
        yield spool, Q(spool, qe.id)


def _engines() -> list[type[WriteTx]]:
    found, todo = [], list(WriteTx.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if "add_history" in vars(c)]


def check_history(action: str, dst: str | None, caller: str) -> None:
    """One history row: written by ``service/moves.py``, its action a row of the table
    whose targets hold the state it names."""
    assert caller == moves.__file__, \
        f"history {action!r} written outside service/moves.py: {caller}"
    to = State(dst.split("/")[0]) if dst is not None else None
    transitions.transition(Action(action), to)  # KeyError: no such row


@pytest.fixture(autouse=True)
def history_goes_through_the_table(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for cls in _engines():
        original = vars(cls)["add_history"]

        def add_history(self: WriteTx, entry_id: int, at_ns: int, action: str, *rest: Any,
                        __original: Any = original) -> None:
            check_history(action, rest[1], sys._getframe(1).f_code.co_filename)
            __original(self, entry_id, at_ns, action, *rest)

        monkeypatch.setattr(cls, "add_history", add_history)
    yield
