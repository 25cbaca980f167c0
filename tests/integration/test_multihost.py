"""Two daemons (two "hosts") on one postgresql:// store with content in a shared directory:
the database decides every claim; changes through one show in the other; the blob location
is recorded once; losing the database fails transitions with EIO, and the mount comes back
by itself (DESIGN §6 "Multi-host")."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from helpers.inspection import ls, read
from helpers.mounts import MountFactory
from helpers.namespace import Namespace, daemon_pid
from helpers.pgserver import PgServer
from helpers.procs import finish_claimers, ok, one_line_error, spoolfs_cli, start_claimers
from helpers.queues import Queue
from helpers.s3server import S3Server
from helpers.waiting import wait_until
from spoolfs.store.site import default_local_base

pytestmark = pytest.mark.fuse

PROPAGATION = 3.0  # DESIGN §6: within about a second; slack for a loaded machine


def fsck_clean(store: str) -> None:
    res = spoolfs_cli("fsck", store, timeout=120)
    out = (res.stdout + res.stderr).decode(errors="replace")
    assert res.returncode == 0 and out.rstrip().endswith("fsck: clean"), out


@pytest.fixture(params=["shared-dir", "s3"])
def blobs_at(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the two hosts keep content: a directory both see, or an S3 bucket."""
    if request.param == "s3":
        return str(request.getfixturevalue("s3_url"))
    return str(tmp_path / "shared-blobs")


def stored_objects(where: str, s3: S3Server | None) -> int:
    if where.startswith("s3://"):
        assert s3 is not None
        bucket, prefix = where[5:].split("/", 1)
        pages = s3.client().get_paginator("list_objects_v2").paginate(  # type: ignore[attr-defined]
            Bucket=bucket, Prefix=prefix)
        return sum(len(p.get("Contents", [])) for p in pages)
    return sum(len(fs) for _, _, fs in os.walk(where))


def test_two_hosts_one_database(mounter: MountFactory, pg_url: str, blobs_at: str,
                                tmp_path: Path, request: pytest.FixtureRequest) -> None:
    blobs = blobs_at
    a = mounter(pg_url, tmp_path / "a", extra=["--blobs", blobs])
    b = mounter(pg_url, tmp_path / "b")  # the location comes from the store's record
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    qb = Queue(b.path / "q", tmp_path / "scratch")

    data = q.publish("first", os.urandom(50_000))
    wait_until(lambda: ls(qb.ready) == ["first"], timeout=PROPAGATION, alive=b.daemon_alive,
               what="a publish through host A to show on host B")
    assert read(qb.ready / "first") == data
    ok("mv", qb.ready / "first", qb.consumer("w1"))
    wait_until(lambda: ls(q.working / "w1") == ["first"], timeout=PROPAGATION,
               alive=a.daemon_alive, what="a claim through B to show in A")
    ok("mv", q.working / "w1/first", q.success)

    big = q.publish("big", os.urandom(6 << 20))  # hashed while cp writes it (blobs/running.py)
    wait_until(lambda: ls(qb.ready) == ["big"], timeout=PROPAGATION, alive=b.daemon_alive,
               what="a large publish through host A to show on host B")
    assert ok("getfattr", "--only-values", "-n", "user.spool.sha256",
              qb.ready / "big").decode() == hashlib.sha256(big).hexdigest()
    assert read(qb.ready / "big") == big
    ok("mv", qb.ready / "big", qb.consumer("w1"))
    ok("mv", qb.working / "w1/big", qb.success)

    names = [f"m{i:03d}" for i in range(150)]
    src = tmp_path / "src"
    src.mkdir()
    for n in names:
        (src / n).write_bytes(n.encode() * 100)
    ok("cp", "-t", q.ready, *(src / n for n in names))
    consumers = [f"c{i}" for i in range(6)]
    for c in consumers:
        q.consumer(c)
    wait_until(lambda: ls(qb.ready) == names and set(consumers) <= set(ls(qb.working)),
               timeout=PROPAGATION, alive=b.daemon_alive, what="B to see the published files")
    claims = finish_claimers(start_claimers([q.path, qb.path], consumers, tmp_path / "logs"))
    won = Counter(n for c in consumers for n in claims[c])
    assert sorted(won) == names and set(won.values()) == {1}, "each claimed exactly once"

    # the small files' content in the database, the two larger ones in the blob store
    s3 = request.getfixturevalue("s3_server") if blobs.startswith("s3://") else None
    assert stored_objects(blobs, s3) == 2
    with psycopg.connect(pg_url) as conn:
        inline = conn.execute("SELECT data FROM blobs WHERE data IS NOT NULL").fetchall()
    assert sorted(bytes(d) for d, in inline) == sorted(n.encode() * 100 for n in names)
    a.umount()
    b.umount()
    fsck_clean(pg_url)


