"""The store contract, run against every engine: the embedded SQLite engine and memory."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from spoolfs.core.errors import Exists
from spoolfs.core.rules import State
from spoolfs.store.base import ENTRY_COLUMNS, LISTED_COLUMNS, Entry, Store, WriteTx
from spoolfs.store.registry import open_store
from spoolfs.store.sqlite import SqliteStore

ENGINES = ["sqlite", "memory", "postgresql"]


@pytest.fixture(params=ENGINES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "postgresql":
        url = request.getfixturevalue("pg_url")
    else:
        url = str(tmp_path / "s") if request.param == "sqlite" else "memory:"
    s = open_store(url)
    yield s
    s.close()


def one(store: Store, fn, durable: bool = True):  # type: ignore[no-untyped-def]
    ok, value = store.run_batch([fn], durable)[0]
    if not ok:
        raise value
    return value


def msg(tx: WriteTx, parent: int, name: bytes, **kw):  # type: ignore[no-untyped-def]
    return tx.insert(parent=parent, name=name, kind="message", state=State.READY, mode=0o100644,
                     mtime_ns=1, ctime_ns=1, created_ns=1, **kw)


def test_root_exists(store: Store) -> None:
    root = store.reader().get(1)
    assert root is not None and root.kind == "root" and root.parent is None


def test_insert_lookup_bytes_names(store: Store) -> None:
    name = b"\xff odd\nname"
    e = one(store, lambda tx: msg(tx, 1, name))
    got = store.reader().lookup(1, name)
    assert got is not None and got.id == e.id and got.name == name and got.state is State.READY


def test_rename_reads_read_what_each_reads(store: Store) -> None:
    """A rename's three reads, together (one round trip on a database server): each answer
    is what its own read gives, whichever is missing, and when some are the same row."""
    d = one(store, lambda tx: tx.insert(parent=1, name=b"dir", kind="state", mode=0o40755,
                                        mtime_ns=1, ctime_ns=1, created_ns=1))
    e = one(store, lambda tx: msg(tx, d.id, b"m", size=5))
    one(store, lambda tx: msg(tx, d.id, b"n", size=5))
    r = store.reader()
    for parent, name, other in ((d.id, b"m", d.id), (d.id, b"m", 999_999), (d.id, b"x", d.id),
                                (d.id, b"x", 999_999), (1, b"dir", d.id), (d.id, b"m", e.id)):
        for new_name in (b"m", b"n", b"free", b"dir"):
            assert r.rename_reads(parent, name, other, new_name) == (
                r.lookup(parent, name), r.get(other), r.lookup(other, new_name))
    got, where, there = r.rename_reads(d.id, b"m", d.id, b"n")
    assert got is not None and where is not None and there is not None
    assert (got.id, where.id, there.name) == (e.id, d.id, b"n")


def test_a_move_to_a_free_name_leaves_a_taken_name_alone(store: Store) -> None:
    """A move that takes a name only if no other row has it: False, nothing changed, when
    one has (a hidden upload too), and when the row moved meanwhile; a move onto its own
    name is no other row's."""
    e = one(store, lambda tx: msg(tx, 1, b"a"))
    one(store, lambda tx: msg(tx, 1, b"taken"))
    one(store, lambda tx: msg(tx, 1, b"hidden", hidden=1, staged=1))
    for name in (b"taken", b"hidden"):
        assert not one(store, lambda tx, n=name: tx.move(e.id, 1, b"a", 1, n, free=True,
                                                         state=State.WORKING))
    assert not one(store, lambda tx: tx.move(e.id, 1, b"gone", 1, b"b", free=True))
    r = store.reader()
    assert r.get(e.id) == r.lookup(1, b"a") and r.get(e.id).state is State.READY  # type: ignore[union-attr]
    assert one(store, lambda tx: tx.move(e.id, 1, b"a", 1, b"a", free=True, state=State.WORKING))
    assert one(store, lambda tx: tx.move(e.id, 1, b"a", 1, b"b", free=True))
    got = store.reader().lookup(1, b"b")
    assert got is not None and got.id == e.id and got.state is State.WORKING


