"""Reconcile what a crash leaves behind, before a mount serves requests.

- an upload into ``ready/`` that never closed is moved to ``partial/``: ``ready/`` only ever
  shows complete files (skipped while another daemon still has it open for writing);
- staging files without a message (and held by no upload) are removed, and unreferenced blob
  rows, under the store's write lock so no other daemon is mid-transaction;
- blob files without a blob row (``orphan_blob_files``) once the mount serves: a deep queue
  of large messages has a million files, whose walk would hold up the mount for a minute.
  gc's mark and sweep do it, without a grace period: the walk and the row lookups take no
  lock; only the files found orphaned are looked at again under it. An orphan file harms
  nothing meanwhile: placing a blob over one replaces it.

A store shared by several hosts takes no such lock: there, blob files and rows are left to
gc, and only uploads staged on this host are judged.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import trio

from spoolfs.core.rules import Action, State
from spoolfs.core.transitions import Context
from spoolfs.service import gc
from spoolfs.service.moves import apply
from spoolfs.service.spool import Spool
from spoolfs.store.base import Entry, WriteTx

log = logging.getLogger(__name__)


def recover(spool: Spool) -> dict[str, int]:
    r, content = spool.r, spool.content
    counts = {"uploads_to_partial": 0, "staging_orphans": 0, "blobs_freed": 0}
    if content.staging.adopt_flat_layout():
        log.info("recovery: staging files moved into the bucketed layout")
    entries = r.staged_entries()  # found by index: mounting costs the same however deep the queues

    shared = not spool.place.embedded
    for e in entries:
        if not e.hidden or content.staging.held(e.id):
            continue
        if shared and not os.path.exists(content.staging.path(e.id)):
            continue  # being written on another host: that host's daemon judges it
        assert e.queue is not None
        partial = next((c for c in r.children(e.queue) if c.state is State.PARTIAL), None)
        if partial is None:
            continue

        def fn(tx: WriteTx, e: Entry = e, partial: Entry = partial) -> bool:
            cur = tx.get(e.id)
            if cur is None or not cur.hidden or cur.parent != e.parent or cur.name != e.name:
                return False  # its writer closed it since the list was read: published
            name = cur.name
            if tx.lookup(partial.id, name) is not None:
                name = (name + b".recovered-%d" % cur.id)[-255:]
            return apply(tx, cur, Action.RECOVERED, State.PARTIAL, Context(time.time_ns()),
                         (None, os.getpid()), into=(partial.id, name),
                         src="ready (unclosed upload)", why="upload never closed before a crash")

        ok, moved = spool.store.run_batch([fn], durable=True)[0]
        if not ok or not moved:
            continue
        counts["uploads_to_partial"] += 1
        log.warning("recovery: unclosed upload %r moved from ready/ to partial/", e.name)

    def orphans(tx: WriteTx) -> None:
        # A new upload's staging file is held before its row commits: a file nobody holds
        # and no row names is left over from a crash.
        staged = {e.id for e in tx.staged_entries()}
        for sid in content.staging.ids():
            if sid not in staged and not content.staging.held(sid):
                content.staging.remove(sid)
                counts["staging_orphans"] += 1
        if shared:
            # Other hosts place content and commit rows meanwhile, under no lock of ours:
            # blob files and rows are gc's, which waits out a grace period (service/gc.py).
            return
        for b in tx.unreferenced_blobs():
            tx.blob_delete(b.id)
            if b.data is None:
                content.blobs.remove(b.sha256, b.id)
            counts["blobs_freed"] += 1

    ok, err = spool.store.run_batch([orphans], durable=True)[0]
    if not ok:
        raise err
    if any(counts.values()):
        log.info("recovery: %s", ", ".join(f"{k}={v}" for k, v in counts.items()))
    return counts


async def orphan_blob_files(spool: Spool, stop: threading.Event | None = None) -> int:
    """Remove the blob files a crash left without a row (an embedded store's; a shared one
    leaves them to gc); how many. Run once the mount serves: gc's mark (no lock) and sweep
    (each file found looked at again under the write lock), in a worker thread, with no grace
    period (``gc.crash_leftovers``). ``stop``: set by an unmount that will not wait for the
    end; the walk stops at its next page."""
    if not spool.place.embedded:
        return 0
    start = time.monotonic()
    files, report = await trio.to_thread.run_sync(gc.crash_leftovers, spool.place, stop)
    if files is None:
        log.warning("recovery: the walk of the blob files stopped by the unmount after %.1f s "
                    "(%d left by a crash removed); the next mount walks them again",
                    time.monotonic() - start, report.blob_files)
        return report.blob_files
    # the line says when it is done: from then on, fsck beside the daemon finds no leftover
    log.info("recovery: %d blob file(s) looked at in %.1f s, %d left by a crash removed",
             files, time.monotonic() - start, report.blob_files)
    return report.blob_files