def test_the_blob_location_is_recorded_once(mounter: MountFactory, pg_url: str,
                                            tmp_path: Path) -> None:
    first = mounter(pg_url, tmp_path / "m0", start=False)
    (tmp_path / "m0").mkdir()
    res = spoolfs_cli(*first.argv)
    assert res.returncode != 0 and "needs --blobs" in one_line_error(res)
    mounter(pg_url, tmp_path / "m1", extra=["--blobs", str(tmp_path / "blobs")])
    other = mounter(pg_url, tmp_path / "m2", extra=["--blobs", str(tmp_path / "elsewhere")],
                    start=False)
    (tmp_path / "m2").mkdir()
    res = spoolfs_cli(*other.argv)
    assert res.returncode != 0 and "keeps its content in" in one_line_error(res)
    assert not (tmp_path / "elsewhere").exists()


def test_an_unreachable_database_is_one_line_at_mount(mounter: MountFactory,
                                                      tmp_path: Path) -> None:
    m = mounter("postgresql://spool@127.0.0.1:9/spool", tmp_path / "m",
                extra=["--blobs", str(tmp_path / "b")], start=False)
    (tmp_path / "m").mkdir()
    res = spoolfs_cli(*m.argv, timeout=60)
    assert res.returncode != 0
    assert "database unavailable" in one_line_error(res)
    assert not os.path.ismount(tmp_path / "m")


def test_losing_the_database_fails_transitions_and_the_mount_recovers(
        mounter: MountFactory, tmp_path: Path) -> None:
    server = PgServer().start()  # its own: stopping the session's would fail other tests
    try:
        url = server.new_database()
        m = mounter(url, tmp_path / "m", extra=["--blobs", str(tmp_path / "blobs")])
        q = Queue.create(m.path, "q", tmp_path / "scratch")
        q.publish("before")
        q.consumer("w")
        server.stop()
        with pytest.raises(OSError) as exc:
            os.rename(q.ready / "before", q.working / "w" / "before")
        assert exc.value.errno == errno.EIO
        server.start()
        wait_until(lambda: ls(q.ready) == ["before"], timeout=60, alive=m.daemon_alive,
                   what="the mount to answer again once the database is back")
        ok("mv", q.ready / "before", q.working / "w")
        q.publish("after")
        assert ls(q.ready) == ["after"] and ls(q.working / "w") == ["before"]
        m.umount()
    finally:
        server.close()


def _stop_inside_a_write(pid: int, db_url: str, server: PgServer) -> None:
    """SIGSTOP daemon ``pid`` at a moment it holds a write transaction open (a paused
    machine): stopped, then its database session found idle inside a transaction that has
    written, or continued and tried again."""
    db = db_url.rsplit("/", 1)[1]
    with psycopg.connect(server.url(), autocommit=True) as c:
        for _ in range(500):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.2)  # the other daemon's batches never idle this long
            held = c.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname=%s AND backend_xid IS "
                "NOT NULL AND state='idle in transaction' AND state_change < now() - "
                "interval '100 milliseconds'", (db,)).fetchone()
            if held and held[0]:
                return
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.01)
    raise AssertionError(f"daemon {pid} was never caught inside a write transaction")


