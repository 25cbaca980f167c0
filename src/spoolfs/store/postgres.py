"""The PostgreSQL engine: one database shared by every host that mounts the spool.

psycopg 3's synchronous API (its asynchronous one needs asyncio, not trio): write batches run
in worker threads (``blocking``: the committer never runs them on the event loop), each one
transaction on a connection of the pool, so a cancelled caller never leaves one open.

- Every function of a batch runs in a savepoint; a function that fails rolls back alone. A
  function that loses a deadlock or a lock wait to another host is run again (a few times),
  since its savepoint released what it held; the others keep their work. The ``BEGIN`` and
  each savepoint go to the server with the next statement, in its round trip.
- Moves are compare-and-set (``UPDATE … WHERE id AND parent AND name``): under READ COMMITTED
  a second mover waits for the first to commit, then finds the row moved and changes nothing.
- ``durable=True`` commits with ``synchronous_commit=on``; uploads in progress may skip the
  wait for the log flush.
- Each transaction that changes what ``ls``/``stat``/``getfattr`` show appends to ``changes``
  under a transaction-level advisory lock taken just before its commit, so sequence order is
  commit order and a follower reading "after N" never skips a late commit; one NOTIFY per
  commit wakes the followers (store/pg_schema.py, service/follower.py).
- The connection settings bound every wait: connect_timeout, statement_timeout, lock_timeout
  and TCP keepalives; a lost server is ``StoreFailure`` (EIO) in one line, and the pool
  reconnects by itself when it returns.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import psycopg
import psycopg.errors
from psycopg import sql
from psycopg_pool import ConnectionPool, PoolTimeout

from spoolfs.core.errors import SpoolError, StoreFailure
from spoolfs.core.rules import State
from spoolfs.store import pg_schema as schema
from spoolfs.store.base import (
    ENTRY_COLUMNS,
    LISTED_COLUMNS,
    Blob,
    ChangeRow,
    Entry,
    ReadTx,
    Steps,
    Store,
    WriteTx,
)
from spoolfs.store.pg_statements import Statements

log = logging.getLogger(__name__)
_T = TypeVar("_T")

CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_MS = 30_000
LOCK_TIMEOUT_MS = 10_000
#: a daemon opening a database that another one is setting up or migrating (building indexes
#: over every row) waits this long for it
SCHEMA_LOCK_TIMEOUT_MS = 600_000
#: a transaction left open by a daemon that vanished holds its row locks at most this long
IDLE_IN_TX_TIMEOUT_MS = 60_000
#: a write batch idle this long between two of its statements is ended by the server: its
#: daemon has stopped (a paused machine, a process killed but unable to exit), and its row
#: locks would hold every other host's moves of those rows until they fail (lock_timeout).
#: A batch runs its statements back to back: its gaps are Python's, milliseconds.
WRITE_IDLE_TIMEOUT_MS = 5_000
RETRIES = 5  # runs of a function that keeps losing deadlocks before it fails
POOL_MAX = 4
#: connections of the reader for reads as steps (``_Reader``)
STEP_CONNECTIONS = 4
#: reads go as steps once they take this long on average, waited for at once (``_Reader``)
STEP_AFTER_S = 0.0005
#: while reads go as steps, one in this many is waited for at once, to measure again
MEASURE_EVERY = 64
CHANGES_PAGE = 1000

#: libpq settings every connection gets (a URL may override them)
CONNECT_KWARGS: dict[str, Any] = {
    "connect_timeout": CONNECT_TIMEOUT_S,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
    "application_name": "spoolfs",
}
SESSION = (f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}; "
           f"SET lock_timeout = {LOCK_TIMEOUT_MS}; "
           f"SET idle_in_transaction_session_timeout = {IDLE_IN_TX_TIMEOUT_MS}")
#: while a statement runs (waits on a lock), the server looks this often whether its client
#: is still there: a daemon killed then (its socket closed) has its session ended and its
#: earlier locks released at once, not when that statement's lock_timeout runs out.
#: PostgreSQL 14 and later; an older server keeps them until then.
CLIENT_CHECK = "SET client_connection_check_interval = 1000"

_COLS = ", ".join(f"e.{c}" for c in ENTRY_COLUMNS)
_ROW = f"{_COLS}, b.refcount FROM entries e LEFT JOIN blobs b ON b.id = e.blob"
_SEL = f"SELECT {_ROW}"
_GET = f"{_SEL} WHERE e.id=%s"
_LOOKUP = f"{_SEL} WHERE e.parent=%s AND e.name=%s"
#: an entry and its content's blob row in one round trip (an open's reads)
_GET_WITH_BLOB = (f"SELECT {_COLS}, b.refcount, b.id, b.sha256, b.size, b.data FROM entries e "
                  "LEFT JOIN blobs b ON b.id = e.blob WHERE e.id=%s")
_ENTRY_PART = len(ENTRY_COLUMNS) + 1  # (its refcount too)
#: a rename's three reads in one round trip, each row tagged with which it answers
_RENAME_READS = (f"SELECT 0, {_ROW} WHERE e.parent=%s AND e.name=%s UNION ALL "
                 f"SELECT 1, {_ROW} WHERE e.id=%s UNION ALL "
                 f"SELECT 2, {_ROW} WHERE e.parent=%s AND e.name=%s")
_LISTED = (f"SELECT {', '.join(f'e.{c}' for c in LISTED_COLUMNS)}, b.refcount "
           "FROM entries e LEFT JOIN blobs b ON b.id = e.blob")
_BLOB = "SELECT id, sha256, size, refcount, data FROM blobs"
#: one more reference on the blob of this content, or a new row for it (``n``: its id):
#: one round trip, and no lost race. A row of the same content another host has inserted,
#: not yet committed, is waited for, then shared (a lookup then an insert failed on the
#: unique content). The new row's id is drawn first, so that the row returned tells
#: whether it is this one.
_TAKE = ("WITH n AS (SELECT COALESCE(%s::bigint, "
         "nextval(pg_get_serial_sequence('blobs', 'id'))) AS id), "
         "b AS (INSERT INTO blobs (id, sha256, size, refcount, data) "
         "SELECT n.id, %s::bytea, %s::bigint, 1, %s::bytea FROM n "
         "ON CONFLICT (sha256) DO UPDATE SET refcount = blobs.refcount + 1 RETURNING id)")
#: errors that mean another transaction was in the way, not that the function is wrong
_LOST = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)


def _session(conn: psycopg.Connection[Any]) -> None:
    """Every connection's settings (SESSION, and CLIENT_CHECK where the server has it). The
    engine's statements are prepared by pg_statements, never by psycopg (which would drop
    them at its next ROLLBACK: that module says why)."""
    conn.prepare_threshold = None
    conn.execute(SESSION if conn.info.server_version < 140000 else f"{SESSION}; {CLIENT_CHECK}")


#: the pool's connections whose session has the commit's function (pg_schema.COMMIT_FUNCTION)
_WITH_COMMIT_FUNCTION: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
_told: set[str] = set()  # what was logged once per daemon


def _make_commit_function(conn: psycopg.Connection[Any]) -> None:
    """The commit's function in this session. Where the server makes none (a role the
    database lets make no temporary object, a read-only server or role, no PL/pgSQL), the
    connection commits without it, sending the statement in full (``_commit``); a broken
    connection fails as any other would at its set-up."""
    try:
        conn.execute(cast(Any, schema.COMMIT_FUNCTION))
    except psycopg.Error as e:
        if conn.broken:
            raise
        why = type(e).__name__
        if why not in _told:
            _told.add(why)
            log.warning("the database makes no function for this session (%s): each commit "
                        "sends its change-log statement in full, 0.15-0.2 ms slower",
                        str(e).strip().splitlines()[0] if str(e).strip() else why)
        return
    _WITH_COMMIT_FUNCTION.add(conn)


def _rollback(conn: psycopg.Connection[Any]) -> None:
    """End the transaction on ``conn`` whatever state it is in (a broken connection: the
    pool discards it)."""
    try:
        conn.execute("ROLLBACK")
    except psycopg.Error:
        pass


class _FirstTripFailed(Exception):
    """A batch's connection broke at its first round trip: nothing was done on it."""


