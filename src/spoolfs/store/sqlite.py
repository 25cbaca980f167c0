"""The embedded engine: SQLite in WAL mode, ``synchronous=FULL``, foreign keys on.

Three connections: one for write batches, used on the event loop's thread (a batch commits
with ``synchronous=NORMAL``; ``sync()`` then makes it durable with one ``fdatasync`` of the
write-ahead log, which the committer runs in a worker thread when other requests are waiting),
one for queries, and one opened at the first ``scan()`` for long reads (recovery, paged
listings) in one snapshot. The event loop's queries go through the writer's connection while
no batch is under way (``_Queries``): its page cache outlives this daemon's commits, where
another connection drops its whole cache at its first query after each. Several daemons may
open the same file; SQLite's locks serialize their writers.

A store directory keeps a metadata reserve (store/reserve.py): before opening and before every
commit, a nearly full disk releases it, and a commit or open that finds the disk full all the
same fails with ``StoreFull`` (ENOSPC, one clear line) rather than a bare I/O error.
"""

from __future__ import annotations

import enum
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, cast

from spoolfs.blobs.layout import StoreLayout
from spoolfs.core.errors import SpoolError, StoreFailure, StoreFull
from spoolfs.core.rules import State
from spoolfs.store import schema
from spoolfs.store.base import (
    ENTRY_COLUMNS,
    LISTED_COLUMNS,
    Blob,
    Entry,
    ReadTx,
    Store,
    StoreBusy,
    WriteTx,
)
from spoolfs.store.private import FILE_MODE, make_store_dir
from spoolfs.store.reserve import FULL_ERRNOS, Reserve

log = logging.getLogger(__name__)

_COLS = ", ".join(f"e.{c}" for c in ENTRY_COLUMNS)
# The blob's reference count rides along: it is the message's link count.
_SEL = f"SELECT {_COLS}, b.refcount FROM entries e LEFT JOIN blobs b ON b.id = e.blob"
_LISTED = (f"SELECT {', '.join(f'e.{c}' for c in LISTED_COLUMNS)}, b.refcount "
           "FROM entries e LEFT JOIN blobs b ON b.id = e.blob")
_RET = ", ".join(ENTRY_COLUMNS)  # a new row, as INSERT ... RETURNING gives it back
_BLOB = ENTRY_COLUMNS.index("blob")
BUSY_TIMEOUT_MS = 30_000
#: A new store's page size. A claim changes about a dozen pages (the row, four of its indexes,
#: two directories' times, a history row), each written whole to the log and synced: with
#: 1 KiB pages a durable transition puts a quarter of the bytes in the log, and its fsync took
#: 250-275 µs instead of 330-390 µs here. A store made with another size keeps it (SQLite
#: fixes the size when the file is created).
PAGE_SIZE = 1024


def raise_if_full(e: BaseException, reserve: Reserve | None) -> None:
    """Raise ``StoreFull`` from ``e`` when it means the store's disk is full, releasing the
    reserve (if any is left) so that a retry finds space. SQLite says SQLITE_FULL when a
    write finds no space, but a plain I/O error when it cannot size its shared-memory index."""
    if isinstance(e, OSError):
        full = e.errno in FULL_ERRNOS
    elif isinstance(e, sqlite3.Error):
        code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
        full = code == sqlite3.SQLITE_FULL or (code == sqlite3.SQLITE_IOERR and reserve is not None
                                               and reserve.nearly_full())
    else:
        full = False
    if full:
        if reserve is not None:
            reserve.release("the store's disk is full")
        raise StoreFull(f"the store's disk is full ({e})") from e


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                           timeout=BUSY_TIMEOUT_MS / 1000)
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # before WAL: only a new file takes it
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


class _Cursor(Protocol):
    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class _Conn(Protocol):
    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> _Cursor: ...


def staged_among(conn: _Conn, entry_ids: Sequence[int]) -> set[int]:
    """Of ``entry_ids`` (a page: a parameter each), those of entries whose content is staged."""
    if not entry_ids:
        return set()
    return {int(i) for (i,) in conn.execute(
        "SELECT id FROM entries WHERE staged=1 AND id IN "
        f"({','.join('?' * len(entry_ids))})", tuple(entry_ids))}


