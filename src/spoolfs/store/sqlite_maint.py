"""Maintenance access to the embedded engine for ``gc`` and ``fsck``: its own connection to
``STORE/meta.db`` (never creating a store), explicit snapshots and write-lock transactions.

SQLite errors leave as ``StoreFailure`` (``StoreFull`` on a full disk) so that callers above
the store name no engine."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from spoolfs.core.errors import StoreFailure
from spoolfs.core.rules import State
from spoolfs.store import schema
from spoolfs.store.base import ENTRY_COLUMNS, FsckTx, GcTx, Maintenance
from spoolfs.store.reserve import Reserve
from spoolfs.store.sqlite import BUSY_TIMEOUT_MS, raise_if_full, staged_among


class SqliteGcTx(GcTx):
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def files_named(self, blob_ids: Sequence[int]) -> dict[int, bytes]:
        if not blob_ids:
            return {}
        return {int(i): bytes(s) for i, s in self.conn.execute(
            "SELECT id, sha256 FROM blobs WHERE data IS NULL AND id IN "
            f"({','.join('?' * len(blob_ids))})", tuple(blob_ids))}

    def unreferenced_blobs(self, after: int, limit: int) -> list[int]:
        return [int(i) for (i,) in self.conn.execute(
            "SELECT id FROM blobs b WHERE id > ? AND NOT EXISTS "
            "(SELECT 1 FROM entries e WHERE e.blob = b.id) ORDER BY id LIMIT ?", (after, limit))]

    def staged_among(self, entry_ids: Sequence[int]) -> set[int]:
        return staged_among(self.conn, entry_ids)

    def is_staged(self, entry_id: int) -> bool:
        row = self.conn.execute("SELECT staged FROM entries WHERE id=?", (entry_id,)).fetchone()
        return row is not None and bool(row[0])

    def names_blob_file(self, sha256: bytes, blob_id: int) -> bool:
        if blob_id < 0:
            return False
        row = self.conn.execute("SELECT sha256, data IS NULL FROM blobs WHERE id=?",
                                (blob_id,)).fetchone()
        return row is not None and bytes(row[0]) == sha256 and bool(row[1])

    def delete_unreferenced_blob(self, blob_id: int) -> tuple[bytes, int, int, bool] | None:
        c = self.conn
        row = c.execute("SELECT sha256, size, refcount, data IS NULL FROM blobs WHERE id=?",
                        (blob_id,)).fetchone()
        if row is None:
            return None
        if c.execute("SELECT 1 FROM entries WHERE blob=? LIMIT 1", (blob_id,)).fetchone():
            return None
        c.execute("DELETE FROM blobs WHERE id=?", (blob_id,))
        return bytes(row[0]), int(row[1]), int(row[2]), bool(row[3])


class SqliteFsckTx(SqliteGcTx, FsckTx):
    def integrity_ok(self) -> bool:
        return bool(self.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok")

    def dangling(self) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self.conn.execute("PRAGMA foreign_key_check")]

    def schema_version(self) -> str | None:
        v = self.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return None if v is None else str(v[0])

    def tree_page(self, after: int, limit: int
                  ) -> list[tuple[int, int | None, bytes, str, int, int | None, bool, bool]]:
        return [(eid, parent, bytes(name), kind, mode, blob, bool(staged), pid is not None)
                for eid, parent, name, kind, mode, blob, staged, pid in self.conn.execute(
                    "SELECT e.id, e.parent, e.name, e.kind, e.mode, e.blob, e.staged, p.id "
                    "FROM entries e LEFT JOIN entries p ON p.id = e.parent WHERE e.id > ? "
                    "ORDER BY e.id LIMIT ?", (after, limit))]

    def blob_references(self, after: int, limit: int) -> list[tuple[int, int, int]]:
        return [(int(i), int(r), int(n)) for i, r, n in self.conn.execute(
            "SELECT b.id, b.refcount, (SELECT COUNT(*) FROM entries e WHERE e.blob = b.id) "
            "FROM blobs b WHERE b.id > ? ORDER BY b.id LIMIT ?", (after, limit))]

    def missing_blob_rows(self) -> list[tuple[int, int]]:
        return [(int(i), int(n)) for i, n in self.conn.execute(
            "SELECT e.blob, COUNT(*) FROM entries e WHERE e.blob IS NOT NULL AND NOT EXISTS "
            "(SELECT 1 FROM blobs b WHERE b.id = e.blob) GROUP BY e.blob ORDER BY e.blob")]

    def file_blobs_named(self, blob_ids: Sequence[int]) -> dict[int, tuple[bytes, int]]:
        if not blob_ids:
            return {}
        return {int(i): (bytes(s), int(n)) for i, s, n in self.conn.execute(
            "SELECT id, sha256, size FROM blobs WHERE data IS NULL AND id IN "
            f"({','.join('?' * len(blob_ids))})", tuple(blob_ids))}

    def file_blobs_page(self, after: int, limit: int) -> list[tuple[int, bytes, int]]:
        return [(int(i), bytes(s), int(n)) for i, s, n in self.conn.execute(
            "SELECT id, sha256, size FROM blobs WHERE data IS NULL AND id > ? "
            "ORDER BY id LIMIT ?", (after, limit))]

    def inline_blobs_page(self, after: int, limit: int) -> list[tuple[int, bytes, bytes]]:
        return [(int(i), bytes(s), bytes(d)) for i, s, d in self.conn.execute(
            "SELECT id, sha256, data FROM blobs WHERE data IS NOT NULL AND id > ? "
            "ORDER BY id LIMIT ?", (after, limit))]

    def blob_content(self, blob_id: int) -> tuple[bytes, int, bytes | None] | None:
        row = self.conn.execute("SELECT sha256, size, data FROM blobs WHERE id=?",
                                (blob_id,)).fetchone()
        return None if row is None else (bytes(row[0]), row[1], row[2])

    def blob_id_by_sha(self, sha256: bytes) -> tuple[int, bytes | None] | None:
        row = self.conn.execute("SELECT id, data FROM blobs WHERE sha256=?",
                                (sha256,)).fetchone()
        return None if row is None else (int(row[0]), row[1])

    def insert_empty_blob(self, sha256: bytes) -> int:
        return int(self.conn.execute("INSERT INTO blobs (sha256, size, refcount, data) "
                                     "VALUES (?, 0, 0, X'')", (sha256,)).lastrowid or 0)

    def make_blob_empty(self, blob_id: int) -> None:
        self.conn.execute("UPDATE blobs SET data=X'', size=0 WHERE id=?", (blob_id,))

    def delete_blob(self, blob_id: int) -> None:
        self.conn.execute("DELETE FROM blobs WHERE id=?", (blob_id,))

    def blob_exists(self, blob_id: int) -> bool:
        return self.conn.execute("SELECT 1 FROM blobs WHERE id=?", (blob_id,)).fetchone() \
            is not None

    def references(self, blob_id: int) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM entries WHERE blob=?",
                                     (blob_id,)).fetchone()[0])

    def repoint(self, old: int, new: int, refs: int) -> None:
        self.conn.execute("UPDATE entries SET blob=? WHERE blob=?", (new, old))
        self.conn.execute("UPDATE blobs SET refcount=refcount+? WHERE id=?", (refs, new))

    def rebuild_file_blob(self, blob_id: int, sha256: bytes, size: int, refs: int) -> None:
        self.conn.execute("INSERT INTO blobs (id, sha256, size, refcount, data) "
                          "VALUES (?, ?, ?, ?, NULL)", (blob_id, sha256, size, refs))

    def holders(self, blob_id: int | None = None, entry_id: int | None = None
                ) -> list[tuple[int, str, bytes]]:
        where, arg = (("m.blob = ?", blob_id) if entry_id is None else
                      ("m.id = ? AND m.blob IS NULL AND m.staged = 0", entry_id))
        return [(eid, kind, bytes(name)) for eid, kind, name in self.conn.execute(
            "SELECT m.id, m.kind, m.name FROM entries m WHERE m.kind IN ('message', 'member') "
            f"AND {where} ORDER BY m.id", (arg,))]

    def give_blob(self, entry_id: int, blob_id: int) -> None:
        self.conn.execute("UPDATE entries SET blob=?, staged=0, size=0 WHERE id=?",
                          (blob_id, entry_id))
        self.conn.execute("UPDATE blobs SET refcount=refcount+1 WHERE id=?", (blob_id,))

    def link(self, entry_id: int) -> tuple[str, int | None, bytes] | None:
        row = self.conn.execute("SELECT kind, parent, name FROM entries WHERE id=?",
                                (entry_id,)).fetchone()
        return None if row is None else (row[0], row[1], bytes(row[2]))

    def place(self, entry_id: int) -> tuple[int, bytes, int, str, str | None, bytes | None]:
        parent, name, queue, state, consumer, error = self.conn.execute(
            "SELECT parent, name, queue, state, consumer, error FROM entries WHERE id=?",
            (entry_id,)).fetchone()
        return parent, bytes(name), queue, state, consumer, error

    def set_error(self, entry_id: int, error: bytes) -> None:
        self.conn.execute("UPDATE entries SET error=? WHERE id=?", (error, entry_id))

    def state_dir(self, queue: int, name: bytes) -> int | None:
        row = self.conn.execute("SELECT id FROM entries WHERE parent=? AND name=? "
                                "AND kind='state'", (queue, name)).fetchone()
        return None if row is None else int(row[0])

    def name_taken(self, parent: int, name: bytes) -> bool:
        return self.conn.execute("SELECT 1 FROM entries WHERE parent=? AND name=?",
                                 (parent, name)).fetchone() is not None

    def move_entry(self, entry_id: int, parent: int, name: bytes, fields: dict[str, Any]
                   ) -> None:
        for k in fields:
            if k not in ENTRY_COLUMNS or k in ("id", "parent", "name"):
                raise ValueError(f"unknown entry column {k}")
        sets = "".join(f", {k}=?" for k in fields)
        vals = [v.value if isinstance(v, State) else v for v in fields.values()]
        self.conn.execute(f"UPDATE entries SET parent=?, name=?{sets} WHERE id=?",
                          (parent, name, *vals, entry_id))

    def add_history(self, entry_id: int, at_ns: int, action: str, src: str, dst: str, pid: int,
                    reason: str) -> None:
        self.conn.execute("INSERT INTO history (entry, at_ns, action, src, dst, uid, pid, reason) "
                          "VALUES (?, ?, ?, ?, ?, NULL, ?, ?)",
                          (entry_id, at_ns, action, src, dst, pid, reason))

    def refcount_and_references(self, blob_id: int) -> tuple[int, int] | None:
        row = self.conn.execute("SELECT refcount, (SELECT COUNT(*) FROM entries WHERE blob=?) "
                                "FROM blobs WHERE id=?", (blob_id, blob_id)).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def set_refcount(self, blob_id: int, refcount: int) -> None:
        self.conn.execute("UPDATE blobs SET refcount=? WHERE id=?", (refcount, blob_id))


class SqliteMaintenance(Maintenance):
    """``db`` is ``STORE/meta.db``; ``reserve`` the store directory's metadata reserve."""

    version = schema.VERSION


    def __init__(self, db: str, reserve: Reserve | None, read_only: bool = False) -> None:
        if reserve is not None:
            reserve.release_if_low()  # on a full disk, room to open the log and its index
        self.reserve = reserve
        try:
            mode = "ro" if read_only else "rw"
            self.conn = sqlite3.connect(f"file:{db}?mode={mode}", uri=True, isolation_level=None,
                                        check_same_thread=False,
                                        timeout=BUSY_TIMEOUT_MS / 1000)
        except sqlite3.Error as e:
            raise StoreFailure(str(e)) from e
        try:
            self.conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.execute("PRAGMA foreign_keys=ON")
            self.conn.execute("PRAGMA schema_version").fetchone()  # opens the log: errors here
            if read_only:
                self.conn.execute("PRAGMA query_only=ON")
        except sqlite3.Error as e:
            self.conn.close()
            raise_if_full(e, reserve)
            raise StoreFailure(str(e)) from e
        self.tx = SqliteFsckTx(self.conn)

    @contextmanager
    def _failures(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as e:
            raise_if_full(e, self.reserve)
            raise StoreFailure(str(e)) from e

    @contextmanager
    def read(self) -> Iterator[FsckTx]:
        with self._failures():
            self.conn.execute("BEGIN")
            try:
                yield self.tx
            finally:
                self.conn.execute("COMMIT")

    @contextmanager
    def write(self) -> Iterator[FsckTx]:
        with self._failures():
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.tx
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()

