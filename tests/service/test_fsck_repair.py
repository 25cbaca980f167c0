"""``fsck`` finds each kind of corruption and ``--repair`` fixes it, on a real store.

Messages are made through the service (as ``test_spool.py`` does); the damage is then done by
hand, with SQL on a connection of the test's own and with plain file operations, while the
service still has the store open (as a mounted daemon would). Every test ends with fsck clean,
and a message whose content was lost is in ``error/`` with the reason, never gone.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from helpers.deep import file_messages, peak_bytes
from helpers.spool import WHO, Q, content, running, upload
from spoolfs.cli import main as cli
from spoolfs.core.rules import State
from spoolfs.service import fsck as fsck_mod
from spoolfs.service.content import INLINE_MAX
from spoolfs.service.fsck import Fsck
from spoolfs.service.spool import Spool

BIG = INLINE_MAX * 2 + 123
EMPTY = hashlib.sha256(b"").digest()


Env = tuple[Spool, Q, Path]


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with running(tmp_path) as spool:
        qe = await spool.mkdir(1, b"q", 0o755, WHO)
        yield spool, Q(spool, qe.id), tmp_path


def sql(store: Path, stmt: str, *args: object) -> list[tuple[object, ...]]:
    """Tamper: one statement on a connection of our own (foreign keys off, as sqlite3's
    default)."""
    conn = sqlite3.connect(store / "meta.db", isolation_level=None)
    try:
        return conn.execute(stmt, args).fetchall()
    finally:
        conn.close()


def blob_path(spool: Spool, entry_id: int) -> str:
    b = spool.r.blob(spool.get(entry_id).blob)
    assert b is not None and b.data is None
    return spool.content.blobs.path(b.sha256, b.id)


def check(store: Path, **kw: object) -> list[str]:
    return Fsck(str(store), **kw).run()  # type: ignore[arg-type]


def repair(store: Path, grace_ns: int = 0, **kw: object) -> tuple[list[str], list[str]]:
    """fsck, then repair what it found: (problems, fixes)."""
    f = Fsck(str(store), grace_ns=grace_ns, **kw)  # type: ignore[arg-type]
    try:
        problems = f.check()
        fixes = f.repair()
    finally:
        f.close()
    return problems, fixes


def has(lines: list[str], *words: str) -> bool:
    return any(all(w in line for w in words) for line in lines)


def assert_lost(spool: Spool, q: Q, entry_id: int, name: bytes, what: str) -> None:
    """The message is in error/ under ``name``, empty, with the reason and a history row."""
    e = spool.get(entry_id)
    assert (e.parent, e.name, e.state) == (q[State.ERROR], name, State.ERROR)
    assert e.consumer is None and e.lease_ns is None and e.retry_ns is None
    assert e.finished_ns is not None and e.size == 0 and not e.staged
    assert e.error is not None and bytes(e.error).startswith(b"content lost: ")
    assert what.encode() in bytes(e.error)
    assert content(spool, entry_id) == b""
    assert spool.r.blob(e.blob).sha256 == EMPTY  # type: ignore[union-attr]
    last = spool.r.history(entry_id)[-1]
    assert last[1] == "repair" and last[3] == "error" and "content lost" in last[6]


# --------------------------------------------------------------------------- refcounts


async def test_wrong_refcounts_are_recomputed(env: Env) -> None:
    spool, q, store = env
    big = os.urandom(BIG)
    a = await upload(spool, q[State.READY], b"a", big)
    await spool.link(a, q[State.READY], b"b", WHO)
    s = await upload(spool, q[State.READY], b"s", b"small")
    sql(store, "UPDATE blobs SET refcount = 7 WHERE id = ?", spool.get(a).blob)
    sql(store, "UPDATE blobs SET refcount = 0 WHERE id = ?", spool.get(s).blob)

    problems = check(store)
    assert has(problems, f"blob {spool.get(a).blob}: refcount 7, referenced 2")
    assert has(problems, f"blob {spool.get(s).blob}: refcount 0, referenced 1")
    _, fixes = repair(store)
    assert has(fixes, "refcount 7 corrected to 2") and has(fixes, "refcount 0 corrected to 1")
    assert check(store) == []
    assert spool.r.blob(spool.get(a).blob).refcount == 2  # type: ignore[union-attr]
    assert content(spool, a) == big and content(spool, s) == b"small"
    # and the service counts on from the right number
    await spool.unlink(q[State.READY], b"a", WHO)
    await spool.unlink(q[State.READY], b"b", WHO)
    assert list(spool.content.blobs.walk()) == []


# --------------------------------------------------------------------------- orphans


async def test_unreferenced_blob_rows_are_deleted_with_their_files(env: Env) -> None:
    spool, q, store = env
    keep = await upload(spool, q[State.READY], b"keep", os.urandom(BIG))
    big = os.urandom(BIG)
    gone = await upload(spool, q[State.READY], b"gone", big)
    path = blob_path(spool, gone)
    leaked = spool.get(gone).blob
    # a message vanished without releasing its content; and a leaked inline blob
    sql(store, "DELETE FROM entries WHERE id = ?", gone)
    sql(store, "INSERT INTO blobs (sha256, size, refcount, data) VALUES (?, 3, 0, X'616263')",
        hashlib.sha256(b"abc").digest())

    problems = check(store)
    assert has(problems, f"blob {leaked}: refcount 1, referenced 0")
    assert len([p for p in problems if "no message references it" in p]) == 2
    _, fixes = repair(store)
    assert has(fixes, f"blob {leaked}: refcount 1 corrected to 0")
    assert has(fixes, f"deleted unreferenced blob {leaked}", "and its file")
    assert has(fixes, "deleted unreferenced blob", "inline")
    assert not os.path.exists(path)
    assert sql(store, "SELECT COUNT(*) FROM blobs") == [(1,)]
    assert check(store) == []
    assert content(spool, keep) != b""


async def test_orphan_blob_file_respects_the_grace_period(env: Env) -> None:
    spool, q, store = env
    m = await upload(spool, q[State.READY], b"m", os.urandom(BIG))
    live = blob_path(spool, m)
    data = os.urandom(BIG)
    sha = hashlib.sha256(data).digest()
    orphan = spool.content.blobs.path(sha, 999)
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    Path(orphan).write_bytes(data)
    junk = os.path.join(store, "blobs", "not-a-blob")
    Path(junk).write_bytes(b"?")

    assert has(check(store), "orphan blob file", orphan)
    assert has(check(store), "orphan blob file", junk)
    # just made: younger than the default grace period, so left alone (a note, no problem)
    f = Fsck(str(store), grace_ns=fsck_mod.gc.GRACE_NS)
    try:
        assert f.check() == []
        assert has(f.notes, orphan, "younger than the grace period")
        assert f.repair() == []
    finally:
        f.close()
    assert os.path.exists(orphan)
    # ten minutes later it goes
    problems, fixes = repair(store, grace_ns=fsck_mod.gc.GRACE_NS,
                             now_ns=time.time_ns() + fsck_mod.gc.GRACE_NS)
    assert has(problems, "orphan blob file", orphan)
    assert has(fixes, "removed orphan blob file", orphan)
    assert has(fixes, "removed orphan blob file", junk)
    assert not os.path.exists(orphan) and not os.path.exists(junk) and os.path.exists(live)
    assert check(store) == []


async def test_orphan_staging_files_are_removed(env: Env) -> None:
    spool, q, store = env
    e, h = await spool.create(q[State.PARTIAL], b"uploading", 0o644, WHO)
    spool.write(h, 0, b"half")
    pub = await upload(spool, q[State.READY], b"published", b"done")
    staging = spool.content.staging
    os.makedirs(os.path.dirname(staging.path(99999)), exist_ok=True)
    Path(staging.path(99999)).write_bytes(b"crash leftover")  # no entry at all
    Path(staging.path(pub)).write_bytes(b"stale")  # its message is published: not staged

    problems = check(store)
    assert has(problems, "orphan staging file", staging.path(99999))
    assert has(problems, "orphan staging file", staging.path(pub))
    assert not has(problems, staging.path(e.id))
    _, fixes = repair(store)
    assert len([f for f in fixes if "orphan staging file" in f]) == 2
    assert sorted(staging.ids()) == [e.id]  # the upload in progress keeps its file
    await spool.close(h, WHO)
    assert content(spool, e.id) == b"half" and content(spool, pub) == b"done"


# --------------------------------------------------------------------------- lost content


async def test_missing_blob_file_sends_every_reference_to_error(env: Env) -> None:
    spool, q, store = env
    other = await spool.mkdir(1, b"other", 0o755, WHO)
    oq = Q(spool, other.id)
    big = os.urandom(BIG)
    a = await upload(spool, q[State.READY], b"a", big)
    b = await spool.link(a, oq[State.READY], b"b", WHO)
    c = (await spool.link(a, q[State.READY], b"c", WHO)).id
    w = await spool.mkdir(q[State.WORKING], b"w1", 0o755, WHO)
    await spool.rename(q[State.READY], b"c", w.id, b"c", 0, WHO)
    fine = await upload(spool, q[State.READY], b"fine", os.urandom(BIG))
    bid = spool.get(a).blob
    os.unlink(blob_path(spool, a))

    problems = check(store)
    assert problems == [f"blob {bid}: file missing"]
    _, fixes = repair(store)
    assert len([f for f in fixes if "moved to error/" in f]) == 3
    assert has(fixes, f"deleted damaged blob {bid}")
    assert check(store) == []
    assert_lost(spool, q, a, b"a", "file missing")
    assert_lost(spool, oq, b.id, b"b", "file missing")
    assert_lost(spool, q, c, b"c", "file missing")
    assert spool.get(c).attempts == 1  # its claim still counted
    assert content(spool, fine) != b""
    assert sql(store, "SELECT COUNT(*) FROM blobs WHERE id = ?", bid) == [(0,)]
    # the lost messages are ordinary error/ messages: they can be deleted
    await spool.unlink(q[State.ERROR], b"a", WHO)


async def test_truncated_and_corrupted_blob_files(env: Env) -> None:
    spool, q, store = env
    t = await upload(spool, q[State.READY], b"truncated", os.urandom(BIG))
    x = await upload(spool, q[State.READY], b"corrupt", os.urandom(BIG))
    tpath, xpath = blob_path(spool, t), blob_path(spool, x)
    os.truncate(tpath, 1000)
    with open(xpath, "r+b") as f:
        f.seek(5000)
        f.write(b"\0garbage\0")
    tbid, xbid = spool.get(t).blob, spool.get(x).blob

    problems = check(store)
    assert has(problems, f"blob {tbid}: file has 1000 bytes, not {BIG}")
    assert has(problems, f"blob {xbid}: content does not match its hash")
    _, fixes = repair(store)
    assert check(store) == []
    assert_lost(spool, q, t, b"truncated", "file has 1000 bytes")
    assert_lost(spool, q, x, b"corrupt", "does not match its hash")
    # what was left of the content is kept for a human, outside the blob store
    kept = sorted(os.listdir(store / "lost+found"))
    assert kept == sorted([os.path.basename(tpath), os.path.basename(xpath)])
    assert os.path.getsize(store / "lost+found" / os.path.basename(tpath)) == 1000
    assert has(fixes, "kept the damaged content in", "lost+found")


async def test_damaged_inline_content(env: Env) -> None:
    spool, q, store = env
    m = await upload(spool, q[State.READY], b"small", b"precious")
    sql(store, "UPDATE blobs SET data = X'00' WHERE id = ?", spool.get(m).blob)
    assert has(check(store), "inline content does not match its hash")
    repair(store)
    assert check(store) == []
    assert_lost(spool, q, m, b"small", "inline content does not match its hash")


async def test_lost_message_takes_a_free_name_in_error(env: Env) -> None:
    spool, q, store = env
    w = await spool.mkdir(q[State.WORKING], b"w1", 0o755, WHO)
    # error/ already holds "f" and "f.~1~"
    await upload(spool, q[State.READY], b"f", b"one")
    await spool.rename(q[State.READY], b"f", w.id, b"f", 0, WHO)
    await spool.rename(w.id, b"f", q[State.ERROR], b"f", 0, WHO)
    await upload(spool, q[State.READY], b"g", b"two")
    await spool.rename(q[State.READY], b"g", w.id, b"g", 0, WHO)
    await spool.rename(w.id, b"g", q[State.ERROR], b"f.~1~", 0, WHO)
    m = await upload(spool, q[State.READY], b"f", os.urandom(BIG))
    os.unlink(blob_path(spool, m))
    _, fixes = repair(store)
    assert has(fixes, "moved to error/ as 'f.~2~'")
    assert_lost(spool, q, m, b"f.~2~", "file missing")
    assert content(spool, spool.lookup(q[State.ERROR], b"f").id) == b"one"


async def test_missing_blob_row_is_rebuilt_from_its_file(env: Env) -> None:
    spool, q, store = env
    big = os.urandom(BIG)
    a = await upload(spool, q[State.READY], b"a", big)
    await spool.link(a, q[State.READY], b"b", WHO)
    bid = spool.get(a).blob
    sql(store, "DELETE FROM blobs WHERE id = ?", bid)
    problems = check(store)
    assert has(problems, f"blob {bid} referenced by 2 message(s) is missing")
    _, fixes = repair(store)
    assert has(fixes, f"blob {bid} was missing: rebuilt from its file")
    assert check(store) == []
    assert content(spool, a) == big and spool.get(a).state is State.READY
    assert spool.r.blob(bid).refcount == 2  # type: ignore[union-attr]


async def test_missing_blob_row_and_file(env: Env) -> None:
    spool, q, store = env
    a = await upload(spool, q[State.READY], b"a", os.urandom(BIG))
    bid = spool.get(a).blob
    os.unlink(blob_path(spool, a))
    sql(store, "DELETE FROM blobs WHERE id = ?", bid)
    assert has(check(store), f"blob {bid} referenced by 1 message(s) is missing")
    repair(store)
    assert check(store) == []
    assert_lost(spool, q, a, b"a", f"blob {bid} is missing")


async def test_message_without_any_content(env: Env) -> None:
    spool, q, store = env
    a = await upload(spool, q[State.READY], b"a", b"x")
    blob = spool.get(a).blob
    sql(store, "UPDATE entries SET blob = NULL, staged = 0 WHERE id = ?", a)
    sql(store, "UPDATE blobs SET refcount = 0 WHERE id = ?", blob)
    assert has(check(store), f"message {a}", "needs exactly one of blob / staging")
    _, fixes = repair(store)
    assert check(store) == []
    assert_lost(spool, q, a, b"a", "neither a blob nor an upload")
    assert has(fixes, f"deleted unreferenced blob {blob}")


async def test_every_kind_at_once_through_the_command_line(
        env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    spool, q, store = env
    a = await upload(spool, q[State.READY], b"a", os.urandom(BIG))
    b = await upload(spool, q[State.READY], b"b", os.urandom(BIG))
    c = await upload(spool, q[State.READY], b"c", b"c")
    os.unlink(blob_path(spool, a))  # missing blob file
    os.truncate(blob_path(spool, b), 10)  # truncated blob file
    sql(store, "UPDATE blobs SET refcount = 5 WHERE id = ?", spool.get(c).blob)  # refcount
    os.makedirs(os.path.dirname(spool.content.staging.path(77777)), exist_ok=True)
    Path(spool.content.staging.path(77777)).write_bytes(b"x")  # orphan staging file
    Path(spool.content.blobs.path(b"\xab" * 32, 4242)).parent.mkdir(parents=True, exist_ok=True)
    Path(spool.content.blobs.path(b"\xab" * 32, 4242)).write_bytes(b"x")  # orphan blob file
    sql(store, "INSERT INTO blobs (sha256, size, refcount, data) VALUES (?, 1, 0, X'79')",
        hashlib.sha256(b"y").digest())  # orphan blob row
    monkeypatch.setattr(fsck_mod, "PROGRESS_EVERY", 5)

    assert cli(["fsck", str(store)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "fsck: 6 problem(s)"
    assert any(line.startswith("fsck: checked ") for line in out)
    assert "fsck: 5 objects checked" in out  # progress

    # default grace: the fresh orphan files are left (notes), everything else is repaired
    assert cli(["fsck", str(store), "--repair"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len([line for line in out if line.startswith("repaired: ")]) >= 5
    assert len([line for line in out if line.startswith("note: ")]) >= 2
    assert out[-1].startswith("fsck: 4 problem(s) repaired") and out[-1].endswith("clean")
    assert os.path.exists(spool.content.staging.path(77777))

    assert cli(["fsck", str(store), "--repair", "--grace", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert has(out, "repaired: removed orphan staging file")
    assert has(out, "repaired: removed orphan blob file")
    assert cli(["fsck", str(store)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "fsck: clean"
    assert_lost(spool, q, a, b"a", "file missing")
    assert_lost(spool, q, b, b"b", "file has 10 bytes")
    assert content(spool, c) == b"c"


async def test_fsck_of_something_that_is_no_store(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["fsck", str(tmp_path / "nothing")]) != 0
    assert "is not a spoolfs store" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()


async def test_a_file_of_a_batch_lost_sends_the_whole_batch_to_error(env: Env) -> None:
    spool, q, store = env
    root = await spool.mkdir(q[State.PARTIAL], b"b1", 0o755, WHO)
    sub = await spool.mkdir(root.id, b"sub", 0o755, WHO)
    await upload(spool, root.id, b"a", b"small")
    big = await upload(spool, sub.id, b"big", os.urandom(BIG))
    await spool.rename(q[State.PARTIAL], b"b1", q[State.READY], b"b1", 0, WHO)
    w = await spool.mkdir(q[State.WORKING], b"w1", 0o755, WHO)
    await spool.rename(q[State.READY], b"b1", w.id, b"b1", 0, WHO)
    assert check(store) == []  # a batch and its directories hold no content of their own
    os.unlink(blob_path(spool, big))

    assert check(store) == [f"blob {spool.get(big).blob}: file missing"]
    _, fixes = repair(store)
    assert check(store) == []
    b = spool.get(root.id)
    assert (b.parent, b.state, b.consumer, b.lease_ns) == (q[State.ERROR], State.ERROR, None, None)
    assert b.error is not None
    assert bytes(b.error).startswith(b"content lost: 'sub/big' in the batch: blob ")
    assert spool.r.history(root.id)[-1][1] == "repair"
    assert content(spool, big) == b"" and spool.get(big).parent == sub.id  # the tree follows
    assert content(spool, spool.lookup(root.id, b"a").id) == b"small"
    assert has(fixes, f"message {root.id} 'b1' (working/w1): content lost: 'sub/big'")


async def test_damaged_empty_content_is_restored_not_lost(env: Env) -> None:
    spool, q, store = env
    m = await upload(spool, q[State.READY], b"empty", b"")
    sql(store, "UPDATE blobs SET data = X'00', size = 1 WHERE id = ?", spool.get(m).blob)
    assert has(check(store), "inline content does not match its hash")
    _, fixes = repair(store)
    assert has(fixes, "the empty content restored")
    assert check(store) == []
    assert spool.get(m).state is State.READY and content(spool, m) == b""


async def test_what_cannot_be_repaired_is_reported_and_fails(
        env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    spool, q, store = env
    assert cli(["fsck", str(store), "--repair"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "fsck: clean"
    m = await upload(spool, q[State.READY], b"m", b"x")
    sql(store, "UPDATE entries SET staged = 1 WHERE id = ?", m)  # both a blob and an upload
    assert cli(["fsck", str(store), "--repair"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "fsck: 1 problem(s) left after repair"
    assert has(out, f"message {m}", "needs exactly one of blob / staging")
    sql(store, "UPDATE entries SET staged = 0 WHERE id = ?", m)


async def test_a_repair_applies_the_repair_rows_effects(env: Env) -> None:
    """fsck moves a message through the transition table like every mover: a message that
    was abandoned in error/ before its content was lost gets exactly the REPAIR row's fields."""
    from spoolfs.core.rules import Action, kind_of
    from spoolfs.core.transitions import Context, fields_of, transition

    spool, q, store = env
    m = await upload(spool, q[State.READY], b"m", os.urandom(BIG))
    sql(store, "UPDATE entries SET abandoned = 1, retry_ns = 5 WHERE id = ?", m)
    os.unlink(blob_path(spool, m))
    before = spool.get(m)
    _, fixes = repair(store)
    assert has(fixes, "content lost")
    e = spool.get(m)
    want = fields_of(transition(Action.REPAIR, State.ERROR), kind_of(State.READY, b"m"),
                     Context(e.finished_ns or 0, reason=e.error))
    for column, value in want.items():
        assert getattr(e, column) == value, (column, getattr(e, column), value)
    assert e.attempts == before.attempts and e.enqueued_ns == before.enqueued_ns
    assert spool.r.history(m)[-1][1] == Action.REPAIR.value