class _Rows(list[Any]):
    """A query's rows, read whole: what a cursor gives, for the few ways queries use one."""

    def fetchone(self) -> Any:
        return self[0] if self else None

    def fetchall(self) -> list[Any]:
        return self


class _Queries:
    """The connection ``SqliteStore.reader()`` queries through. On the thread that commits
    without waiting (the event loop's: ``run_batch(wait=False)``), while no batch is under way
    there or in a worker thread, a query runs on the writer's connection and its rows are read
    whole before the connection is let go: a row read just after a commit costs 11-13 µs there
    against 17-25 µs on a connection of its own, which finds the database changed and drops its
    cache (a claim's five reads, a produced file's three). Anywhere else, and inside a batch
    (whose reads must not see its own uncommitted changes), it runs on the readers'."""

    def __init__(self, store: SqliteStore) -> None:
        self._store = store

    def execute(self, sql: str, params: Sequence[Any] = (), /) -> _Cursor:
        s = self._store
        if threading.get_ident() == s._home and s._lock.acquire(blocking=False):
            try:
                if not s._wconn.in_transaction:
                    return _Rows(s._wconn.execute(sql, params).fetchall())
            except sqlite3.OperationalError as e:  # the writer's wait may be 0: busy goes on
                if e.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY:  # to the readers' one
                    raise
            finally:
                s._lock.release()
        return s._rconn.execute(sql, params)


