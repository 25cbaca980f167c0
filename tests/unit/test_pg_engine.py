"""What only a shared database shows: several daemons' stores on one PostgreSQL database."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest

from helpers.pgserver import PgServer
from spoolfs.core.errors import StoreFailure
from spoolfs.core.rules import State
from spoolfs.store import pg_schema
from spoolfs.store.base import Entry, WriteTx
from spoolfs.store.pg_maint import open_maintenance
from spoolfs.store.postgres import PostgresStore
from spoolfs.store.registry import open_store


def one(store: PostgresStore, fn):  # type: ignore[no-untyped-def]
    ok, value = store.run_batch([fn], True)[0]
    if not ok:
        raise value
    return value


def msg(tx: WriteTx, parent: int, name: bytes):  # type: ignore[no-untyped-def]
    return tx.insert(parent=parent, name=name, kind="message", state=State.READY,
                     mode=0o100644, mtime_ns=1, ctime_ns=1, created_ns=1)


@pytest.fixture
def two(pg_url: str) -> Iterator[tuple[PostgresStore, PostgresStore]]:
    a, b = PostgresStore(pg_url), PostgresStore(pg_url)
    yield a, b
    a.close()
    b.close()


def test_a_url_opens_the_engine(pg_url: str) -> None:
    s = open_store(pg_url)
    assert isinstance(s, PostgresStore) and s.reader().get(1) is not None
    s.close()
    s = open_store(pg_url.replace("postgresql://", "postgres://"))
    assert isinstance(s, PostgresStore)
    s.close()


def test_concurrent_first_opens_make_one_root(pg_server: PgServer) -> None:
    url = pg_server.new_database()
    stores: list[PostgresStore] = []
    errors: list[BaseException] = []

    def opener() -> None:
        try:
            stores.append(PostgresStore(url))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=opener) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    roots = [e for e in stores[0].reader().all_entries() if e.kind == "root"]
    assert [r.id for r in roots] == [1]
    e = one(stores[0], lambda tx: msg(tx, 1, b"after"))
    assert e.id > 1
    for s in stores:
        s.close()


def test_racing_claims_from_two_stores_have_one_winner(two) -> None:  # type: ignore[no-untyped-def]
    a, b = two
    ids = [one(a, lambda tx, i=i: msg(tx, 1, b"m%d" % i)).id for i in range(40)]
    wins: dict[str, list[int]] = {"a": [], "b": []}

    def claimer(store: PostgresStore, who: str) -> None:
        for i in ids:
            def claim(tx: WriteTx, i: int = i) -> bool:  # from where both saw it
                name = b"m%d" % ids.index(i)
                return tx.move(i, 1, name, 1, name + b".taken", state=State.WORKING)
            for ok, won in store.run_batch([claim], True):
                if ok and won:
                    wins[who].append(i)

    ta = threading.Thread(target=claimer, args=(a, "a"))
    tb = threading.Thread(target=claimer, args=(b, "b"))
    ta.start(), tb.start()
    ta.join(), tb.join()
    assert sorted(wins["a"] + wins["b"]) == ids  # each once, none twice


@pytest.mark.parametrize("where", ["in a function", "before its commit"])
def test_a_host_stopped_inside_its_transaction_holds_the_others_up_only_briefly(
        two, monkeypatch: pytest.MonkeyPatch, where: str) -> None:  # type: ignore[no-untyped-def]
    """A daemon stopped between two statements of a batch (a paused VM, a process that is
    being killed but cannot exit) keeps its connection, and its row locks, open: every other
    host's move of those rows would wait, then fail. Its transaction is ended by the server
    once it has idled a moment, wherever the batch stopped; the other host's move goes
    through, and the stopped batch changes nothing. (The change log's rows, written under a
    lock every other commit waits for, go in the commit's own round trip: no daemon can stop
    between them and the commit.)"""
    import spoolfs.store.postgres as pg

    monkeypatch.setattr(pg, "WRITE_IDLE_TIMEOUT_MS", 300)
    a, b = two
    m = one(a, lambda tx: msg(tx, 1, b"m"))
    locked, release = threading.Event(), threading.Event()

    def stop() -> None:
        locked.set()
        release.wait(20)  # stopped, locks held

    def moves(tx: WriteTx) -> bool:
        tx.move(m.id, 1, b"m", 1, b"by-a", state=State.WORKING)
        if where == "in a function":
            stop()
        return tx.get(m.id) is not None

    if where == "before its commit":
        commit = PostgresStore._commit

        def stop_then_commit(self: PostgresStore, conn: Any, statements: Any, tx: Any) -> None:
            if self is a:
                stop()
            commit(self, conn, statements, tx)

        monkeypatch.setattr(PostgresStore, "_commit", stop_then_commit)
    got: list[BaseException] = []

    def run_a() -> None:
        try:
            got.extend(e for ok, e in a.run_batch([moves], True) if not ok)
        except StoreFailure as e:
            got.append(e)

    stopped = threading.Thread(target=run_a)
    stopped.start()
    try:
        assert locked.wait(10)
        ok, moved = b.run_batch([lambda tx: tx.move(m.id, 1, b"m", 1, b"by-b",
                                                    state=State.WORKING)], True)[0]
    finally:
        release.set()
        stopped.join()
    assert ok, moved
    assert moved is True
    assert b.reader().get(m.id).name == b"by-b"
    assert len(got) == 1 and "idle-in-transaction" in str(got[0])  # a's changed nothing


def test_a_host_killed_while_it_waits_on_a_lock_lets_go_of_the_others(
        two, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A daemon killed (kill -9: its process gone, its socket closed by its kernel) while one
    of its statements waits on a row lock: the server notices within a second and ends its
    session, releasing the locks it took earlier; it does not wait for that statement's
    lock_timeout (10 s) first. Here host B holds x and waits for y, which host A holds; once
    B is killed, A takes x well inside B's lock_timeout."""
    a, _ = two
    x = one(a, lambda tx: msg(tx, 1, b"x")).id
    y = one(a, lambda tx: msg(tx, 1, b"y")).id
    holder = psycopg.connect(a.url)  # host A's transaction holding y
    holder.execute("UPDATE entries SET attempts = 1 WHERE id = %s", (y,))
    script = tmp_path / "b.py"
    script.write_text(
        "import sys\n"
        "from spoolfs.store.postgres import PostgresStore\n"
        "conn = PostgresStore(sys.argv[1]).connect()\n"
        "conn.execute('UPDATE entries SET attempts = 2 WHERE id = %s', (int(sys.argv[2]),))\n"
        "print('holding', flush=True)\n"
        "conn.execute('UPDATE entries SET attempts = 2 WHERE id = %s', (int(sys.argv[3]),))\n")
    b = subprocess.Popen([sys.executable, str(script), a.url, str(x), str(y)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert b.stdout is not None and b.stdout.readline() == "holding\n"
        with psycopg.connect(a.url, autocommit=True) as watch:
            while not watch.execute("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = "
                                    "'Lock' AND query LIKE 'UPDATE entries%%'").fetchone():
                time.sleep(0.05)
        b.kill()
        b.wait()
        with psycopg.connect(a.url) as other:
            other.execute("SET lock_timeout = '5s'")  # half of B's
            other.execute("UPDATE entries SET attempts = 3 WHERE id = %s", (x,))
            other.commit()
    finally:
        b.kill()
        b.wait()
        if b.stdout is not None:
            b.stdout.close()
        holder.rollback()
        holder.close()


@pytest.mark.parametrize("version", [130000, 150000])
def test_a_server_before_14_gets_the_settings_it_has(version: int) -> None:
    """client_connection_check_interval came with PostgreSQL 14: an older server would refuse
    every connection that set it."""
    from spoolfs.store import postgres

    class Conn:
        class info:  # noqa: N801 (psycopg's attribute)
            server_version = version
        sent: list[str] = []

        def execute(self, query: str) -> None:
            self.sent.append(query)
    conn = Conn()
    postgres._session(cast(Any, conn))
    assert conn.sent[0].startswith(postgres.SESSION)
    assert ("client_connection_check_interval" in conn.sent[0]) == (version >= 140000)


def test_two_hosts_creating_one_name_at_once_have_one_winner(two) -> None:  # type: ignore[no-untyped-def]
    """The second insert of a name another host is inserting waits for it, then finds the
    name taken: None (EEXIST for the caller), not a constraint's error."""
    a, b = two
    inserted, release = threading.Event(), threading.Event()

    def new(tx: WriteTx) -> Entry | None:
        return tx.insert_unless_named(parent=1, name=b"same", kind="message",
                                      state=State.PARTIAL, staged=1, mode=0o100644,
                                      mtime_ns=1, ctime_ns=1, created_ns=1)

    def held(tx: WriteTx) -> Entry | None:
        got = new(tx)
        inserted.set()
        release.wait(10)
        return got
    won: list[Any] = []
    t = threading.Thread(target=lambda: won.append(one(a, held)))
    t.start()
    assert inserted.wait(10)
    threading.Timer(0.3, release.set).start()
    assert one(b, new) is None  # waited for a's commit
    t.join(10)
    assert won[0] is not None and b.reader().lookup(1, b"same") == won[0]


def test_ids_are_unique_across_stores(two) -> None:  # type: ignore[no-untyped-def]
    a, b = two
    got = [one(s, lambda tx, n=n: msg(tx, 1, n)).id
           for n, s in ((b"x%d" % i, (a, b)[i % 2]) for i in range(20))]
    assert len(set(got)) == 20
    assert a.reserve_blob_id() != b.reserve_blob_id()


def test_changes_are_logged_in_commit_order_with_their_origin(two) -> None:  # type: ignore[no-untyped-def]
    a, b = two
    start = a.last_change()
    e = one(a, lambda tx: msg(tx, 1, b"m"))
    one(b, lambda tx: tx.move(e.id, 1, b"m", 1, b"n"))
    one(a, lambda tx: tx.set_xattr(e.id, b"user.k", b"v"))
    one(b, lambda tx: tx.delete(e.id))
    got = [c for c in a.changes_since(start) if c.entry_id == e.id]
    assert [c.origin for c in got] == [a.origin, b.origin, a.origin, b.origin]
    assert (got[1].old_parent, got[1].old_name, got[1].parent, got[1].name) == (1, b"m", 1, b"n")
    assert got[3].parent is None and got[3].old_name == b"n"
    seqs = [c.seq for c in a.changes_since(start)]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_a_commit_wakes_a_waiting_follower(two) -> None:  # type: ignore[no-untyped-def]
    a, b = two
    assert a.wait_changes(0.01) is False  # LISTEN is set up; nothing yet
    one(b, lambda tx: msg(tx, 1, b"wake"))
    assert a.wait_changes(30) is True


def test_a_daemons_own_commits_do_not_wake_its_follower(two) -> None:  # type: ignore[no-untyped-def]
    """Its own changes need no invalidation: waking for each would cost the follower a read
    of the change log and three thread hand-offs per commit, beside every request."""
    a, b = two
    assert a.wait_changes(0.01) is False
    for i in range(3):
        one(a, lambda tx, i=i: msg(tx, 1, b"own%d" % i))
    assert a.wait_changes(0.3) is False
    one(a, lambda tx: msg(tx, 1, b"own-again"))
    one(b, lambda tx: msg(tx, 1, b"theirs"))
    assert a.wait_changes(30) is True
    for i in range(3):  # a burst of another host's commits: one wake answers them all
        one(b, lambda tx, i=i: msg(tx, 1, b"burst%d" % i))
    time.sleep(0.5)  # (each delivered at its commit; margin for a loaded machine)
    assert a.wait_changes(30) is True
    assert a.wait_changes(0.05) is False


def test_opening_a_set_up_database_takes_no_table_lock(pg_url: str) -> None:
    """A daemon mounting (or restarting after kill -9) beside busy hosts: the schema is
    already there, so opening takes no lock on the tables. Set-up statements take them
    (CREATE INDEX IF NOT EXISTS locks its table before it finds the index), and against other
    hosts' transactions that was a wait, or a deadlock that failed the mount."""
    PostgresStore(pg_url).close()  # set up
    with psycopg.connect(pg_url) as busy:  # another host, in a transaction on every table
        for table in ("entries", "blobs", "history", "xattrs", "policies", "meta", "changes"):
            busy.execute(f"LOCK TABLE {table} IN ROW EXCLUSIVE MODE")
        PostgresStore(pg_url).close()  # waiting, it would fail at the lock timeout
        busy.rollback()


def test_a_newer_schema_is_refused_in_one_line(pg_url: str) -> None:
    PostgresStore(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("UPDATE meta SET value='999' WHERE key='schema_version'")
    with pytest.raises(StoreFailure, match="schema version 999"):
        PostgresStore(pg_url)


def test_an_unreachable_database_is_one_line_quickly() -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreFailure, match="database unavailable"):
        PostgresStore("postgresql://nobody@127.0.0.1:9/none")
    assert time.monotonic() - t0 < 30


def test_maintenance_runs_the_checks(pg_url: str) -> None:
    s = PostgresStore(pg_url)
    e = one(s, lambda tx: msg(tx, 1, b"m"))

    def attach(tx: WriteTx) -> None:
        bid = tx.blob_insert(b"\x01" * 32, 3, None)
        tx.blob_ref(bid, 1)
        tx.update(e.id, blob=bid)

    one(s, attach)
    s.close()
    m = open_maintenance(pg_url)
    try:
        with m.read() as tx:
            assert tx.integrity_ok() and tx.dangling() == []
            assert tx.schema_version() == str(pg_schema.VERSION)
            (file_blob, refcount, referenced), = tx.blob_references(-1, 100)
            assert (refcount, referenced) == (1, 1) and tx.blob_references(file_blob, 100) == []
            assert tx.missing_blob_rows() == []
            assert tx.unreferenced_blobs(0, 100) == []
            assert tx.files_named([file_blob, file_blob + 99]) == {file_blob: b"\x01" * 32}
            assert tx.files_named([]) == {}
            assert tx.file_blobs_named([file_blob]) == {file_blob: (b"\x01" * 32, 3)}
            assert tx.file_blobs_page(-1, 100) == [(file_blob, b"\x01" * 32, 3)]
            assert tx.inline_blobs_page(-1, 100) == []
            assert tx.staged_among([e.id, 1]) == set() and tx.staged_among([]) == set()
            tree = tx.tree_page(-1, 2)
            assert [row[0] for row in tree] == [1, tree[1][0]] and tree[0][7] is False
            assert tx.tree_page(-1, 1000)[-1][:2] == (e.id, e.parent)
        with m.write() as tx:
            bid = tx.insert_empty_blob(b"\x02" * 32)
            assert bid > 0 and tx.blob_exists(bid)
        with m.read() as tx:
            assert tx.unreferenced_blobs(0, 100) == [bid]
            assert tx.unreferenced_blobs(bid, 100) == []
            assert tx.files_named([bid]) == {}  # empty content is kept in the row
            assert tx.inline_blobs_page(-1, 100) == [(bid, b"\x02" * 32, b"")]
    finally:
        m.close()


def test_a_server_that_goes_away_fails_transitions_and_comes_back(pg_server: PgServer) -> None:
    """Its own server: stopping the session's would fail the other tests."""
    server = PgServer().start()
    try:
        url = server.new_database()
        s = PostgresStore(url)
        e = one(s, lambda tx: msg(tx, 1, b"m"))
        server.stop()
        t0 = time.monotonic()
        with pytest.raises(StoreFailure):
            one(s, lambda tx: tx.update(e.id, attempts=1))
        with pytest.raises(StoreFailure):
            s.reader().get(e.id)
        assert time.monotonic() - t0 < 60
        server.start()
        deadline = time.monotonic() + 60
        while True:  # the pool reconnects by itself
            try:
                assert one(s, lambda tx: tx.update(e.id, attempts=2))
                break
            except StoreFailure:
                assert time.monotonic() < deadline, "the store did not come back"
                time.sleep(0.2)
        got = s.reader().get(e.id)
        assert got is not None and got.attempts == 2
        s.close()
    finally:
        server.close()


@pytest.mark.parametrize("first", ["transition", "scan", "follower"])
def test_the_first_use_after_a_server_restart_goes_through(pg_server: PgServer, first: str
                                                           ) -> None:
    """Connections the pool kept are broken by a restart: whatever begins on one moves to a
    new connection (nothing was done on the broken one) instead of failing."""
    server = PgServer().start()
    try:
        url = server.new_database()
        s = PostgresStore(url)
        e = one(s, lambda tx: msg(tx, 1, b"m"))
        held = [s._pool.getconn() for _ in range(3)]  # the pool keeps several
        for conn in held:
            s._pool.putconn(conn)
        server.stop()
        server.start()
        if first == "scan":
            with s.scan() as r:
                assert r.get(e.id) is not None
        elif first == "follower":
            assert [c.entry_id for c in s.changes_since(0)] == [1, e.id]
        assert one(s, lambda tx: tx.update(e.id, attempts=2))
        got = s.reader().get(e.id)
        assert got is not None and got.attempts == 2
        s.close()
    finally:
        server.close()


def test_gc_prunes_the_change_log(pg_url: str) -> None:
    s = PostgresStore(pg_url)
    one(s, lambda tx: msg(tx, 1, b"m"))
    assert s.changes_since(0)
    s.close()
    m = open_maintenance(pg_url)
    try:
        assert m.prune_changes(3600) == 0  # young rows stay
        assert m.prune_changes(0) > 0
    finally:
        m.close()
    s = PostgresStore(pg_url)
    assert s.changes_since(0) == []
    s.close()


def test_the_hot_path_queries_read_their_indexes_also_after_a_migration(pg_url: str) -> None:
    """A directory's link count (every ``stat working/`` after a claim), the idle-view sweep,
    a publish's duplicate check and the retention sweep each read an index that names exactly
    the rows they return, not every message beside them; a database made by version 1 gets
    those indexes (and loses the ones they replace) when it is opened."""
    PostgresStore(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as c:  # as version 1 made it
        for name in ("entries_subdirs", "entries_purgeable", "entries_blob_queue"):
            c.execute(f"DROP INDEX {name}")
        c.execute("CREATE INDEX entries_blob ON entries(blob)")
        c.execute("CREATE INDEX entries_finished ON entries(queue, state, finished_ns) "
                  "WHERE finished_ns IS NOT NULL")
        c.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    store = PostgresStore(pg_url)
    ran: list[tuple[str, Sequence[Any]]] = []
    try:
        d = one(store, lambda tx: tx.insert(parent=1, name=b"q", kind="queue", mode=0o40755,
                                            mtime_ns=1, ctime_ns=1, created_ns=1)).id
        b = one(store, lambda tx: tx.blob_insert(b"\1" * 32, 1, None))
        r = store.reader()
        run = r._run  # type: ignore[attr-defined]

        def recording(query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
            ran.append((query, params))
            return run(query, params)  # type: ignore[no-any-return]
        r._run = recording  # type: ignore[attr-defined]
        try:
            assert r.subdirs(d) == 0 and r.subdirectories(d) == []
            assert r.published_with(d, b, 0, 0) is None
            assert r.finished_before(d, State.ERROR, 1000, 500) == []
        finally:
            r._run = run  # type: ignore[attr-defined]
    finally:
        store.close()
    expected = ["entries_subdirs", "entries_subdirs", "entries_blob_queue", "entries_purgeable"]
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("SET enable_seqscan = off")  # a few rows: the planner would scan the table
        for (query, params), index in zip(ran, expected, strict=True):
            plan = "\n".join(row[0] for row in c.execute(f"EXPLAIN {query}", params))
            assert index in plan, f"{query}\n{plan}"
        names = {row[0] for row in c.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename='entries'")}
        version = c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    assert {"entries_blob", "entries_finished"}.isdisjoint(names), names
    assert version is not None and int(version[0]) == pg_schema.VERSION == 2


def test_a_migration_is_not_cut_short_by_the_request_limits(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A migration builds indexes over every row: on a large table that takes longer than a
    request may (statement timeout), and it rolled back at every mount. It runs without the
    limit."""
    from spoolfs.store import postgres
    PostgresStore(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    monkeypatch.setattr(postgres, "SESSION", "SET statement_timeout = 100")
    monkeypatch.setitem(pg_schema.MIGRATIONS, 1,
                        ["SELECT pg_sleep(0.3)", *pg_schema.MIGRATIONS[1]])
    PostgresStore(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as c:
        version = c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    assert version is not None and int(version[0]) == pg_schema.VERSION


def _traced_store(pg_url: str, monkeypatch: pytest.MonkeyPatch, trace: Any) -> PostgresStore:
    """A store whose pool's one connection writes what libpq sends to ``trace``."""
    configure = PostgresStore._configure

    def traced(conn: psycopg.Connection[Any]) -> None:
        configure(conn)
        conn.pgconn.trace(trace.fileno())
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
    monkeypatch.setattr(PostgresStore, "_configure", staticmethod(traced))
    return PostgresStore(pg_url, pool_max=1)


def _waits(sent: str) -> int:
    """The times a client that sent ``sent`` (libpq's trace) waited for the server: after
    each Query and each Sync; a statement's prepare (a named Parse) has a Sync of its own."""
    sends = [line.split("\t")[2:4] for line in sent.splitlines()
             if line.startswith("F\t") and "spoolfs_prepare" not in line]
    return sum(1 for s in sends if s[0].strip() in ("Query", "Sync")) - sum(
        1 for s in sends if s[0].strip() == "Parse" and not s[1].startswith(' ""'))


@pytest.mark.parametrize("claims", [1, 2])
def test_a_claim_is_three_round_trips(pg_url: str, monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path, claims: int) -> None:
    """Each round trip waits on a server that may be on another machine: a claim's
    transaction (begun, its target looked up, the move with its directories' times, its
    history and change rows with the commit) waits three times, whatever it changes: the
    transaction is begun in the round trip of its first statement. Another claim in the
    same batch waits twice more: its savepoint goes with its first statement too. Counted
    in what libpq sends on the pool's connection, its checks included, once each statement
    is prepared on it (the first run of a prepared
    statement waits once more, for its Parse, and inside a transaction twice more, for the
    savepoint it is prepared in: pg_statements.py)."""
    trace = open(tmp_path / "trace", "w")  # noqa: SIM115 (closed below)
    store = _traced_store(pg_url, monkeypatch, trace)
    try:
        def mkdir(name: bytes):  # type: ignore[no-untyped-def]
            return lambda tx: tx.insert(parent=1, name=name, kind="state", mode=0o40755,
                                        mtime_ns=1, ctime_ns=1, created_ns=1).id
        ready, working = one(store, mkdir(b"ready")), one(store, mkdir(b"working"))
        es = [one(store, lambda tx, n=n: msg(tx, ready, n)) for n in (b"m", b"n", b"o")]

        def claim(e: Entry, tx: WriteTx) -> bool:
            assert tx.lookup(working, e.name) is None
            moved = tx.move(e.id, ready, e.name, working, e.name, state=State.WORKING)
            tx.add_history(e.id, 2, "claim", "ready", "working", 0, 1, None)
            return moved

        assert one(store, lambda tx: claim(es[0], tx))  # each statement prepared
        start = os.path.getsize(trace.name)  # (libpq writes each message out whole)
        got = store.run_batch([lambda tx, e=e: claim(e, tx) for e in es[1:1 + claims]],
                              durable=True)
        assert got == [(True, True)] * claims
        with open(trace.name) as f:
            f.seek(start)
            sent = f.read()
        assert _waits(sent) == 1 + 2 * claims, sent
        assert "pg_temp.spoolfs_commit(" in sent  # the session's function, not the statement
        r = store.reader()
        for e in es[:1 + claims]:
            got_e = r.get(e.id)
            assert got_e is not None and (got_e.parent, got_e.state) == (working, State.WORKING)
            assert [h[1] for h in r.history(e.id)] == ["claim"]
        left = r.get(es[2].id)
        assert left is not None and left.parent == (working if claims == 2 else ready)
        dirs = (r.get(ready), r.get(working))
        assert all(d is not None and d.mtime_ns > 1 for d in dirs)
    finally:
        store.close()
        trace.close()


def test_a_function_that_fails_before_its_first_statement_undoes_only_itself(
        pg_url: str) -> None:
    """A batch's function refused before it sent anything (its savepoint not yet sent
    either) rolls back nothing of the function before it; one that sent nothing at all
    commits nothing."""
    store = PostgresStore(pg_url)
    try:
        e = one(store, lambda tx: msg(tx, 1, b"kept"))

        def refused(tx: WriteTx) -> None:
            raise ValueError("refused before any statement")

        got = store.run_batch([lambda tx: tx.update(e.id, attempts=5), refused,
                               lambda tx: tx.update(e.id, mode=0o100600)], durable=True)
        assert got[0] == (True, True) and got[2] == (True, True)
        assert isinstance(got[1][1], ValueError) and not got[1][0]
        cur = store.reader().get(e.id)
        assert cur is not None and (cur.attempts, cur.mode) == (5, 0o100600)
        assert [ok for ok, _ in store.run_batch([refused], durable=True)] == [False]
        assert store.run_batch([lambda tx: 7], durable=False) == [(True, 7)]
        cur = store.reader().get(e.id)
        assert cur is not None and cur.attempts == 5
    finally:
        store.close()


def _commit_function_on(store: PostgresStore) -> bool:
    """Whether the pool's connections have the commit's function (pg_temp: each session
    its own)."""
    with store._conn() as conn:  # noqa: SLF001 (the pool's connection, as a batch gets it)
        row = conn.execute("SELECT count(*) FROM pg_proc WHERE proname = 'spoolfs_commit' "
                           "AND pronamespace = pg_my_temp_schema()").fetchone()
    return row is not None and row[0] == 1


def _history_and_changes(store: PostgresStore, entry_id: int, start: int
                         ) -> tuple[list[str], list[tuple[int | None, bytes | None]]]:
    r = store.reader()
    return ([h[1] for h in r.history(entry_id)],
            [(c.parent, c.name) for c in store.changes_since(start) if c.entry_id == entry_id])


def _commits_of_every_kind(store: PostgresStore) -> None:
    """A batch with changes and history, one with changes only, one with history only, one
    with neither: each commits what it made, in order, and only changes notify."""
    start = store.last_change()
    e = one(store, lambda tx: msg(tx, 1, b"fn"))  # changes, no history
    assert _history_and_changes(store, e.id, start) == ([], [(1, b"fn")])

    def moved(tx: WriteTx) -> None:  # changes and two history rows, in order
        assert tx.move(e.id, 1, b"fn", 1, b"fn2", state=State.WORKING)
        tx.add_history(e.id, 2, "claim", "ready", "working", 0, 1, None)
        tx.add_history(e.id, 3, "renew", "working", "working", None, None, "why")
    one(store, moved)
    one(store, lambda tx: tx.add_history(e.id, 4, "note", None, None, 0, 1, None))  # history
    one(store, lambda tx: tx.get(e.id))  # neither
    assert _history_and_changes(store, e.id, start) == (
        ["claim", "renew", "note"], [(1, b"fn"), (1, b"fn2")])


def test_a_commit_sends_its_change_and_history_rows_through_the_sessions_function(
        two) -> None:  # type: ignore[no-untyped-def]
    """A commit's change-log and history rows, its lock and its notification go in one
    function made in each session (planned once there), called with the COMMIT in one
    message, instead of one statement the server parses and plans at every commit."""
    a, b = two
    assert _commit_function_on(a)
    assert b.wait_changes(0.01) is False
    _commits_of_every_kind(a)
    assert b.wait_changes(30) is True  # the changes notified the other daemon


def _granted_role(pg_server: PgServer, prefix: str, also: str) -> str:
    """A new database with the schema made by its owner, and the URL of a role that has the
    README's grants there and ``also`` (a statement naming ``{role}`` and ``{db}``)."""
    url = pg_server.new_database()
    PostgresStore(url).close()
    role, db = f"{prefix}{os.getpid()}", url.rsplit("/", 1)[1]
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"CREATE ROLE {role} LOGIN")
        c.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        c.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}")
        c.execute(cast(Any, also.format(role=role, db=db)))
    return url.replace("postgresql://postgres@", f"postgresql://{role}@")


def test_a_role_without_temporary_privilege_commits_without_the_function(
        pg_server: PgServer) -> None:
    """A database that lets a role make no temporary object: the commit's statement is sent
    in full, as before the function, and everything still commits."""
    store = PostgresStore(_granted_role(pg_server, "nt", 'REVOKE TEMPORARY ON DATABASE "{db}" '
                                        "FROM PUBLIC"))
    try:
        assert not _commit_function_on(store)
        _commits_of_every_kind(store)
    finally:
        store.close()


def test_a_read_only_role_opens_the_store_and_is_refused_its_writes_at_once(
        pg_server: PgServer) -> None:
    """The function cannot be made on a read-only server or for a read-only role: the
    connections are still handed out (a read through the pool works), and a write is refused
    by the server, not by a pool that has no connection to give."""
    store = PostgresStore(_granted_role(pg_server, "ro", "ALTER ROLE {role} SET "
                                        "default_transaction_read_only = on"))
    try:
        assert not _commit_function_on(store)
        with store.scan() as r:
            root = r.get(1)
        assert root is not None
        with pytest.raises(StoreFailure, match="read-only"):
            one(store, lambda tx: msg(tx, 1, b"refused"))
    finally:
        store.close()


def test_a_session_that_lost_its_function_fails_one_commit_then_says_it_all(
        pg_url: str) -> None:
    """Something between the daemon and the server that resets a session drops its temporary
    function: that connection's next commit fails (EIO for its requests, nothing half-done),
    and its later ones send the statement in full."""
    store = PostgresStore(pg_url)
    try:
        one(store, lambda tx: msg(tx, 1, b"before"))
        n = store._pool.get_stats()["pool_size"]  # noqa: SLF001 (every connection it made)
        with contextlib.ExitStack() as held:
            for _ in range(n):
                held.enter_context(store._conn()).execute("DISCARD TEMP")  # noqa: SLF001
        failed = 0
        for i in range(n + 1):
            try:
                one(store, lambda tx, i=i: msg(tx, 1, b"lost%d" % i))
            except StoreFailure as e:
                assert "spoolfs_commit" in str(e)
                failed += 1
            else:
                break
        assert 1 <= failed <= n  # one commit per connection that lost it, at most
        for i in range(failed):
            assert store.reader().lookup(1, b"lost%d" % i) is None  # rolled back whole
        start = store.last_change()
        for i in range(2 * n):  # every connection again, each saying it all
            e = one(store, lambda tx, i=i: msg(tx, 1, b"after%d" % i))
            assert _history_and_changes(store, e.id, start)[1] == [(1, b"after%d" % i)]
    finally:
        store.close()


def test_functions_that_lose_leave_the_statements_prepared(pg_url: str) -> None:
    """A function that fails rolls back to its savepoint. psycopg, had it prepared anything
    on the connection (an empty batch's COMMIT, from its fifth run), would follow that
    ROLLBACK with DEALLOCATE ALL, dropping the engine's statements (pg_statements.py), and
    the next batch on the connection failed on them."""
    store = PostgresStore(pg_url, pool_max=1)
    try:
        for _ in range(8):
            assert one(store, lambda tx: tx.get(1)) is not None  # nothing changed: COMMIT

        def loses(tx: WriteTx) -> None:
            tx.get(1)
            raise StoreFailure("lost")
        ok, err = store.run_batch([loses], True)[0]
        assert not ok and str(err) == "lost"
        assert one(store, lambda tx: tx.get(1)) is not None
        assert one(store, lambda tx: msg(tx, 1, b"m")).name == b"m"
    finally:
        store.close()


def test_content_stored_first_is_taken_under_its_reserved_id(pg_url: str) -> None:
    """Content a blob store holds under a reserved id gets its row under that id; the same
    content stored again under another id shares the first row (the second object is an
    orphan, for gc)."""
    store = PostgresStore(pg_url)
    try:
        reserved = store.reserve_blob_id()
        sha = b"\4" * 32
        assert one(store, lambda tx: tx.blob_take(sha, 7, None, blob_id=reserved)) \
            == (reserved, True)
        again = store.reserve_blob_id()
        assert one(store, lambda tx: tx.blob_take(sha, 7, None, blob_id=again)) \
            == (reserved, False)
        blob = store.reader().blob(reserved)
        assert blob is not None and blob.refcount == 2 and store.reader().blob(again) is None
    finally:
        store.close()


def test_two_hosts_publishing_the_same_content_at_once_share_one_blob(two) -> None:  # type: ignore[no-untyped-def]
    """Host A's publish has inserted the content's row and not yet committed when host B's
    publish of the same bytes looks for it: B waits for A's commit, then takes a reference
    on A's row. (Looked up first and inserted when absent, B's insert failed on the unique
    content once A committed, and so did B's publish.)"""
    a, b = two
    sha = b"\7" * 32
    inserted, release = threading.Event(), threading.Event()

    def a_takes(tx: WriteTx):  # type: ignore[no-untyped-def]
        got = tx.blob_take(sha, 1, None, blob_id=a.reserve_blob_id())
        inserted.set()
        release.wait(10)  # not committed yet
        return got

    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(one(a, a_takes)))
    t.start()
    try:
        assert inserted.wait(10)
        threading.Timer(0.3, release.set).start()  # A commits while B waits on it
        b_got = one(b, lambda tx: tx.blob_take(sha, 1, None, blob_id=b.reserve_blob_id()))
    finally:
        release.set()
        t.join()
    a_got = out[0]
    assert a_got[1] is True and b_got == (a_got[0], False)
    blob = b.reader().blob(a_got[0])
    assert blob is not None and blob.refcount == 2


def test_the_pools_own_statements_are_prepared_too(pg_url: str) -> None:
    """A publish reserves its content's id, and the follower reads the change log, each in a
    statement of its own on the pool: prepared once on the connection, as a transaction's
    statements are (psycopg prepares nothing there: pg_statements.py)."""
    store = PostgresStore(pg_url, pool_max=1)
    try:
        ids = [store.reserve_blob_id() for _ in range(3)]
        assert ids == sorted(set(ids))
        one(store, lambda tx: msg(tx, 1, b"m"))
        assert b"m" in [c.name for c in store.changes_since(0)]
        with store._conn() as conn:  # noqa: SLF001 (the pool's one connection)
            prepared = [r[0] for r in conn.execute(
                "SELECT statement FROM pg_prepared_statements").fetchall()]
        assert sum("nextval(pg_get_serial_sequence('blobs'" in p for p in prepared) == 1
        assert sum("FROM changes WHERE seq > $1" in p for p in prepared) == 1
    finally:
        store.close()


def test_a_read_whose_statements_were_dropped_prepares_them_again(pg_url: str) -> None:
    """Something between daemon and server drops the session's prepared statements
    (``DEALLOCATE ALL``): a lookup prepares its statement again and answers, rather than
    failing once with EIO."""
    store = PostgresStore(pg_url)
    try:
        r = store.reader()
        assert r.get(1) is not None
        conn = store._reader._conn  # noqa: SLF001 (the reader's own connection)
        assert conn is not None
        conn.execute("DEALLOCATE ALL")
        assert r.get(1) is not None
    finally:
        store.close()
