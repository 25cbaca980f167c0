"""Consistency checks of a store, one small ``check_*`` method per kind of damage, and their
repair.

The checks read the store through a connection of their own and change nothing; they may run
while daemons have the store mounted. Each problem is one line in ``problems``; what can be
repaired is also remembered as a candidate for ``repair``.

``repair`` fixes, one write transaction per kind (``Maintenance.write()``: its own connection, so
it is safe while daemons serve the store), each candidate checked again under the lock:

1. **lost content**: a blob whose file is missing, of the wrong size or not matching its
   SHA-256, inline content not matching its hash, a blob row that messages reference but that is
   gone, a message (or a file in a batch) with neither content nor an upload. A missing row is
   first rebuilt from a blob file that still holds its content (``<sha256>.<id>``, hash
   checked), or the messages are pointed at another blob with the same hash. Otherwise every
   message referencing the content moves to its queue's ``error/`` (``name.~N~`` when the name
   is taken; a batch moves as a whole when one of its files lost its content) with
   ``user.spool.error`` = ``content lost: <what>``, ``consumer``, lease and retry cleared, a
   ``repair`` history row, and the **empty inline blob** as its content (size 0): the tree stays
   consistent (every file has exactly one of blob or upload), the message can be read,
   inspected, redriven and deleted like any other, and its error says why it is empty. Nothing
   vanishes. The damaged blob row is deleted; what was left of its content is kept in
   ``STORE/lost+found/<sha256>.<id>`` for a human to look at.
2. **refcounts**: recomputed from the messages that reference each blob.
3. **unreferenced blob rows**: deleted, then their files.
4. **orphan blob files** and 5. **orphan staging files**: removed once older than the grace
   period (a file is placed just before the transaction that names it commits).

An upload a sync of which failed (its staging file marked: blobs/writeback.py) is a note, not
a problem: the store is whole, and the upload is never published.

Schema damage, a missing parent, a file with both a blob and an upload, and a directory with
content are reported but not repaired (``fsck --repair`` then exits 1).
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from spoolfs.blobs.files import file_info
from spoolfs.blobs.writeback import failed_before
from spoolfs.core.errors import StoreFailure
from spoolfs.core.names import free_name
from spoolfs.core.rules import Action, State, kind_of
from spoolfs.core.transitions import Context, fields_of, transition
from spoolfs.service import gc
from spoolfs.store.base import FsckTx, by_id
from spoolfs.store.private import DIR_MODE, FILE_MODE
from spoolfs.store.site import Place, as_place

PROGRESS_EVERY = 10_000
#: rows and files looked at together: what a check holds at once
PAGE = 500
#: rows that hold content: messages, and the files of a batch (its members)
CONTENT_KINDS = ("message", "member")
EMPTY_SHA256 = hashlib.sha256(b"").digest()
T = TypeVar("T")




def _show(name: bytes) -> str:
    return repr(name)[1:]


class _IdSet:
    """A set of ids, a bit each, in chunks of 65,536 ids (8 KiB): 16 chunks for a million
    ids given out in order, and one for an odd large id."""

    def __init__(self) -> None:
        self._chunks: dict[int, bytearray] = {}

    def add(self, i: int) -> None:
        chunk = self._chunks.get(i >> 16)
        if chunk is None:
            chunk = self._chunks[i >> 16] = bytearray(8192)
        chunk[(i & 0xFFFF) >> 3] |= 1 << (i & 7)

    def __contains__(self, i: int) -> bool:
        chunk = self._chunks.get(i >> 16)
        return chunk is not None and bool(chunk[(i & 0xFFFF) >> 3] & 1 << (i & 7))


class Fsck:
    """``Fsck(STORE).run()`` checks and returns the problems (one line each). To repair:
    ``check()``, then ``repair()`` (the fixes, one line each), then ``close()``.

    ``grace_ns``: when given (repair mode), orphan files younger than this are not problems but
    ``notes``: they may belong to a transaction about to commit."""

    def __init__(self, where: str | Place, progress: Callable[[str], None] = lambda s: None,
                 grace_ns: int | None = None, now_ns: int | None = None,
                 hash_files: bool = True, read_only: bool = False) -> None:
        self.place = as_place(where)
        self.maint = self.place.maintenance(read_only)
        self.tx = self.maint.tx
        self.blobs = self.place.blobs
        self.staging = self.place.staging
        self.progress = progress
        self.grace_ns = grace_ns
        self.now_ns = time.time_ns() if now_ns is None else now_ns
        self.hash_files = hash_files  # False: blob files are checked by size only
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.counts = {"entries": 0, "blobs": 0, "blob files": 0, "staging files": 0}
        self._checked = 0
        # what the checks saw, and the candidates for repair
        self._files: dict[int, tuple[str, bytes]] = {}  # blob id -> (path, sha) of an orphan
        self.lost: dict[int, str] = {}  # blob id -> what is wrong with its content
        self.missing_rows: set[int] = set()  # blob ids referenced but without a row
        self.no_content: set[int] = set()  # messages with neither a blob nor an upload
        self.bad_refcounts: set[int] = set()
        self.unreferenced: set[int] = set()
        self.orphan_files: list[tuple[str, bytes, int]] = []
        self.orphan_staging: list[int] = []
        self._moved: set[int] = set()  # messages moved to error/ by this repair

    # ---- running ----------------------------------------------------------------------------

    def run(self) -> list[str]:
        try:
            return self.check()
        finally:
            self.close()

    def check(self) -> list[str]:
        """Every check, each a page (``PAGE``) at a time: fsck holds no more for a store of a
        million messages than for one of a thousand."""
        self.check_schema()
        with self.maint.read():  # messages and blob rows from one snapshot
            self.check_tree()
            self.check_refcounts()
        self.check_blob_files()
        self.check_inline_blobs()
        self.check_staging()
        return self.problems

    def close(self) -> None:
        self.maint.close()

    def summary(self) -> str:
        return "fsck: checked " + ", ".join(f"{n} {k}" for k, n in self.counts.items())

    def _bad(self, msg: str) -> None:
        self.problems.append(msg)

    def _tick(self, kind: str) -> None:
        self.counts[kind] += 1
        self._checked += 1
        if self._checked % PROGRESS_EVERY == 0:
            self.progress(f"fsck: {self._checked} objects checked")

    def _young(self, path: str, blob: bool = False) -> bool:
        """An orphan file (a staging file, or a blob object when ``blob``) that repair would
        leave alone (grace period, repair mode only)."""
        if self.grace_ns is None:
            return False
        info = self.blobs.info(path) if blob else file_info(path)
        if info is None:
            return True  # gone meanwhile: nothing to report
        if self.now_ns - info.stored_ns < self.grace_ns:
            self.notes.append(f"orphan file {path} is younger than the grace period: left")
            return True
        return False

    # ---- checks -----------------------------------------------------------------------------

    def check_schema(self) -> None:
        with self.maint.read() as tx:
            if not tx.integrity_ok():
                self._bad("database integrity check failed")
            for row in tx.dangling():
                self._bad(f"dangling reference: {row}")
            v = tx.schema_version()
        if v is not None and v.isdigit() and int(v) > self.maint.version:
            raise StoreFailure(f"the store has schema version {v}; this spoolfs knows up to "
                               f"{self.maint.version}: upgrade spoolfs")
        if v is None or int(v) != self.maint.version:
            self._bad(f"schema version {v} != {self.maint.version}")

    def check_tree(self) -> None:
        rows = by_id(self.tx.tree_page, PAGE)
        for eid, parent, name, kind, mode, blob, staged, has_parent in rows:
            self._tick("entries")
            if eid != 1 and not has_parent:
                self._bad(f"entry {eid} {name!r}: parent {parent} missing")
            if kind not in CONTENT_KINDS:
                continue
            if stat.S_ISDIR(mode):  # a batch, or a directory in one: no content of its own
                if blob is not None or staged:
                    self._bad(f"{kind} {eid} {name!r}: a directory with content")
            elif (blob is None) == (not staged):
                self._bad(f"{kind} {eid} {name!r}: needs exactly one of blob / staging")
                if blob is None:
                    self.no_content.add(eid)

    def check_refcounts(self) -> None:
        """Each blob row's count against the entries that reference it (the store counts
        them, by its index of entries by blob), then references to rows that are gone."""
        for bid, refcount, n in by_id(self.tx.blob_references, PAGE):
            self._tick("blobs")
            if refcount != n:
                self._bad(f"blob {bid}: refcount {refcount}, referenced {n}")
                self.bad_refcounts.add(bid)
            if n == 0:
                self._bad(f"blob {bid}: no message references it")
                self.unreferenced.add(bid)
        for bid, n in self.tx.missing_blob_rows():
            self._bad(f"blob {bid} referenced by {n} message(s) is missing")
            self.missing_rows.add(bid)

    def check_blob_files(self) -> None:
        """The walk of the blob files, a page at a time with the page's rows (each page its
        own short read: a long check never holds the store's log back), then the rows whose
        file the walk did not find. A row the walk missed may be newer than the walk's pass:
        it is missing only if its file is missing now."""
        seen = _IdSet()
        for page in gc.pages(self.blobs.walk(), PAGE):
            with self.maint.read() as tx:
                rows = tx.file_blobs_named([bid for _, _, bid in page if bid >= 0])
            for path, sha, bid in page:
                self._tick("blob files")
                row = rows.get(bid)
                if row is None or row[0] != sha:
                    if bid >= 0 and sha:
                        self._files[bid] = (path, sha)
                    if not self._young(path, blob=True):
                        self._bad(f"orphan blob file {path}")
                        self.orphan_files.append((path, sha, bid))
                    continue
                seen.add(bid)
                self._check_blob_file(bid, path, row[0], row[1])
        for bid, sha, size in self._each(lambda tx, after, n: tx.file_blobs_page(after, n)):
            if bid not in seen:
                self._check_blob_file(bid, self.blobs.name(sha, bid), sha, size)

    def _check_blob_file(self, bid: int, path: str, sha: bytes, size: int) -> None:
        """One blob row's file. A problem counts only if the row is still there once the file
        was looked at (a message deleted meanwhile takes its file with it). A file that
        cannot be read is reported, not repaired (its content may be whole)."""
        try:
            problem = self._file_problem(path, sha, size, self.hash_files)
        except OSError as err:
            self._bad(f"blob {bid}: file cannot be read ({path}): {err.strerror or err}")
            return
        if problem is None:
            return
        with self.maint.read() as tx:
            if tx.blob_content(bid) is None:
                return  # deleted meanwhile, with its file
        self._bad(f"blob {bid}: {problem}" if problem == "file missing" else
                  f"blob {bid}: {problem} ({path})")
        self.lost[bid] = problem

    def check_inline_blobs(self) -> None:
        for bid, sha, data in self._each(lambda tx, after, n: tx.inline_blobs_page(after, n)):
            if hashlib.sha256(data).digest() != sha:
                self._bad(f"blob {bid}: inline content does not match its hash")
                self.lost[bid] = "inline content does not match its hash"

    def check_staging(self) -> None:
        for page in gc.pages(self.staging.ids(), PAGE):
            with self.maint.read() as tx:
                staged = tx.staged_among(page)
            for sid in page:
                self._tick("staging files")
                # held: made ahead by a daemon for its next upload (service/staging_pool.py)
                if sid not in staged and not self.staging.held(sid):
                    path = self.staging.path(sid)
                    if not self._young(path):
                        self._bad(f"orphan staging file {path}")
                        self.orphan_staging.append(sid)
                elif sid in staged:
                    self._check_synced(sid)

    def _check_synced(self, sid: int) -> None:
        """An upload a sync of which failed is never published (blobs/writeback.py): no
        damage to the store, but its writer has to know."""
        path = self.staging.path(sid)
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return  # gone meanwhile, or another host's upload
        if failed_before(mode):
            self.notes.append(f"upload {sid} ({path}): a sync of its content failed; it will "
                              "not be published until it is removed or written whole again")

    def _each(self, query: Callable[[FsckTx, int, int], list[T]]) -> Iterator[T]:
        """The rows of a paged ``query``, each page read in a short transaction of its own."""
        def page(after: int, limit: int) -> list[T]:
            with self.maint.read() as tx:
                return query(tx, after, limit)
        return by_id(page, PAGE)

    def _file_problem(self, path: str, sha: bytes, size: int, hash_it: bool = True) -> str | None:
        """What is wrong with the stored object ``path`` of a blob, or None."""
        if not hash_it:
            info = self.blobs.info(path)
            if info is None:
                return "file missing"
            return None if info.size == size else f"file has {info.size} bytes, not {size}"
        res = self.blobs.digest(path)
        if res is None:
            return "file missing"
        digest, got = res
        if got != size:
            return f"file has {got} bytes, not {size}"
        if digest != sha:
            return "content does not match its hash"
        return None

    # ---- repair -----------------------------------------------------------------------------

    def repair(self) -> list[str]:
        """Fix what ``check`` found; one line per fix."""
        grace = gc.GRACE_NS if self.grace_ns is None else self.grace_ns
        fixes: list[str] = []
        fixes += self._repair_content()
        fixes += self._repair_refcounts()
        report = gc.Report()
        gc.sweep_blob_rows(self.maint, self.blobs, self.unreferenced, report)
        gc.sweep_blob_files(self.maint, self.blobs, self.orphan_files, grace, self.now_ns, report)
        gc.sweep_staging(self.maint, self.staging, self.orphan_staging, grace, self.now_ns,
                         report)
        fixes += report.lines
        if report.young:
            self.notes.append(f"{report.young} orphan file(s) became younger than the grace "
                              "period meanwhile: left")
        return fixes

    def _repair_content(self) -> list[str]:
        if not (self.lost or self.missing_rows or self.no_content):
            return []
        c = self.tx
        now = time.time_ns()
        fixes: list[str] = []
        keep: list[tuple[str, bytes | None, str]] = []  # (what to keep, inline data, name)
        empty: list[int] = []

        def empty_blob() -> int:
            if not empty:
                row = c.blob_id_by_sha(EMPTY_SHA256)
                if row is None:
                    bid = c.insert_empty_blob(EMPTY_SHA256)
                else:
                    bid = row[0]
                    if row[1] is None or bytes(row[1]) != b"":
                        c.make_blob_empty(bid)
                empty.append(bid)
            return empty[0]

        with self.maint.write():
            for bid in sorted(self.lost):
                row = c.blob_content(bid)
                if row is None:
                    continue  # gone meanwhile (its last reference went)
                sha, size, data = row
                path = self.blobs.name(sha, bid)
                if sha == EMPTY_SHA256:  # the empty content: known without a copy
                    c.make_blob_empty(bid)
                    fixes.append(f"blob {bid}: the empty content restored")
                    continue
                if data is None:
                    problem = self._file_problem(path, sha, size)
                elif hashlib.sha256(data).digest() != sha:
                    problem = "inline content does not match its hash"
                else:
                    problem = None
                if problem is None:
                    continue
                what = f"blob {bid} (sha256 {sha.hex()[:16]}..., {size} bytes): {problem}"
                fixes += self._lose(c.holders(blob_id=bid), what, empty_blob, now)
                c.delete_blob(bid)
                fixes.append(f"deleted damaged blob {bid}")
                if data is not None:
                    keep.append(("", bytes(data), f"{sha.hex()}.{bid}"))
                elif os.path.exists(path):
                    keep.append((path, None, f"{sha.hex()}.{bid}"))

            for bid in sorted(self.missing_rows):
                if c.blob_exists(bid):
                    continue
                n = c.references(bid)
                if n == 0:
                    continue
                fix = self._rebuild_row(bid, n)
                if fix is not None:
                    fixes.append(fix)
                    continue
                what = f"blob {bid} is missing from the store"
                fixes += self._lose(c.holders(blob_id=bid), what, empty_blob, now)

            for eid in sorted(self.no_content):
                fixes += self._lose(c.holders(entry_id=eid),
                                    "it had neither a blob nor an upload", empty_blob, now)
        for path, data, name in keep:  # after the commit: the row is gone, its id never reused
            fixes.append(self._keep(path, data, name))
        return fixes

    def _rebuild_row(self, bid: int, refs: int) -> str | None:
        """A blob row that messages reference is gone: rebuild it from its file, if that file
        is intact, or point the messages at a blob of the same content."""
        found = self._files.get(bid)
        if found is None:
            return None
        path, sha = found
        res = self.blobs.digest(path)
        if res is None or res[0] != sha:
            return None
        size = res[1]
        c = self.tx
        other = c.blob_id_by_sha(sha)
        if other is not None:
            c.repoint(bid, other[0], refs)
            return (f"blob {bid} was missing: its {refs} message(s) now share blob {other[0]}, "
                    "which holds the same content")
        c.rebuild_file_blob(bid, sha, size, refs)
        return f"blob {bid} was missing: rebuilt from its file {path} ({refs} message(s))"

    def _lose(self, rows: list[tuple[int, str, bytes]], what: str,
              empty_blob: Callable[[], int], now: int) -> list[str]:
        """Inside the write transaction: every one of ``rows`` (id, kind, name of a message or
        a file in a batch) lost its content. It gets the empty blob, and its message (a batch,
        for a file in one) goes to its queue's ``error/`` with the reason."""
        fixes = []
        for eid, kind, name in rows:
            bid = empty_blob()
            self.tx.give_blob(eid, bid)
            if kind == "message":
                fixes.append(self._to_error(eid, f"content lost: {what}", now))
                continue
            root, path = self._batch_of(eid)
            if root is None:
                fixes.append(f"file {eid} {_show(bytes(name))} of a batch that is gone: "
                             f"content lost: {what}; it is empty now")
                continue
            fixes.append(self._to_error(root, f"content lost: {_show(path)} in the batch: {what}",
                                        now))
        return fixes

    def _batch_of(self, member: int) -> tuple[int | None, bytes]:
        """The batch root a member belongs to, and the member's path inside it."""
        parts: list[bytes] = []
        eid: int | None = member
        while eid is not None:
            row = self.tx.link(eid)
            if row is None:
                return None, b"/".join(reversed(parts))
            if row[0] == "message":
                return eid, b"/".join(reversed(parts))
            if row[0] != "member":
                return None, b"/".join(reversed(parts))
            parts.append(row[2])
            eid = row[1]
        return None, b"/".join(reversed(parts))

    def _to_error(self, eid: int, reason: str, now: int) -> str:
        """Move message ``eid`` to its queue's ``error/`` (a free name there; nothing is
        replaced) with ``reason``; a second loss in the same repair adds to the reason."""
        c = self.tx
        parent, name, queue, state, consumer, error = c.place(eid)
        if eid in self._moved:
            reason = f"{bytes(error or b'').decode(errors='replace')}; {reason}"
            c.set_error(eid, reason.encode())
            return f"message {eid} {_show(name)}: {reason}"
        self._moved.add(eid)
        err = c.state_dir(queue, b"error")
        target = parent if err is None else err
        new_name = name if target == parent else self._free_name(target, name)
        new_state = "error" if err is not None else state
        # the REPAIR row's effects, as every mover applies a row (service/moves.py)
        fields = fields_of(transition(Action.REPAIR, State.ERROR),
                           kind_of(State(state), bytes(name)), Context(now, reason=reason.encode()))
        c.move_entry(eid, target, new_name, {**fields, "state": new_state})
        src = f"{state}/{consumer}" if consumer else state
        c.add_history(eid, now, Action.REPAIR.value, src, new_state, os.getpid(), reason)
        where_to = (f"moved to error/ as {_show(new_name)}" if err is not None
                    else "left in place (its queue has no error/ directory)")
        return f"message {eid} {_show(name)} ({src}): {reason}; {where_to}"

    def _free_name(self, parent: int, name: bytes) -> bytes:
        """``name``, or ``name.~N~`` when it is taken (never replace anything)."""
        return free_name(name, lambda n: self.tx.name_taken(parent, n))

    def _keep(self, path: str, data: bytes | None, name: str) -> str:
        """Keep what is left of damaged content in ``STORE/lost+found/``."""
        d = self.place.lost_found
        try:
            os.makedirs(d, DIR_MODE, exist_ok=True)
            dst = os.path.join(d, name)
            n = 0
            while os.path.lexists(dst):
                n += 1
                dst = os.path.join(d, f"{name}.~{n}~")
            if data is not None:
                with open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE),
                          "wb") as f:
                    f.write(data)
            else:
                os.rename(path, dst)
        except OSError as e:
            return f"could not keep the damaged content of {name} in {d}: {e}"
        return f"kept the damaged content in {dst}"

    def _repair_refcounts(self) -> list[str]:
        if not self.bad_refcounts:
            return []
        fixes = []
        with self.maint.write() as c:
            for bid in sorted(self.bad_refcounts):
                row = c.refcount_and_references(bid)
                if row is None or row[0] == row[1]:
                    continue
                c.set_refcount(bid, row[1])
                fixes.append(f"blob {bid}: refcount {row[0]} corrected to {row[1]}")
                if row[1] == 0:
                    self.unreferenced.add(bid)
        return fixes

