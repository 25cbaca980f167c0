"""The lifecycle of DESIGN §4 on a real mount: leases, attempts, retries with backoff, abandoned
messages, retention and queue policies, driven the way an operator and shell consumers do.

Leases are short (1-2 s, set with ``spoolfs queue set``); every wait polls with a generous
deadline. Times are compared only as recorded by the spool itself (``user.spool.history``,
``user.spool.lease_expires``, ``user.spool.retry_at``) or as lower bounds ("not before"), never
as "this was fast".
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import pytest

from helpers.inspection import blob_files, listxattr, ls, read, setxattr, xattr_text
from helpers.mounts import Mount, MountFactory
from helpers.procs import (
    Procs,
    cli,
    fails,
    finish_claimers,
    ok,
    one_line_error,
    spoolfs_cli,
    start_claimers,
    wait_open,
)
from helpers.queues import Queue, make_content
from helpers.waiting import patience, stretched, wait_until

pytestmark = pytest.mark.fuse

LEASE = 2  # seconds: the lease of most tests here
SLOW = 20.0  # deadline for anything the lifecycle timer does (it runs every 0.5 s)
PURGE = 40.0  # deadline for retention (swept every few seconds)
SPOOL = "user.spool."


# --------------------------------------------------------------------------- helpers


def set_policy(queue: Path, *assignments: str) -> dict[str, str]:
    """``spoolfs queue set QUEUE key=value...``; returns the policy it prints."""
    return parse_policy(cli("queue", "set", queue, *assignments))


def show_policy(*where: object) -> dict[str, str]:
    return parse_policy(cli("queue", "show", *where))


def parse_policy(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        assert eq, f"not a key=value line in the policy shown: {line!r}"
        out[key] = value
    return out


def when(stamp: str) -> float:
    """A spool timestamp (``2026-01-02T03:04:05.678Z``) as seconds since the epoch."""
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=timezone.utc).timestamp()


def xattr_time(path: Path, name: str) -> float:
    return when(xattr_text(path, SPOOL + name))


HISTORY_LINE = re.compile(
    r"^(\S+) (.+?) (\S+) -> (\S+) (?:uid=\S+ pid=\S+|by spoolfs)(?: \((.*)\))?$")


class Step:
    def __init__(self, line: str) -> None:
        m = HISTORY_LINE.match(line)
        assert m is not None, f"unexpected history line: {line!r}"
        self.at = when(m.group(1))
        self.action, self.src, self.dst, self.reason = m.group(2, 3, 4, 5)
        self.line = line

    def __repr__(self) -> str:
        return self.line


def history(path: Path) -> list[Step]:
    """The transitions ``user.spool.history`` lists, oldest first."""
    return [Step(line) for line in xattr_text(path, SPOOL + "history").splitlines() if line]


def actions(path: Path) -> list[str]:
    """The actions of a message's history after it was published."""
    steps = history(path)
    return [s.action for s in steps if "publish" not in s.action]


def steps_of(path: Path, action: str) -> list[Step]:
    return [s for s in history(path) if s.action == action]


def files(root: Path) -> list[str]:
    """Every message under a queue directory, as ``state[/consumer]/name``."""
    out = ok("find", root, "-type", "f", "-printf", "%P\\0")
    return sorted(os.fsdecode(n) for n in out.split(b"\0") if n)


def attrs(path: Path) -> set[str]:
    return listxattr(path, "^user\\.spool\\.")


def spool_attr(path: Path, key: str) -> str:
    return xattr_text(path, SPOOL + key)


def lifecycle_wait(predicate: Callable[[], object], what: str, mount: Mount,
                   timeout: float = SLOW) -> None:
    wait_until(predicate, timeout=timeout, what=what, alive=mount.daemon_alive)


def lifecycle_ran(mount: Mount, fresh_queue: Callable[[], Queue]) -> None:
    """Return once the lifecycle timer has run a round later than one lease of 1 s from now:
    anything due by now has been acted on. A sentinel claim must expire first, which a sleep
    could not promise on a loaded machine."""
    sentinel = fresh_queue()
    set_policy(sentinel.path, "lease_timeout=1s")
    sentinel.publish("sentinel")
    sentinel.claim("sentinel")
    lifecycle_wait(lambda: files(sentinel.path) == ["ready/sentinel"],
                   "a sentinel claim to expire (a later lifecycle round)", mount)


# --------------------------------------------------------------------------- 1. kill -9


