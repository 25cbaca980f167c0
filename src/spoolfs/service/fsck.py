"""Consistency checks of a store, one small ``check_*`` method per kind of damage. Reports; the
repairs come with the garbage-collection work."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable

from spoolfs.blobs import BlobDir, StagingDir
from spoolfs.store import schema
from spoolfs.store.sqlite import SqliteStore

PROGRESS_EVERY = 10_000


class Fsck:
    def __init__(self, store_dir: str, progress: Callable[[str], None] = lambda s: None) -> None:
        self.store_dir = store_dir
        self.store = SqliteStore(os.path.join(store_dir, "meta.db"))
        self.r = self.store.reader()
        self.blobs = BlobDir(os.path.join(store_dir, "blobs"))
        self.staging = StagingDir(os.path.join(store_dir, "staging"))
        self.progress = progress
        self.problems: list[str] = []

    def run(self) -> list[str]:
        try:
            for check in (self.check_schema, self.check_tree, self.check_refcounts,
                          self.check_blob_files, self.check_staging):
                check()
        finally:
            self.store.close()
        return self.problems

    def _bad(self, msg: str) -> None:
        self.problems.append(msg)

    def check_schema(self) -> None:
        c = self.store._rconn
        if c.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
            self._bad("database integrity check failed")
        for row in c.execute("PRAGMA foreign_key_check"):
            self._bad(f"dangling reference: {row}")
        v = c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if v is None or int(v[0]) != schema.VERSION:
            self._bad(f"schema version {v and v[0]} != {schema.VERSION}")

    def check_tree(self) -> None:
        ids = {e.id: e for e in self.r.all_entries()}
        for e in ids.values():
            if e.id != 1 and (e.parent is None or e.parent not in ids):
                self._bad(f"entry {e.id} {e.name!r}: parent {e.parent} missing")
            if e.kind == "message" and (e.blob is None) == (not e.staged):
                self._bad(f"message {e.id} {e.name!r}: needs exactly one of blob / staging")

    def check_refcounts(self) -> None:
        refs = Counter(e.blob for e in self.r.all_entries() if e.blob is not None)
        blobs = {b.id: b for b in self.r.all_blobs()}
        for bid, n in refs.items():
            if bid not in blobs:
                self._bad(f"blob {bid} referenced by {n} message(s) is missing")
        for b in blobs.values():
            if b.refcount != refs.get(b.id, 0):
                self._bad(f"blob {b.id}: refcount {b.refcount}, referenced {refs.get(b.id, 0)}")

    def check_blob_files(self) -> None:
        blobs = {b.id: b for b in self.r.all_blobs()}
        on_disk = {}
        for i, (path, sha, bid) in enumerate(self.blobs.walk(), 1):
            on_disk[bid] = path
            if i % PROGRESS_EVERY == 0:
                self.progress(f"fsck: {i} blob files checked")
            b = blobs.get(bid)
            if b is None or b.sha256 != sha or b.data is not None:
                self._bad(f"orphan blob file {path}")
                continue
            h = hashlib.sha256()
            size = 0
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    size += len(chunk)
            if h.digest() != b.sha256 or size != b.size:
                self._bad(f"blob {bid}: content does not match its hash ({path})")
        for b in blobs.values():
            if b.data is None and b.id not in on_disk:
                self._bad(f"blob {b.id}: file missing")
            if b.data is not None and hashlib.sha256(b.data).digest() != b.sha256:
                self._bad(f"blob {b.id}: inline content does not match its hash")

    def check_staging(self) -> None:
        staged = {e.id for e in self.r.all_entries() if e.staged}
        for sid in self.staging.ids():
            if sid not in staged:
                self._bad(f"orphan staging file {self.staging.path(sid)}")
