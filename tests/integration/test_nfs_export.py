"""A spool exported over NFS (``-o nfs_export``) by nfs-ganesha, used by NFS clients (libnfs,
NFSv3 and v4) next to local consumers: publish by rename and by create, claims exactly once,
leases kept only by what a client does, and a daemon restart under the export."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.devices import anonymous_minor, mount_with_device, mount_without_device
from helpers.mounts import Mount, MountFactory, mounting
from helpers.nfs import NfsServer
from helpers.nfsclient import NfsClient
from helpers.procs import process_exited, spoolfs_cli
from helpers.queues import Queue
from helpers.waiting import patience, wait_until

pytestmark = pytest.mark.fuse

#: messages published over NFS by rename, and as many by create (SPOOLFS_NFS_FILES)
FILES = int(os.environ.get("SPOOLFS_NFS_FILES", "300"))


@pytest.fixture
def exported(mounter: MountFactory, tmp_path: Path) -> Iterator[tuple[Mount, NfsServer, Queue]]:
    m = mounter(tmp_path / "store", tmp_path / "mnt", extra=["-o", "nfs_export"])
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    server = NfsServer(m.path, tmp_path / "ganesha").start()
    try:
        yield m, server, q
    finally:
        server.close()


def _body(name: str) -> bytes:
    return (name + "\n").encode() * 50


def _fsck_clean(m: Mount) -> None:
    res = spoolfs_cli("fsck", str(m.store))
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()


@pytest.mark.parametrize("version", [3, 4])
def test_publish_by_rename_and_by_create_appear_at_once(
        exported: tuple[Mount, NfsServer, Queue], version: int) -> None:
    m, server, q = exported
    c = server.client(version)
    try:
        c.write_file("q/partial/renamed", _body("renamed"))
        c.rename("q/partial/renamed", "q/ready/renamed")
        assert (q.ready / "renamed").read_bytes() == _body("renamed")  # at once, whole
        c.write_file("q/ready/created", _body("created"))
        assert (q.ready / "created").read_bytes() == _body("created")
        assert sorted(os.listdir(q.ready)) == ["created", "renamed"]
        assert sorted(c.listdir("q/ready")) == ["created", "renamed"]
        res = spoolfs_cli("status", str(m.path), "--json")
        assert b'"count": 2' in res.stdout
    finally:
        c.close()
    _fsck_clean(m)


def test_an_unsynced_create_is_no_ghost(exported: tuple[Mount, NfsServer, Queue]) -> None:
    """A create the client was told succeeded appears whole once the server lets go of it;
    never an empty message the client was told failed."""
    m, server, q = exported
    c = server.client(3)
    try:
        c.write_file("q/ready/late", _body("late"), sync=False)
    finally:
        c.close()
    wait_until(lambda: (q.ready / "late").exists(), timeout=30,
               what="the server to close its descriptor and the create to appear")
    assert (q.ready / "late").read_bytes() == _body("late")


def _consume(claim: object, name: str, log: list[tuple[str, str, bytes]],
             stop: threading.Event) -> None:
    """The seed's loop: list ready/, test each name with ``[ -e ]``, claim it by rename into
    the own view, read it, work on it, finish it; until ready/ is empty or ``stop`` is set.
    ``claim`` is an NfsClient or a local mount path."""
    if isinstance(claim, NfsClient):
        c = claim
        c.mkdir(f"q/working/{name}")
        listdir, exists, rename, read = c.listdir, c.exists, c.rename, c.read_file
        base = ""
    else:
        base = f"{claim}/"
        os.mkdir(f"{base}q/working/{name}")
        listdir, exists, rename = os.listdir, os.path.exists, os.rename

        def read(p: str) -> bytes:
            with open(p, "rb") as f:
                return f.read()
    order = random.Random(name)
    while not stop.is_set():
        try:
            names = listdir(f"{base}q/ready")
        except FileNotFoundError:
            continue  # over NFS: a name the server was listing was claimed meanwhile
        if not names:
            return
        order.shuffle(names)  # consumers meet on some names, not on every one
        for n in names:
            if stop.is_set():
                return
            if not exists(f"{base}q/ready/{n}"):
                continue  # another consumer took it since the listing
            try:
                rename(f"{base}q/ready/{n}", f"{base}q/working/{name}/{n}")
            except OSError as e:
                if e.errno == errno.ENOENT:
                    continue  # another consumer won it
                raise
            log.append((name, n, read(f"{base}q/working/{name}/{n}")))
            time.sleep(0.002)  # the work: a local consumer would otherwise take everything
            rename(f"{base}q/working/{name}/{n}", f"{base}q/success/{n}")


def _run_consumers(consumers: list[tuple[object, str]],
                   log: list[tuple[str, str, bytes]], ready: Path) -> list[BaseException]:
    """Run ``_consume`` for each (NfsClient or mount path, name) in a thread of its
    own until all return. Consumers still running once nothing was claimed for a while are
    stopped and reported (a listing that kept showing claimed names spun for ever). The
    clients are closed then, but never one whose thread may still use it."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def run(who: object, name: str) -> None:
        try:
            _consume(who, name, log, stop)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=c, name=c[1]) for c in consumers]
    for t in threads:
        t.start()
    claimed, since = -1, time.monotonic()
    while any(t.is_alive() for t in threads):
        time.sleep(0.2)
        waiting = len(os.listdir(ready))
        if len(log) != claimed:
            claimed, since = len(log), time.monotonic()
        elif time.monotonic() - since > patience(20 if not waiting else 60):
            left = [t.name for t in threads if t.is_alive()]
            errors.append(AssertionError(
                f"nothing claimed for {time.monotonic() - since:.0f} s with {waiting} "
                f"message(s) in ready/; still running: {left}"))
            stop.set()
            break
    stuck = _join(threads)
    errors += [AssertionError(f"{name} is stuck in a call to the server") for name in stuck]
    for who, name in consumers:
        if isinstance(who, NfsClient) and name not in stuck:
            who.close()
    return errors


