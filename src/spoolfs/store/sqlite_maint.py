"""Maintenance access to the embedded engine for ``gc`` and ``fsck``: its own connection to
``STORE/meta.db`` (never creating a store), explicit snapshots and write-lock transactions.

SQLite errors leave as ``StoreFailure`` (``StoreFull`` on a full disk) so that callers above
the store name no engine."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from spoolfs.core.errors import StoreFailure
from spoolfs.store.base import GcTx, Maintenance
from spoolfs.store.reserve import Reserve
from spoolfs.store.sqlite import BUSY_TIMEOUT_MS, raise_if_full


class SqliteGcTx(GcTx):
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def blobs_in_files(self) -> dict[int, bytes]:
        return {int(i): bytes(s) for i, s in
                self.conn.execute("SELECT id, sha256 FROM blobs WHERE data IS NULL")}

    def unreferenced_blobs(self) -> list[int]:
        return [int(i) for (i,) in self.conn.execute(
            "SELECT id FROM blobs b WHERE NOT EXISTS "
            "(SELECT 1 FROM entries e WHERE e.blob = b.id)")]

    def staged_ids(self) -> set[int]:
        return {int(i) for (i,) in self.conn.execute("SELECT id FROM entries WHERE staged=1")}

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


class SqliteMaintenance(Maintenance):
    """``db`` is ``STORE/meta.db``; ``reserve`` the store directory's metadata reserve."""

    tx_class: type[SqliteGcTx] = SqliteGcTx

    def __init__(self, db: str, reserve: Reserve | None) -> None:
        if reserve is not None:
            reserve.release_if_low()  # on a full disk, room to open the log and its index
        self.reserve = reserve
        try:
            self.conn = sqlite3.connect(f"file:{db}?mode=rw", uri=True, isolation_level=None,
                                        check_same_thread=False,
                                        timeout=BUSY_TIMEOUT_MS / 1000)
        except sqlite3.Error as e:
            raise StoreFailure(str(e)) from e
        try:
            self.conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.execute("PRAGMA foreign_keys=ON")
            self.conn.execute("PRAGMA schema_version").fetchone()  # opens the log: errors here
        except sqlite3.Error as e:
            self.conn.close()
            raise_if_full(e, reserve)
            raise StoreFailure(str(e)) from e
        self.tx = self.tx_class(self.conn)

    @contextmanager
    def _failures(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as e:
            raise_if_full(e, self.reserve)
            raise StoreFailure(str(e)) from e

    @contextmanager
    def read(self) -> Iterator[SqliteGcTx]:
        with self._failures():
            self.conn.execute("BEGIN")
            try:
                yield self.tx
            finally:
                self.conn.execute("COMMIT")

    @contextmanager
    def write(self) -> Iterator[SqliteGcTx]:
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