class SqliteRead(ReadTx):
    def __init__(self, conn: _Conn) -> None:
        self.conn = conn

    def get(self, entry_id: int) -> Entry | None:
        row = self.conn.execute(f"{_SEL} WHERE e.id=?", (entry_id,)).fetchone()
        return Entry.from_row(row) if row else None

    def lookup(self, parent: int, name: bytes) -> Entry | None:
        row = self.conn.execute(f"{_SEL} WHERE e.parent=? AND e.name=?", (parent, name)).fetchone()
        return Entry.from_row(row) if row else None

    def children(self, parent: int) -> list[Entry]:
        rows = self.conn.execute(f"{_SEL} WHERE e.parent=? ORDER BY e.id", (parent,)).fetchall()
        return [Entry.from_row(r) for r in rows]

    def page(self, parent: int, after: int, limit: int) -> list[Entry]:
        rows = self.conn.execute(f"{_SEL} WHERE e.parent=? AND e.id>? AND e.hidden=0 "
                                 "ORDER BY e.id LIMIT ?", (parent, after, limit)).fetchall()
        return [Entry.from_row(r) for r in rows]

    def listing(self, parent: int, after: int, limit: int) -> list[Entry]:
        rows = self.conn.execute(f"{_LISTED} WHERE e.parent=? AND e.id>? AND e.hidden=0 "
                                 "ORDER BY e.id LIMIT ?", (parent, after, limit)).fetchall()
        return [Entry.listed(r) for r in rows]

    def has_children(self, parent: int) -> bool:
        return self.conn.execute("SELECT 1 FROM entries WHERE parent=? LIMIT 1",
                                 (parent,)).fetchone() is not None

    def subdirs(self, parent: int) -> int:
        return int(self.conn.execute(  # S_IFMT / S_IFDIR
            "SELECT COUNT(*) FROM entries WHERE parent=? AND hidden=0 AND (mode & 61440)=16384",
            (parent,)).fetchone()[0])

    def subdirectories(self, parent: int) -> list[Entry]:
        rows = self.conn.execute(f"{_SEL} WHERE e.parent=? AND e.hidden=0 "
                                 "AND (e.mode & 61440)=16384 ORDER BY e.id", (parent,)).fetchall()
        return [Entry.from_row(r) for r in rows]

    def blob(self, blob_id: int) -> Blob | None:
        row = self.conn.execute("SELECT id, sha256, size, refcount, data FROM blobs WHERE id=?",
                                (blob_id,)).fetchone()
        return Blob(*row) if row else None

    def xattrs(self, entry_id: int) -> dict[bytes, bytes]:
        rows = self.conn.execute("SELECT name, value FROM xattrs WHERE entry=?", (entry_id,))
        return {bytes(n): bytes(v) for n, v in rows}

    def history(self, entry_id: int) -> list[tuple[Any, ...]]:
        return self.conn.execute(
            "SELECT at_ns, action, src, dst, uid, pid, reason FROM history WHERE entry=? "
            "ORDER BY id",
            (entry_id,)).fetchall()

    def due_leases(self, now_ns: int, limit: int) -> list[Entry]:
        rows = self.conn.execute(f"{_SEL} WHERE e.lease_ns IS NOT NULL AND e.lease_ns <= ? "
                                 "ORDER BY e.lease_ns LIMIT ?", (now_ns, limit)).fetchall()
        return [Entry.from_row(r) for r in rows]

    def due_retries(self, now_ns: int, limit: int) -> list[Entry]:
        rows = self.conn.execute(f"{_SEL} WHERE e.retry_ns IS NOT NULL AND e.retry_ns <= ? "
                                 "ORDER BY e.retry_ns LIMIT ?", (now_ns, limit)).fetchall()
        return [Entry.from_row(r) for r in rows]

    def finished_before(self, queue: int, state: State, before_ns: int, limit: int
                        ) -> list[Entry]:
        rows = self.conn.execute(
            f"{_SEL} WHERE e.queue=? AND e.state=? AND e.finished_ns IS NOT NULL "
            "AND e.finished_ns < ? AND e.kind='message' AND e.retry_ns IS NULL "
            "ORDER BY e.finished_ns LIMIT ?", (queue, state.value, before_ns, limit)).fetchall()
        return [Entry.from_row(r) for r in rows]

    def published_with(self, queue: int, blob_id: int, since_ns: int, besides: int
                       ) -> Entry | None:
        row = self.conn.execute(
            f"{_SEL} WHERE e.blob=? AND e.queue=? AND e.id<>? AND e.kind='message' "
            "AND e.enqueued_ns >= ? ORDER BY e.enqueued_ns LIMIT 1",
            (blob_id, queue, besides, since_ns)).fetchone()
        return Entry.from_row(row) if row else None

    def stats(self) -> list[tuple[Any, ...]]:
        return self.conn.execute(
            "SELECT queue, state, consumer, COUNT(*), COALESCE(SUM(size), 0), "
            "MIN(CASE state WHEN 'partial' THEN created_ns "
            "  WHEN 'ready' THEN (CASE WHEN substr(name, 1, 1) = X'2E' THEN NULL "
            "                     ELSE enqueued_ns END) "
            "  WHEN 'working' THEN claimed_ns ELSE finished_ns END), "
            "MIN(lease_ns), SUM(abandoned), SUM(retry_ns IS NOT NULL) "
            "FROM entries WHERE kind='message' AND hidden=0 "
            "GROUP BY queue, state, consumer").fetchall()

    def uploads(self, after: int, limit: int) -> list[tuple[int, int, str]]:
        return self.conn.execute("SELECT id, queue, state FROM entries WHERE staged=1 "
                                 "AND kind='message' AND hidden=0 AND id>? ORDER BY id LIMIT ?",
                                 (after, limit)).fetchall()

    def sharing(self, blob_id: int, limit: int) -> list[int]:
        return [r[0] for r in self.conn.execute(
            "SELECT id FROM entries WHERE blob=? LIMIT ?", (blob_id, limit))]

    def policies(self) -> dict[int, dict[str, str]]:
        out: dict[int, dict[str, str]] = {}
        for queue, key, value in self.conn.execute("SELECT queue, key, value FROM policies"):
            out.setdefault(queue, {})[key] = value
        return out

    def meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def all_entries(self) -> list[Entry]:
        return [Entry.from_row(r) for r in self.conn.execute(f"{_SEL} ORDER BY e.id")]

    def unclosed_uploads(self, after: int, limit: int) -> list[Entry]:
        return [Entry.from_row(r) for r in self.conn.execute(
            f"{_SEL} WHERE e.staged=1 AND e.hidden=1 AND e.id>? ORDER BY e.id LIMIT ?",
            (after, limit))]

    def staged_among(self, entry_ids: Sequence[int]) -> set[int]:
        return staged_among(self.conn, entry_ids)

    def unreferenced_blobs(self, after: int, limit: int) -> list[Blob]:
        return [Blob(*r) for r in self.conn.execute(
            "SELECT id, sha256, size, refcount, data FROM blobs WHERE refcount=0 AND id>? "
            "ORDER BY id LIMIT ?", (after, limit))]

    def highest_entry_id(self) -> int:
        # AUTOINCREMENT gives ids above both (reserve_entry_ids raises the record)
        row = self.conn.execute(
            "SELECT max(coalesce((SELECT seq FROM sqlite_sequence WHERE name='entries'), 0), "
            "coalesce((SELECT max(id) FROM entries), 0))").fetchone()
        return int(row[0])

    def all_blobs(self) -> list[Blob]:
        return [Blob(*r) for r in
                self.conn.execute("SELECT id, sha256, size, refcount, data FROM blobs ORDER BY id")]


