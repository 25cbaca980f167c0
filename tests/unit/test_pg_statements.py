"""The PostgreSQL engine's statements through libpq's own calls (store/pg_statements.py):
the same rows as psycopg's cursor, the same errors, and the cursor where the server cannot
prepare a query with its parameters' types left to it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors
import pytest

from spoolfs.store.pg_statements import NAME_PREFIX, Statements, placeholders, rows_of


@pytest.fixture
def conn(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("CREATE TABLE t (id BIGINT PRIMARY KEY, name BYTEA UNIQUE, note TEXT, "
                  "n INTEGER)")
        yield c


def _prepared(conn: psycopg.Connection[Any]) -> list[str]:
    return [r[0] for r in conn.execute("SELECT name FROM pg_prepared_statements "
                                       "ORDER BY name").fetchall()]


def test_placeholders_are_numbered_and_a_literal_percent_stays() -> None:
    assert placeholders("SELECT %s, %s FROM t WHERE note LIKE 'a%%' AND n=%s") == \
        b"SELECT $1, $2 FROM t WHERE note LIKE 'a%' AND n=$3"
    assert placeholders("SELECT 1") == b"SELECT 1"


def test_rows_read_back_as_a_cursor_reads_them(conn: psycopg.Connection[Any]) -> None:
    """Every byte value of a name, text beyond ASCII, NULL, the extremes of a bigint: what a
    cursor reads, and each query prepared once, under the module's names."""
    s = Statements(conn)
    name = bytes(range(256))
    assert s.run("INSERT INTO t VALUES (%s, %s, %s, %s)", (2**63 - 1, name, "é ∑ 漢", None)) == []
    assert s.run("INSERT INTO t VALUES (%s, %s, %s, %s)", (-2**63, b"", None, -7)) == []
    query = "SELECT id, name, note, n FROM t WHERE name=%s"
    for key in (name, b"", b"absent"):
        got = s.run(query, (key,))
        cur = conn.cursor()
        assert got == rows_of(cur.execute(query, (key,))), key
    assert s.run(query, (name,)) == [(2**63 - 1, name, "é ∑ 漢", None)]
    assert s.run(query, (b"absent",)) == []
    assert [n for n in _prepared(conn) if n.startswith(NAME_PREFIX)] == \
        [f"{NAME_PREFIX}0", f"{NAME_PREFIX}1"]  # the insert's and the select's, each once


def test_a_query_the_server_cannot_prepare_goes_to_the_cursor_inside_a_transaction(
        conn: psycopg.Connection[Any]) -> None:
    """A parameter whose type the server cannot tell (``%s IS NULL``, where psycopg's cursor
    names an int's) is refused at its prepare: inside a transaction that refusal is undone
    alone, the cursor runs the query, and the transaction goes on to commit what it did
    before and after."""
    s = Statements(conn)
    conn.execute("BEGIN")
    s.run("INSERT INTO t (id) VALUES (%s)", (1,))
    assert s.run("SELECT %s IS NULL", (3,)) == [(False,)]
    s.run("INSERT INTO t (id) VALUES (%s)", (2,))
    conn.execute("COMMIT")
    assert conn.execute("SELECT id FROM t ORDER BY id").fetchall() == [(1,), (2,)]
    assert s.run("SELECT %s IS NULL", (4,)) == [(False,)]  # known now: the cursor at once
    assert _prepared(conn) == [f"{NAME_PREFIX}0"]


def test_an_array_goes_to_the_cursor(conn: psycopg.Connection[Any]) -> None:
    s = Statements(conn)
    s.run("INSERT INTO t (id) VALUES (%s), (%s)", (1, 2))
    assert s.run("SELECT id FROM t WHERE id = ANY(%s) ORDER BY id", ([1, 2, 3],)) == [(1,), (2,)]


def test_text_with_a_nul_is_refused_as_the_cursor_refuses_it(
        conn: psycopg.Connection[Any]) -> None:
    """libpq would cut a text parameter at its first NUL; the cursor refuses it whole."""
    s = Statements(conn)
    with pytest.raises(psycopg.DataError):
        s.run("INSERT INTO t (id, note) VALUES (%s, %s)", (1, "a\0b"))
    assert s.run("SELECT count(*) FROM t", ()) == [(0,)]