def test_get_with_blob_reads_what_each_reads(store: Store) -> None:
    """An open's two reads, together (one round trip on a database server): the entry and
    its content's blob row, inline or in a file; none for an entry without content, or
    none at all."""
    inline = one(store, lambda tx: tx.blob_insert(b"\1" * 32, 3, b"abc", refs=1))
    in_file = one(store, lambda tx: tx.blob_insert(b"\2" * 32, 9, None, refs=2))
    es = [one(store, lambda tx, n=n, b=b: msg(tx, 1, n, blob=b, size=3))
          for n, b in ((b"inline", inline), (b"file", in_file), (b"other", in_file))]
    es.append(one(store, lambda tx: msg(tx, 1, b"none")))
    r = store.reader()
    for e in es:
        got = r.get(e.id)
        assert got is not None
        assert r.get_with_blob(e.id) == (got, r.blob(got.blob) if got.blob else None)
    assert r.get_with_blob(999_999) == (None, None)
    got_e, b = r.get_with_blob(es[1].id)
    assert b is not None and (b.id, b.sha256, b.size, b.refcount, b.data) == (
        in_file, b"\2" * 32, 9, 2, None)


def test_insert_unless_named_leaves_a_taken_name_alone(store: Store) -> None:
    """A new upload's row, unless its name is taken (by a hidden upload too): then none,
    and nothing changes (one statement on a database server)."""
    shown = one(store, lambda tx: msg(tx, 1, b"shown"))
    hidden = one(store, lambda tx: msg(tx, 1, b"hidden", hidden=1, staged=1))

    def new(name: bytes):  # type: ignore[no-untyped-def]
        return lambda tx: tx.insert_unless_named(parent=1, name=name, kind="message",
                                                 state=State.PARTIAL, staged=1, mode=0o100644,
                                                 mtime_ns=1, ctime_ns=1, created_ns=1)
    assert one(store, new(b"shown")) is None
    assert one(store, new(b"hidden")) is None
    made = one(store, new(b"free"))
    r = store.reader()
    assert made is not None and r.get(made.id) == made == r.lookup(1, b"free")
    assert r.get(shown.id) == shown and r.get(hidden.id) == hidden
    assert [e.name for e in r.children(1) if e.is_message] == [b"shown", b"hidden", b"free"]


def test_attach_blob_takes_the_content_and_points_the_entry_at_it(store: Store) -> None:
    """A published upload's content: a new blob row with one reference, or one more on the
    row of the same content, and the entry pointed at it (no longer staged, its size and
    time), in one statement on a database server; the change is seen by other hosts."""
    a = one(store, lambda tx: msg(tx, 1, b"a", staged=1))
    b = one(store, lambda tx: msg(tx, 1, b"b", staged=1))
    sha = b"\7" * 32
    start = store.last_change() if hasattr(store, "last_change") else None
    bid, new = one(store, lambda tx: tx.attach_blob(a.id, sha, 5, None, 111))
    assert new
    assert one(store, lambda tx: tx.attach_blob(b.id, sha, 5, None, 222)) == (bid, False)
    r = store.reader()
    for e, mtime in ((a, 111), (b, 222)):
        got = r.get(e.id)
        assert got is not None
        assert (got.blob, got.staged, got.size, got.mtime_ns, got.refs) == (
            bid, False, 5, mtime, 2)
    blob = r.blob(bid)
    assert blob is not None and (blob.sha256, blob.size, blob.refcount) == (sha, 5, 2)
    if start is not None:
        assert b.id in [c.entry_id for c in store.changes_since(start)]  # type: ignore[attr-defined]


def test_move_is_compare_and_set(store: Store) -> None:
    e = one(store, lambda tx: msg(tx, 1, b"a"))
    assert one(store, lambda tx: tx.move(e.id, 1, b"a", 1, b"b", state=State.WORKING))
    # A second mover that saw the old place loses.
    assert not one(store, lambda tx: tx.move(e.id, 1, b"a", 1, b"c"))
    assert store.reader().get(e.id).name == b"b"  # type: ignore[union-attr]


def test_failed_function_rolls_back_only_itself(store: Store) -> None:
    def bad(tx: WriteTx) -> None:
        msg(tx, 1, b"half")
        raise Exists("no")

    results = store.run_batch([lambda tx: msg(tx, 1, b"x"), bad, lambda tx: msg(tx, 1, b"y")],
                              durable=True)
    assert [ok for ok, _ in results] == [True, False, True]
    r = store.reader()
    assert r.lookup(1, b"x") and r.lookup(1, b"y") and r.lookup(1, b"half") is None