def _fields(fields: dict[str, Any]) -> tuple[str, list[Any]]:
    for k in fields:
        if k not in ENTRY_COLUMNS or k == "id":
            raise ValueError(f"unknown entry column {k}")
    vals = [v._value_ if isinstance(v, enum.Enum) else v for v in fields.values()]
    return ", ".join(f"{k}=?" for k in fields), vals


class SqliteWrite(SqliteRead, WriteTx):
    def __init__(self, conn: sqlite3.Connection) -> None:
        super().__init__(conn)
        self.conn: sqlite3.Connection = conn

    def insert(self, **fields: Any) -> Entry:
        cols = list(fields)
        for k in cols:
            if k not in ENTRY_COLUMNS:
                raise ValueError(f"unknown entry column {k}")
        vals = [v._value_ if isinstance(v, enum.Enum) else v for v in fields.values()]
        row = self.conn.execute(
            f"INSERT INTO entries ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
            f"RETURNING {_RET}", vals).fetchone()
        # the link count rides along with a row that shares content (a link): read it then
        entry = Entry.from_row((*row, None)) if row[_BLOB] is None else self.get(row[0])
        assert entry is not None
        if not entry.hidden:
            self._dir_changed(entry.parent)
        return entry

    def reserve_entry_ids(self, n: int) -> list[int]:
        # AUTOINCREMENT takes the next id above the recorded sequence: raising the record
        # keeps the ids below it from every other insert (rolled back with the
        # transaction, as a row inserted would be)
        row = self.conn.execute(
            "UPDATE sqlite_sequence SET seq = max(seq, (SELECT coalesce(max(id), 0) FROM "
            "entries)) + ? WHERE name='entries' RETURNING seq", (n,)).fetchone()
        if row is None:  # no row was ever inserted (a store always has its root)
            raise StoreFailure("no entry sequence to reserve ids from")
        return list(range(int(row[0]) - n + 1, int(row[0]) + 1))

    def _dir_changed(self, *dirs: int | None) -> None:
        """A name appeared in or left these directories: their mtime and ctime move, as on
        any file system (scripts poll a directory's time), for every daemon on the store."""
        ids = [d for d in dict.fromkeys(dirs) if d is not None]
        if ids:  # one statement for both directories of a move
            now = time.time_ns()
            self.conn.execute("UPDATE entries SET mtime_ns=?, ctime_ns=? WHERE id IN "
                              f"({', '.join('?' * len(ids))})", (now, now, *ids))

    def _hidden(self, entry_id: int) -> bool | None:
        row = self.conn.execute("SELECT hidden FROM entries WHERE id=?", (entry_id,)).fetchone()
        return None if row is None else bool(row[0])

    def move(self, entry_id: int, parent: int, name: bytes, new_parent: int, new_name: bytes,
             *, free: bool = False, **fields: Any) -> bool:
        sets, vals = _fields(fields)
        sets = f"parent=?, name=?{', ' + sets if sets else ''}"
        # whether it was hidden: what the update leaves, unless it changes that too
        was_hidden = self._hidden(entry_id) if "hidden" in fields else None
        taken = (" AND NOT EXISTS (SELECT 1 FROM entries t WHERE t.parent=? AND t.name=? AND "
                 "t.id<>?)" if free else "")
        rows = self.conn.execute(
            f"UPDATE entries SET {sets} WHERE id=? AND parent=? AND name=?{taken} "
            "RETURNING hidden", [new_parent, new_name, *vals, entry_id, parent, name,
                                 *((new_parent, new_name, entry_id) if free else ())]
        ).fetchall()
        if len(rows) != 1:
            return False
        if was_hidden is None:
            was_hidden = bool(rows[0][0])
        # a hidden upload is no name in its directory: it leaves or arrives unseen
        self._dir_changed(None if was_hidden else parent,
                          None if fields.get("hidden", was_hidden) else new_parent)
        return True

    def update(self, entry_id: int, **fields: Any) -> bool:
        sets, vals = _fields(fields)
        appears = "hidden" in fields and not fields["hidden"] and self._hidden(entry_id)
        rows = self.conn.execute(f"UPDATE entries SET {sets} WHERE id=? RETURNING parent",
                                 [*vals, entry_id]).fetchall()
        if appears and rows:  # a hidden upload published: a name arrives
            self._dir_changed(rows[0][0])
        return len(rows) == 1

    def delete(self, entry_id: int) -> bool:
        rows = self.conn.execute("DELETE FROM entries WHERE id=? RETURNING parent, hidden",
                                 (entry_id,)).fetchall()
        if not rows:
            return False
        if not rows[0][1]:
            self._dir_changed(rows[0][0])
        return True

    def set_policy(self, queue: int, values: dict[str, str | None]) -> None:
        for key, value in values.items():
            if value is None:
                self.conn.execute("DELETE FROM policies WHERE queue=? AND key=?", (queue, key))
            else:
                self.conn.execute("INSERT OR REPLACE INTO policies (queue, key, value) "
                                  "VALUES (?, ?, ?)", (queue, key, value))

    def set_meta(self, key: str, value: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def drop_history(self, entry_id: int) -> None:
        self.conn.execute("DELETE FROM history WHERE entry=?", (entry_id,))

    def set_xattr(self, entry_id: int, name: bytes, value: bytes) -> None:
        self.conn.execute("INSERT OR REPLACE INTO xattrs (entry, name, value) VALUES (?, ?, ?)",
                          (entry_id, name, value))

    def remove_xattr(self, entry_id: int, name: bytes) -> bool:
        return self.conn.execute("DELETE FROM xattrs WHERE entry=? AND name=?",
                                 (entry_id, name)).rowcount == 1

    def copy_xattrs(self, src: int, dst: int) -> None:
        self.conn.execute("INSERT OR REPLACE INTO xattrs (entry, name, value) "
                          "SELECT ?, name, value FROM xattrs WHERE entry=?", (dst, src))

    def blob_by_sha(self, sha256: bytes) -> Blob | None:
        row = self.conn.execute("SELECT id, sha256, size, refcount, data FROM blobs WHERE sha256=?",
                                (sha256,)).fetchone()
        return Blob(*row) if row else None

    def blob_insert(self, sha256: bytes, size: int, data: bytes | None,
                    blob_id: int | None = None, refs: int = 0) -> int:
        cur = self.conn.execute(
            "INSERT INTO blobs (id, sha256, size, refcount, data) VALUES (?, ?, ?, ?, ?)",
            (blob_id, sha256, size, refs, data))
        return cast(int, cur.lastrowid)  # set after an INSERT

    def blob_ref(self, blob_id: int, delta: int) -> int:
        row = self.conn.execute("UPDATE blobs SET refcount = refcount + ? WHERE id=? "
                                "RETURNING refcount", (delta, blob_id)).fetchone()
        if row is None:
            raise StoreFailure(f"blob {blob_id} is missing")
        return int(row[0])

    def blob_delete(self, blob_id: int) -> None:
        self.conn.execute("DELETE FROM blobs WHERE id=?", (blob_id,))

    def add_history(self, entry_id: int, at_ns: int, action: str, src: str | None,
                    dst: str | None, uid: int | None, pid: int | None,
                    reason: str | None) -> None:
        self.conn.execute(
            "INSERT INTO history (entry, at_ns, action, src, dst, uid, pid, reason) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (entry_id, at_ns, action, src, dst, uid, pid, reason))


class SqliteStore(Store):
    """``path`` is the database file; created with its schema and root entry if missing.
    ``reserve`` is the store directory's metadata reserve, released when the disk fills."""

    deferred_sync = True

    def __init__(self, path: str, reserve: Reserve | None = None) -> None:
        self.path = path
        self.reserve = reserve
        self._wconn = _connect(path)
        try:
            self._init_schema()
            self._rconn = _connect(path)
        except BaseException:
            self._wconn.close()
            raise
        #: held while the writer's connection is in use: a batch, or a query lent to it
        self._lock = threading.Lock()
        self._home: int | None = None  # the thread that commits without waiting (the loop's)
        self._reader = SqliteRead(_Queries(self))
        self._writer = SqliteWrite(self._wconn)
        self._sync = "FULL"
        self._busy_ms = BUSY_TIMEOUT_MS
        self._scan_conn: sqlite3.Connection | None = None  # opened at the first scan
        self._scan_lock = threading.Lock()
        self._wal_fd = -1  # the write-ahead log, for sync()
        self._wal_lock = threading.Lock()

    def _init_schema(self) -> None:
        c = self._wconn
        c.executescript(schema.TABLES)  # idempotent: CREATE ... IF NOT EXISTS
        c.execute("BEGIN IMMEDIATE")
        try:
            if c.execute("SELECT 1 FROM entries WHERE id=1").fetchone() is None:
                now = time.time_ns()
                c.execute("INSERT INTO entries (id, parent, name, kind, mode, mtime_ns, ctime_ns, "
                          "created_ns) VALUES (1, NULL, X'', 'root', ?, ?, ?, ?)",
                          (0o40755, now, now, now))
                c.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                          (str(schema.VERSION),))
            self._migrate()
            c.execute("COMMIT")
        except BaseException:
            if c.in_transaction:  # SQLite has rolled back by itself after some errors
                c.execute("ROLLBACK")
            raise
        c.executescript(schema.INDEXES)

    def _migrate(self) -> None:
        """Bring an older store to this schema, in the transaction that opens it."""
        c = self._wconn
        row = c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        version = int(row[0]) if row else schema.VERSION
        if version > schema.VERSION:
            raise StoreFailure(f"the store has schema version {version}; this spoolfs knows "
                               f"up to {schema.VERSION}: upgrade spoolfs")
        while version < schema.VERSION:
            for stmt in schema.MIGRATIONS[version]:
                c.execute(stmt)
            version += 1
            log.info("store %s migrated to schema version %d", self.path, version)
        if row is None or int(row[0]) != version:  # opening an up-to-date store writes nothing
            c.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(version),))

    def reader(self) -> ReadTx:
        return self._reader

    @contextmanager
    def scan(self) -> Iterator[ReadTx]:
        with self._scan_lock:
            if self._scan_conn is None:
                self._scan_conn = _connect(self.path)
                self._scan_conn.execute("PRAGMA query_only=ON")
            conn = self._scan_conn
            conn.execute("BEGIN")  # every query below sees the same committed state
            try:
                yield SqliteRead(conn)
            finally:
                conn.execute("COMMIT")

    def _set_sync(self, mode: str) -> None:
        if mode != self._sync:
            self._wconn.execute(f"PRAGMA synchronous={mode}")
            self._sync = mode

    def _set_busy_timeout(self, ms: int) -> None:
        if ms != self._busy_ms:
            self._wconn.execute(f"PRAGMA busy_timeout={ms}")
            self._busy_ms = ms

    def run_batch(self, fns: Sequence[Callable[[WriteTx], Any]], durable: bool,
                  wait: bool = True) -> list[tuple[bool, Any]]:
        if not wait:
            self._home = threading.get_ident()
        with self._lock:
            return self._run_batch(fns, durable, wait)

    def _run_batch(self, fns: Sequence[Callable[[WriteTx], Any]], durable: bool,
                   wait: bool) -> list[tuple[bool, Any]]:
        c = self._wconn
        # In WAL mode a FULL commit fsyncs the log, which also makes every earlier NORMAL
        # commit durable: uploads in progress skip the fsync, transitions never do.
        self._set_sync("FULL" if durable else "NORMAL")
        self._set_busy_timeout(BUSY_TIMEOUT_MS if wait else 0)
        results: list[tuple[bool, Any]] = []
        if self.reserve is not None:
            self.reserve.release_if_low()
        try:
            c.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            if not wait and e.sqlite_errorcode == sqlite3.SQLITE_BUSY:
                raise StoreBusy() from e
            raise_if_full(e, self.reserve)
            raise StoreFailure(f"store unavailable: {e}") from e
        except sqlite3.Error as e:
            raise StoreFailure(f"store unavailable: {e}") from e
        alone = len(fns) == 1  # no savepoint needed: a failure rolls the transaction back
        try:
            for fn in fns:
                if not alone:
                    c.execute("SAVEPOINT op")
                try:
                    res = fn(self._writer)
                except (SpoolError, sqlite3.IntegrityError, OSError, ValueError, ArithmeticError,
                        TypeError) as e:  # this request fails alone; the others commit
                    if alone:
                        c.execute("ROLLBACK")
                        return [(False, e)]
                    c.execute("ROLLBACK TO op")
                    c.execute("RELEASE op")
                    results.append((False, e))
                else:
                    if not alone:
                        c.execute("RELEASE op")
                    results.append((True, res))
            c.execute("COMMIT")
        except sqlite3.Error as e:
            log.error("store commit failed: %s", e)
            try:
                c.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise_if_full(e, self.reserve)
            raise StoreFailure(f"store commit failed: {e}") from e
        except BaseException:
            c.execute("ROLLBACK")
            raise
        return results

    def sync(self) -> None:
        """fsync the write-ahead log: in WAL mode a transaction is durable once its frames in
        the log are on disk (what ``synchronous=FULL`` does at each commit), and an fsync
        covers every frame written before it, this daemon's or another's. A checkpoint that
        moved frames into the database file has synced both files itself. A log replaced
        since it was opened (the last connection of another daemon closed it) is opened
        again, and the database file synced too."""
        with self._wal_lock:
            try:
                if self._wal_fd >= 0 and os.fstat(self._wal_fd).st_nlink == 0:
                    os.close(self._wal_fd)
                    self._wal_fd = -1
                    self._fsync_path(self.path)
                if self._wal_fd < 0:
                    try:
                        self._wal_fd = os.open(self.path + "-wal", os.O_RDONLY | os.O_CLOEXEC)
                    except FileNotFoundError:  # every commit is in the database file
                        self._fsync_path(self.path)
                        return
                    self._fsync_path(os.path.dirname(self.path) or ".")  # the log's name
                os.fdatasync(self._wal_fd)
            except OSError as e:
                raise_if_full(e, self.reserve)
                raise StoreFailure(f"store sync failed: {e}") from e

    @staticmethod
    def _fsync_path(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._scan_lock:
            if self._scan_conn is not None:
                self._scan_conn.close()
        with self._wal_lock:
            if self._wal_fd >= 0:
                os.close(self._wal_fd)
                self._wal_fd = -1
        self._rconn.close()
        with self._lock:
            self._wconn.close()


def check_version(conn: sqlite3.Connection) -> None:
    """Refuse, in one line, a store this spoolfs cannot read as it is (without changing it)."""
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    version = int(row[0]) if row else schema.VERSION
    if version > schema.VERSION:
        raise StoreFailure(f"the store has schema version {version}; this spoolfs knows up to "
                           f"{schema.VERSION}: upgrade spoolfs")
    if version < schema.VERSION:
        raise StoreFailure(f"the store has schema version {version}, older than this spoolfs's "
                           f"{schema.VERSION}: mount it once (that upgrades it), then try again")


@contextmanager
def reading(path: str, reserve: Reserve | None = None) -> Iterator[SqliteRead]:
    """The database ``path`` opened read-only: nothing created, migrated or written, so it
    works beside a running daemon and for a user who may only read the store. (SQLite may
    still need room for the log's index: on a full disk the store's reserve makes it.)"""
    if reserve is not None:
        reserve.release_if_low()
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None,
                               timeout=BUSY_TIMEOUT_MS / 1000)
    except sqlite3.Error as e:
        raise_if_full(e, reserve)
        raise StoreFailure(f"{path}: {e}") from e
    try:
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA query_only=ON")
        check_version(conn)
        conn.execute("BEGIN")  # one snapshot for everything read
        yield SqliteRead(conn)
    except sqlite3.Error as e:
        raise_if_full(e, reserve)
        raise StoreFailure(f"{path}: {e}") from e
    finally:
        conn.close()


def open_store(store_dir: str) -> SqliteStore:
    """Open (or create) the store in ``store_dir``. On a full disk, the reserve makes room for
    the database's log and index; without one, ``StoreFull`` says the disk is full."""
    reserve = Reserve(store_dir)
    try:
        make_store_dir(store_dir)
        reserve.release_if_low()
        db = StoreLayout(store_dir).meta_db
        # Made owner-only before SQLite opens it: its -wal and -shm files take its mode.
        os.close(os.open(db, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE))
        return SqliteStore(db, reserve)
    except (sqlite3.Error, OSError) as e:
        raise_if_full(e, reserve)
        raise