# --------------------------------------------------------------------------- depth


async def test_a_deep_store_is_checked_a_page_at_a_time(env: Env) -> None:
    """A million messages with contents of their own: a check that held every content row
    (every small message's bytes among them), every reference count and every blob file's
    name at once took gigabytes. Each pass goes a page at a time, so what fsck holds does not
    grow with the messages, and damage past the first pages is still found."""
    spool, q, store = env
    n = 3 * fsck_mod.PAGE
    ready = q[State.READY]
    file_messages(store, spool, ready, 0, n)
    file_messages(store, spool, ready, n, n, inline=True, size=1000)
    small = peak_bytes(lambda: check(store) == [] or pytest.fail("fsck found damage"))
    more = 3000
    file_messages(store, spool, ready, 2 * n, more)
    file_messages(store, spool, ready, 2 * n + more, more, inline=True, size=1000)
    large = peak_bytes(lambda: check(store) == [] or pytest.fail("fsck found damage"))
    assert large - small < 10 * 2 * more, (small, large)  # bytes held per added message

    gone, wrong, bad = (spool.lookup(ready, b"m%d" % i) for i in (2 * n + 7, 2 * n + 9,
                                                                   2 * n + more + 5))
    os.unlink(blob_path(spool, gone.id))
    sql(store, "UPDATE blobs SET refcount = 3 WHERE id = ?", wrong.blob)
    sql(store, "UPDATE blobs SET data = ? WHERE id = ?", b"not it", bad.blob)
    sql(store, "DELETE FROM blobs WHERE id = ?", spool.lookup(ready, b"m%d" % (n + 1)).blob)
    loose = os.path.join(str(store), "blobs", "ab", "cd", "ab" * 32 + ".99999999")
    os.makedirs(os.path.dirname(loose), exist_ok=True)
    with open(loose, "wb") as f:
        f.write(b"loose")
    missing_row = spool.lookup(ready, b"m%d" % (n + 1)).blob
    assert sorted(check(store)) == sorted([
        f"blob {gone.blob}: file missing",
        f"blob {wrong.blob}: refcount 3, referenced 1",
        f"blob {bad.blob}: inline content does not match its hash",
        f"blob {missing_row} referenced by 1 message(s) is missing",
        f"dangling reference: ('entries', {spool.lookup(ready, b'm%d' % (n + 1)).id}, "
        "'blobs', 0)",
        f"orphan blob file {loose}",
    ])
    _, fixes = repair(store)
    assert len([f for f in fixes if "moved to error/" in f]) == 3
    assert check(store) == [] and not os.path.exists(loose)


