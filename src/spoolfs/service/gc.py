"""Garbage collection: what crashes leave behind, removed in two phases.

Three kinds of garbage:

- **unreferenced blob rows**: a ``blobs`` row that no message references (the row goes, then
  its file);
- **orphan blob files**: a file under ``blobs/`` that no blob row names (``<sha256>.<id>`` with
  no row ``id`` of that hash stored in a file), left by a crash between placing the file and
  committing its row, or between committing a row's deletion and removing its file;
- **orphan staging files**: ``staging/<id>`` without a staged message, held by no daemon (a
  daemon holds the files it made ahead for its next uploads: service/staging_pool.py).

Blob rows and blob files go a page (``PAGE``) at a time, marked then swept, so that a store of a
million contents in files costs a page of memory, not a million names.

**Mark**: a read of the store (no lock) and a walk of the directories find candidates; a file is
a candidate only once it is older than the grace period (its ``ctime``: placing a blob file is a
``link``, which sets it, while its ``mtime`` is the upload's last write). **Sweep**: under the
store's write lock (``Maintenance.write()``: a connection of our own), each candidate is checked
again and removed only if it is still garbage. A daemon places a blob file or creates a staging
file inside the write transaction that names it (or makes it ahead, held, under an id reserved
for it), so while we hold the lock no file is between being created and being named. Orphan
files are therefore unlinked *before* we give the lock up (an id that was never committed may
be used again by the next transaction); the file of a blob row we delete goes after the commit,
as the daemon does it: a committed id is never reused, so a later blob with the same content has
a file of another name.

``collect`` is used by ``spoolfs gc`` and by ``periodic``, a daemon's background collection (a
trio task); ``fsck --repair`` uses the sweeps too. A "message" here is any row that holds content,
files in a batch included. The store's queries come from its ``Maintenance`` interface.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from spoolfs.blobs import StagingDir
from spoolfs.blobs.base import BlobStore
from spoolfs.blobs.files import ObjectInfo
from spoolfs.core.errors import StoreFailure
from spoolfs.store.base import Maintenance
from spoolfs.store.site import Place, as_place

log = logging.getLogger(__name__)

NS = 1_000_000_000
#: Orphan files younger than this are left alone (``--grace``).
GRACE_NS = 600 * NS
#: How long a shared store keeps its change log (gc prunes older rows): far longer than any
#: follower's one-second poll. A daemon cut off from the database for longer misses what was
#: pruned; its kernel keeps nothing for longer than its entry and attribute timeout (1 s).
CHANGES_KEPT_S = 3600.0
#: How often a daemon's background collection runs.
INTERVAL_S = 600.0
#: Blob files (and rows) marked and swept at a time: what a collection holds in memory.
PAGE = 500

T = TypeVar("T")


@dataclass
class Report:
    blob_rows: int = 0  # unreferenced blob rows deleted
    blob_files: int = 0  # orphan blob files removed (not counting the files of deleted rows)
    staging_files: int = 0  # orphan staging files removed
    bytes: int = 0  # freed: sizes of deleted rows' content and of removed files
    young: int = 0  # orphan files left alone: younger than the grace period
    lines: list[str] = field(default_factory=list)  # one per removal
    stopped: bool = False  # ended early (``stop``): what was found so far is removed

    @property
    def removed(self) -> int:
        return self.blob_rows + self.blob_files + self.staging_files

    def summary(self) -> str:
        s = (f"removed {self.blob_rows} unreferenced blob row(s), {self.blob_files} orphan "
             f"blob file(s), {self.staging_files} orphan staging file(s); {self.bytes} bytes freed")
        if self.young:
            s += f"; {self.young} orphan file(s) younger than the grace period left"
        return s


def _age_ns(st: os.stat_result, now_ns: int) -> int:
    # ctime, not mtime: link() (placing a blob) and every write set it, touch -d cannot undo it
    return now_ns - max(st.st_ctime_ns, st.st_mtime_ns)


def _old_enough(path: str, grace_ns: int, now_ns: int) -> os.stat_result | None:
    """The file's stat if it exists and is older than the grace period."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st if _age_ns(st, now_ns) >= grace_ns else None


# --------------------------------------------------------------------------- sweeps


def sweep_blob_rows(maint: Maintenance, blobs: BlobStore, candidates: Iterable[int],
                    report: Report) -> None:
    """Delete blob rows that no message references (checked again under the lock), then their
    files."""
    ids = sorted(set(candidates))
    if not ids:
        return
    gone: list[tuple[bytes, int]] = []
    with maint.write() as tx:
        for bid in ids:
            row = tx.delete_unreferenced_blob(bid)
            if row is None:
                continue
            sha, size, refcount, in_file = row
            if in_file:
                gone.append((sha, bid))
            report.blob_rows += 1
            report.bytes += size
            was = f", its refcount said {refcount}" if refcount else ""
            report.lines.append(f"deleted unreferenced blob {bid} ({size} bytes"
                                f"{', and its file' if in_file else ', inline'}{was})")
    for sha, bid in gone:  # after the commit: a committed id is never used again
        blobs.remove(sha, bid)