def test_ids_never_reused(store: Store) -> None:
    a = one(store, lambda tx: msg(tx, 1, b"a"))
    one(store, lambda tx: tx.delete(a.id))
    b = one(store, lambda tx: msg(tx, 1, b"a"))
    assert b.id > a.id


def test_reserved_ids_are_never_taken_by_another_insert(store: Store) -> None:
    """service/staging_pool.py makes staging files under ids reserved ahead of their rows."""
    before = one(store, lambda tx: msg(tx, 1, b"before"))
    ids = one(store, lambda tx: tx.reserve_entry_ids(4), durable=False)
    assert len(ids) == 4 and ids == sorted(set(ids)) and ids[0] > before.id
    after = one(store, lambda tx: msg(tx, 1, b"after"))
    assert after.id > ids[-1]
    taken = one(store, lambda tx: msg(tx, 1, b"taken", id=ids[1]))
    assert taken.id == ids[1] and store.reader().lookup(1, b"taken") == taken
    assert one(store, lambda tx: tx.reserve_entry_ids(1))[0] > after.id


def test_blob_refcounts(store: Store) -> None:
    sha = bytes(32)
    bid = one(store, lambda tx: tx.blob_insert(sha, 3, b"abc"))
    assert one(store, lambda tx: tx.blob_ref(bid, 1)) == 1
    assert one(store, lambda tx: tx.blob_ref(bid, 1)) == 2
    assert one(store, lambda tx: tx.blob_ref(bid, -2)) == 0
    assert one(store, lambda tx: tx.blob_by_sha(sha)).data == b"abc"
    with pytest.raises(Exception):
        one(store, lambda tx: tx.blob_insert(sha, 3, b"abc"))  # one row per content
    # a publish's new content is counted as it is inserted
    counted = one(store, lambda tx: tx.blob_insert(b"\2" * 32, 1, None, refs=1))
    assert one(store, lambda tx: tx.blob_ref(counted, 1)) == 2


def test_a_publish_takes_a_reference_on_its_content(store: Store) -> None:
    """``blob_take``: a new content's row with one reference, or one more reference on the row
    that holds it already; its id, and whether the row is new."""
    sha = b"\3" * 32
    bid, new = one(store, lambda tx: tx.blob_take(sha, 5, None))
    assert new and store.reader().blob(bid) is not None
    assert one(store, lambda tx: tx.blob_take(sha, 5, None)) == (bid, False)
    assert one(store, lambda tx: tx.blob_ref(bid, 0)) == 2
    inline, new = one(store, lambda tx: tx.blob_take(b"\5" * 32, 3, b"abc"))
    assert new and store.reader().blob(inline).data == b"abc"


def test_xattrs_follow_links_and_cascade(store: Store) -> None:
    a = one(store, lambda tx: msg(tx, 1, b"a"))
    one(store, lambda tx: tx.set_xattr(a.id, b"user.k", b"v"))
    b = one(store, lambda tx: msg(tx, 1, b"b"))
    one(store, lambda tx: tx.copy_xattrs(a.id, b.id))
    assert store.reader().xattrs(b.id) == {b"user.k": b"v"}
    one(store, lambda tx: tx.delete(a.id))
    assert store.reader().xattrs(a.id) == {}


def test_a_scan_in_another_thread_sees_one_committed_state(store: Store) -> None:
    one(store, lambda tx: msg(tx, 1, b"before"))
    seen: list[list[bytes]] = []

    def scan() -> None:
        with store.scan() as r:
            seen.append([e.name for e in r.children(1)])
            one(store, lambda tx: msg(tx, 1, b"during"))  # the writer is never blocked
            seen.append([e.name for e in r.children(1)])

    t = threading.Thread(target=scan)
    t.start()
    t.join()
    assert seen == [[b"before"], [b"before"]], "a scan saw a commit made during it"
    with store.scan() as r:
        assert [e.name for e in r.children(1)] == [b"before", b"during"]