def test_a_host_stopped_inside_a_transaction_holds_the_other_up_only_briefly(
        mounter: MountFactory, pg_server: PgServer, tmp_path: Path) -> None:
    """Claimers on host B, B stopped while a claim's transaction is open (its row locks
    held), then claimers on host A over the same names: each of A's moves goes through or
    loses with ENOENT, none fails with EIO (the server ends B's idle transaction); B's stopped
    claim changed nothing; every message is claimed once."""
    url = pg_server.new_database()
    a = mounter(url, tmp_path / "a", extra=["--blobs", str(tmp_path / "blobs")])
    b = mounter(url, tmp_path / "b")
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    qb = Queue(b.path / "q", tmp_path / "scratch")
    names = [f"m{i:03d}" for i in range(300)]
    for n in names:
        q.publish(n, n.encode())
    for c in ("a1", "a2"):
        q.consumer(c)
    for c in ("b1", "b2"):
        qb.consumer(c)
    wait_until(lambda: len(ls(qb.ready)) == len(names), timeout=PROPAGATION, alive=b.daemon_alive,
               what="host B to list every name")
    on_b = start_claimers([qb.path], ["b1", "b2"], tmp_path / "logs-b")
    try:
        _stop_inside_a_write(b.pid, url, pg_server)
        claims_a = finish_claimers(start_claimers([q.path], ["a1", "a2"], tmp_path / "logs-a"))
    finally:
        os.kill(b.pid, signal.SIGCONT)
    for _, p, _, _ in on_b:
        p.communicate(timeout=120)
    held = {c: ls(q.working / c) for c in ("a1", "a2", "b1", "b2")}
    assert sorted(n for v in held.values() for n in v) == names  # each once, none lost
    assert sorted(claims_a["a1"] + claims_a["a2"]) == sorted(held["a1"] + held["a2"])
    assert ls(q.ready) == []
    fsck_clean(url)


