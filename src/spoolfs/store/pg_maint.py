"""Maintenance access to a PostgreSQL store for ``gc`` and ``fsck``.

The maintenance queries are the embedded engine's (store/sqlite_maint.py): they are plain SQL
but for their placeholders and SQLite's pragmas, which a thin connection adapter translates,
so the checks fsck and gc rely on are written once for every engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import psycopg

from spoolfs.store import pg_schema
from spoolfs.store.base import FsckTx, Maintenance
from spoolfs.store.pg_statements import rows_of
from spoolfs.store.postgres import PostgresStore, unavailable
from spoolfs.store.sqlite_maint import SqliteFsckTx

#: SQLite's pragmas fsck asks, and what they mean on a database that enforces its constraints
_PRAGMAS = {
    "PRAGMA integrity_check": [("ok",)],  # PostgreSQL checks pages itself (and amcheck)
    "PRAGMA foreign_key_check": [],  # foreign keys are enforced on every statement
}


class _Cursor:
    def __init__(self, rows: list[tuple[Any, ...]], rowcount: int,
                 lastrowid: int | None = None) -> None:
        self._rows = rows
        self.rowcount = rowcount
        self.lastrowid = lastrowid

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._rows

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self._rows)


class _Adapter:
    """The part of ``sqlite3.Connection`` the maintenance queries use, on psycopg."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def execute(self, query: str, params: Sequence[Any] = ()) -> _Cursor:
        if query in _PRAGMAS:
            rows = _PRAGMAS[query]
            return _Cursor(list(rows), len(rows))
        q = query.replace("?", "%s").replace("X''", "''::bytea")
        returning = q.lstrip().upper().startswith("INSERT") and "RETURNING" not in q.upper() \
            and re.search(r"INSERT INTO blobs \(sha256", q) is not None
        if returning:
            q += " RETURNING id"
        try:
            cur = self.conn.execute(cast(Any, q), params)
            rows = rows_of(cur)
        except psycopg.Error as e:
            raise unavailable(e) from e
        lastrowid = int(rows[0][0]) if returning and rows else None
        return _Cursor([tuple(r) for r in rows], cur.rowcount, lastrowid)


class PgMaintenance(Maintenance):
    version = pg_schema.VERSION

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        try:
            self.conn = store.connect(autocommit=True)
        except psycopg.Error as e:
            store.close()
            raise unavailable(e) from e
        self.tx = SqliteFsckTx(cast(Any, _Adapter(self.conn)))

    @contextmanager
    def read(self) -> Iterator[FsckTx]:
        try:
            with self.conn.transaction():
                self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                yield self.tx
        except psycopg.Error as e:
            raise unavailable(e) from e

    @contextmanager
    def write(self) -> Iterator[FsckTx]:
        try:
            with self.conn.transaction():
                # each statement sees what committed before it, whatever the server's
                # default: gc's sweep asks a file's lock, then its row (service/gc.py)
                self.conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                yield self.tx
        except psycopg.Error as e:
            raise unavailable(e) from e

    def prune_changes(self, older_than_s: float) -> int:
        return self.store.prune_changes(older_than_s)

    def close(self) -> None:
        self.conn.close()
        self.store.close()


def open_maintenance(url: str) -> PgMaintenance:
    return PgMaintenance(PostgresStore(url, pool_max=1))