def test_two_handles_on_one_file_see_each_other(tmp_path: Path) -> None:
    s1 = SqliteStore(str(tmp_path / "m.db"))
    s2 = SqliteStore(str(tmp_path / "m.db"))
    try:
        e = one(s1, lambda tx: msg(tx, 1, b"a"))
        assert s2.reader().get(e.id) is not None
        assert one(s2, lambda tx: tx.move(e.id, 1, b"a", 1, b"b"))
        assert not one(s1, lambda tx: tx.move(e.id, 1, b"a", 1, b"c"))
    finally:
        s1.close()
        s2.close()


def test_visible_names_coming_and_going_stamp_their_directories(store: Store) -> None:
    def mkdir(name: bytes):  # type: ignore[no-untyped-def]
        return lambda tx: tx.insert(parent=1, name=name, kind="state", mode=0o40755,
                                    mtime_ns=1, ctime_ns=1, created_ns=1)
    a, b = one(store, mkdir(b"a")).id, one(store, mkdir(b"b")).id

    def stamps() -> tuple[int, int]:
        da, db = store.reader().get(a), store.reader().get(b)
        assert da is not None and db is not None and da.mtime_ns == da.ctime_ns
        return da.mtime_ns, db.mtime_ns

    hidden = one(store, lambda tx: msg(tx, a, b"up", hidden=1))
    assert stamps() == (1, 1), "a hidden upload is no name yet"
    one(store, lambda tx: tx.move(hidden.id, a, b"up", b, b"up", hidden=0))
    ta, tb = stamps()
    assert ta == 1 and tb > 1, "a hidden row leaves unseen and arrives seen"
    e = one(store, lambda tx: msg(tx, a, b"m"))
    ta, tb2 = stamps()
    assert ta > 1 and tb2 == tb
    one(store, lambda tx: tx.move(e.id, a, b"m", b, b"m", hidden=1))
    ta2, tb3 = stamps()
    assert ta2 > ta and tb3 == tb, "moved away from a, hidden in b"
    one(store, lambda tx: tx.update(e.id, hidden=0))
    assert stamps()[1] > tb, "a hidden upload appearing is an addition"
    before = stamps()
    one(store, lambda tx: tx.update(e.id, mode=0o100600))
    assert stamps() == before, "attributes of a name are not the directory's business"
    one(store, lambda tx: tx.delete(e.id))
    assert stamps()[1] > before[1]


def test_store_settings(store: Store) -> None:
    assert store.reader().meta("blobs") is None
    one(store, lambda tx: tx.set_meta("blobs", "s3://bucket/prefix"))
    assert store.reader().meta("blobs") == "s3://bucket/prefix"
    one(store, lambda tx: tx.set_meta("blobs", "/shared/dir"))
    assert store.reader().meta("blobs") == "/shared/dir"


def test_a_directory_is_read_in_pages_by_id(store: Store) -> None:
    """``page`` gives a directory's visible entries in id order after a given id: a listing
    resumes where it stopped while names come and go, and skips unpublished uploads."""
    d = one(store, lambda tx: tx.insert(parent=1, name=b"d", kind="state", state=State.READY,
                                        mode=0o40755, mtime_ns=1, ctime_ns=1, created_ns=1))
    ids = [one(store, lambda tx, i=i: msg(tx, d.id, b"m%02d" % i)).id for i in range(7)]
    one(store, lambda tx: msg(tx, d.id, b"hidden", hidden=1))
    r = store.reader()
    first = r.page(d.id, 0, 3)
    assert [e.id for e in first] == ids[:3]
    one(store, lambda tx: tx.delete(ids[3]))  # gone before its turn: never listed
    one(store, lambda tx: tx.delete(ids[1]))  # gone after it was listed: shifts nothing
    late = one(store, lambda tx: msg(tx, d.id, b"late"))
    rest = r.page(d.id, first[-1].id, 3)
    assert [e.id for e in rest] == ids[4:7]
    assert [e.id for e in r.page(d.id, rest[-1].id, 3)] == [late.id]
    assert r.page(d.id, late.id, 3) == []