def test_ctrl_c_cancels_a_statement_on_the_server(conn: psycopg.Connection[Any]) -> None:
    """A command line tool's Ctrl-C while a statement waits on the server: the statement is
    cancelled there and the tool gets KeyboardInterrupt at once, its connection usable."""
    import signal
    import threading
    import time

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    s = Statements(conn)
    old = signal.signal(signal.SIGINT, interrupt)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            s.run("SELECT pg_sleep(%s)", (20,))
        assert time.monotonic() - start < 10
    finally:
        signal.signal(signal.SIGINT, old)
    assert not conn.broken and s.run("SELECT %s + 1", (1,)) == [(2,)]


def test_errors_are_psycopgs_own(conn: psycopg.Connection[Any]) -> None:
    """The engine tells a lost race, a duplicate name and a lost server by psycopg's classes;
    a transaction after an error is aborted, as with the cursor."""
    s = Statements(conn)
    s.run("INSERT INTO t (id, name) VALUES (%s, %s)", (1, b"a"))
    with pytest.raises(psycopg.errors.UniqueViolation):
        s.run("INSERT INTO t (id, name) VALUES (%s, %s)", (2, b"a"))
    conn.execute("BEGIN")
    with pytest.raises(psycopg.errors.DivisionByZero):
        s.run("SELECT 1 / %s", (0,))
    with pytest.raises(psycopg.errors.InFailedSqlTransaction):
        s.run("SELECT id FROM t WHERE id=%s", (1,))
    conn.execute("ROLLBACK")
    assert s.run("SELECT id FROM t WHERE id=%s", (1,)) == [(1,)]


def test_statements_dropped_by_the_server_are_made_again(
        conn: psycopg.Connection[Any]) -> None:
    """``DEALLOCATE ALL`` (a pooler between two clients): the next run fails as psycopg's
    would, the one after prepares again."""
    s = Statements(conn)
    assert s.run("SELECT %s + 1", (1,)) == [(2,)]
    conn.execute("DEALLOCATE ALL")
    with pytest.raises(psycopg.errors.InvalidSqlStatementName):
        s.run("SELECT %s + 1", (1,))
    assert s.run("SELECT %s + 1", (2,)) == [(3,)]


def test_a_session_the_server_ended_says_why(pg_url: str) -> None:
    """The server ends a session idle inside its transaction: the error is psycopg's
    OperationalError (the engine's cue that the connection is gone), and it says why."""
    import time

    with psycopg.connect(pg_url, autocommit=True) as c:
        s = Statements(c)
        c.execute("SET idle_in_transaction_session_timeout = 200")
        c.execute("BEGIN")
        time.sleep(0.6)
        with pytest.raises(psycopg.OperationalError, match="idle-in-transaction"):
            s.run("SELECT %s", (1,))
        assert c.broken


def test_rollbacks_keep_the_statements(conn: psycopg.Connection[Any]) -> None:
    """The engine runs a few commands through psycopg again and again (``COMMIT``, the
    savepoints), and rolls back to a savepoint when a function of a batch loses. psycopg,
    once it has prepared a statement of its own, follows a ROLLBACK it has not prepared
    with DEALLOCATE ALL, which took this module's statements too: the next transaction
    failed on them."""
    s = Statements(conn)
    query = "SELECT id FROM t WHERE id=%s"
    s.run("INSERT INTO t (id) VALUES (%s)", (1,))
    for _ in range(8):  # psycopg would prepare COMMIT from its fifth run
        conn.execute("BEGIN")
        assert s.run(query, (1,)) == [(1,)]
        conn.execute("COMMIT")
    conn.execute("BEGIN")
    conn.execute("SAVEPOINT op")
    conn.execute("ROLLBACK TO op")  # (its first run: not prepared)
    conn.execute("COMMIT")
    conn.execute("BEGIN")
    assert s.run(query, (1,)) == [(1,)]
    conn.execute("COMMIT")
    assert f"{NAME_PREFIX}1" in _prepared(conn)