class IntegrityError(ValueError):
    """A constraint of the schema refused a change: the function's changes roll back."""


def unavailable(e: BaseException) -> StoreFailure:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return StoreFailure(f"database unavailable: {first}")


def _value(v: Any) -> Any:
    if isinstance(v, State):
        return v.value
    if isinstance(v, bool):
        return int(v)
    return v


def _blob(row: Sequence[Any] | None) -> Blob | None:
    if row is None:
        return None
    b = Blob(*row)
    b.sha256 = bytes(b.sha256)
    b.data = bytes(b.data) if b.data is not None else None
    return b


@dataclass(frozen=True, slots=True)
class Change:
    seq: int
    entry_id: int
    parent: int | None
    name: bytes | None
    old_parent: int | None
    old_name: bytes | None
    origin: str


def _found(rows: list[tuple[Any, ...]]) -> tuple[Entry | None, Entry | None, Entry | None]:
    """``_RENAME_READS``'s rows: the entry found by name, the one found by id, the one found
    by the new name."""
    found: list[Entry | None] = [None, None, None]
    for row in rows:
        found[row[0]] = Entry.from_row(row[1:])
    return found[0], found[1], found[2]


#: a directory's subdirectories, counted (its link count)
_SUBDIRS = ("SELECT COUNT(*) FROM entries WHERE parent=%s AND hidden=0 "
            "AND (mode & 61440)=16384")  # S_IFMT / S_IFDIR


def _with_blob(rows: list[tuple[Any, ...]]) -> tuple[Entry | None, Blob | None]:
    """``_GET_WITH_BLOB``'s row: the entry, and its content's blob row."""
    if not rows:
        return None, None
    row = rows[0]
    blob_id, sha256, size, data = row[_ENTRY_PART:]
    return Entry.from_row(row[:_ENTRY_PART]), None if blob_id is None else _blob(
        (blob_id, sha256, size, row[_ENTRY_PART - 1], data))


