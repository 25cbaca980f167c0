"""Fixtures of the service tests: a spool on a store in ``tmp_path`` with a queue ``q``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from helpers.spool import WHO, Q, running
from spoolfs.service.spool import Spool


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[Spool, Q]]:
    async with running(tmp_path) as spool:
        qe = await spool.mkdir(1, b"q", 0o755, WHO)
        yield spool, Q(spool, qe.id)
