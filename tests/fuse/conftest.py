"""Fixtures for calling the FUSE handlers (``fuse/ops.py``) directly, without a kernel.

The handlers run on a real store in ``tmp_path`` with the committer in a trio nursery, as in
tests/service; the pyfuse3 calls that need a mounted session (notifications, readdir replies)
are replaced by recorders (helpers/kernel.py). Every test ends with a clean fsck.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pyfuse3
import pytest

from helpers.kernel import Fs, Kernel, Listing
from helpers.spool import running
from spoolfs.fuse import ops as ops_module
from spoolfs.fuse.ops import Operations


@pytest.fixture
async def fs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fs]:
    kernel, listing = Kernel(), Listing()
    monkeypatch.setattr(pyfuse3, "readdir_reply", listing.reply)
    monkeypatch.setattr(pyfuse3, "invalidate_entry_async",
                        lambda ino, name, ignore_enoent=False:
                        kernel.invalidated_entries.append((ino, name)))
    monkeypatch.setattr(pyfuse3, "invalidate_inode",
                        lambda ino, attr_only=False: kernel.invalidated_inodes.append(ino))
    # Whether the opener still holds the file is read from /proc; here no other descriptor
    # exists, and this process's own descriptors could share a small inode number by chance.
    monkeypatch.setattr(ops_module, "_holds", lambda pid, ino: False)
    async with running(tmp_path) as spool:
        f = Fs(Operations(spool), spool, kernel, listing)
        await f.make_queue()
        yield f