def test_the_files_found_cost_a_bit_each_whatever_their_ids() -> None:
    """What the walk found is a bit per blob id, in chunks: an odd large id (a row made by
    hand) costs one chunk, not a bitmap up to it."""
    found = fsck_mod._IdSet()
    ids = (0, 1, 7, 8, 65_535, 65_536, 2**40, 2**62)
    for i in ids:
        found.add(i)
    assert all(i in found for i in ids)
    assert not any(i in found for i in (2, 9, 65_537, 2**40 + 1, 2**62 - 1, -1))
    assert len(found._chunks) == 4


async def test_a_blob_file_that_cannot_be_read_is_one_line(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk error reading a blob file is a problem line, not a traceback that ends the
    check, and repair leaves the file's messages where they are (the content may be whole)."""
    spool, q, store = env
    a = await upload(spool, q[State.READY], b"a", os.urandom(BIG))
    b = await upload(spool, q[State.READY], b"b", os.urandom(BIG))
    bad = blob_path(spool, a)
    digest = spool.content.blobs.digest

    def failing(self: object, path: str) -> tuple[bytes, int] | None:
        if path == bad:
            raise OSError(errno.EIO, "Input/output error")
        return digest(path)

    monkeypatch.setattr(type(spool.content.blobs), "digest", failing)
    assert check(store) == [f"blob {spool.get(a).blob}: file cannot be read ({bad}): "
                            "Input/output error"]
    assert repair(store)[1] == []
    assert spool.get(a).state is State.READY and spool.get(b).state is State.READY
    monkeypatch.undo()