def test_a_listing_reads_what_the_attributes_show(store: Store) -> None:
    """``listing`` is ``page`` with each entry read as a listing shows it: the fields of its
    attributes (``LISTED_COLUMNS``) and its link count, the same as a whole row has them."""
    d = one(store, lambda tx: tx.insert(parent=1, name=b"d", kind="state", state=State.READY,
                                        mode=0o40755, mtime_ns=1, ctime_ns=1, created_ns=1))
    bid = one(store, lambda tx: tx.blob_insert(b"s" * 32, 5, None))
    one(store, lambda tx: tx.blob_ref(bid, 2))
    one(store, lambda tx: msg(tx, d.id, b"a", blob=bid, size=5, uid=7, gid=8, atime_ns=3))
    one(store, lambda tx: msg(tx, d.id, b"b", blob=bid, size=5, staged=1))
    one(store, lambda tx: msg(tx, d.id, b"hidden", hidden=1))
    one(store, lambda tx: tx.insert(parent=d.id, name=b"sub", kind="queue", mode=0o40755,
                                    mtime_ns=1, ctime_ns=1, created_ns=1))  # no state
    r = store.reader()
    whole, listed = r.page(d.id, 0, 10), r.listing(d.id, 0, 10)
    assert [e.name for e in listed] == [b"a", b"b", b"sub"]
    for w, e in zip(whole, listed, strict=True):
        assert all(getattr(e, c) == getattr(w, c) for c in LISTED_COLUMNS)
        assert e.refs == w.refs
    assert [e.refs for e in listed] == [2, 2, None]
    assert [e.state for e in listed] == [State.READY, State.READY, None]
    assert r.listing(d.id, listed[0].id, 1)[0].name == b"b"


def test_a_directory_counts_its_visible_subdirectories_only(store: Store) -> None:
    """A directory's link count is 2 + its subdirectories (``nlink_of``), and the idle-view
    sweep reads working/'s subdirectories: messages and a hidden directory are not among
    them, and a directory moved away no longer is."""
    def mkdir(parent: int, name: bytes, **kw):  # type: ignore[no-untyped-def]
        return lambda tx: tx.insert(parent=parent, name=name, kind="consumer", mode=0o40755,
                                    mtime_ns=1, ctime_ns=1, created_ns=1, **kw)
    d = one(store, mkdir(1, b"working")).id
    for i in range(5):
        one(store, lambda tx, i=i: msg(tx, d, b"m%d" % i))
    a = one(store, mkdir(d, b"a"))
    one(store, mkdir(d, b"b"))
    one(store, mkdir(d, b"unseen", hidden=1))
    assert store.reader().subdirs(d) == 2
    assert [e.name for e in store.reader().subdirectories(d)] == [b"a", b"b"]
    one(store, lambda tx: tx.move(a.id, d, b"a", 1, b"a"))
    assert store.reader().subdirs(d) == 1
    assert [e.name for e in store.reader().subdirectories(d)] == [b"b"]
    assert store.reader().subdirs(a.id) == 0


def test_a_rows_state_is_read_as_the_state_it_names() -> None:
    """Every row read turns its state into a ``State`` (by a table: it is on every read);
    a value no state has is refused as ``State`` refuses it."""
    row = [1, 1, b"m", "message", 1, None, 0, None, 0, 0, 0o100644, 0, 0, 1, 1, 1, None,
           None, None, 0, None, None, None, None, 0, None, None, None]
    for s in State:
        row[ENTRY_COLUMNS.index("state")] = s.value
        assert Entry.from_row(row).state is s
        listed = [row[ENTRY_COLUMNS.index(c)] for c in LISTED_COLUMNS] + [None]
        assert Entry.listed(listed).state is s
    row[ENTRY_COLUMNS.index("state")] = None
    assert Entry.from_row(row).state is None
    row[ENTRY_COLUMNS.index("state")] = "lost"
    with pytest.raises(ValueError):
        Entry.from_row(row)


def test_a_batchs_history_is_what_its_functions_left(store: Store) -> None:
    """History kept in order across the functions of one batch; a function that fails leaves
    none; rows dropped after they were added in the same transaction are gone."""
    a = one(store, lambda tx: msg(tx, 1, b"a"))
    b = one(store, lambda tx: msg(tx, 1, b"b"))

    def note(entry: int, action: str):  # type: ignore[no-untyped-def]
        return lambda tx: tx.add_history(entry, 1, action, "ready", "working", 0, 1, None)

    def fails(tx: WriteTx) -> None:
        note(a.id, "lost")(tx)
        raise Exists("no")

    def added_then_dropped(tx: WriteTx) -> None:
        note(b.id, "gone")(tx)
        tx.drop_history(b.id)
        note(b.id, "kept")(tx)

    results = store.run_batch([note(a.id, "first"), fails, note(a.id, "second"),
                               added_then_dropped, note(a.id, "third")], durable=True)
    assert [ok for ok, _ in results] == [True, False, True, True, True]
    r = store.reader()
    assert [h[1] for h in r.history(a.id)] == ["first", "second", "third"]
    assert [h[1] for h in r.history(b.id)] == ["kept"]
    one(store, lambda tx: tx.drop_history(a.id))
    assert store.reader().history(a.id) == []