def test_killed_consumer_lease_expires_back_to_ready(module_mount: Mount,
                                                     fresh_queue: Callable[[], Queue],
                                                     procs: Procs) -> None:
    """A consumer killed with ``kill -9`` while holding a claimed file: after the lease the file
    is back in ready/ (attempts 1), a new claim makes attempt 2, and the history tells the
    story. One that held the file open keeps it until it dies, then a lease longer."""
    q = fresh_queue()
    set_policy(q.path, f"lease_timeout={LEASE}s")
    data = q.publish("f")
    q.publish("g")
    q.consumer("c1")
    q.consumer("c2")

    # c1 claims and then sleeps, never touching the file again; c2 keeps g open while it sleeps
    c1 = procs.sh("mv ready/f working/c1/ && exec sleep 120", cwd=q.path)
    c2 = procs.sh("mv ready/g working/c2/ && exec 3<working/c2/g && exec sleep 120", cwd=q.path)
    lifecycle_wait(lambda: files(q.path) == ["working/c1/f", "working/c2/g"],
                   "both consumers to claim", module_mount)
    assert spool_attr(q.working / "c1/f", "attempts") == "1"
    assert spool_attr(q.working / "c1/f", "consumer") == "c1"
    g_first_lease = xattr_time(q.working / "c2/g", "lease_expires")
    wait_open(c2, q.working / "c2/g")

    ok("kill", "-9", str(c1.pid))
    c1.wait(timeout=patience(10))
    lifecycle_wait(lambda: "ready/f" in files(q.path),
                   "the dead consumer's file to come back to ready/", module_mount)
    f = q.ready / "f"
    assert files(q.path) == ["ready/f", "working/c2/g"], "the message must be in ready/ only"
    assert spool_attr(f, "attempts") == "1"
    assert spool_attr(f, "error") == "lease expired"
    assert spool_attr(f, "state") == "ready"
    assert f"{SPOOL}lease_expires" not in attrs(f)
    assert read(f) == data
    assert actions(f) == ["claim", "expire", "retry"]
    expire = steps_of(f, "expire")[0]
    assert (expire.src, expire.dst) == ("working/c1", "error")

    # g is held open by the sleeping c2: still claimed a good while after its first lease ended
    wait_until(lambda: time.time() > g_first_lease + 1.0, timeout=30, what="g's first lease end")
    assert files(q.path) == ["ready/f", "working/c2/g"], \
        "a file held open must keep its lease (DESIGN §4)"
    killed_at = time.time()  # the last close comes after this
    ok("kill", "-9", str(c2.pid))
    c2.wait(timeout=patience(10))
    lifecycle_wait(lambda: "ready/g" in files(q.path),
                   "the file of the killed holder to come back to ready/", module_mount)
    g_expire = steps_of(q.ready / "g", "expire")
    assert len(g_expire) == 1, history(q.ready / "g")
    assert g_expire[0].at >= killed_at + LEASE * 0.75, (
        "after the last close, the lease must count from the close "
        f"(killed at {killed_at:.3f}, expired at {g_expire[0].at:.3f})")

    # claimed again: attempt 2, and the history shows claim, expire, retry, claim
    q.claim("f", "c1")
    w = q.working / "c1/f"
    assert spool_attr(w, "attempts") == "2"
    assert actions(w) == ["claim", "expire", "retry", "claim"]
    shown = cli("history", w)  # the operator's view of the same story
    assert shown.splitlines() == xattr_text(w, SPOOL + "history").splitlines()
    q.finish("f", "c1")
    assert read(q.success / "f") == data


# --------------------------------------------------------------------------- 2. heartbeats