def _join(threads: list[threading.Thread]) -> list[str]:
    """Wait for ``threads``; the names of those still running (stuck: their NfsClient must
    not be closed under them)."""
    for t in threads:
        t.join(timeout=patience(60))  # a libnfs call gives up after its 20 s timeout
    return [t.name for t in threads if t.is_alive()]


def test_claims_are_exactly_once_over_nfs_and_local(
        exported: tuple[Mount, NfsServer, Queue]) -> None:
    m, server, q = exported
    producer3, producer4 = server.client(3), server.client(4)
    try:
        for i in range(FILES):
            producer3.write_file(f"q/partial/r{i:05d}", _body(f"r{i:05d}"))
            producer3.rename(f"q/partial/r{i:05d}", f"q/ready/r{i:05d}")
            producer4.write_file(f"q/ready/c{i:05d}", _body(f"c{i:05d}"))
    finally:
        producer3.close()
        producer4.close()
    expected = {f"{k}{i:05d}" for i in range(FILES) for k in "rc"}
    assert set(os.listdir(q.ready)) == expected  # none invisible, no ghost
    log: list[tuple[str, str, bytes]] = []
    consumers: list[tuple[object, str]] = [
        (server.client(v), f"nfs{i}") for i, v in enumerate((3, 4, 3, 4))]
    consumers += [(m.path, f"local{i}") for i in range(2)]
    errors = _run_consumers(consumers, log, q.ready)
    assert not errors, errors
    claimed = Counter(n for _, n, _ in log)
    assert set(claimed) == expected and max(claimed.values()) == 1
    assert all(data == _body(n) for _, n, data in log)
    assert {who[:3] for who, _, _ in log} == {"nfs", "loc"}, "both kinds of consumer claimed"
    assert set(os.listdir(q.path / "success")) == expected
    assert os.listdir(q.ready) == []
    assert all(os.listdir(v) == [] for v in (q.working / d for d in os.listdir(q.working)))
    _fsck_clean(m)