def test_a_move_that_loses_changes_nothing_else(store: Store) -> None:
    """A compare-and-set move that finds the row gone from its place stamps no directory."""
    e = one(store, lambda tx: msg(tx, 1, b"a"))
    root = store.reader().get(1)
    assert root is not None
    assert not one(store, lambda tx: tx.move(e.id, 1, b"elsewhere", 1, b"b"))
    after = store.reader().get(1)
    assert after is not None and after.mtime_ns == root.mtime_ns


def test_an_insert_returns_the_row_as_it_is_read(store: Store) -> None:
    def both(tx: WriteTx):  # type: ignore[no-untyped-def]
        e = msg(tx, 1, b"a", size=5)
        return e, tx.get(e.id)

    made, read = one(store, both)
    assert made == read and made.refs == read.refs
    assert made == store.reader().get(made.id)


def test_what_recovery_judges_is_read_in_pages_by_id(store: Store) -> None:
    """Recovery reads the unclosed uploads, the staged ids among a page of staging files, and
    the unreferenced blob rows a page at a time: a store with a million uploads left in
    ``partial/`` mounts holding a page of them."""
    staged = [one(store, lambda tx, i=i: msg(tx, 1, b"s%02d" % i, staged=1, hidden=int(i % 4 > 0)))
              .id for i in range(10)]  # every fourth a closed upload (partial/'s, say)
    unclosed = [i for n, i in enumerate(staged) if n % 4]
    sealed = one(store, lambda tx: msg(tx, 1, b"sealed"))
    r = store.reader()
    first = r.unclosed_uploads(0, 3)
    assert [e.id for e in first] == unclosed[:3] and all(e.staged and e.hidden for e in first)
    one(store, lambda tx: tx.delete(unclosed[3]))
    rest = r.unclosed_uploads(first[-1].id, 3)
    assert [e.id for e in rest] == unclosed[4:7]
    assert r.unclosed_uploads(unclosed[6], 3) == []
    assert r.staged_among([staged[0], unclosed[3], sealed.id, 999_999, staged[6]]) \
        == {staged[0], staged[6]}
    assert r.staged_among([]) == set()
    closed = [i for n, i in enumerate(staged) if n % 4 == 0]  # what a status snapshot sizes
    assert [u[0] for u in r.uploads(0, 2)] == closed[:2]
    assert [u[0] for u in r.uploads(closed[1], 2)] == closed[2:]

    bids = [one(store, lambda tx, i=i: tx.blob_insert(bytes([i]) * 32, 1, b"%d" % i))
            for i in range(5)]
    one(store, lambda tx: tx.blob_ref(bids[2], 1))
    page = r.unreferenced_blobs(0, 2)
    assert [b.id for b in page] == bids[:2] and page[0].data == b"0"
    assert [b.id for b in r.unreferenced_blobs(bids[1], 2)] == [bids[3], bids[4]]
    assert r.unreferenced_blobs(bids[4], 2) == []


def test_the_highest_id_given_bounds_every_later_one(store: Store) -> None:
    """Recovery removes the staging files above the highest id given before the mount
    serves, and walks those at or below it later: no upload of the mount takes one of them."""
    r = store.reader()
    assert r.highest_entry_id() >= 1  # the root's
    a = one(store, lambda tx: msg(tx, 1, b"a"))
    b = one(store, lambda tx: msg(tx, 1, b"b"))
    one(store, lambda tx: tx.delete(b.id))
    assert r.highest_entry_id() == b.id > a.id  # a row deleted keeps its id given
    ids = one(store, lambda tx: tx.reserve_entry_ids(3), durable=False)
    assert one(store, lambda tx: tx.highest_entry_id()) == ids[-1] == r.highest_entry_id()
    assert one(store, lambda tx: msg(tx, 1, b"c")).id > ids[-1]