def _old_object(blobs: BlobStore, name: str, grace_ns: int, now_ns: int, report: Report
                ) -> ObjectInfo | None:
    """A stored object's info if it is older than the grace period (a younger one is
    counted as left)."""
    info = blobs.info(name)
    if info is None:
        return None
    if now_ns - info.stored_ns < grace_ns:
        report.young += 1
        return None
    return info


def pages(items: Iterable[T], size: int = PAGE) -> Iterator[list[T]]:
    """``items`` in lists of ``size``."""
    it = iter(items)
    while page := list(itertools.islice(it, size)):
        yield page


def collect_blob_files(maint: Maintenance, blobs: BlobStore, grace_ns: int, now_ns: int,
                       report: Report, stop: threading.Event | None = None) -> int | None:
    """Mark and sweep the blob objects that no row names, a page of the walk at a time: the
    page's rows read (no lock), then the orphans older than the grace period swept. Holds a
    page, not the store's million names. Returns how many objects there are, or None when
    ``stop`` was set before the walk's end (it stops at the next page)."""
    objects = 0
    for page in pages(blobs.walk()):
        if stop is not None and stop.is_set():
            return None
        objects += len(page)
        with maint.read() as tx:
            named = tx.files_named([bid for _, _, bid in page if bid >= 0])
        orphans = [(name, sha, bid) for name, sha, bid in page
                   if named.get(bid) != sha
                   and _old_object(blobs, name, grace_ns, now_ns, report) is not None]
        if orphans:
            sweep_blob_files(maint, blobs, orphans, grace_ns, now_ns, report)
    return objects


def collect_blob_rows(maint: Maintenance, blobs: BlobStore, report: Report,
                      stop: threading.Event | None = None) -> bool:
    """Delete the blob rows that no message references, a page at a time. False when
    ``stop`` was set before the end."""
    after = 0
    while True:
        if stop is not None and stop.is_set():
            return False
        with maint.read() as tx:
            page = tx.unreferenced_blobs(after, PAGE)
        sweep_blob_rows(maint, blobs, page, report)
        if len(page) < PAGE:
            return True
        after = page[-1]


def sweep_blob_files(maint: Maintenance, blobs: BlobStore,
                     candidates: Iterable[tuple[str, bytes, int]],
                     grace_ns: int, now_ns: int, report: Report) -> None:
    """Remove blob objects that no row names and that are older than the grace period, while
    holding the write lock. (A store shared by hosts holds no lock over its blob store: there
    the grace period, far longer than any upload waits for its commit, is the guard.)"""
    files = list(candidates)
    if not files:
        return
    with maint.write() as tx:
        for name, sha, bid in files:
            if tx.names_blob_file(sha, bid):
                continue
            info = _old_object(blobs, name, grace_ns, now_ns, report)
            if info is None:
                continue
            if blobs.unlink(name):
                report.blob_files += 1
                report.bytes += info.size if info.links <= 1 else 0
                report.lines.append(f"removed orphan blob file {name} ({info.size} bytes)")


def collect_staging_files(maint: Maintenance, staging: StagingDir, report: Report,
                          stop: threading.Event | None = None, grace_ns: int = 0,
                          now_ns: int | None = None, upto: int | None = None) -> bool:
    """Mark and sweep the staging files without a staged message that no daemon holds, a
    page at a time: the page's rows read (no lock), then the orphans swept. Only those older
    than the grace period when ``now_ns`` is given, only ids up to ``upto`` when it is. False
    when ``stop`` was set before the end (it stops at the next page)."""
    for page in pages(staging.ids(hi=upto)):
        if stop is not None and stop.is_set():
            return False
        with maint.read() as tx:
            staged = tx.staged_among(page)
        orphans = []
        for sid in page:
            if sid in staged or staging.held(sid):  # held: a daemon's file made ahead
                continue
            if now_ns is not None and _old_enough(staging.path(sid), grace_ns, now_ns) is None:
                report.young += os.path.lexists(staging.path(sid))
                continue
            orphans.append(sid)
        sweep_staging(maint, staging, orphans, grace_ns, now_ns, report)
    return True