def test_listings_over_nfs_follow_claims_made_here(
        exported: tuple[Mount, NfsServer, Queue]) -> None:
    """NFS clients list ready/ and try every name while a local consumer claims them all,
    in order, as fast as it goes: once ready/ is empty, every client lists it empty
    (nfs-ganesha's listing cache kept some names claimed under it for good, so a consumer
    listing them spun for ever: mount-examples/ganesha.conf). Three rounds."""
    m, server, q = exported
    clients = [server.client(v) for v in (3, 4, 3, 4)]
    for i, c in enumerate(clients):
        c.mkdir(f"q/working/nfs{i}")
    os.mkdir(q.working / "local")
    stuck: list[str] = []
    try:
        for rnd in range(3):
            _claim_round(q, clients, rnd, stuck)
    finally:
        if not stuck:
            for c in clients:
                c.close()
    _fsck_clean(m)


def _claim_round(q: Queue, clients: list[NfsClient], rnd: int, stuck: list[str]) -> None:
    """One round of the test above: 600 published here and claimed here, in order, while
    the clients list ready/ and try every name; then every client lists ready/ empty."""
    names = [f"m{rnd}-{i:04d}" for i in range(2 * FILES)]
    for n in names:
        (q.partial / n).write_bytes(_body(n))
        os.rename(q.partial / n, q.ready / n)
    stop = threading.Event()
    errors: list[BaseException] = []

    def tries(i: int, c: NfsClient) -> None:
        try:
            while not stop.is_set():
                try:
                    listed = c.listdir("q/ready")
                except FileNotFoundError:
                    continue  # the listing met a name claimed meanwhile: list again
                for n in listed:
                    if stop.is_set():
                        return
                    if c.exists(f"q/ready/{n}"):
                        with contextlib.suppress(FileNotFoundError):
                            c.rename(f"q/ready/{n}", f"q/working/nfs{i}/{n}")
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=tries, args=(i, c), name=f"nfs{i}")
               for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for n in names:
        with contextlib.suppress(FileNotFoundError):
            os.rename(q.ready / n, q.working / "local" / n)
    stop.set()
    stuck += _join(threads)
    assert not stuck, f"{stuck} stuck in a call to the server"
    assert not errors, errors
    assert os.listdir(q.ready) == []
    seen = {f"v{c.version}#{i}": c.listdir("q/ready") for i, c in enumerate(clients)}
    assert all(v == [] for v in seen.values()), {k: len(v) for k, v in seen.items()}
    claimed = [n for d in os.listdir(q.working) for n in os.listdir(q.working / d)
               if n.startswith(f"m{rnd}-")]
    assert sorted(claimed) == names  # each exactly once


def test_the_claim_of_a_client_that_stops_expires(exported: tuple[Mount, NfsServer, Queue]
                                                  ) -> None:
    """The server keeps a descriptor on what a client read: that holds no lease. A client
    that touches its claim keeps it; one that stops loses it within its lease."""
    m, server, q = exported
    res = spoolfs_cli("queue", "set", str(q.path), "lease_timeout=3s")
    assert res.returncode == 0, res.stderr
    q.publish("kept")
    q.publish("dropped")
    keeper, quitter = server.client(4), server.client(3)
    keeper.mkdir("q/working/keeper")
    quitter.mkdir("q/working/quitter")
    keeper.rename("q/ready/kept", "q/working/keeper/kept")
    quitter.rename("q/ready/dropped", "q/working/quitter/dropped")
    assert quitter.read_file("q/working/quitter/dropped").startswith(b"dropped")
    quitter.close()  # the client stops; the server may still hold the file open
    end = time.monotonic() + 8
    while time.monotonic() < end:  # more than two leases
        keeper.touch("q/working/keeper/kept")
        time.sleep(0.5)
    assert os.listdir(q.working / "keeper") == ["kept"]
    assert "dropped" not in os.listdir(q.working / "quitter")
    keeper.close()
    # expired into error/, and back in ready/ for a retry (no backoff) soon after
    dropped = q.ready / "dropped"
    if not dropped.exists():
        dropped = q.path / "error" / "dropped"
    history = spoolfs_cli("history", str(dropped)).stdout.decode()
    assert "lease expired" in history, history