def test_an_unreachable_s3_endpoint_is_one_line_at_mount(
        mounter: MountFactory, pg_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k",
                 "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    m = mounter(pg_url, tmp_path / "m", extra=["--blobs", "s3://spool/p"], start=False)
    (tmp_path / "m").mkdir()
    res = spoolfs_cli(*m.argv, timeout=120)
    line = one_line_error(res)
    assert "S3" in line and "spool" in line, line
    assert not os.path.ismount(tmp_path / "m")


def test_a_view_removed_and_made_again_on_one_host_is_seen_on_the_other(
        mounter: MountFactory, pg_url: str, tmp_path: Path) -> None:
    """The kernel keeps the names of queues, state directories and views longer on a shared
    store (fuse/ops.py STRUCTURE_TIMEOUT): another host's removal of one, or a queue made
    again, reaches this mount through its follower, within about a second, not after it."""
    a = mounter(pg_url, tmp_path / "a", extra=["--blobs", str(tmp_path / "shared-blobs")])
    b = mounter(pg_url, tmp_path / "b")
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    qb = Queue(b.path / "q", tmp_path / "scratch")
    view = q.consumer("c1")
    wait_until(lambda: (qb.working / "c1").is_dir(), timeout=PROPAGATION,
               alive=b.daemon_alive, what="B to see the view")
    first = os.stat(qb.working / "c1").st_ino  # the name kept by B's kernel now
    os.rmdir(view)
    wait_until(lambda: not (qb.working / "c1").exists(), timeout=PROPAGATION,
               alive=b.daemon_alive, what="B to see the view removed")
    os.mkdir(view)
    wait_until(lambda: (qb.working / "c1").is_dir(), timeout=PROPAGATION,
               alive=b.daemon_alive, what="B to see the view made again")
    assert os.stat(qb.working / "c1").st_ino != first
    os.rmdir(q.path)  # (its state directories and empty views with it)
    wait_until(lambda: not (b.path / "q").exists(), timeout=PROPAGATION,
               alive=b.daemon_alive, what="B to see the queue removed")
    a.umount()
    b.umount()


def test_an_upload_written_on_one_host_is_refused_on_another(
        mounter: MountFactory, pg_url: str, tmp_path: Path) -> None:
    """Host B runs in a mount namespace of its own, where the directory of each host's
    uploads in progress is empty: as on another machine, host A's upload in ``partial/`` has
    no bytes on B. B may list it, but ``mv`` into ``ready/`` and ``cat`` are refused with
    EREMOTE and change nothing (they published an empty message); A publishes it whole."""
    a = mounter(pg_url, tmp_path / "a", extra=["--blobs", str(tmp_path / "shared-blobs")])
    q = Queue.create(a.path, "q", tmp_path / "scratch")
    ns = Namespace(tmp_path / "sbin", private=[default_local_base()])
    b, log = tmp_path / "b", tmp_path / "b.log"
    b.mkdir()
    try:
        res = ns.run(tmp_path / "sbin/spoolfs", pg_url, b, "--log-file", log)
        assert res.returncode == 0, f"host B's mount: {res.stderr}\n{log.read_text()}"
        ns.mountpoints.append(b)
        ns.daemons.append(daemon_pid(log))
        ns.ok("sh", "-c", f"echo mine > {b}/q/partial/own")  # B has uploads of its own
        data = b"written on host A\n" * 100
        (q.partial / "up").write_bytes(data)
        wait_until(lambda: ns.ok("ls", b / "q/partial").split() == ["own", "up"],
                   timeout=PROPAGATION, what="host B to list A's upload")
        for argv in (("mv", b / "q/partial/up", b / "q/ready/up"), ("cat", b / "q/partial/up")):
            res = ns.run(*argv)
            assert res.returncode != 0 and "Object is remote" in res.stderr, res
        assert ls(q.partial) == ["own", "up"] and ls(q.ready) == []
        ok("mv", q.partial / "up", q.ready / "up")
        assert read(q.ready / "up") == data
        wait_until(lambda: ns.run("cat", b / "q/ready/up").stdout == data.decode(),
                   timeout=PROPAGATION, what="host B to read the message A published")
    finally:
        ns.close()
    a.umount()
    fsck_clean(pg_url)


def test_a_role_that_does_not_own_the_database_runs_the_spool_with_the_readmes_grants(
        mounter: MountFactory, pg_url: str, tmp_path: Path) -> None:
    """The README's grants (every table; the sequences' USAGE) are all a role other than the
    database's owner needs once the first mount made the tables: publish, claim, finish, a
    restart's recovery (it reads the entries' sequence), a removal, fsck and gc. Without
    USAGE on the sequences the mount is one line that names the sequence."""
    owner = mounter(pg_url, tmp_path / "m0", extra=["--blobs", str(tmp_path / "blobs")])
    owner.umount()
    role = f"spool_{pg_url.rsplit('/', 1)[1]}"  # roles are the server's: one per test database
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute(f"CREATE ROLE {role} LOGIN")
        c.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        c.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}")
    url = pg_url.replace("postgres@", f"{role}@", 1)
    m = mounter(url, tmp_path / "m1")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    data = q.publish("a", os.urandom(10_000))
    q.publish("b", b"second")
    ok("mv", q.ready / "a", q.consumer("w1"))
    ok("mv", q.working / "w1/a", q.success)
    ok("mv", q.ready / "b", q.consumer("w1"))
    m.kill9()  # "b" stays claimed; the next mount recovers as this role
    m = mounter(url, tmp_path / "m1")
    assert ls(q.working / "w1") == ["b"] and read(q.success / "a") == data
    ok("rm", q.success / "a")
    assert ls(q.success) == []
    m.umount()
    fsck_clean(url)
    res = spoolfs_cli("gc", url, timeout=120)
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute(f"REVOKE USAGE ON ALL SEQUENCES IN SCHEMA public FROM {role}")
        c.execute(f"GRANT UPDATE ON ALL SEQUENCES IN SCHEMA public TO {role}")
    other = mounter(url, tmp_path / "m2", start=False)
    (tmp_path / "m2").mkdir()
    line = one_line_error(spoolfs_cli(*other.argv, timeout=60))
    assert "permission denied for sequence entries_id_seq" in line, line