class PgRead(ReadTx):
    def __init__(self, run: Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]) -> None:
        self._run = run

    def q(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._run(query, params)

    def q1(self, query: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = self._run(query, params)
        return rows[0] if rows else None

    def _entries(self, query: str, params: Sequence[Any] = ()) -> list[Entry]:
        return [Entry.from_row(r) for r in self.q(query, params)]

    def get(self, entry_id: int) -> Entry | None:
        row = self.q1(_GET, (entry_id,))
        return Entry.from_row(row) if row else None

    def get_with_blob(self, entry_id: int) -> tuple[Entry | None, Blob | None]:
        return _with_blob(self.q(_GET_WITH_BLOB, (entry_id,)))

    def lookup(self, parent: int, name: bytes) -> Entry | None:
        row = self.q1(_LOOKUP, (parent, name))
        return Entry.from_row(row) if row else None

    def rename_reads(self, parent: int, name: bytes, new_parent: int, new_name: bytes
                     ) -> tuple[Entry | None, Entry | None, Entry | None]:
        return _found(self.q(_RENAME_READS, (parent, name, new_parent, new_parent, new_name)))

    def _steps(self, query: str, params: Sequence[Any]) -> Steps[list[tuple[Any, ...]]]:
        """A query as steps (``base.Steps``); here (a transaction's) waited for at once."""
        return self._run(query, params)
        yield

    def lookup_steps(self, parent: int, name: bytes) -> Steps[Entry | None]:
        rows = yield from self._steps(_LOOKUP, (parent, name))
        return Entry.from_row(rows[0]) if rows else None

    def names_steps(self, parent: int, limit: int) -> Steps[list[bytes]]:
        rows = yield from self._steps("SELECT name FROM entries WHERE parent=%s LIMIT %s",
                                      (parent, limit))
        return [bytes(r[0]) for r in rows]

    def get_steps(self, entry_id: int) -> Steps[Entry | None]:
        rows = yield from self._steps(_GET, (entry_id,))
        return Entry.from_row(rows[0]) if rows else None

    def get_with_blob_steps(self, entry_id: int) -> Steps[tuple[Entry | None, Blob | None]]:
        return _with_blob((yield from self._steps(_GET_WITH_BLOB, (entry_id,))))

    def rename_reads_steps(self, parent: int, name: bytes, new_parent: int, new_name: bytes
                           ) -> Steps[tuple[Entry | None, Entry | None, Entry | None]]:
        return _found((yield from self._steps(
            _RENAME_READS, (parent, name, new_parent, new_parent, new_name))))

    def children(self, parent: int) -> list[Entry]:
        return self._entries(f"{_SEL} WHERE e.parent=%s ORDER BY e.id", (parent,))

    def page(self, parent: int, after: int, limit: int) -> list[Entry]:
        return self._entries(f"{_SEL} WHERE e.parent=%s AND e.id>%s AND e.hidden=0 "
                             "ORDER BY e.id LIMIT %s", (parent, after, limit))

    def listing(self, parent: int, after: int, limit: int) -> list[Entry]:
        return [Entry.listed(r) for r in self.q(
            f"{_LISTED} WHERE e.parent=%s AND e.id>%s AND e.hidden=0 ORDER BY e.id LIMIT %s",
            (parent, after, limit))]

    def has_children(self, parent: int) -> bool:
        return self.q1("SELECT 1 FROM entries WHERE parent=%s LIMIT 1", (parent,)) is not None

    def subdirs(self, parent: int) -> int:
        rows = self.q(_SUBDIRS, (parent,))
        return int(rows[0][0]) if rows else 0

    def subdirs_steps(self, parent: int) -> Steps[int]:
        rows = yield from self._steps(_SUBDIRS, (parent,))
        return int(rows[0][0]) if rows else 0

    def subdirectories(self, parent: int) -> list[Entry]:
        return self._entries(f"{_SEL} WHERE e.parent=%s AND e.hidden=0 "
                             "AND (e.mode & 61440)=16384 ORDER BY e.id", (parent,))

    def blob(self, blob_id: int) -> Blob | None:
        return _blob(self.q1(f"{_BLOB} WHERE id=%s", (blob_id,)))

    def blob_by_sha(self, sha256: bytes) -> Blob | None:
        return _blob(self.q1(f"{_BLOB} WHERE sha256=%s", (sha256,)))

    def xattrs(self, entry_id: int) -> dict[bytes, bytes]:
        return {bytes(n): bytes(v) for n, v in
                self.q("SELECT name, value FROM xattrs WHERE entry=%s", (entry_id,))}

    def history(self, entry_id: int) -> list[tuple[Any, ...]]:
        return self.q("SELECT at_ns, action, src, dst, uid, pid, reason FROM history "
                      "WHERE entry=%s ORDER BY id", (entry_id,))

    def due_leases(self, now_ns: int, limit: int) -> list[Entry]:
        return self._entries(f"{_SEL} WHERE e.lease_ns IS NOT NULL AND e.lease_ns <= %s "
                             "ORDER BY e.lease_ns LIMIT %s", (now_ns, limit))

    def due_retries(self, now_ns: int, limit: int) -> list[Entry]:
        return self._entries(f"{_SEL} WHERE e.retry_ns IS NOT NULL AND e.retry_ns <= %s "
                             "ORDER BY e.retry_ns LIMIT %s", (now_ns, limit))

    def finished_before(self, queue: int, state: State, before_ns: int, limit: int
                        ) -> list[Entry]:
        return self._entries(
            f"{_SEL} WHERE e.queue=%s AND e.state=%s AND e.finished_ns IS NOT NULL "
            "AND e.finished_ns < %s AND e.kind='message' AND e.retry_ns IS NULL "
            "ORDER BY e.finished_ns LIMIT %s", (queue, state.value, before_ns, limit))

    def published_with(self, queue: int, blob_id: int, since_ns: int, besides: int
                       ) -> Entry | None:
        row = self.q1(
            f"{_SEL} WHERE e.blob=%s AND e.queue=%s AND e.id<>%s AND e.kind='message' "
            "AND e.enqueued_ns >= %s ORDER BY e.enqueued_ns LIMIT 1",
            (blob_id, queue, besides, since_ns))
        return Entry.from_row(row) if row else None

    def stats(self) -> list[tuple[Any, ...]]:
        return self.q(
            "SELECT queue, state, consumer, COUNT(*), COALESCE(SUM(size), 0)::bigint, "
            "MIN(CASE state WHEN 'partial' THEN created_ns "
            "  WHEN 'ready' THEN (CASE WHEN substring(name FROM 1 FOR 1) = '\\x2e'::bytea "
            "                     THEN NULL ELSE enqueued_ns END) "
            "  WHEN 'working' THEN claimed_ns ELSE finished_ns END), "
            "MIN(lease_ns), SUM(abandoned)::bigint, "
            "SUM(CASE WHEN retry_ns IS NOT NULL THEN 1 ELSE 0 END)::bigint "
            "FROM entries WHERE kind='message' AND hidden=0 "
            "GROUP BY queue, state, consumer")

    def uploads(self, after: int, limit: int) -> list[tuple[int, int, str]]:
        return cast(list[tuple[int, int, str]], self.q(
            "SELECT id, queue, state FROM entries WHERE staged=1 AND kind='message' "
            "AND hidden=0 AND id>%s ORDER BY id LIMIT %s", (after, limit)))

    def sharing(self, blob_id: int, limit: int) -> list[int]:
        return [r[0] for r in self.q("SELECT id FROM entries WHERE blob=%s LIMIT %s",
                                     (blob_id, limit))]

    def policies(self) -> dict[int, dict[str, str]]:
        out: dict[int, dict[str, str]] = {}
        for queue, key, value in self.q("SELECT queue, key, value FROM policies"):
            out.setdefault(queue, {})[key] = value
        return out

    def meta(self, key: str) -> str | None:
        row = self.q1("SELECT value FROM meta WHERE key=%s", (key,))
        return None if row is None else str(row[0])

    def all_entries(self) -> list[Entry]:
        return self._entries(f"{_SEL} ORDER BY e.id")

    def unclosed_uploads(self, after: int, limit: int) -> list[Entry]:
        return self._entries(f"{_SEL} WHERE e.staged=1 AND e.hidden=1 AND e.id>%s "
                             "ORDER BY e.id LIMIT %s", (after, limit))

    def staged_among(self, entry_ids: Sequence[int]) -> set[int]:
        if not entry_ids:
            return set()
        return {int(i) for (i,) in self.q(
            "SELECT id FROM entries WHERE staged=1 AND id = ANY(%s)", (list(entry_ids),))}

    def unreferenced_blobs(self, after: int, limit: int) -> list[Blob]:
        return [cast(Blob, _blob(r)) for r in self.q(
            f"{_BLOB} WHERE refcount=0 AND id>%s ORDER BY id LIMIT %s", (after, limit))]

    def highest_entry_id(self) -> int:
        # the sequence's, not the rows': a value drawn (by any host, any transaction, rolled
        # back or not) is never drawn again; NULL before the first
        rows = self.q("SELECT coalesce(pg_sequence_last_value("
                      "pg_get_serial_sequence('entries', 'id')::regclass), 0)")
        return int(rows[0][0])

    def all_blobs(self) -> list[Blob]:
        return [cast(Blob, _blob(r)) for r in self.q(f"{_BLOB} ORDER BY id")]


def _stamping(ids: str) -> str:
    """A statement's part that sets the times (two ``%s``: mtime and ctime) of the
    directories query ``ids`` names, with the change it is part of: one round trip. Its rows
    are locked in id order (the index's), whatever the order of a move: two hosts moving
    between the same directories never lock them crosswise."""
    return ("stamped AS (UPDATE entries SET mtime_ns=%s, ctime_ns=%s "
            f"WHERE id = ANY(ARRAY({ids})) RETURNING id)")


def _sets(fields: dict[str, Any]) -> tuple[str, list[Any]]:
    for k in fields:
        if k not in ENTRY_COLUMNS or k == "id":
            raise ValueError(f"unknown entry column {k}")
    return ", ".join(f"{k}=%s" for k in fields), [_value(v) for v in fields.values()]


class PgWrite(PgRead, WriteTx):
    """Inside one transaction; records what changed for the change log."""

    def __init__(self, run: Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]) -> None:
        super().__init__(run)
        self.changed: list[ChangeRow] = []
        #: history rows, written with the change rows in the commit's statement (nothing in a
        #: transaction reads them back); an entry's ``drop_history`` as ``(entry, None, ...)``.
        #: Both lists only grow, so a function's savepoint is a length of each.
        self.noted: list[tuple[Any, ...]] = []

    def mark(self) -> tuple[int, int]:
        return len(self.changed), len(self.noted)

    def undo(self, mark: tuple[int, int]) -> None:
        del self.changed[mark[0]:]
        del self.noted[mark[1]:]

    def history_rows(self) -> list[tuple[Any, ...]]:
        """The history rows to write, in order, less those a later drop removed."""
        rows: list[tuple[Any, ...]] = []
        for row in self.noted:
            if row[1] is None:
                rows = [r for r in rows if r[0] != row[0]]
            else:
                rows.append(row)
        return rows

    def _changed(self, entry: int, parent: int | None, name: bytes | None,
                 old_parent: int | None = None, old_name: bytes | None = None) -> None:
        self.changed.append((entry, parent, name, old_parent, old_name))

    def reserve_entry_ids(self, n: int) -> list[int]:
        # a sequence never hands a value out twice, whatever happens to this transaction;
        # other hosts draw from it meanwhile, so the ids need not be consecutive
        rows = self.q("SELECT nextval(pg_get_serial_sequence('entries', 'id')) "
                      "FROM generate_series(1, %s)", (n,))
        return sorted(int(r[0]) for r in rows)

    def insert(self, **fields: Any) -> Entry:
        entry = self._insert(fields, "")
        assert entry is not None
        return entry

    def insert_unless_named(self, **fields: Any) -> Entry | None:
        # (a name another transaction is inserting: waited for, then None if it committed)
        return self._insert(fields, " ON CONFLICT (parent, name) DO NOTHING")

    def _insert(self, fields: dict[str, Any], conflict: str) -> Entry | None:
        for k in fields:
            if k not in ENTRY_COLUMNS:
                raise ValueError(f"unknown entry column {k}")
        cols = ", ".join(fields)
        marks = ", ".join(["%s"] * len(fields))
        # the new row read back as ``get`` reads it, and its directory's times, in the same
        # round trip
        now = time.time_ns()
        row = self.q1(f"WITH e AS (INSERT INTO entries ({cols}) VALUES ({marks}){conflict} "
                      "RETURNING *), " + _stamping("SELECT parent FROM e WHERE hidden = 0") +
                      f" SELECT {_COLS}, b.refcount FROM e LEFT JOIN blobs b ON b.id = e.blob",
                      [*(_value(v) for v in fields.values()), now, now])
        if row is None:
            return None
        entry = Entry.from_row(row)
        if not entry.hidden:
            self._stamped(entry.parent)
            self._changed(entry.id, entry.parent, entry.name)
        return entry

    def _stamped(self, *dirs: int | None) -> None:
        """Directories whose times a statement moved (``_stamping``): their attributes
        changed."""
        for d in sorted({d for d in dirs if d is not None}):
            self._changed(d, None, None)

    def move(self, entry_id: int, parent: int, name: bytes, new_parent: int, new_name: bytes,
             *, free: bool = False, **fields: Any) -> bool:
        # (with ``free``, a name another transaction is taking is not seen: the unique index
        # waits for it, then fails this statement if it committed, as a lookup first would)
        sets, vals = _sets(fields)
        sets = "parent=%s, name=%s" + (", " + sets if sets else "")
        # One round trip: the move, and the times of the directories where a name left and
        # arrived (a hidden row is no name). ``was`` is the row as the statement found it
        # (RETURNING shows the new values).
        now = time.time_ns()
        taken = ("AND NOT EXISTS (SELECT 1 FROM entries t WHERE t.parent=%s AND t.name=%s "
                 "AND t.id <> %s) " if free else "")
        rows = self.q(f"WITH m AS (UPDATE entries SET {sets} FROM entries was "
                      "WHERE was.id = entries.id AND entries.id=%s AND entries.parent=%s "
                      f"AND entries.name=%s {taken}"
                      "RETURNING was.hidden AS was, entries.hidden AS now), "
                      + _stamping("SELECT d FROM m, unnest(ARRAY["
                                  "CASE WHEN m.was = 0 THEN %s::bigint END, "
                                  "CASE WHEN m.now = 0 THEN %s::bigint END]) AS d "
                                  "WHERE d IS NOT NULL") +
                      " SELECT was, now FROM m",
                      [new_parent, new_name, *vals, entry_id, parent, name,
                       *((new_parent, new_name, entry_id) if free else ()), now, now, parent,
                       new_parent])
        if len(rows) != 1:
            return False
        was_hidden, now_hidden = rows[0]
        self._stamped(None if was_hidden else parent, None if now_hidden else new_parent)
        self._changed(entry_id, new_parent, new_name, parent, name)
        return True

    def update(self, entry_id: int, **fields: Any) -> bool:
        sets, vals = _sets(fields)
        if "hidden" in fields and not fields["hidden"]:
            # a hidden upload published: a name arrives, and its directory's times move
            now = time.time_ns()
            rows = self.q(f"WITH u AS (UPDATE entries SET {sets} FROM entries was "
                          "WHERE was.id = entries.id AND entries.id=%s RETURNING entries.parent, "
                          "entries.name, was.hidden AS was), "
                          + _stamping("SELECT parent FROM u WHERE was <> 0") +
                          " SELECT parent, name, was FROM u", [*vals, entry_id, now, now])
        else:
            rows = self.q(f"UPDATE entries SET {sets} WHERE id=%s RETURNING parent, name, 0",
                          [*vals, entry_id])
        if len(rows) != 1:
            return False
        parent, name, was_hidden = rows[0]
        if was_hidden:
            self._stamped(parent)
        self._changed(entry_id, parent, bytes(name))
        return True

    def delete(self, entry_id: int) -> bool:
        now = time.time_ns()
        rows = self.q("WITH x AS (DELETE FROM entries WHERE id=%s RETURNING parent, hidden, name), "
                      + _stamping("SELECT parent FROM x WHERE hidden = 0") +
                      " SELECT parent, hidden, name FROM x", (entry_id, now, now))
        if not rows:
            return False
        parent, hidden, name = rows[0]
        if not hidden:
            self._stamped(parent)
        self._changed(entry_id, None, None, parent, bytes(name))
        return True

    def set_policy(self, queue: int, values: dict[str, str | None]) -> None:
        for key, value in values.items():
            if value is None:
                self.q("DELETE FROM policies WHERE queue=%s AND key=%s", (queue, key))
            else:
                self.q("INSERT INTO policies (queue, key, value) VALUES (%s, %s, %s) "
                       "ON CONFLICT (queue, key) DO UPDATE SET value = EXCLUDED.value",
                       (queue, key, value))

    def set_meta(self, key: str, value: str) -> None:
        self.q("INSERT INTO meta (key, value) VALUES (%s, %s) "
               "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value", (key, value))

    def drop_history(self, entry_id: int) -> None:
        self.q("DELETE FROM history WHERE entry=%s", (entry_id,))
        self.noted.append((entry_id, None, None, None, None, None, None, None))

    def set_xattr(self, entry_id: int, name: bytes, value: bytes) -> None:
        self.q("INSERT INTO xattrs (entry, name, value) VALUES (%s, %s, %s) "
               "ON CONFLICT (entry, name) DO UPDATE SET value = EXCLUDED.value",
               (entry_id, name, value))
        self._changed(entry_id, None, None)

    def remove_xattr(self, entry_id: int, name: bytes) -> bool:
        gone = bool(self.q("DELETE FROM xattrs WHERE entry=%s AND name=%s RETURNING entry",
                           (entry_id, name)))
        if gone:
            self._changed(entry_id, None, None)
        return gone

    def copy_xattrs(self, src: int, dst: int) -> None:
        self.q("INSERT INTO xattrs (entry, name, value) SELECT %s, name, value FROM xattrs "
               "WHERE entry=%s ON CONFLICT (entry, name) DO UPDATE SET value = EXCLUDED.value",
               (dst, src))

    def blob_insert(self, sha256: bytes, size: int, data: bytes | None,
                    blob_id: int | None = None, refs: int = 0) -> int:
        """A new blob row; ``blob_id`` one from ``reserve_blob_id`` (content stored under
        that id before this transaction), or ``data``: content small enough to live in
        the row."""
        if blob_id is None:
            row = self.q1("INSERT INTO blobs (sha256, size, refcount, data) "
                          "VALUES (%s, %s, %s, %s) RETURNING id", (sha256, size, refs, data))
        else:
            row = self.q1("INSERT INTO blobs (id, sha256, size, refcount, data) "
                          "VALUES (%s, %s, %s, %s, %s) RETURNING id",
                          (blob_id, sha256, size, refs, data))
        assert row is not None
        return int(row[0])

    def blob_ref(self, blob_id: int, delta: int) -> int:
        row = self.q1("UPDATE blobs SET refcount = refcount + %s WHERE id=%s RETURNING refcount",
                      (delta, blob_id))
        if row is None:
            raise StoreFailure(f"blob {blob_id} is missing")
        return int(row[0])

    def blob_take(self, sha256: bytes, size: int, data: bytes | None,
                  blob_id: int | None = None) -> tuple[int, bool]:
        row = self.q1(f"{_TAKE} SELECT b.id, b.id = n.id FROM b, n",
                      (blob_id, sha256, size, data))
        assert row is not None
        return int(row[0]), bool(row[1])

    def attach_blob(self, entry_id: int, sha256: bytes, size: int, data: bytes | None,
                    mtime_ns: int, blob_id: int | None = None) -> tuple[int, bool]:
        row = self.q1(f"{_TAKE}, u AS (UPDATE entries SET blob = b.id, staged = 0, "
                      "size = %s, mtime_ns = %s FROM b WHERE entries.id = %s "
                      "RETURNING entries.parent, entries.name) "
                      "SELECT b.id, b.id = n.id, u.parent, u.name FROM b CROSS JOIN n "
                      "LEFT JOIN u ON true",
                      (blob_id, sha256, size, data, size, mtime_ns, entry_id))
        assert row is not None
        if row[2] is not None:
            self._changed(entry_id, row[2], bytes(row[3]))
        return int(row[0]), bool(row[1])

    def blob_delete(self, blob_id: int) -> None:
        self.q("DELETE FROM blobs WHERE id=%s", (blob_id,))

    def add_history(self, entry_id: int, at_ns: int, action: str, src: str | None,
                    dst: str | None, uid: int | None, pid: int | None,
                    reason: str | None) -> None:
        self.noted.append((entry_id, at_ns, action, src, dst, uid, pid, reason))


def _runner(statements: Statements  # (the transaction's: each statement's rows read whole)
            ) -> Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]:

    def run(query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        try:
            return statements.run(query, params)
        except psycopg.errors.IntegrityError as e:
            raise IntegrityError(str(e).splitlines()[0]) from e
    return run


class _Reader(PgRead):
    """``reader()``: one autocommit connection of its own, reopened when it breaks. Each
    query is a statement of its own, bounded by the session's timeouts.

    Reads as steps (``lookup_steps``...) run on connections of their own, up to
    ``STEP_CONNECTIONS`` at once, each made when first needed while the reader's own
    connection is up (on the caller's thread: a connect waited for, once per connection):
    the event loop that drives the steps answers other requests while the server answers.
    With all of them busy, or one of them broken, a read is waited for on the reader's own
    connection, as any read. So is every such read while they take less than
    ``STEP_AFTER_S`` on average (a server on the same machine or next to it): there the
    steps' own work (the loop's wait registered and woken, a task switch) costs more CPU
    than the round trip saves. While reads go as steps, one in ``MEASURE_EVERY`` is waited
    for at once to measure again."""

    def __init__(self, store: PostgresStore) -> None:
        super().__init__(self._query)
        self._store = store
        self._conn: psycopg.Connection[Any] | None = None
        self._statements: Statements | None = None  # the connection's, for every query
        self._lock = threading.Lock()
        self._spare: list[Statements] = []  # step connections not in use (the loop's only)
        self._stepping = 0  # step connections open, in use or not
        self._closed = False  # close_all: a step connection in use is closed at its end
        self._took = 0.0  # a read waited for at once, on average (weight 0.2 for the latest)
        self._reads = 0

    def _steps(self, query: str, params: Sequence[Any]) -> Steps[list[tuple[Any, ...]]]:
        self._reads += 1
        if self._took < STEP_AFTER_S or self._reads % MEASURE_EVERY == 0:
            return self._timed(query, params)
        st = self._spare.pop() if self._spare else self._new_spare()
        if st is None:
            return self._query(query, params)
        kept = False
        try:
            rows = yield from st.steps(query, params)
            kept = True
            return rows
        except psycopg.errors.QueryCanceled as e:  # (its statement_timeout)
            kept = True
            raise unavailable(e) from e
        except (psycopg.OperationalError, psycopg.errors.InvalidSqlStatementName):
            kept = not st.conn.broken  # (statements dropped: prepared again on it next time)
        except psycopg.Error as e:
            kept = True
            raise unavailable(e) from e
        finally:
            if kept and not self._closed:
                self._spare.append(st)
            else:  # broken, left in the middle of a statement (the steps were stopped), or
                # the store closed meanwhile
                self._stepping -= 1
                _close_quietly(st.conn)
        return self._query(query, params)  # once more, waited for (and reconnected) here

    def _timed(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """``_query``, timed into ``_took`` unless it had to connect first."""
        connected = self._conn is not None and not self._conn.closed
        start = time.monotonic()
        rows = self._query(query, params)
        if connected:
            self._took += (time.monotonic() - start - self._took) * 0.2
        return rows

    def _new_spare(self) -> Statements | None:
        if self._stepping >= STEP_CONNECTIONS or self._conn is None or self._conn.closed \
                or self._closed:
            return None  # (while the reader's own is down, its connect alone is waited for)
        try:
            conn = self._store.connect(autocommit=True)
        except psycopg.Error as e:
            log.debug("no connection for reads as steps: %s", e)
            return None
        self._stepping += 1
        return Statements(conn)

    def _query(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        with self._lock:
            for attempt in (1, 2):
                try:
                    if self._conn is None or self._conn.closed or self._statements is None:
                        self._conn = self._store.connect(autocommit=True)
                        self._statements = Statements(self._conn)
                    return self._statements.run(query, params)
                except psycopg.OperationalError as e:
                    self.close()
                    if attempt == 2 or isinstance(e, psycopg.errors.QueryCanceled):
                        raise unavailable(e) from e
                except psycopg.errors.InvalidSqlStatementName as e:
                    # the session's statements were dropped (DEALLOCATE): prepared again
                    if attempt == 2:
                        raise unavailable(e) from e
                except psycopg.Error as e:
                    raise unavailable(e) from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        """The reader's own connection; ``close_all`` the step connections too."""
        if self._conn is not None:
            _close_quietly(self._conn)
            self._conn = None
            self._statements = None

    def close_all(self) -> None:
        self._closed = True
        self.close()
        while self._spare:
            self._stepping -= 1
            _close_quietly(self._spare.pop().conn)


def _close_quietly(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.close()
    except psycopg.Error:
        pass


class PostgresStore(Store):
    """``url`` is a libpq connection URL (``postgresql://USER@HOST:PORT/DB``); the password
    comes from ``~/.pgpass`` or ``PGPASSWORD``, as for every libpq program."""

    #: run_batch waits on the network: the committer runs it in a worker thread
    blocking = True
    #: the database is shared by several hosts: recovery judges only this host's files
    shared = True

    def __init__(self, url: str, pool_max: int = POOL_MAX) -> None:
        self.url = url
        self.origin = uuid.uuid4().hex[:16]
        self._check_url()
        try:
            with self.connect(autocommit=True) as conn:
                self._init_schema(conn)
        except psycopg.Error as e:
            raise unavailable(e) from e
        self._pool = ConnectionPool(url, min_size=1, max_size=pool_max, open=False,
                                    kwargs={**CONNECT_KWARGS, "autocommit": True},
                                    configure=self._configure,
                                    timeout=CONNECT_TIMEOUT_S * 2, reconnect_timeout=0,
                                    name="spoolfs")
        self._pool.open(wait=False)
        self._reader = _Reader(self)
        self._scan_lock = threading.Lock()
        self._listen: psycopg.Connection[Any] | None = None

    def _check_url(self) -> None:
        try:
            psycopg.conninfo.conninfo_to_dict(self.url)
        except psycopg.ProgrammingError as e:
            raise StoreFailure(f"not a PostgreSQL URL: {e}") from e

    @staticmethod
    def _configure(conn: psycopg.Connection[Any]) -> None:
        _session(conn)  # autocommit: transactions are begun and ended explicitly
        _make_commit_function(conn)

    def connect(self, autocommit: bool = False) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self.url, autocommit=True, **CONNECT_KWARGS)
        _session(conn)
        conn.autocommit = autocommit
        return conn

    def _init_schema(self, conn: psycopg.Connection[Any]) -> None:
        """Tables, the root entry and migrations, once, even when several daemons open an
        empty database at the same moment. A database already at this version is left alone:
        set-up statements lock the tables they name (CREATE INDEX IF NOT EXISTS does before it
        finds the index), which against other hosts' transactions is a wait or a deadlock."""
        try:
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except psycopg.errors.UndefinedTable:
            row = None  # a new database (autocommit: nothing to roll back)
        if row is not None and int(row[0]) == schema.VERSION:
            return
        with conn.transaction():
            # Set-up and migrations build indexes over every row: no statement limit, and
            # another daemon opening meanwhile waits up to ten minutes for them
            conn.execute("SET LOCAL statement_timeout = 0; "
                         f"SET LOCAL lock_timeout = {SCHEMA_LOCK_TIMEOUT_MS}")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (schema.LOCK_SCHEMA,))
            conn.execute(cast(Any, schema.TABLES))
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                now = time.time_ns()
                conn.execute("INSERT INTO entries (id, parent, name, kind, mode, mtime_ns, "
                             "ctime_ns, created_ns) VALUES (1, NULL, '', 'root', %s, %s, %s, %s) "
                             "ON CONFLICT (id) DO NOTHING", (0o40755, now, now, now))
                conn.execute("SELECT setval(pg_get_serial_sequence('entries', 'id'), "
                             "GREATEST((SELECT max(id) FROM entries), 1))")
                conn.execute("INSERT INTO meta VALUES ('schema_version', %s)",
                             (str(schema.VERSION),))
                return
            version = int(row[0])
            if version > schema.VERSION:
                raise StoreFailure(f"the database has schema version {version}; this spoolfs "
                                   f"knows up to {schema.VERSION}: upgrade spoolfs")
            if version < schema.VERSION:
                log.info("migrating the database from schema version %d to %d: other hosts' "
                         "writes wait until it is done", version, schema.VERSION)
            while version < schema.VERSION:
                for stmt in schema.MIGRATIONS[version]:
                    conn.execute(cast(Any, stmt))
                version += 1
                log.info("database migrated to schema version %d", version)
            conn.execute("UPDATE meta SET value=%s WHERE key='schema_version'", (str(version),))

    # ---- the Store interface ------------------------------------------------------------

    def reader(self) -> ReadTx:
        return self._reader

    @contextmanager
    def scan(self) -> Iterator[ReadTx]:
        with self._scan_lock, self._begun("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"
                                          ) as (conn, _):
            try:
                yield PgRead(_runner(Statements(conn)))
                conn.execute("COMMIT")
            except psycopg.Error as e:
                _rollback(conn)
                raise unavailable(e) from e
            except BaseException:
                _rollback(conn)
                raise

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        try:
            with self._pool.connection() as conn:
                yield conn
        except PoolTimeout as e:
            raise StoreFailure("database unavailable: no connection within "
                               f"{CONNECT_TIMEOUT_S * 2} s") from e
        except psycopg.OperationalError as e:
            raise unavailable(e) from e

    @contextmanager
    def _begun(self, first: str, params: Sequence[Any] = ()
               ) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Cursor[Any]]]:
        """A connection of the pool, and the cursor of statement ``first`` run on it
        (``_first``)."""
        with self._first(lambda conn: conn.execute(cast(Any, first), params)) as (conn, cur):
            yield conn, cur

    def _rows(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows of one statement on a connection of the pool, prepared there as the
        engine's statements are (pg_statements)."""
        with self._first(lambda conn: Statements(conn).run(query, params)) as (_, rows):
            return rows

    @contextmanager
    def _first(self, run: Callable[[psycopg.Connection[Any]], _T]
               ) -> Iterator[tuple[psycopg.Connection[Any], _T]]:
        """A connection of the pool, and what ``run`` (its first statement) gave on it. A
        connection the server dropped (a restart) fails at its first statement, before any
        work: the pool discards it, and the statement runs on another one. (The pool checks
        no connection it hands out: a check is a round trip.)"""
        for attempt in range(POOL_MAX + 1):
            with self._conn() as conn:
                try:
                    got = run(conn)
                except psycopg.OperationalError as e:
                    if conn.broken and attempt < POOL_MAX:
                        continue
                    raise unavailable(e) from e
                except psycopg.Error as e:
                    raise unavailable(e) from e
                yield conn, got
                return
        raise AssertionError("unreachable")

    def run_batch(self, fns: Sequence[Callable[[WriteTx], Any]], durable: bool,
                  wait: bool = True) -> list[tuple[bool, Any]]:
        # Begun in the round trip of the batch's first statement, its first function's
        # savepoint included; each next one's savepoint goes with that one's first statement.
        begin = [b"BEGIN", b"SET LOCAL idle_in_transaction_session_timeout = "
                 + str(WRITE_IDLE_TIMEOUT_MS).encode()]
        if not durable:
            begin.append(b"SET LOCAL synchronous_commit = off")
        begin.append(b"SAVEPOINT op")
        for attempt in range(POOL_MAX + 1):
            with self._conn() as conn:
                statements = Statements(conn)
                statements.ahead(*begin)
                try:
                    return self._run(conn, statements, fns)
                except _FirstTripFailed as e:
                    # A connection the server dropped (a restart) fails at its first round
                    # trip, before any work: the pool discards it, and the batch runs on
                    # another one. (The pool checks no connection it hands out: a check is
                    # a round trip.)
                    if attempt == POOL_MAX:
                        raise unavailable(e.__cause__ or e) from e
        raise AssertionError("unreachable")

    def _run(self, conn: psycopg.Connection[Any], statements: Statements,
             fns: Sequence[Callable[[WriteTx], Any]]) -> list[tuple[bool, Any]]:
        """The batch, in the transaction ``statements`` begins on ``conn``."""
        results: list[tuple[bool, Any]] = []
        tx = PgWrite(_runner(statements))
        try:
            for i, fn in enumerate(fns):
                if i:
                    statements.ahead(b"RELEASE op", b"SAVEPOINT op")
                results.append(self._one(statements, tx, fn))
            try:
                self._commit(conn, statements, tx)
            except BaseException:
                if self.on_commit is not None and tx.changed:
                    self.on_commit(tx.changed, False)
                raise
        except psycopg.Error as e:
            if not statements.answered and conn.broken:
                raise _FirstTripFailed() from e
            _rollback(conn)
            log.error("database commit failed: %s", e)
            raise unavailable(e) from e
        except BaseException:
            _rollback(conn)
            raise
        if self.on_commit is not None and tx.changed:
            self.on_commit(tx.changed, True)
        return results

    def _one(self, statements: Statements, tx: PgWrite, fn: Callable[[WriteTx], Any]
             ) -> tuple[bool, Any]:
        """Run ``fn`` inside savepoint ``op`` (asked for by the caller). Rolling back to a
        savepoint keeps it: a function run again starts from the same one."""
        for attempt in range(1, RETRIES + 1):
            mark = tx.mark()
            try:
                return True, fn(tx)
            except _LOST as e:  # another host's transaction was in the way
                self._undo(statements, tx, mark)
                if attempt == RETRIES:
                    return False, StoreFailure(f"database busy: {str(e).splitlines()[0]}")
                continue
            except psycopg.errors.LockNotAvailable as e:  # held beyond lock_timeout
                self._undo(statements, tx, mark)
                return False, StoreFailure(f"database busy: {str(e).splitlines()[0]}")
            except psycopg.OperationalError:
                raise  # the connection is gone: the whole batch fails
            except (SpoolError, IntegrityError, psycopg.errors.DataError, OSError, ValueError,
                    ArithmeticError, TypeError) as e:  # this request fails alone
                self._undo(statements, tx, mark)
                return False, e
        raise AssertionError("unreachable")

    @staticmethod
    def _undo(statements: Statements, tx: PgWrite, mark: tuple[int, int]) -> None:
        """Back to savepoint ``op``: where the function sent nothing (its savepoint still
        waits to be sent), nothing of it is on the server."""
        if not statements.pending:
            statements.run("ROLLBACK TO op")
        tx.undo(mark)

    def _commit(self, conn: psycopg.Connection[Any], statements: Statements, tx: PgWrite
                ) -> None:
        """The batch's change rows and history rows, and the commit: one round trip however
        many rows. The statement is bound here (a client-side cursor: a prepared statement
        cannot carry two commands) and sent with the COMMIT in one message, so no daemon can
        stop between the two; and never as a pipeline, which would leave a stopped session
        not idle to the server, keeping its locks. The lock, held to the commit, is taken
        before the first change row draws its sequence number: change rows of concurrent
        transactions are numbered in commit order. NOTIFY is sent at commit. The statement
        calls the session's function (pg_schema.COMMIT_FUNCTION) where it was made, and
        says it all where not."""
        history = tx.history_rows()
        if not statements.answered:  # nothing sent yet
            if not history:
                statements.pending.clear()  # no transaction to end
                return
            statements.send_pending()  # history alone (no function of the engine makes it)
        statements.pending.clear()  # a savepoint nothing followed: the commit ends them
        if not tx.changed and not history:
            conn.execute("COMMIT")
            return
        changes = [list(col) for col in zip(*dict.fromkeys(tx.changed), strict=True)]
        columns: list[Any] = [list(col) for col in zip(*history, strict=True)]
        by_function = conn in _WITH_COMMIT_FUNCTION
        if by_function:
            query = schema.COMMIT_CALL
            params = [schema.LOCK_CHANGES, self.origin, *(changes or [[]] * 5),
                      *(columns or [[]] * 8), schema.CHANNEL]
        else:
            noted = ("noted AS (INSERT INTO history (entry, at_ns, action, src, dst, uid, pid, "
                     "reason) SELECT h.entry, h.at_ns, h.action, h.src, h.dst, h.uid, h.pid, "
                     "h.reason FROM unnest(%s::bigint[], %s::bigint[], %s::text[], %s::text[], "
                     "%s::text[], %s::bigint[], %s::bigint[], %s::text[]) WITH ORDINALITY "
                     "AS h(entry, at_ns, action, src, dst, uid, pid, reason, n) ORDER BY h.n)")
            if not changes:
                query, params = f"WITH {noted} SELECT 1", columns
            else:
                query = ("WITH held AS (SELECT pg_advisory_xact_lock(%s)), "
                         "logged AS (INSERT INTO changes (entry, parent, name, old_parent, "
                         "old_name, origin) SELECT c.*, %s FROM held, unnest(%s::bigint[], "
                         "%s::bigint[], %s::bytea[], %s::bigint[], %s::bytea[]) AS c) "
                         + (f", {noted} " if history else "") + "SELECT pg_notify(%s, %s)")
                params = [schema.LOCK_CHANGES, self.origin, *changes, *columns,
                          schema.CHANNEL, self.origin]
        try:
            psycopg.ClientCursor(conn).execute(cast(Any, query + "; COMMIT"), params)
        except psycopg.errors.UndefinedFunction:
            if by_function:  # the session lost its temporary objects (something between this
                # daemon and the server reset it): this batch fails, its next ones say it all
                _WITH_COMMIT_FUNCTION.discard(conn)
            raise

    def reserve_blob_id(self) -> int:
        """A blob id no other row will take: content is stored under it before the
        transaction that inserts its row (``blob_insert(..., blob_id=)``)."""
        return int(self._rows("SELECT nextval(pg_get_serial_sequence('blobs', 'id'))")[0][0])

    # ---- the change log -----------------------------------------------------------------

    def last_change(self) -> int:
        row = self._reader.q1("SELECT COALESCE(max(seq), 0) FROM changes")
        return int(row[0]) if row else 0

    def changes_since(self, seq: int, limit: int = CHANGES_PAGE) -> list[Change]:
        rows = self._rows("SELECT seq, entry, parent, name, old_parent, old_name, origin "
                          "FROM changes WHERE seq > %s ORDER BY seq LIMIT %s", (seq, limit))
        return [Change(s, e, p, bytes(n) if n is not None else None, op,
                       bytes(on) if on is not None else None, o)
                for s, e, p, n, op, on, o in rows]

    def wait_changes(self, timeout: float) -> bool:
        """Block until another daemon's commit notifies (True) or ``timeout`` passes (False).
        A notification names the daemon that committed (its payload): this daemon's own are
        passed over, since it told the kernel of its changes as it made them. Once one of
        another's arrives, those already queued behind it are taken too, so that a burst of
        commits costs the follower one read of the log, not one each. (An empty payload, from
        a daemon of an earlier version, counts as another's.)"""
        try:
            if self._listen is None or self._listen.closed:
                self._listen = self.connect(autocommit=True)
                self._listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(schema.CHANNEL)))
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                if any(n.payload != self.origin
                       for n in self._listen.notifies(timeout=left, stop_after=1)):
                    for _ in self._listen.notifies(timeout=0):
                        pass
                    return True
            return False
        except psycopg.Error as e:
            if self._listen is not None:
                self._listen.close()
                self._listen = None
            raise unavailable(e) from e

    def prune_changes(self, before_s: float) -> int:
        """Drop change rows older than ``before_s`` seconds (gc): a follower that was away
        longer than that has reconnected and dropped its whole cache anyway."""
        with self._begun("DELETE FROM changes WHERE at < now() - make_interval(secs => %s)",
                         (before_s,)) as (_, cur):
            return cur.rowcount

    def close(self) -> None:
        self._reader.close_all()
        if self._listen is not None:
            self._listen.close()
        self._pool.close()


def open_store(url: str) -> PostgresStore:
    return PostgresStore(url)