def test_a_daemon_restart_under_the_export(exported: tuple[Mount, NfsServer, Queue],
                                          tmp_path: Path) -> None:
    """kill -9 of the daemon: clients get errors. In the README's order (stop the NFS server,
    ``spoolfs umount``, which detaches the dead mount, mount again, start the server) the same
    client goes on with the file handles it had, when the new mount has the old one's device
    number (helpers/devices.py: the suite's other mounts are kept from taking it)."""
    m, server, q = exported
    minor = anonymous_minor(m.path)
    c = server.client(3)
    try:
        c.write_file("q/ready/before", _body("before"))
        pid = m.pid
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: process_exited(pid), timeout=10, what="the daemon to die")
        with pytest.raises(OSError):
            c.listdir("q/ready")
        server.stop()
        with mounting(alone=True):  # no other mount of the suite moves the numbers meanwhile
            res = spoolfs_cli("umount", str(m.path))
            assert res.returncode == 0 and b"detached" in res.stdout, res.stderr
            since = mount_with_device(m, minor, tmp_path / "held")
        server.start()
        assert wait_until(lambda: _listing(c, "q/ready"), timeout=30,
                          what="the client to see the spool again") == ["before"]
        assert c.read_file("q/ready/before") == _body("before")
        c.write_file("q/ready/after", _body("after"))
        assert sorted(os.listdir(q.ready)) == ["after", "before"]
        assert "device number" not in m.log_text(since) and not m.last_stderr
    finally:
        c.close()
    _fsck_clean(m)


def test_a_restart_on_another_device_number_is_logged(
        exported: tuple[Mount, NfsServer, Queue], tmp_path: Path) -> None:
    """When the spool's new mount gets another device number (another mount took the old
    one meanwhile), the clients' old handles are stale: the daemon says so in its log and
    ``spoolfs`` on its stderr, and a client that mounts again works."""
    m, server, q = exported
    minor = anonymous_minor(m.path)
    old = server.client(3)
    try:
        old.write_file("q/ready/before", _body("before"))
        server.stop()
        m.umount()
        since = m.log_size()
        mount_without_device(m, minor, tmp_path / "held")
        server.start()
        line = wait_until(lambda: next((ln for ln in m.log_text(since).splitlines()
                                        if "device number" in ln), None),
                          timeout=10, what="the warning in the daemon's log")
        assert "WARNING" in line and f"0:{minor}" in line and "mount again" in line, line
        # and at the terminal of whoever mounted it
        assert "spoolfs: warning: nfs_export: the device number" in m.last_stderr, m.last_stderr
        new = server.client(3)
        try:
            assert wait_until(lambda: _listing(new, "q/ready"), timeout=30,
                              what="a new client to see the spool") == ["before"]
        finally:
            new.close()
        assert _listing(old, "q/ready") is None  # its handles are stale
    finally:
        old.close()
    _fsck_clean(m)


def _listing(c: NfsClient, path: str) -> list[str] | None:
    try:
        return sorted(c.listdir(path))
    except OSError:
        return None


def test_removed_names_can_be_created_again_over_nfs4(
        exported: tuple[Mount, NfsServer, Queue]) -> None:
    """Messages finished and removed (locally, or by the client) free their names: an NFSv4
    client that created them creates them again (the server must not answer with the removed entries' handles,
    NFS4ERR_STALE)."""
    m, server, q = exported
    names = [f"again{i:02d}" for i in range(20)]
    c = server.client(4)
    try:
        for round_ in range(3):
            for n in names:
                c.write_file(f"q/ready/{n}", _body(f"{n}.{round_}"))
            assert sorted(c.listdir("q/ready")) == names
            os.mkdir(q.working / f"local{round_}")
            for n in names:
                os.rename(q.ready / n, q.working / f"local{round_}" / n)
                assert (q.working / f"local{round_}" / n).read_bytes() == _body(f"{n}.{round_}")
                os.rename(q.working / f"local{round_}" / n, q.path / "success" / n)
                if round_ % 2:
                    c.unlink(f"q/success/{n}")  # removed by the client that made it
                else:
                    os.unlink(q.path / "success" / n)
            assert c.listdir("q/ready") == [] and c.listdir("q/success") == []
    finally:
        c.close()
    _fsck_clean(m)