def test_touch_reads_and_open_files_keep_the_lease(module_mount: Mount,
                                                   fresh_queue: Callable[[], Queue],
                                                   procs: Procs, tmp_path: Path) -> None:
    """``touch`` (the shell heartbeat), repeated reads and an open descriptor each keep a claim
    for several lease lengths, while an idle claim expires; after the last close the lease runs
    a full timeout from the close."""
    q = fresh_queue()
    set_policy(q.path, f"lease_timeout={LEASE}s")
    content = {n: q.publish(n) for n in ("t", "r", "o", "idle")}
    q.consumer("c1")

    # Each holder claims its message itself, so its first heartbeat follows the claim at once
    # however loaded the machine is; the heartbeats go on until the test has finished t and r.
    stop = tmp_path / "stop"
    beats = 16  # 16 x 0.5 s = 4 lease lengths
    opened_at = time.time()
    toucher = procs.sh('mv ready/t working/c1/ || exit 1; i=0; '
                       'while [ $i -lt "$1" ] || [ ! -e "$2" ]; do '
                       'touch working/c1/t || exit 1; sleep 0.5; i=$((i+1)); done', beats, stop,
                       cwd=q.path)
    reader = procs.sh('mv ready/r working/c1/ || exit 1; i=0; '
                      'while [ $i -lt "$1" ] || [ ! -e "$2" ]; do '
                      'cat working/c1/r > /dev/null || exit 1; sleep 0.5; i=$((i+1)); done',
                      beats, stop, cwd=q.path)
    opener = procs.sh('mv ready/o working/c1/ || exit 1; exec 3<working/c1/o; sleep "$1"',
                      beats * 0.5, cwd=q.path)
    q.claim("idle", "c1")
    wait_open(opener, q.working / "c1/o")
    lifecycle_wait(lambda: {"working/c1/t", "working/c1/r"} <= set(files(q.path)),
                   "the toucher and the reader to claim", module_mount)
    claimed = {n: steps_of(q.working / "c1" / n, "claim")[0].at for n in ("t", "r", "o")}

    # the idle claim is not kept by anything: it leaves working/ after one lease
    lifecycle_wait(lambda: "ready/idle" in files(q.path), "the idle claim to expire",
                   module_mount)
    _, err = opener.communicate(timeout=patience(60))
    assert opener.returncode == 0, err.decode(errors="replace")
    closed_after = opened_at + beats * 0.5  # the sleep holding o open ended no earlier
    wait_until(lambda: time.time() - max(claimed.values()) > 3 * LEASE,
               what="three lease lengths since the last claim")

    for n in ("t", "r"):  # o's lease runs from its close now: checked below, by its history
        assert f"working/c1/{n}" in files(q.path), \
            f"{n} left working/ although its holder kept the lease"
        assert "expire" not in actions(q.working / "c1" / n), history(q.working / "c1" / n)
    assert spool_attr(q.ready / "idle", "error") == "lease expired"

    # The next heartbeats renew with a long lease, so finishing t and r below cannot race
    # their leases on a loaded machine.
    set_policy(q.path, "lease_timeout=1h")
    lifecycle_wait(lambda: all(xattr_time(q.working / "c1" / n, "lease_expires")
                               > time.time() + 600 for n in ("t", "r")),
                   "the heartbeats to renew with the new lease", module_mount)
    stop.touch()
    for p in (toucher, reader):
        _, err = p.communicate(timeout=patience(60))
        assert p.returncode == 0, f"heartbeat loop failed: {err.decode(errors='replace')}"

    # the touched and the read message finish normally
    for n in ("t", "r"):
        q.finish(n, "c1")
        assert read(q.success / n) == content[n]
        assert actions(q.success / n) == ["claim", "finish"]

    # o's last close came after `closed_after`: its lease runs a full timeout from then
    lifecycle_wait(lambda: "ready/o" in files(q.path),
                   "the closed file to expire a lease after its close", module_mount)
    (exp,) = steps_of(q.ready / "o", "expire")
    assert exp.at >= closed_after + LEASE * 0.75, (
        f"lease expired {exp.at - closed_after:+.2f}s after the last close; "
        f"it must run about {LEASE}s from the close")
    assert exp.at - claimed["o"] > 3 * LEASE


# --------------------------------------------------------------------------- 3. abandoned


