"""Reconcile what a crash leaves behind, before a mount serves requests.

- an upload into ``ready/`` that never closed is moved to ``partial/``: ``ready/`` only ever
  shows complete files (skipped while another daemon still has it open for writing);
- staging files without a message (and held by no upload) are removed; blob files without a
  blob row and unreferenced blob rows too, under the store's write lock so no other daemon is
  mid-transaction. The blob files are walked, and their rows looked up, before the lock is
  taken (a deep queue of large messages has a million): under it, only the files found
  orphaned are looked at again. A store shared by several hosts takes no such lock: there,
  blob files and rows are left to gc, and only uploads staged on this host are judged.
"""

from __future__ import annotations

import logging
import os
import time

from spoolfs.core.rules import Action, State
from spoolfs.core.transitions import Context
from spoolfs.service.moves import apply
from spoolfs.service.spool import Spool
from spoolfs.store.base import Blob, Entry, WriteTx

log = logging.getLogger(__name__)


def recover(spool: Spool) -> dict[str, int]:
    r, content = spool.r, spool.content
    counts = {"uploads_to_partial": 0, "staging_orphans": 0, "blob_orphans": 0, "blobs_freed": 0}
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

    # Blob files no row names, found without the lock: another daemon on the store commits
    # meanwhile, and a file it places then is looked at again below.
    suspects = [] if shared else [
        (path, sha, bid) for path, sha, bid in content.blobs.walk()
        if not _named(r.blob(bid), sha)]

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
        # Holding the write lock: no other daemon is between placing a blob file and
        # committing the row that names it. (Content kept inside the store, small messages,
        # has no file: a deep queue of those costs nothing here.)
        for path, sha, bid in suspects:
            if not _named(tx.blob(bid), sha):
                try:
                    os.unlink(path)
                except FileNotFoundError:  # removed meanwhile (another daemon's recovery)
                    continue
                counts["blob_orphans"] += 1
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


def _named(b: Blob | None, sha: bytes) -> bool:
    """Whether a blob file of this content is the one blob row ``b`` (looked up by the file's
    id) names: a row of the same content, kept in a file."""
    return b is not None and b.sha256 == sha and b.data is None