def sweep_staging(maint: Maintenance, staging: StagingDir, candidates: Iterable[int],
                  grace_ns: int, now_ns: int | None, report: Report) -> None:
    """Remove staging files without a staged message, older than the grace period (any when
    ``now_ns`` is None), while holding the write lock. Each file's own lock is taken before
    its row is asked, and held until it is unlinked (``StagingDir.remove_unheld``): a file a
    daemon no longer holds has its row committed, or none will come (a shared store's
    transaction is no lock over another host's commits), and an upload that makes the file
    meanwhile finds it gone once it gets its lock, and makes it again."""
    ids = sorted(set(candidates))
    if not ids:
        return
    with maint.write() as tx:
        for sid in ids:
            def orphaned(st: os.stat_result, sid: int = sid) -> bool:  # under the file's lock
                if tx.is_staged(sid):
                    return False
                if now_ns is not None and _age_ns(st, now_ns) < grace_ns:
                    report.young += 1
                    return False
                return True
            st = staging.remove_unheld(sid, orphaned)
            if st is not None:
                report.staging_files += 1
                report.bytes += st.st_size if st.st_nlink <= 1 else 0
                report.lines.append(f"removed orphan staging file {staging.path(sid)} "
                                    f"({st.st_size} bytes)")


# --------------------------------------------------------------------------- collection


def collect(where: str | Place, grace_ns: int = GRACE_NS, now_ns: int | None = None,
            stop: threading.Event | None = None) -> Report:
    """Mark, then sweep (short write transactions, a page of each kind of garbage at a time).
    Safe while daemons have the store mounted. ``where``: a store directory or URL, or its
    ``Place``. ``stop`` (a daemon's unmount) ends it at the next page, with what it did."""
    now = time.time_ns() if now_ns is None else now_ns
    place = as_place(where)
    blobs, staging = place.blobs, place.staging
    report = Report()
    maint = place.maintenance()
    try:
        # blob rows and files: marked and swept a page at a time
        if not collect_blob_rows(maint, blobs, report, stop) or \
                collect_blob_files(maint, blobs, grace_ns, now, report, stop) is None:
            report.stopped = True
            return report
        # staging files (as many as uploads under way): marked and swept a page at a time
        if not collect_staging_files(maint, staging, report, stop, grace_ns, now):
            report.stopped = True
            return report
        pruned = maint.prune_changes(CHANGES_KEPT_S)
        if pruned:
            report.lines.append(f"pruned {pruned} change-log row(s) older than "
                                f"{CHANGES_KEPT_S:g}s")
    finally:
        maint.close()
    return report


def crash_staging(place: Place, upto: int, before_ns: int,
                  stop: threading.Event | None = None) -> tuple[bool, Report]:
    """Recovery's staging files, once a mount serves (service/recovery.py): those with ids
    up to ``upto`` (the highest the store had given when the mount began) without a staged
    message, that no daemon holds, last changed before ``before_ns`` (the mount's start by
    the staging directory's clock: a file of an upload that took one of those ids again
    after a database server's crash is newer); whether the walk ended (False: stopped by
    ``stop``, at the next page), and what was removed (``young``: the files kept as newer)."""
    report = Report()
    maint = place.maintenance()
    try:
        done = collect_staging_files(maint, place.staging, report, stop, grace_ns=1,
                                     now_ns=before_ns, upto=upto)
    finally:
        maint.close()
    return done, report


def crash_leftovers(place: Place, stop: threading.Event | None = None
                    ) -> tuple[int | None, Report]:
    """Recovery's last step, once a mount of an embedded store serves (service/recovery.py):
    the blob files a crash left without their row, whatever their age; how many blob files
    there are (None: stopped by ``stop``, at the next page), and what was removed. No grace
    period: the store's write lock covers its blob directory, and while the sweep holds it
    no daemon is between placing a file and committing the row that names it."""
    assert place.embedded, "a shared blob store is guarded by the grace period alone"
    report = Report()
    maint = place.maintenance()
    try:
        objects = collect_blob_files(maint, place.blobs, 0, time.time_ns(), report, stop)
    finally:
        maint.close()
    return objects, report


async def periodic(where: str | Place, interval_s: float = INTERVAL_S,
                   grace_ns: int = GRACE_NS, stop: threading.Event | None = None) -> None:
    """A daemon's background collection: ``collect`` every ``interval_s`` in a worker thread.
    A failure is logged and the next round runs; it never ends the mount. The thread cannot
    be cancelled: an unmount sets ``stop``, and a round under way ends at its next page."""
    import trio

    while True:
        await trio.sleep(interval_s)
        try:
            report = await trio.to_thread.run_sync(collect, where, grace_ns, None, stop)
        except (OSError, StoreFailure) as e:
            log.warning("gc: failed, trying again in %gs: %s", interval_s, e)
            continue
        except Exception:
            log.exception("gc: unexpected error; trying again in %gs", interval_s)
            continue
        for line in report.lines:
            log.info("gc: %s", line)
        if report.removed:
            log.info("gc: %s", report.summary())
