"""The PostgreSQL engine's statements, run through libpq's own calls.

psycopg's cursor costs a daemon 90-100 µs of its CPU per statement (finding the query's
placeholders, adapting each parameter, looking up its prepared statement, its bookkeeping
around the wait), where libpq's calls take 55-70 with the rows loaded. A message carried
through a queue costs about 35 statements, a third of them on the event loop, where every
other request waits for them. So the engine runs its statements as psycopg does underneath:
each query prepared once per connection under a name of its own, then sent with
``PGconn.send_query_prepared`` and waited for by the connection's own ``wait`` (the GIL let
go meanwhile; Ctrl-C cancels the statement on the server, as with a cursor), its parameters
sent as text and its rows loaded by psycopg's own loaders, so that a row reads back as the
same Python values a cursor gives.

A parameter's type is left to the server (as psycopg does for ``str``), but for ``bytes``,
sent as ``bytea``. The cursor runs a statement instead when one of its parameters is not
None, an int, bytes or a str without NUL (an array; a NUL, which the cursor refuses), and
when the server cannot prepare its query with the types left to it (found once per
connection, in a savepoint of its own inside a transaction, so that the transaction goes
on), unprepared: psycopg prepares nothing on a connection these statements run on, for once
it has prepared a statement it ends every ``ROLLBACK`` (``ROLLBACK TO`` a savepoint too)
with ``DEALLOCATE ALL``, which would drop this module's statements with its own. Names carry
the process's own prefix: behind a pooler that hands sessions from client to client, another
client's statement of the same name is never run by mistake (it is an error instead).

Commands that return no rows and need no answer of their own (a transaction's ``BEGIN`` and
settings, a savepoint) wait for the next statement and go with it in one pipeline: on a
server 3 ms away a transaction that took four round trips takes three.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import psycopg
import psycopg.errors
from psycopg import generators, pq
from psycopg.abc import PQGen
from psycopg.adapt import Transformer

from spoolfs.store.base import Steps

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_BYTEA = 17
_LEFT_TO_SERVER = 0
#: queries prepared on one connection at most; more run through the cursor (the engine has
#: about 60)
MAX_PREPARED = 200
#: the class of SQLSTATEs that says the query cannot be prepared as sent (42P18: a
#: parameter whose type the server cannot tell; 42883, 42725: no function or operator for it)
_CANNOT_PREPARE = "42"

_Key = tuple[str, tuple[int, ...]]
#: the start of this process's statement names (see above)
NAME_PREFIX = f"spoolfs_{os.urandom(4).hex()}_"


class _Prepared:
    """One connection's prepared queries: their names, None for those its cursor runs. Kept
    apart from ``Statements`` (made per transaction: cheap), which holds the connection: a
    registry keyed weakly by the connection must not hold it, or no dropped connection of the
    pool would ever be freed."""

    __slots__ = ("names", "made")

    def __init__(self) -> None:
        self.names: dict[_Key, bytes | None] = {}
        self.made = 0  # names given on the connection so far: a new one is never reused


_PREPARED: weakref.WeakKeyDictionary[psycopg.Connection[Any], _Prepared] = \
    weakref.WeakKeyDictionary()


class _NotText(Exception):
    """A parameter this module does not send: the cursor sends it."""


def _text(v: Any, encoding: str) -> bytes | None:
    if v is None:
        return None
    t = type(v)
    if t is int:
        return str(v).encode()
    if t is bytes:
        return b"\\x" + bytes.hex(v).encode()
    if t is str and "\0" not in v:
        return str.encode(v, encoding)
    raise _NotText


def rows_of(cur: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
    """The rows the cursor's statement returned; none for a statement that returns none.
    (Asked of the result's status: ``cur.description`` builds a column object per column
    each time, 40-50 µs for an entry's 28 columns, more than the server takes to find it.)"""
    res = cur.pgresult
    return cur.fetchall() if res is not None and res.status == pq.ExecStatus.TUPLES_OK else []


def _on(fd: int, gen: PQGen[_T]) -> Steps[_T]:
    """psycopg's generator ``gen`` as steps on the connection's socket ``fd``."""
    try:
        wait = next(gen)
        while True:
            wait = gen.send((yield fd, wait))
    except StopIteration as done:
        return cast(_T, done.value)


def placeholders(query: str) -> bytes:
    """psycopg's ``%s`` as libpq's ``$1``, ``$2``...; ``%%`` as ``%``."""
    n = 0
    parts = []
    for literal in query.split("%%"):
        pieces = literal.split("%s")
        out = [pieces[0]]
        for piece in pieces[1:]:
            n += 1
            out.append(f"${n}{piece}")
        parts.append("".join(out))
    return "%".join(parts).encode()


class Statements:
    """``run`` on one connection: its rows, as a cursor's ``fetchall`` gives them (none for a
    statement that returns none). Used by one thread at a time, as the connection is."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        #: commands without rows (``BEGIN``, ``SAVEPOINT op``) that go to the server with the
        #: next statement, in the same round trip (``ahead``)
        self.pending: list[bytes] = []
        self.pgconn = conn.pgconn
        self._encoding = conn.info.encoding
        conn.prepare_threshold = None  # (see above: never DEALLOCATE ALL; the engine's
        # connections are made so, before psycopg can have prepared anything on them)
        self._load = Transformer(conn)
        self._prepared = _PREPARED.setdefault(conn, _Prepared())
        self._names = self._prepared.names
        self._cursor: psycopg.Cursor[Any] | None = None
        #: whether anything went to the server and came back (a connection that breaks
        #: before has done nothing there)
        self.answered = False

    def run(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.conn.wait(self._statement(query, params))

    def ahead(self, *commands: bytes) -> None:
        """Commands that return no rows, sent with the next statement in one round trip (a
        pipeline), or by ``send_pending``: a transaction's ``BEGIN`` and its settings, a
        function's savepoint. An error in them fails that statement."""
        self.pending.extend(commands)

    def send_pending(self) -> None:
        """The commands ``ahead`` kept, sent now (their own round trip)."""
        if self.pending:
            self.conn.wait(self._send_pending())

    def steps(self, query: str, params: Sequence[Any] = ()) -> Steps[list[tuple[Any, ...]]]:
        """``run`` as steps: what the statement waits for (its prepare too, the first time on
        this connection) is yielded (``base.Steps``) rather than waited for here, so that the
        caller's event loop goes on meanwhile. One the cursor runs is waited for here. A
        caller that stops the steps before they end must close the connection: its
        statement is still under way."""
        return _on(self.pgconn.socket, self._statement(query, params))

    def _statement(self, query: str, params: Sequence[Any]) -> PQGen[list[tuple[Any, ...]]]:
        """A statement as psycopg's generators are: what it waits for is yielded."""
        try:
            values = [_text(v, self._encoding) for v in params]
        except _NotText:
            yield from self._send_pending()
            return self._by_cursor(query, params)
        key = (query, tuple(_BYTEA if type(v) is bytes else _LEFT_TO_SERVER for v in params))
        name = self._names.get(key, b"")
        if name and self.pending:
            return (yield from self._pipelined(name, values))
        yield from self._send_pending()  # (a statement is prepared inside the transaction)
        if name == b"":
            name = yield from self._preparing(key)
        if name is None:
            return self._by_cursor(query, params)
        # (None is NULL: libpq takes it, as psycopg's own calls do, its annotation aside)
        self.pgconn.send_query_prepared(name, cast(Any, values))
        res = (yield from generators.execute(self.pgconn))[-1]
        self.answered = True
        return self._rows(res)

    def _pipelined(self, name: bytes, values: list[bytes | None]
                   ) -> PQGen[list[tuple[Any, ...]]]:
        """The pending commands, then the prepared statement ``name``: one round trip."""
        pg = self.pgconn
        commands, self.pending = self.pending, []
        pg.enter_pipeline_mode()
        try:
            for command in commands:
                pg.send_query_params(command, None)
            pg.send_query_prepared(name, cast(Any, values))
            pg.pipeline_sync()
            yield from generators.send(pg)
            results = []
            for _ in range(len(commands) + 1):
                results.append((yield from generators.fetch_many(pg)))
            yield from generators.fetch_many(pg)  # the Sync's own result
        finally:
            try:
                pg.exit_pipeline_mode()
            except psycopg.OperationalError:  # results left unread (the connection broke
                # meanwhile, or the statement was cancelled): never used again
                if pg.status == pq.ConnStatus.OK:
                    self.conn.close()
        self.answered = True
        for res in results[:-1]:
            if not res or res[-1].status != pq.ExecStatus.COMMAND_OK:
                raise self._error(res[-1]) if res else psycopg.OperationalError(
                    "no result from the server")
        if not results[-1]:
            raise psycopg.OperationalError("no result from the server")
        return self._rows(results[-1][-1])

    def _send_pending(self) -> PQGen[None]:
        if self.pending:
            commands, self.pending = self.pending, []
            yield from self._simple(b"; ".join(commands))
            self.answered = True

    def _rows(self, res: pq.abc.PGresult) -> list[tuple[Any, ...]]:
        status = res.status
        if status == pq.ExecStatus.TUPLES_OK:
            self._load.set_pgresult(res)
            return self._load.load_rows(0, res.ntuples, tuple)
        if status == pq.ExecStatus.COMMAND_OK:
            return []
        raise self._error(res)

    def _error(self, res: pq.abc.PGresult) -> psycopg.Error:
        if self.pgconn.status == pq.ConnStatus.BAD:  # the server went away meanwhile: the
            # connection's message says why first (its session ended: FATAL ...)
            return psycopg.OperationalError(self.pgconn.get_error_message(self._encoding))
        if res.status != pq.ExecStatus.FATAL_ERROR:
            return psycopg.InterfaceError(f"unexpected result from the server: {res.status}")
        e = psycopg.errors.error_from_result(res, encoding=self._encoding)
        if isinstance(e, psycopg.errors.InvalidSqlStatementName):
            self._names.clear()  # its statements were dropped (DEALLOCATE): made again
        return e

    def _preparing(self, key: _Key) -> PQGen[bytes | None]:
        """The name ``key``'s query is prepared under on this connection, or None for one
        the cursor runs (what it waits for is yielded)."""
        if len(self._names) >= MAX_PREPARED:
            return None
        name = f"{NAME_PREFIX}{self._prepared.made}".encode()
        self._prepared.made += 1
        in_tx = self.pgconn.transaction_status == pq.TransactionStatus.INTRANS
        if in_tx:  # a refusal would end the transaction: undone alone
            yield from self._simple(b"SAVEPOINT spoolfs_prepare")
        self.pgconn.send_prepare(name, placeholders(key[0]), list(key[1]))
        res = (yield from generators.execute(self.pgconn))[-1]
        if res.status == pq.ExecStatus.COMMAND_OK:
            if in_tx:
                yield from self._simple(b"RELEASE spoolfs_prepare")
            self._names[key] = name
            return name
        error = self._error(res)
        if not (error.sqlstate or "").startswith(_CANNOT_PREPARE):
            raise error
        if in_tx:
            yield from self._simple(b"ROLLBACK TO spoolfs_prepare; RELEASE spoolfs_prepare")
        log.debug("the cursor runs %.60r: %s", key[0], str(error).splitlines()[0])
        self._names[key] = None
        return None

    def _simple(self, command: bytes) -> PQGen[None]:
        self.pgconn.send_query(command)
        for res in (yield from generators.execute(self.pgconn)):
            if res.status != pq.ExecStatus.COMMAND_OK:
                raise self._error(res)

    def _by_cursor(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        if self._cursor is None:
            self._cursor = self.conn.cursor()
        return rows_of(self._cursor.execute(cast(Any, query), params, prepare=False))
