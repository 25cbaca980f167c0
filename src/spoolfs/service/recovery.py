"""Reconcile what a crash leaves behind, before a mount serves requests.

- an upload into ``ready/`` that never closed is moved to ``partial/``: ``ready/`` only ever
  shows complete files (skipped while another daemon still has it open for writing);
- staging files without a message (and held by no upload) are removed, and unreferenced blob
  rows, under the store's write lock so no other daemon is mid-transaction. Of the staging
  files, only those above the highest entry id the store has given, before the mount serves:
  a power cut can take the ids given back below the files of uploads it cut short (uploads
  and reservations commit without fsync), and the mount's uploads take those ids again. The
  files at or below it (``orphan_staging_files``), once the mount serves: an upload left in
  ``partial/`` has one, and a million would hold up the mount for seconds. No upload takes
  one of those ids again, so that a leftover harms nothing meanwhile; a file changed since
  the mount began is kept all the same (a database server that crashes during the mount can
  take the ids given back below the bound, as a power cut can here).
- blob files without a blob row (``orphan_blob_files``) once the mount serves: a deep queue
  of large messages has a million files, whose walk would hold up the mount for a minute.
  An orphan file harms nothing meanwhile: placing a blob over one replaces it.

Both walks are gc's mark and sweep, without a grace period: the walk and the row lookups
take no lock; only the files found orphaned are looked at again under it.

A store shared by several hosts takes no such lock: there, blob files and rows are left to
gc, and only uploads staged on this host are judged.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import NamedTuple

import trio

from spoolfs.core.rules import Action, State
from spoolfs.core.transitions import Context
from spoolfs.service import gc
from spoolfs.service.moves import apply
from spoolfs.service.spool import Spool
from spoolfs.store.base import Entry, WriteTx

log = logging.getLogger(__name__)


#: rows and files judged per query and per batch: what recovery holds, however many uploads
#: a store has under way or left in ``partial/``
PAGE = 500


class Recovered(NamedTuple):
    counts: dict[str, int]
    #: the highest entry id given when the mount began: the staging files at or below it
    #: are walked once the mount serves (``orphan_staging_files``)
    staging_upto: int
    #: when the mount began, by the staging directory's clock: that walk removes only files
    #: changed before it
    staging_before_ns: int


def recover(spool: Spool) -> Recovered:
    counts = {"uploads_to_partial": 0, "staging_orphans": 0, "blobs_freed": 0}
    if spool.content.staging.adopt_flat_layout():
        log.info("recovery: staging files moved into the bucketed layout")
    try:
        before_ns = spool.content.staging.clock_ns()
    except OSError as e:  # the walk after serving then removes nothing: gc's, later
        log.warning("recovery: the staging directory's clock not read (%s): the staging "
                    "files a crash left are left to gc", e)
        before_ns = 0
    after = 0
    while True:  # found by index: mounting costs the same however deep the queues
        page = spool.r.unclosed_uploads(after, PAGE)
        counts["uploads_to_partial"] += sum(_unclosed_to_partial(spool, e) for e in page)
        if len(page) < PAGE:
            break
        after = page[-1].id
    counts["staging_orphans"], upto = _staging_above(spool)
    if spool.place.embedded:
        # A shared store's blob files and rows are gc's: other hosts place content and commit
        # rows meanwhile, under no lock of ours (gc waits out a grace period: service/gc.py).
        counts["blobs_freed"] = _unreferenced_blobs(spool)
    if any(counts.values()):
        log.info("recovery: %s", ", ".join(f"{k}={v}" for k, v in counts.items()))
    return Recovered(counts, upto, before_ns)


def _unclosed_to_partial(spool: Spool, e: Entry) -> bool:
    """Move an upload into ``ready/`` that never closed, and that no daemon holds, to
    ``partial/``; whether it moved."""
    r, content = spool.r, spool.content
    if content.staging.held(e.id):
        return False
    if not spool.place.embedded and not os.path.exists(content.staging.path(e.id)):
        return False  # being written on another host: that host's daemon judges it
    assert e.queue is not None
    partial = next((c for c in r.children(e.queue) if c.state is State.PARTIAL), None)
    if partial is None:
        return False

    def fn(tx: WriteTx) -> bool:
        cur = tx.get(e.id)
        if cur is None or not cur.hidden or cur.parent != e.parent or cur.name != e.name:
            return False  # its writer closed it since the page was read: published
        name = cur.name
        if tx.lookup(partial.id, name) is not None:
            name = (name + b".recovered-%d" % cur.id)[-255:]
        return apply(tx, cur, Action.RECOVERED, State.PARTIAL, Context(time.time_ns()),
                     (None, os.getpid()), into=(partial.id, name),
                     src="ready (unclosed upload)", why="upload never closed before a crash")

    ok, moved = spool.store.run_batch([fn], durable=True)[0]
    if not ok or not moved:
        return False
    log.warning("recovery: unclosed upload %r moved from ready/ to partial/", e.name)
    return True


def _staging_above(spool: Spool) -> tuple[int, int]:
    """Remove the staging files above the highest entry id the store has given that no row
    names and no daemon holds, under the store's write lock (no other daemon is
    mid-transaction or reserving ids); how many, and that id. A new upload's staging file is
    held before its row commits: a file nobody holds and no row names is left over from a
    crash. Those above the id are the few a power cut took the ids of (a bucket or two)."""
    staging = spool.content.staging

    def unstaged(tx: WriteTx, sid: int, _: os.stat_result) -> bool:
        return sid not in tx.staged_among([sid])

    def judge(tx: WriteTx) -> tuple[int, int]:
        upto, removed = tx.highest_entry_id(), 0
        for sid in staging.ids(lo=upto + 1):
            # its row asked under its lock, as gc's sweep: a file no longer held has its row
            # committed, or none will come (a shared store's transaction locks no other host)
            if staging.remove_unheld(sid, functools.partial(unstaged, tx, sid)) is not None:
                removed += 1
        return removed, upto

    ok, found = spool.store.run_batch([judge], durable=False)[0]
    if not ok:
        raise found
    removed, upto = found
    return int(removed), int(upto)


def _unreferenced_blobs(spool: Spool) -> int:
    """Delete the blob rows no message holds (and their files), a page at a time; how many."""
    freed, after = 0, 0

    def free(tx: WriteTx, after: int) -> list[int]:
        page = tx.unreferenced_blobs(after, PAGE)
        for b in page:
            tx.blob_delete(b.id)
            if b.data is None:
                spool.content.blobs.remove(b.sha256, b.id)
        return [b.id for b in page]

    while True:
        ok, ids = spool.store.run_batch([functools.partial(free, after=after)], durable=True)[0]
        if not ok:
            raise ids
        freed += len(ids)
        if len(ids) < PAGE:
            return freed
        after = ids[-1]


async def orphan_staging_files(spool: Spool, recovered: Recovered,
                               stop: threading.Event | None = None) -> int:
    """Remove the staging files a crash left with ids up to ``recovered.staging_upto``: no
    staged message names them, no daemon holds them, and they were last changed before the
    mount began; how many. Run once the mount serves, in a worker thread, a page at a time
    (``gc.crash_staging``). ``stop``: set by an unmount that will not wait for the end; the
    walk stops at its next page."""
    start = time.monotonic()
    done, report = await trio.to_thread.run_sync(
        gc.crash_staging, spool.place, recovered.staging_upto, recovered.staging_before_ns,
        stop)
    if report.young:  # an id given again (a database server's crash), or a file of the
        # mount's first moment: gc's grace period judges them
        log.warning("recovery: %d staging file(s) with ids given before the mount but changed "
                    "since it began kept; gc removes them if no upload claims them",
                    report.young)
    if not done:
        log.warning("recovery: the walk of the staging files stopped by the unmount after "
                    "%.1f s (%d left by a crash removed); the next mount walks them again",
                    time.monotonic() - start, report.staging_files)
    else:  # the line says when it is done: from then on, fsck beside the daemon finds none
        log.info("recovery: staging files looked at in %.1f s, %d left by a crash removed",
                 time.monotonic() - start, report.staging_files)
    return report.staging_files


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
