"""Reconcile what a crash leaves behind, before a mount serves requests.

- an upload into ``ready/`` that never closed is moved to ``partial/``: ``ready/`` only ever
  shows complete files (skipped while another daemon still has it open for writing);
- staging files without a message, blob files without a blob row, unreferenced blob rows are
  removed (files only when older than a grace period: another daemon's transaction may be about
  to commit them).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time

from spoolfs.core.rules import State
from spoolfs.service.spool import Spool
from spoolfs.store.base import WriteTx

log = logging.getLogger(__name__)
GRACE_S = 60.0


def _in_use(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)
    return False


def _old(path: str, now: float) -> bool:
    try:
        return now - os.lstat(path).st_ctime > GRACE_S
    except FileNotFoundError:
        return False


def recover(spool: Spool) -> dict[str, int]:
    r, content = spool.r, spool.content
    counts = {"uploads_to_partial": 0, "staging_orphans": 0, "blob_orphans": 0, "blobs_freed": 0}
    entries = r.all_entries()
    by_id = {e.id: e for e in entries}
    now = time.time()

    for e in entries:
        if not e.hidden or _in_use(content.staging.path(e.id)):
            continue
        assert e.queue is not None
        partial = next((c for c in r.children(e.queue) if c.state is State.PARTIAL), None)
        if partial is None:
            continue

        def fn(tx: WriteTx, e=e, partial=partial) -> None:  # type: ignore[no-untyped-def]
            name = e.name
            if tx.lookup(partial.id, name) is not None:
                name = (name + b".recovered-%d" % e.id)[-255:]
            tx.move(e.id, e.parent, e.name, partial.id, name, state=State.PARTIAL, hidden=0)
            tx.add_history(e.id, time.time_ns(), "recovered", "ready (unclosed upload)",
                           "partial", None, os.getpid(), "upload never closed before a crash")

        spool.store.run_batch([fn], durable=True)
        counts["uploads_to_partial"] += 1
        log.warning("recovery: unclosed upload %r moved from ready/ to partial/", e.name)

    for sid in content.staging.ids():
        e = by_id.get(sid)
        if (e is None or not e.staged) and _old(content.staging.path(sid), now):
            content.staging.remove(sid)
            counts["staging_orphans"] += 1

    blobs = {b.id: b for b in r.all_blobs()}
    for path, sha, bid in content.blobs.walk():
        b = blobs.get(bid)
        if (b is None or b.sha256 != sha or b.data is not None) and _old(path, now):
            os.unlink(path)
            counts["blob_orphans"] += 1

    unreferenced = [b for b in blobs.values() if b.refcount == 0]
    if unreferenced:
        def drop(tx: WriteTx) -> None:
            for b in unreferenced:
                if tx.blob(b.id) is not None and tx.blob(b.id).refcount == 0:  # type: ignore[union-attr]
                    tx.blob_delete(b.id)

        spool.store.run_batch([drop], durable=True)
        for b in unreferenced:
            if b.data is None:
                content.blobs.remove(b.sha256, b.id)
        counts["blobs_freed"] = len(unreferenced)
    if any(counts.values()):
        log.info("recovery: %s", ", ".join(f"{k}={v}" for k, v in counts.items()))
    return counts