def test_out_of_attempts_is_abandoned_until_redriven(module_mount: Mount,
                                                     fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    set_policy(q.path, "lease_timeout=1s", "max_attempts=2")
    data = q.publish("f")

    q.claim("f", "c1")
    lifecycle_wait(lambda: files(q.path) == ["ready/f"], "the first expiry and retry",
                   module_mount)
    assert spool_attr(q.ready / "f", "attempts") == "1"
    assert f"{SPOOL}abandoned" not in attrs(q.ready / "f")

    q.claim("f", "c2")
    assert spool_attr(q.working / "c2/f", "attempts") == "2"
    lifecycle_wait(lambda: files(q.path) == ["error/f"], "the last attempt to expire",
                   module_mount)
    e = q.error / "f"
    assert spool_attr(e, "abandoned") == "1"
    assert spool_attr(e, "error") == "lease expired"
    assert spool_attr(e, "attempts") == "2"
    assert f"{SPOOL}retry_at" not in attrs(e), "an abandoned message has no retry time"
    assert actions(e) == ["claim", "expire", "retry", "claim", "expire"]

    lifecycle_ran(module_mount, fresh_queue)  # an abandoned message stays
    assert files(q.path) == ["error/f"]
    assert actions(e) == ["claim", "expire", "retry", "claim", "expire"]
    assert spool_attr(e, "abandoned") == "1"

    # only an explicit redrive brings it back, with the attempts reset
    ok("mv", e, q.ready)
    r = q.ready / "f"
    assert files(q.path) == ["ready/f"]
    assert spool_attr(r, "attempts") == "0"
    assert f"{SPOOL}abandoned" not in attrs(r)
    assert actions(r)[-1] == "redrive"
    assert read(r) == data

    # the reset is real: one more expiry retries again instead of abandoning
    q.claim("f", "c1")
    assert spool_attr(q.working / "c1/f", "attempts") == "1"
    lifecycle_wait(lambda: files(q.path) == ["ready/f"],
                   "the redriven message to expire and retry (attempts were reset)",
                   module_mount)
    assert spool_attr(r, "attempts") == "1"
    assert actions(r)[-4:] == ["redrive", "claim", "expire", "retry"]


# --------------------------------------------------------------------------- 4. the fence

STALE_HOLDER = r"""
mv ready/f working/c1/ || exit 2
while [ ! -e "$1" ]; do sleep 0.05; done
mv working/c1/f success/
"""


def test_stale_holder_is_fenced_off(module_mount: Mount, fresh_queue: Callable[[], Queue],
                                    procs: Procs, tmp_path: Path) -> None:
    """The holder of an expired lease finds its file gone: its late ``mv … success/`` fails
    with ENOENT, and the message is finished exactly once, by the consumer that claimed it
    after the expiry."""
    q = fresh_queue()
    set_policy(q.path, "lease_timeout=1s")
    data = q.publish("f")
    q.consumer("c1")
    go = tmp_path / "go"
    stale = procs.sh(STALE_HOLDER, go, cwd=q.path)
    lifecycle_wait(lambda: files(q.path) == ["working/c1/f"], "c1 to claim", module_mount)
    lifecycle_wait(lambda: files(q.path) == ["ready/f"], "c1's lease to expire", module_mount)

    # c2's lease is not under test: long enough for the checks below on a loaded machine
    set_policy(q.path, "lease_timeout=1h")
    q.claim("f", "c2")
    go.touch()
    _, err = stale.communicate(timeout=patience(30))
    assert stale.returncode != 0, "the stale holder's mv to success/ must fail"
    assert "No such file or directory" in err.decode(errors="replace"), err
    fails("mv", q.working / "c1/f", q.error, message="No such file or directory")
    fails("cat", q.working / "c1/f", message="No such file or directory")
    fails("touch", q.working / "c1/f")  # and a late heartbeat cannot bring it back
    assert files(q.path) == ["working/c2/f"]

    q.finish("f", "c2")
    assert files(q.path) == ["success/f"], "finished exactly once"
    assert read(q.success / "f") == data
    steps = history(q.success / "f")
    assert [s.action for s in steps if s.action != "publish"] == \
        ["claim", "expire", "retry", "claim", "finish"]
    assert [(s.src, s.dst) for s in steps if s.action == "finish"] == [("working/c2", "success")]


# --------------------------------------------------------------------------- 5. retry_errors


def test_retry_errors_off_is_final_on_retries(module_mount: Mount,
                                              fresh_queue: Callable[[], Queue]) -> None:
    off, on = fresh_queue(), fresh_queue()
    assert show_policy(off.path)["retry_errors"] == "off", "retry_errors is off by default"
    set_policy(on.path, "retry_errors=on")
    for q in (off, on):
        q.publish("f")
        w = q.claim("f", "c1")
        setxattr(w, "user.spool.error", "bad input")  # setfattr, before the mv to error/
        q.finish("f", "c1", to="error")

    lifecycle_wait(lambda: files(on.path) == ["ready/f"],
                   "with retry_errors=on, a consumer's own failure to be retried", module_mount)
    r = on.ready / "f"
    assert spool_attr(r, "attempts") == "1"
    assert actions(r) == ["claim", "finish", "retry"]
    (fin,) = steps_of(r, "finish")
    assert (fin.src, fin.dst) == ("working/c1", "error")
    on.claim("f", "c1")
    assert spool_attr(on.working / "c1/f", "attempts") == "2"

    lifecycle_ran(module_mount, fresh_queue)
    e = off.error / "f"
    assert files(off.path) == ["error/f"], "with retry_errors off an explicit error is final"
    assert spool_attr(e, "error") == "bad input"
    assert spool_attr(e, "attempts") == "1"
    assert {f"{SPOOL}abandoned", f"{SPOOL}retry_at"}.isdisjoint(attrs(e)), attrs(e)
    assert actions(e) == ["claim", "finish"]


# --------------------------------------------------------------------------- 6. backoff


def test_retry_backoff_doubles_and_is_capped(module_mount: Mount,
                                             fresh_queue: Callable[[], Queue]) -> None:
    """retry_backoff=2s: the first failure waits about 2 s in error/ (user.spool.retry_at),
    the second about 4 s (or retry_backoff_max), the last attempt is abandoned."""
    q, capped = fresh_queue(), fresh_queue()
    common = ("retry_errors=on", "retry_backoff=2s", "max_attempts=3")
    set_policy(q.path, *common)
    set_policy(capped.path, *common, "retry_backoff_max=3s")
    queues = (q, capped)
    for x in queues:
        x.publish("f")

    x_retry: dict[Queue, float] = {}

    def fail_all() -> dict[Queue, float]:
        waits = {}
        for x in queues:
            x.claim("f", "c1")
            failed_at = time.time()
            x.finish("f", "c1", to="error")
            e = x.error / "f"
            retry_at = xattr_time(e, "retry_at")
            finish = steps_of(e, "finish")[-1]
            assert abs(retry_at - failed_at) < 60, "retry_at is far from now"
            waits[x] = retry_at - finish.at
            x_retry[x] = retry_at
        for x in queues:  # in error/ until its retry time
            if files(x.path) != ["error/f"]:
                assert time.time() >= x_retry[x], "left error/ before user.spool.retry_at"
        return waits

    def retried_after(waits: dict[Queue, float]) -> None:
        for x in queues:
            lifecycle_wait(lambda x=x: files(x.path) == ["ready/f"], "the retry", module_mount)
            r = x.ready / "f"
            retry = steps_of(r, "retry")[-1]
            finish = steps_of(r, "finish")[-1]
            assert retry.at - finish.at >= waits[x] - 0.01, (
                f"retried {retry.at - finish.at:.2f}s after the failure, before its "
                f"retry_at ({waits[x]:.2f}s)")
            assert f"{SPOOL}retry_at" not in attrs(r)

    first = fail_all()
    for x in queues:
        assert 1.9 <= first[x] <= 2.1, f"first backoff should be 2s, was {first[x]:.3f}s"
    retried_after(first)

    second = fail_all()
    assert 3.9 <= second[q] <= 4.1, f"second backoff should double to 4s, was {second[q]:.3f}s"
    assert 2.9 <= second[capped] <= 3.1, \
        f"retry_backoff_max=3s should cap the second backoff, was {second[capped]:.3f}s"
    retried_after(second)

    for x in queues:  # the third failure is the last attempt
        x.claim("f", "c1")
        x.finish("f", "c1", to="error")
        e = x.error / "f"
        assert spool_attr(e, "abandoned") == "1"
        assert spool_attr(e, "attempts") == "3"
        assert f"{SPOOL}retry_at" not in attrs(e)
        assert actions(e) == ["claim", "finish", "retry"] * 2 + ["claim", "finish"]
    lifecycle_ran(module_mount, fresh_queue)
    for x in queues:
        assert files(x.path) == ["error/f"], "an abandoned message stays in error/"


# --------------------------------------------------------------------------- 7. retention


def test_retention_purges_finished_messages_and_frees_content(
        module_mount: Mount, fresh_queue: Callable[[], Queue]) -> None:
    store = module_mount.store
    r, keep = fresh_queue(), fresh_queue()
    set_policy(r.path, "success_retention=2s", "error_retention=2s")
    big = {n: make_content(n, 100_000) for n in ("s1", "s2", "e1")}
    for n, data in big.items():
        r.publish(n, data)
        r.claim(n)
        r.finish(n, to="error" if n.startswith("e") else "success")
    for n, to in (("ks", "success"), ("ke", "error")):
        keep.publish(n)
        keep.claim(n)
        keep.finish(n, to=to)
    # s2's content is shared by a new upload in another queue (DESIGN §3: link into partial/)
    ok("ln", r.success / "s2", keep.partial / "copy")
    assert os.stat(r.success / "s2").st_nlink == 2
    for data in big.values():
        assert len(blob_files(store, data)) == 1

    lifecycle_wait(lambda: ls(r.success) == [] and ls(r.error) == [],
                   "success/ and error/ to be purged past their retention", module_mount,
                   timeout=PURGE)
    assert files(r.path) == []
    # with the default policy (keep forever) nothing is purged, though older
    assert files(keep.path) == ["error/ke", "partial/copy", "success/ks"]
    # content goes with its last reference; shared content stays readable
    assert blob_files(store, big["s1"]) == [] and blob_files(store, big["e1"]) == [], \
        "the content of purged messages must be freed"
    assert len(blob_files(store, big["s2"])) == 1
    assert os.stat(keep.partial / "copy").st_nlink == 1
    assert read(keep.partial / "copy") == big["s2"]
    ok("mv", keep.partial / "copy", keep.ready)
    keep.claim("copy")
    assert read(keep.working / "w1/copy") == big["s2"]


# --------------------------------------------------------------------------- 8. policies

DEFAULTS = {"lease_timeout": "10m", "max_attempts": "5", "retry_backoff": "0s",
            "retry_backoff_max": "1h", "retry_errors": "off", "success_retention": "forever",
            "error_retention": "forever", "fanout": "none", "duplicates": "allow",
            "duplicates_window": "7d", "max_age.partial": "none", "max_age.ready": "none",
            "max_age.working": "none", "max_error": "none", "max_working_per_consumer": "none",
            "min_free": "auto", "idle_views": "off"}


def test_queue_policies(mounter: MountFactory, store: Path, tmp_path: Path) -> None:
    """``spoolfs queue set|show``, the ``user.spool.policy*`` attributes, refusals that change
    nothing, ``--store`` on a mounted store, and a restart."""
    m = mounter(store, tmp_path / "mnt")
    q = Queue.create(m.path, "q", tmp_path / "scratch")
    assert show_policy(q.path) == DEFAULTS

    printed = set_policy(q.path, "lease_timeout=1h", "max_attempts=3", "retry_errors=on")
    want = {**DEFAULTS, "lease_timeout": "1h", "max_attempts": "3", "retry_errors": "on"}
    assert printed == want
    assert show_policy(q.path) == want
    assert show_policy("--store", store, "q") == want
    assert xattr_text(q.path, "user.spool.policy.lease_timeout") == "1h"
    assert xattr_text(q.path, "user.spool.policy.retry_errors") == "on"
    assert {f"user.spool.policy.{k}" for k in DEFAULTS} <= listxattr(q.path)

    bad_sets = [["bogus=1"], ["lease_timeout=soon"], ["lease_timeout=0"], ["max_attempts=0"],
                ["max_attempts=many"], ["retry_errors=maybe"], ["lease_timeout"],
                ["max_attempts=4", "lease_timeout=x"]]  # one bad value: nothing applied
    for bad in bad_sets:
        line = one_line_error(spoolfs_cli("queue", "set", str(q.path), *bad))
        assert line, bad
        assert show_policy(q.path) == want, f"`spoolfs queue set {bad}` changed something"
    one_line_error(spoolfs_cli("queue", "set", str(q.ready), "lease_timeout=1s"))
    one_line_error(spoolfs_cli("queue", "set", "--store", str(store), "q", "lease_timeout=soon"))
    one_line_error(spoolfs_cli("queue", "set", "--store", str(store), "nosuch",
                               "lease_timeout=1s"))
    fails("setfattr", "-n", "user.spool.policy.lease_timeout", "-v", "soon", q.path,
          message="Invalid argument")
    fails("setfattr", "-n", "user.spool.policy", "-v", "max_attempts=4 retry_errors=maybe",
          q.path, message="Invalid argument")
    fails("setfattr", "-n", "user.spool.policy.bogus", "-v", "1", q.path)
    assert show_policy(q.path) == want
    assert show_policy("--store", store, "q") == want

    # --store writes to the store under the running mount, which picks it up by itself
    assert parse_policy(cli("queue", "set", "--store", store, "q", "lease_timeout=1s")) == \
        {**want, "lease_timeout": "1s"}
    wait_until(lambda: xattr_text(q.path, "user.spool.policy.lease_timeout") == "1s",
               timeout=10, what="the mount to see a policy set with --store",
               alive=m.daemon_alive)
    data = q.publish("f")
    w = q.claim("f")
    lease = xattr_time(w, "lease_expires") - steps_of(w, "claim")[0].at
    assert 0.9 <= lease <= 1.1, f"a claim after the change got a {lease:.2f}s lease, not 1s"
    wait_until(lambda: files(q.path) == ["ready/f"], timeout=SLOW, alive=m.daemon_alive,
               what="the 1s lease set with --store to expire")

    # one key through its own attribute, as setfattr does it
    ok("setfattr", "-n", "user.spool.policy.lease_timeout", "-v", "2s", q.path)
    want = {**want, "lease_timeout": "2s"}
    assert show_policy(q.path) == want

    # a restart keeps the policies, and a lease taken before it still runs out after it
    w = q.claim("f")
    assert spool_attr(w, "attempts") == "2"
    m.restart()
    assert show_policy(q.path) == want
    assert show_policy("--store", store, "q") == want
    assert xattr_text(q.path, "user.spool.policy.max_attempts") == "3"
    wait_until(lambda: files(q.path) == ["ready/f"], timeout=SLOW, alive=m.daemon_alive,
               what="a lease taken before the restart to expire after it")
    assert actions(q.ready / "f") == ["claim", "expire", "retry"] * 2
    assert read(q.ready / "f") == data


@pytest.mark.parametrize("digits", ["\u00b2", "\u2460"])  # '²' and '①': str.isdigit(), not int()
def test_policy_refuses_odd_digits_in_one_line(module_mount: Mount,
                                               fresh_queue: Callable[[], Queue],
                                               digits: str) -> None:
    """A bad value is a bad value, whatever its characters: one line from ``spoolfs queue set``
    (DESIGN §9), EINVAL from ``setfattr`` (never an internal error: EIO), nothing changed."""
    q = fresh_queue()
    before = show_policy(q.path)
    one_line_error(spoolfs_cli("queue", "set", str(q.path), f"max_attempts={digits}"))
    one_line_error(spoolfs_cli("queue", "set", "--store", str(module_mount.store), q.name,
                               f"max_attempts={digits}"))
    fails("setfattr", "-n", "user.spool.policy.max_attempts", "-v", digits, q.path,
          message="Invalid argument")
    assert show_policy(q.path) == before


# --------------------------------------------------------------------------- 9. two daemons


def test_two_daemons_expire_each_lease_once(mounter: MountFactory, store: Path,
                                            tmp_path: Path, procs: Procs) -> None:
    """Both daemons of one store run the lifecycle timer: every expired claim moves exactly
    once, and a file held open through one mount is not expired by the other."""
    a = mounter(store, tmp_path / "a")
    b = mounter(store, tmp_path / "b")
    qa = Queue.create(a.path, "q", tmp_path / "scratch")
    qb = Queue(b.path / "q", tmp_path / "scratch")
    set_policy(qa.path, f"lease_timeout={LEASE}s", "max_attempts=2")
    wait_until(lambda: (b.path / "q").is_dir()
               and xattr_text(qb.path, "user.spool.policy.lease_timeout") == f"{LEASE}s",
               timeout=10, what="mount B to see the queue's policy", alive=b.daemon_alive)

    names = [f"m{i:03d}" for i in range(40)]
    src = tmp_path / "src"
    src.mkdir()
    for n in names:
        (src / n).write_bytes(n.encode() + b"\n")
    ok("cp", "-t", qa.partial, *(src / n for n in names))
    ok("mv", "-t", qa.ready, *(qa.partial / n for n in names))
    consumers = [f"c{i}" for i in range(4)]
    for c in [*consumers, "holder"]:
        qa.consumer(c)
    wait_until(lambda: ls(qb.ready) == names and ls(qb.working) == sorted([*consumers, "holder"]),
               timeout=10, what="mount B to see the messages and consumers", alive=b.daemon_alive)

    # a file claimed and kept open through mount A for several leases
    qa.publish("held")
    qa.claim("held", "holder")
    stop = tmp_path / "stop"
    holder = procs.sh('exec 3<working/holder/held; while [ ! -e "$1" ]; do sleep 0.1; done',
                      stop, cwd=qa.path)
    wait_open(holder, qa.working / "holder/held")

    def alive() -> None:
        a.daemon_alive()
        b.daemon_alive()

    def settled() -> bool:
        seen = [files(q.path) for q in (qa, qb)]
        return seen[0] == seen[1] and \
            not any(f.startswith("working/") and f != "working/holder/held" for f in seen[0])

    won: Counter[str] = Counter()
    for rnd, dirs in enumerate(([qa.path, qb.path], [qb.path, qa.path])):
        claims = finish_claimers(start_claimers(dirs, consumers, tmp_path / f"logs{rnd}"))
        won.update(n for c in consumers for n in claims[c])
        # the consumers are gone; their claims expire (round 1: retried; round 2: abandoned)
        wait_until(settled, timeout=SLOW + 10, alive=alive,
                   what=f"round {rnd + 1}'s claims to expire on both mounts")

    wait_until(lambda: files(qa.path) == sorted([f"error/{n}" for n in names]
                                                 + ["working/holder/held"])
               and files(qb.path) == files(qa.path),
               timeout=SLOW, alive=alive, what="every message abandoned in error/")
    for n in names:
        e = qa.error / n
        assert actions(e) == ["claim", "expire", "retry", "claim", "expire"], \
            f"{n}: {history(e)}"
        assert spool_attr(e, "attempts") == "2"
        assert spool_attr(e, "abandoned") == "1"
        assert read(e) == n.encode() + b"\n"
    assert ls(qa.ready) == [] and ls(qb.ready) == []
    assert won == Counter({n: 2 for n in names}), \
        f"each message is claimed once per attempt: {won - Counter({n: 2 for n in names})}"

    held = qa.working / "holder/held"
    assert "expire" not in actions(held), \
        f"a file held open through mount A was expired: {history(held)}"
    ok("mv", qb.working / "holder/held", qb.success)
    stop.touch()
    _, err = holder.communicate(timeout=patience(30))
    assert holder.returncode == 0, err.decode(errors="replace")
    wait_until(lambda: ls(qa.success) == ["held"], timeout=10, alive=alive,
               what="mount A to see the finish")


# --------------------------------------------------------------------------- 10. name taken


def test_expiry_onto_a_taken_name_loses_nothing(module_mount: Mount,
                                                fresh_queue: Callable[[], Queue]) -> None:
    """An automatic move never replaces a message: an expiry into error/ or a retry into
    ready/ that finds its name taken uses ``name.~N~``."""
    def attempt(lease: float) -> bool:
        """False when the set-up (which must come before either lease ends) took longer."""
        q, r = fresh_queue(), fresh_queue()
        set_policy(q.path, f"lease_timeout={lease:g}s", "max_attempts=1")
        set_policy(r.path, f"lease_timeout={lease:g}s")
        start = time.time()  # no lease below ends before start + lease
        try:
            # q: error/f is taken (a consumer's own failure) when the other f's lease runs out
            first = q.publish("f", b"first\n")
            q.claim("f", "c1")
            second = q.publish("f", b"second\n")
            q.claim("f", "c2")
            q.finish("f", "c2", to="error")
            # r: ready/f is taken by a newer message when the claimed f comes back
            old = r.publish("f", b"old\n")
            r.claim("f", "c1")
            new = r.publish("f", b"new\n")
            assert files(q.path) == ["error/f", "working/c1/f"]
        except AssertionError:
            if time.time() >= start + lease:
                return False
            raise
        if time.time() >= start + lease:
            return False

        lifecycle_wait(lambda: "working/c1/f" not in files(q.path) + files(r.path),
                       "both leases to expire", module_mount)
        lifecycle_wait(lambda: files(r.path) == ["ready/f", "ready/f.~1~"],
                       "the expired message to come back under a free name", module_mount)
        assert files(q.path) == ["error/f", "error/f.~1~"]
        assert read(q.error / "f") == second, "the existing error/f must not be replaced"
        assert read(q.error / "f.~1~") == first
        assert spool_attr(q.error / "f.~1~", "abandoned") == "1"
        assert spool_attr(q.error / "f.~1~", "error") == "lease expired"
        assert actions(q.error / "f.~1~") == ["claim", "expire"]

        assert read(r.ready / "f") == new
        assert read(r.ready / "f.~1~") == old
        assert spool_attr(r.ready / "f.~1~", "attempts") == "1"
        assert actions(r.ready / "f.~1~") == ["claim", "expire", "retry"]
        return True

    stretched(1.0, attempt, what="claims, a publish and a finish within one lease")


def test_idle_empty_views_are_removed(module_mount: Mount,
                                      fresh_queue: Callable[[], Queue]) -> None:
    """``idle_views``: the views of consumers that went away do not stay in status forever;
    a view holding a claim, or one claimed into lately, stays."""
    q = fresh_queue()
    res = spoolfs_cli("queue", "set", str(q.path), "idle_views=2s")
    assert res.returncode == 0, res.stderr
    gone, busy = q.consumer("gone"), q.consumer("busy")
    q.publish("job")
    q.claim("job", "busy")
    wait_until(lambda: not gone.exists(), timeout=patience(30),
               what="the idle, empty view to be removed")
    assert busy.is_dir() and os.listdir(busy) == ["job"]
    assert re.search(rf"consumer view {q.path.name}/working/gone removed: empty, no claim in "
                     r"or out for \d+s", module_mount.log_text())
    q.consumer("gone")  # a consumer that comes back makes its view again
    assert gone.is_dir()
    snap = json.loads((module_mount.path / ".spool" / "status").read_bytes())
    assert "busy" in snap["queues"][q.path.name]["consumers"]
