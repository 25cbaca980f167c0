"""The dataflow patterns of DESIGN §5 on a real mount: subscribers (fan-out), hard links sharing
one blob, and the duplicates policy, driven with real ``mv``/``cp``/``ln``/``rm``/``ls``/``stat``/
``getfattr`` processes.

- A publish into a topic (a queue with ``fanout=a,b,c``) lands in every subscriber's ``ready/``
  and the topic's ``success/`` in one transaction: a watcher listing the subscribers one after
  the other never sees a message in some of them and not in the others, and ``kill -9`` of the
  daemon mid-load leaves every message in all of them or in none.
- Chains fan out recursively; a cycle is refused when set; a missing subscriber refuses the
  whole publish (ENXIO), with nothing changed (``mv``) or the upload back in ``partial/`` (``cp``).
- ``ln`` into ``partial/`` or ``ready/`` makes a message sharing the content: a thousand links of
  a 10 MiB file use 10 MiB of store, ``st_nlink`` counts the messages sharing it, and the blob
  goes with the last of them.
- ``duplicates=allow|reject|skip`` and ``duplicates_window``.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers.inspection import expect_errno, ls, read, setxattr, sha256, snapshot, xattr_text
from helpers.mounts import Mount, MountFactory
from helpers.procs import consumed_names, fails, ok, one_line_error, run, spoolfs_cli
from helpers.queues import Queue, make_content
from helpers.waiting import patience, stretched, wait_until

pytestmark = pytest.mark.fuse

ENXIO_TEXT = "No such device or address"
EEXIST_TEXT = "File exists"
# GNU mv 9.1 tries renameat2(RENAME_NOREPLACE); on EEXIST it stats the destination and, when
# that says ENOENT (a rejected duplicate has no file of that name), sometimes judges by an
# uninitialised stat buffer and prints this instead of retrying (22 of 300 tries here).
MV_EEXIST_ARTEFACT = re.compile(r"cannot overwrite directory .* with non-directory")
CYCLE = re.compile(r"fanout would make a cycle: (\S+(?: -> \S+)+)$")


# --------------------------------------------------------------------------- helpers


def set_policy(queue: Queue | Path, *assignments: str) -> str:
    """``spoolfs queue set QUEUE_DIR key=value...`` that must succeed; its stdout."""
    path = queue.path if isinstance(queue, Queue) else queue
    res = spoolfs_cli("queue", "set", str(path), *assignments)
    assert res.returncode == 0, (f"`spoolfs queue set {path} {' '.join(assignments)}` exited "
                                 f"{res.returncode}: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout.decode()


def refused_as_duplicate(src: Path, dst: Path) -> None:
    """``mv SRC DST`` is refused as a duplicate: mv fails, says so, and the rename itself
    answers exactly EEXIST (checked with one ``rename(2)``, since mv may garble the message)."""
    res = run(["mv", src, dst])
    err = res.stderr.decode(errors="replace")
    assert res.returncode != 0, f"`mv {src} {dst}` of a rejected duplicate succeeded"
    assert EEXIST_TEXT in err or MV_EEXIST_ARTEFACT.search(err), \
        f"`mv {src} {dst}` failed, but not with EEXIST: {err.strip()}"
    expect_errno(errno.EEXIST, os.rename, src, dst)


def policy_of(queue: Queue) -> dict[str, str]:
    res = spoolfs_cli("queue", "show", str(queue.path))
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    return dict(line.partition("=")[::2] for line in res.stdout.decode().splitlines() if line)


def nlink(path: Path) -> int:
    """``stat -c %h``: the link count a user sees."""
    return int(ok("stat", "-c", "%h", "--", path).decode().strip())


def headers(directory: Path, names: list[str] | None = None) -> dict[str, dict[str, str]]:
    """The user headers (``user.*`` other than ``user.spool.*``) of the messages in
    ``directory``, as ``getfattr -d`` prints them: ``{message name: {attribute: value}}``."""
    names = ls(directory) if names is None else names
    if not names:
        return {}
    out = ok("getfattr", "--absolute-names", "-d", "-m", r"^user\.",
             *[str(directory / n) for n in names]).decode()
    result: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in out.splitlines():
        if line.startswith("# file: "):
            current = result.setdefault(os.path.basename(line[len("# file: "):]), {})
        elif line and current is not None:
            key, _, value = line.partition("=")
            if not key.startswith("user.spool."):
                current[key] = value
    for n in names:
        result.setdefault(n, {})
    return result


def history_actions(path: Path) -> list[str]:
    """The action of every line of ``user.spool.history`` (``TIME ACTION SRC -> DST ...``)."""
    lines = xattr_text(path, "user.spool.history").splitlines()
    return [line.split(" ")[1] for line in lines if line.strip()]


def du_k(path: Path) -> int:
    """``du -sk``: KiB of disk the directory uses."""
    return int(ok("du", "-sk", path).split()[0])


def blob_files(store: Path) -> list[Path]:
    return sorted(p for p in (store / "blobs").rglob("*") if p.is_file())


class Watch:
    """A thread that lists ``dirs`` one after the other, over and over, and records every
    snapshot in which a name listed earlier is missing from a directory listed later (with
    nobody consuming, an all-or-none publish never shows that), and every non-empty listing of
    ``empty`` (a topic's ready/, which its messages leave in the same transaction)."""

    def __init__(self, dirs: list[Path], empty: Path | None = None) -> None:
        self.dirs = dirs
        self.empty = empty
        self.snapshots = 0
        self.sizes: set[tuple[int, ...]] = set()
        self.violations: list[str] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fanout-watch", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=patience(30))
        assert not self._thread.is_alive(), "the watcher thread did not stop"

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                listed = [set(os.listdir(d)) for d in self.dirs]
                if self.empty is not None:
                    stray = os.listdir(self.empty)
                    if stray and len(self.violations) < 20:
                        self.violations.append(f"{self.empty} lists {sorted(stray)[:5]}")
                self.snapshots += 1
                self.sizes.add(tuple(len(s) for s in listed))
                for i, earlier in enumerate(listed):
                    for j in range(i + 1, len(listed)):
                        missing = earlier - listed[j]
                        if missing and len(self.violations) < 20:
                            self.violations.append(
                                f"snapshot {self.snapshots}: {sorted(missing)[:5]} listed in "
                                f"{self.dirs[i]} but not in {self.dirs[j]} listed after it "
                                f"(sizes {[len(s) for s in listed]})")
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors.append(e)


class Procs:
    """Shell processes a test starts; killed (by their own pid) at teardown if still running."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def bash(self, script: str, *args: object) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["bash", "-c", script, "bash", *map(str, args)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        self.started.append(p)
        return p

    def close(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.kill()
            p.communicate()


@pytest.fixture
def procs() -> Iterator[Procs]:
    ps = Procs()
    yield ps
    ps.close()


def topic_with(fresh_queue: Callable[[], Queue], n: int) -> tuple[Queue, list[Queue]]:
    """A fresh topic and ``n`` fresh subscriber queues, ``fanout`` set with the CLI."""
    subs = [fresh_queue() for _ in range(n)]
    topic = fresh_queue()
    set_policy(topic, "fanout=" + ",".join(s.name for s in subs))
    assert policy_of(topic)["fanout"] == ",".join(s.name for s in subs)
    return topic, subs


# --------------------------------------------------------------------------- 1. all at once

PUBLISH_ALL = r"""
cd "$1" || exit 2
for f in partial/*; do
  mv -- "$f" ready/ || exit 1
done
"""

MAKE_UPLOADS = r"""
cd "$1" || exit 2
n=$2
for i in $(seq -w 1 "$n"); do
  printf 'message %s\n' "$i" > "partial/m$i" || exit 1
  head -c 700 /dev/urandom >> "partial/m$i" || exit 1
  setfattr -n user.seq -v "$i" "partial/m$i" || exit 1
done
setfattr -n user.batch -v "nightly run" partial/* || exit 1
"""


def test_publish_into_topic_appears_in_every_subscriber_at_once(
        module_mount: Mount, fresh_queue: Callable[[], Queue], procs: Procs) -> None:
    """200 publishes (``mv partial/x ready/``) into a topic with 3 subscribers while a watcher
    lists s1/ready, s2/ready, s3/ready and the topic's success/ in that order: a name in an
    earlier listing is always in every later one (never in 1 or 2 of 3), and the topic's ready/
    never shows anything. Afterwards all have every name, with the same content and headers,
    and ``stat -c %h`` counts the four messages sharing each content."""
    n = 200
    topic, subs = topic_with(fresh_queue, 3)
    ok("bash", "-c", MAKE_UPLOADS, "make", topic.path, str(n))
    names = [f"m{i:03d}" for i in range(1, n + 1)]
    assert ls(topic.partial) == names
    contents = {name: (topic.partial / name).read_bytes() for name in names}
    sent_headers = headers(topic.partial, names)
    assert sent_headers["m001"] == {"user.batch": '"nightly run"', "user.seq": '"001"'}

    watched = [s.ready for s in subs] + [topic.success]
    with Watch(watched, empty=topic.ready) as watch:
        wait_until(lambda: watch.snapshots >= 3, timeout=10, what="the watcher to start")
        producer = procs.bash(PUBLISH_ALL, topic.path)
        _, err = producer.communicate(timeout=patience(120))
        assert producer.returncode == 0, f"a publish failed: {err.decode(errors='replace')}"
        settled = watch.snapshots
        wait_until(lambda: watch.snapshots >= settled + 3, timeout=10,
                   what="the watcher to list the final state")
    assert not watch.errors, f"the watcher failed: {watch.errors[0]!r}"
    assert not watch.violations, \
        "a publish into a topic was seen in some subscribers and not others:\n" + \
        "\n".join(watch.violations)
    partial_views = {s for s in watch.sizes if 0 < s[0] < n}
    assert partial_views, (f"the watcher ({watch.snapshots} snapshots) never saw the publishes "
                           f"under way; sizes seen: {sorted(watch.sizes)[:10]}")

    assert ls(topic.partial) == []
    assert ls(topic.ready) == []
    assert ls(topic.success) == names
    for s in subs:
        assert ls(s.ready) == names, f"{s.name}/ready lacks messages"
        for state in ("partial", "success", "error"):
            assert ls(s.state(state)) == [], f"{s.name}/{state} must be untouched"
    for d in watched:
        assert headers(d, names) == sent_headers, f"headers differ in {d}"
        for name in names:
            assert (d / name).read_bytes() == contents[name], f"{d / name}: content differs"
    one = "m100"
    assert read(subs[1].ready / one) == contents[one]
    sums = {xattr_text(d / one, "user.spool.sha256") for d in watched}
    assert sums == {sha256(contents[one])}
    links = {str(d / one): nlink(d / one) for d in watched}
    assert set(links.values()) == {4}, \
        f"one content shared by the topic's message and 3 subscribers' copies: {links}"
    assert "fanout" in history_actions(topic.success / one)
    assert history_actions(subs[2].ready / one) == ["fanout"]


# --------------------------------------------------------------------------- 2. chains, refusals


def test_fanout_chain_cycle_and_missing_subscriber(module_mount: Mount,
                                                  fresh_queue: Callable[[], Queue],
                                                  tmp_path: Path) -> None:
    """topic -> (a, c), a -> b: one publish lands in b/ and c/, both topics' success/; a policy
    closing the loop is refused with one line naming the cycle, and nothing changes."""
    a, b, c = fresh_queue(), fresh_queue(), fresh_queue()
    t = fresh_queue()
    set_policy(a, f"fanout={b.name}")
    set_policy(t, f"fanout={a.name},{c.name}")
    data = t.put("x", make_content("x", 40_000))  # over the inline limit: a blob file
    setxattr(t.partial / "x", "user.origin", "chain")
    ok("mv", t.partial / "x", t.ready / "x")
    assert ls(t.ready) == [] and ls(t.success) == ["x"]
    assert ls(a.ready) == [] and ls(a.success) == ["x"], "a is a topic itself: its copy is done"
    assert ls(b.ready) == ["x"]
    assert ls(c.ready) == ["x"]
    for p in (t.success / "x", a.success / "x", b.ready / "x", c.ready / "x"):
        assert read(p) == data
        assert xattr_text(p, "user.origin") == "chain"
        assert nlink(p) == 4, f"{p}: 4 messages share the content"
    assert history_actions(a.success / "x") == ["fanout", "fanout"]
    assert history_actions(b.ready / "x") == ["fanout"]

    # closing the loop b -> t (t -> a -> b -> t), or a queue feeding itself: refused, one line
    queues = [a, b, c, t]
    before = {q.name: snapshot(q.path) for q in queues}
    policies = {q.name: policy_of(q) for q in queues}
    res = spoolfs_cli("queue", "set", str(b.path), f"fanout={t.name}")
    line = one_line_error(res)
    m = CYCLE.search(line)
    assert m is not None, f"the refusal does not name the cycle: {line!r}"
    cycle = m.group(1).split(" -> ")
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == sorted([t.name, a.name, b.name]), \
        f"wrong cycle named: {line!r}"
    line = one_line_error(spoolfs_cli("queue", "set", str(c.path), f"fanout={c.name}"))
    assert f"fanout would make a cycle: {c.name} -> {c.name}" in line
    # the daemon refuses it too, when the attribute is set directly
    fails("setfattr", "-n", "user.spool.policy", "-v", f"fanout={t.name}", b.path,
          message="Invalid argument")
    assert {q.name: policy_of(q) for q in queues} == policies, "a refused policy changed"
    assert {q.name: snapshot(q.path) for q in queues} == before

    # the chain still works as before, and ends
    t.publish("y")
    assert ls(b.ready) == ["x", "y"] and ls(c.ready) == ["x", "y"]
    assert ls(t.success) == ["x", "y"] and ls(a.success) == ["x", "y"]
    assert ls(t.ready) == [] and ls(a.ready) == []


def test_missing_subscriber_refuses_the_whole_publish(module_mount: Mount,
                                                      fresh_queue: Callable[[], Queue],
                                                      tmp_path: Path) -> None:
    s = fresh_queue()
    t = fresh_queue()
    missing = f"{t.name}-nosuch"
    set_policy(t, f"fanout={s.name},{missing}")

    # mv partial/x ready/: ENXIO, nothing changed anywhere
    data = t.put("x")
    setxattr(t.partial / "x", "user.k", "v")
    before = (snapshot(t.path), snapshot(s.path))
    fails("mv", t.partial / "x", t.ready / "x", message=ENXIO_TEXT)
    assert (snapshot(t.path), snapshot(s.path)) == before, "a refused publish changed something"
    assert ls(t.partial) == ["x"] and read(t.partial / "x") == data
    assert ls(t.ready) == [] and ls(t.success) == [] and ls(s.ready) == []
    assert not (module_mount.path / missing).exists()

    # cp file ready/: the publish happens at close, refused: cp fails, the upload is in partial/
    big = make_content("upload", 100_000)
    src = tmp_path / "upload"
    src.write_bytes(big)
    res = run(["cp", src, t.ready])
    err = res.stderr.decode(errors="replace")
    assert res.returncode != 0, "cp into a topic with a missing subscriber must fail"
    assert ENXIO_TEXT in err, f"cp's error does not say why: {err!r}"
    assert ls(t.ready) == [] and ls(t.success) == [] and ls(s.ready) == []
    assert ls(t.partial) == ["upload", "x"], "the refused upload must be back in partial/"
    assert read(t.partial / "upload") == big, "the refused upload must be complete"
    hist = xattr_text(t.partial / "upload", "user.spool.history")
    assert "refused" in hist and missing in hist, hist

    # once the subscriber exists, both publish and fan out
    ok("mkdir", module_mount.path / missing)
    ok("mv", t.partial / "x", t.ready / "x")
    ok("mv", t.partial / "upload", t.ready / "upload")
    for q in (s.path, module_mount.path / missing):
        assert ls(q / "ready") == ["upload", "x"]
        assert read(q / "ready/upload") == big
        assert read(q / "ready/x") == data
    assert xattr_text(module_mount.path / missing / "ready/x", "user.k") == "v"
    assert ls(t.partial) == [] and ls(t.success) == ["upload", "x"]


def test_fanout_never_replaces_and_subscriber_policies_apply(
        module_mount: Mount, fresh_queue: Callable[[], Queue]) -> None:
    """A copy never replaces a pending message of the same name in a subscriber's ready/; a
    subscriber that rejects the content as a duplicate refuses the whole publish (all or
    none); one that skips it files its copy in its success/ while the others get theirs."""
    topic, (s1, s2, s3) = topic_with(fresh_queue, 3)
    s1.publish("x", b"old x of s1\n")
    topic.publish("x", b"new x\n")
    names = ls(s1.ready)
    assert len(names) == 2 and "x" in names, names
    assert read(s1.ready / "x") == b"old x of s1\n", "a pending message was replaced"
    other = next(n for n in names if n != "x")
    assert read(s1.ready / other) == b"new x\n"
    assert ls(s2.ready) == ["x"] and ls(s3.ready) == ["x"] and ls(topic.success) == ["x"]

    set_policy(s2, "duplicates=reject")
    set_policy(s3, "duplicates=skip")
    s2.publish("seen", b"seen before\n")
    s3.publish("seen", b"seen before\n")
    topic.put("d", b"seen before\n")
    queues = [topic, s1, s2, s3]
    before = [snapshot(q.path) for q in queues]
    refused_as_duplicate(topic.partial / "d", topic.ready / "d")
    assert [snapshot(q.path) for q in queues] == before, "a refused fan-out changed something"

    set_policy(s2, "duplicates=allow")
    ok("mv", topic.partial / "d", topic.ready / "d")
    assert "d" in ls(s1.ready) and "d" in ls(s2.ready)
    assert "d" not in ls(s3.ready) and ls(s3.success) == ["d"], "s3 skips the duplicate"
    assert xattr_text(s3.success / "d", "user.spool.duplicate_of")
    assert ls(topic.success) == ["d", "x"] and ls(topic.partial) == []


# --------------------------------------------------------------------------- 3. hard links

LINK_MANY = r"""
src=$1; n=$2; shift 2
i=0
while (( i < n )); do
  i=$((i+1))
  q=${@:$(( i % $# + 1 )):1}
  if (( i % 2 )); then s=partial; else s=ready; fi
  ln -- "$src" "$q/$s/l$i" || exit 1
done
"""


def test_thousand_links_share_one_blob(mounter: MountFactory, store: Path,
                                       tmp_path: Path) -> None:
    m = mounter(store, tmp_path / "mnt")
    qs = [Queue.create(m.path, f"h{i}", tmp_path / "scratch") for i in range(3)]
    big = tmp_path / "big"
    big.write_bytes(os.urandom(10 << 20))
    n = 1000

    base_store, base_blobs = du_k(store), du_k(store / "blobs")
    ok("cp", big, qs[0].partial / "orig")
    ok("bash", "-c", LINK_MANY, "links", qs[0].partial / "orig", str(n), *[q.path for q in qs],
       timeout=120)
    grown_store, grown_blobs = du_k(store) - base_store, du_k(store / "blobs") - base_blobs
    assert 10 << 10 <= grown_blobs <= (10 << 10) + 512, \
        f"{n} links of 10 MiB: blobs/ grew by {grown_blobs} KiB, expected the content once"
    # the rest is metadata: 1,001 rows and the SQLite WAL (about 4 MiB here); a second copy
    # of the content would already be 20 MiB
    assert grown_store < 18 << 10, \
        f"{n} links of 10 MiB grew the store by {grown_store} KiB (expected about 10 MiB)"
    assert len(blob_files(store)) == 1

    listed = {f"{q.name}/{s}": ls(q.state(s)) for q in qs for s in ("partial", "ready")}
    assert sum(map(len, listed.values())) == n + 1
    assert all(len(v) > 100 for v in listed.values()), {k: len(v) for k, v in listed.items()}
    # every message shares the content: 1001 (an attribute cached before the last ln may lag
    # up to its 1 s timeout; test_link_count_is_current_right_after_ln covers that)
    samples = [qs[0].partial / "orig", qs[1].ready / "l1000", qs[1].partial / "l1",
               qs[2].ready / "l500"]
    counts = wait_until(lambda: (c := [nlink(p) for p in samples]) == [n + 1] * 4 and c,
                        timeout=5, what=f"stat -c %h to show {n + 1}")
    assert counts == [n + 1] * 4
    ok("cmp", big, qs[2].ready / "l2")

    # remove all but one (the original too): the content stays readable
    keep = qs[1].ready / "l1000"
    victims = [str(q.state(s) / name) for q in qs for s in ("partial", "ready")
               for name in ls(q.state(s)) if q.state(s) / name != keep]
    assert len(victims) == n
    ok("rm", "--", *victims)
    assert [ls(q.state(s)) for q in qs for s in ("partial", "ready")] == \
        [[], [], [], ["l1000"], [], []]
    ok("cmp", big, keep)
    wait_until(lambda: nlink(keep) == 1, timeout=5, what="the survivor's link count to be 1")
    assert len(blob_files(store)) == 1

    # the last one frees the blob file, and the store shrinks back
    peak = du_k(store)
    ok("rm", keep)
    wait_until(lambda: blob_files(store) == [], timeout=10, what="the blob file to be deleted")
    assert du_k(store / "blobs") - base_blobs < 512
    assert peak - du_k(store) >= (10 << 10) - 512, "removing the last link must free ~10 MiB"
    m.umount()
    fsck = spoolfs_cli("fsck", str(store), timeout=60)
    assert fsck.returncode == 0, fsck.stdout.decode(errors="replace")


def test_link_count_is_current_right_after_ln(module_mount: Mount,
                                             fresh_queue: Callable[[], Queue]) -> None:
    """``st_nlink`` is the number of messages sharing the content (DESIGN §5, docs: "the link
    count ``ls -l`` shows"), and a daemon's own changes reach the kernel at once: right after
    ``ln a b`` (or ``rm b``), ``stat -c %h a`` shows the new count, as on any file system."""
    q, other = fresh_queue(), fresh_queue()
    q.put("a", make_content("a", 30_000))
    seen: list[tuple[str, int, int]] = []

    def check(what: str, path: Path, expected: int) -> None:
        seen.append((what, expected, nlink(path)))

    check("before any link: a", q.partial / "a", 1)
    ok("ln", q.partial / "a", q.partial / "b")
    check("after ln a b: a", q.partial / "a", 2)
    check("after ln a b: b", q.partial / "b", 2)
    ok("ln", q.partial / "b", other.ready / "c")
    check("after ln b other/ready/c: a", q.partial / "a", 3)
    check("after ln b other/ready/c: b", q.partial / "b", 3)
    check("after ln b other/ready/c: c", other.ready / "c", 3)
    ok("rm", q.partial / "b")
    check("after rm b: a", q.partial / "a", 2)
    check("after rm b: c", other.ready / "c", 2)
    wrong = [f"{what}: stat -c %h shows {got}, expected {exp}" for what, exp, got in seen
             if got != exp]
    assert not wrong, "stale link counts:\n" + "\n".join(wrong)


# --------------------------------------------------------------------------- 4. duplicates


def test_duplicates_allowed_by_default(module_mount: Mount,
                                       fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    assert policy_of(q)["duplicates"] == "allow"
    same = make_content("same", 20_000)
    q.publish("a", same)
    q.publish("b", same)
    q.publish("c", same)
    assert ls(q.ready) == ["a", "b", "c"]
    assert ls(q.success) == []
    assert nlink(q.ready / "c") == 3, "identical content is stored once, shared"


def test_duplicates_reject(module_mount: Mount, fresh_queue: Callable[[], Queue],
                           tmp_path: Path) -> None:
    q = fresh_queue()
    set_policy(q, "duplicates=reject")
    same = make_content("same", 20_000)
    q.publish("a", same)
    q.put("b", same)
    before = snapshot(q.path)
    refused_as_duplicate(q.partial / "b", q.ready / "b")
    assert snapshot(q.path) == before, "a rejected duplicate changed something"
    assert ls(q.partial) == ["b"] and ls(q.ready) == ["a"] and ls(q.success) == []
    assert read(q.partial / "b") == same

    # different content is no duplicate
    q.publish("c", same + b"!")
    assert ls(q.ready) == ["a", "c"]

    # cp straight into ready/: refused at close, the upload goes to partial/
    src = tmp_path / "d"
    src.write_bytes(same)
    res = run(["cp", src, q.ready])
    assert res.returncode != 0, "cp of a rejected duplicate into ready/ must fail"
    assert EEXIST_TEXT in res.stderr.decode(errors="replace")
    assert ls(q.ready) == ["a", "c"] and ls(q.partial) == ["b", "d"]
    assert "refused" in history_actions(q.partial / "d")

    # the original processed and finished: its content is still already seen
    q.claim("a")
    q.finish("a")
    refused_as_duplicate(q.partial / "b", q.ready / "b")
    assert ls(q.ready) == ["c"] and ls(q.partial) == ["b", "d"] and ls(q.success) == ["a"]


def test_duplicates_skip(module_mount: Mount, fresh_queue: Callable[[], Queue]) -> None:
    q = fresh_queue()
    set_policy(q, "duplicates=skip")
    same = make_content("same", 100)
    q.publish("a", same)
    orig_ino = os.stat(q.ready / "a").st_ino
    q.put("b", same)
    ok("mv", q.partial / "b", q.ready / "b")
    assert ls(q.ready) == ["a"], "a skipped duplicate must not be claimable"
    assert ls(q.partial) == [] and ls(q.success) == ["b"]
    assert read(q.success / "b") == same
    dup = xattr_text(q.success / "b", "user.spool.duplicate_of")
    assert str(orig_ino) in dup or "ready/a" in dup, \
        f"user.spool.duplicate_of must name the original: {dup!r}"
    assert "duplicate" in history_actions(q.success / "b")
    assert xattr_text(q.success / "b", "user.spool.state") == "success"

    q.publish("c", same + b"?")
    assert ls(q.ready) == ["a", "c"] and ls(q.success) == ["b"]
    assert "user.spool.duplicate_of" not in ok("getfattr", "-m", "-", q.ready / "c").decode()


def test_duplicates_window(module_mount: Mount, fresh_queue: Callable[[], Queue]) -> None:
    """``duplicates_window=2s``: the same content is refused within the window and accepted
    after it, while the original is still in ready/. A machine too slow to refuse within 2 s
    gets a longer window."""
    def attempt(window: float) -> bool:
        q = fresh_queue()
        set_policy(q, "duplicates=reject", f"duplicates_window={window:g}s")
        same = make_content("w", 50)

        def refused_in_window(name: str, opened: float) -> bool:
            """``name`` is refused; False when it may have come after the window that opened
            no earlier than ``opened``."""
            q.put(name, same)
            try:
                refused_as_duplicate(q.partial / name, q.ready / name)
            except AssertionError:
                if time.time() >= opened + window:
                    return False
                raise
            return True

        before = time.time()
        q.publish("a", same)
        published = time.time()  # the window opened between `before` and this
        if not refused_in_window("b", before):
            return False
        assert ls(q.partial) == ["b"] and ls(q.ready) == ["a"]
        wait_until(lambda: time.time() > published + window + 0.3, timeout=window + 1,
                   what="the window to end")
        before = time.time()
        ok("mv", q.partial / "b", q.ready / "b")
        assert ls(q.ready) == ["a", "b"], "after the window the same content is new again"
        assert ls(q.success) == [] and ls(q.partial) == []
        return refused_in_window("c", before)  # ...and b opens a new window

    stretched(2.0, attempt, what="a duplicate refused within duplicates_window")


# --------------------------------------------------------------------------- 5. kill -9

PRODUCER = r"""
cd "$1" || exit 2
id=$2 ack=$3 stop=$4
i=0
while [ ! -e "$stop" ]; do
  i=$((i+1)); n="p${id}_$i"
  { printf '%s\n' "$n"; head -c 3000 /dev/zero; } 2>/dev/null > "partial/$n" || continue
  mv -- "partial/$n" ready/ 2>/dev/null && printf '%s\n' "$n" >> "$ack"
done
"""


def expected_content(name: str) -> bytes:
    return name.encode() + b"\n" + bytes(3000)


def test_kill9_during_fanout_publishes_all_or_none(mounter: MountFactory, store: Path,
                                                   tmp_path: Path, procs: Procs) -> None:
    m = mounter(store, tmp_path / "mnt")
    scratch = tmp_path / "scratch"
    subs = [Queue.create(m.path, f"s{i}", scratch) for i in range(1, 4)]
    topic = Queue.create(m.path, "topic", scratch)
    set_policy(topic, "fanout=s1,s2,s3")
    logs = tmp_path / "logs"
    logs.mkdir()
    stop = logs / "stop"
    acks = [logs / f"acked-{i}" for i in range(2)]
    for i, ack in enumerate(acks):
        procs.bash(PRODUCER, topic.path, i, ack, stop)

    def acked() -> set[str]:
        return {n for ack in acks for n in consumed_names(ack)}

    started = time.monotonic()
    wait_until(lambda: len(acked()) >= 40 and time.monotonic() - started >= 1.0, timeout=60,
               alive=m.daemon_alive, what="the producers to publish 40 messages")
    m.kill9()
    stop.touch()
    for p in procs.started:
        try:  # reading its output as it ends: a full pipe would hold it
            p.communicate(timeout=patience(30))
        except subprocess.TimeoutExpired:
            raise AssertionError("a producer hung after the daemon died") from None
    published = acked()
    m.start()

    partial = set(os.listdir(topic.partial))
    done = set(os.listdir(topic.success))
    in_subs = [set(os.listdir(s.ready)) for s in subs]
    assert os.listdir(topic.ready) == [], "a topic's message never rests in its ready/"
    everything = partial | done | set().union(*in_subs)
    torn = {}
    for name in sorted(everything):
        where = (name in done, *(name in s for s in in_subs))
        if all(where):
            assert name not in partial, f"{name}: published and still in partial/"
        elif any(where):
            torn[name] = where
        else:
            assert name in partial
    assert not torn, ("after kill -9, messages in some of (topic success, s1, s2, s3) and not "
                      f"the others: {dict(list(torn.items())[:10])}")
    lost = sorted(published - done)
    assert not lost, f"{len(lost)} acknowledged publishes lost: {lost[:10]}"
    assert len(done) >= len(published) >= 40
    for name in sorted(done):
        for d in [topic.success] + [s.ready for s in subs]:
            assert (d / name).read_bytes() == expected_content(name), f"{d / name}: bad content"
    sample = sorted(published)[0]
    assert nlink(subs[0].ready / sample) == 4
    for s in subs:
        for state in ("partial", "success", "error"):
            assert os.listdir(s.state(state)) == []

    # a publish after the restart still fans out, and the store is consistent
    topic.publish("after")
    assert all("after" in ls(s.ready) for s in subs)
    m.umount()
    fsck = spoolfs_cli("fsck", str(store), timeout=60)
    assert fsck.returncode == 0, "fsck after kill -9 during fan-out:\n" + \
        fsck.stdout.decode(errors="replace") + fsck.stderr.decode(errors="replace")


# --------------------------------------------------------------------------- 6. links + fan-out


def test_links_from_any_state_into_a_topic_fan_out(module_mount: Mount,
                                                   fresh_queue: Callable[[], Queue]) -> None:
    """``ln other/success/f topic/ready/g`` is a publish into the topic: it fans out like any
    other; so does a link into the topic's partial/ published with ``mv``, and a link of a
    claimed message. The source stays where it was, and every message shares one content."""
    other = fresh_queue()
    topic, subs = topic_with(fresh_queue, 3)
    data = other.put("f", make_content("f", 50_000))
    setxattr(other.partial / "f", "user.k", "hv")
    ok("mv", other.partial / "f", other.ready / "f")
    other.claim("f")
    other.finish("f")
    src = other.success / "f"

    ok("ln", src, topic.ready / "g")
    assert ls(topic.ready) == [], "the topic's message must go on to success/"
    assert not os.path.lexists(topic.ready / "g")
    assert ls(topic.success) == ["g"]
    for s in subs:
        assert ls(s.ready) == ["g"]
        assert read(s.ready / "g") == data
        assert xattr_text(s.ready / "g", "user.k") == "hv", "headers are copied to links"
    assert ls(other.success) == ["f"] and read(src) == data
    assert xattr_text(src, "user.spool.state") == "success"
    assert nlink(subs[0].ready / "g") == 5  # other/success/f, topic/success/g, 3 copies

    # a link into the topic's partial/, then published with mv
    ok("ln", src, topic.partial / "h")
    assert ls(topic.partial) == ["h"] and all(ls(s.ready) == ["g"] for s in subs)
    ok("mv", topic.partial / "h", topic.ready / "h")
    assert ls(topic.partial) == [] and ls(topic.ready) == []
    assert ls(topic.success) == ["g", "h"]
    for s in subs:
        assert ls(s.ready) == ["g", "h"]
        assert read(s.ready / "h") == data
    assert nlink(subs[2].ready / "h") == 9

    # a link of a message claimed in another queue (error/ too): the claim is untouched
    other.publish("w", b"work item\n")
    claimed = other.claim("w")
    ok("ln", claimed, topic.ready / "w")
    for s in subs:
        assert read(s.ready / "w") == b"work item\n"
    assert ls(other.working / "w1") == ["w"]
    assert xattr_text(claimed, "user.spool.state") == "working"
    other.finish("w", to="error")
    ok("ln", other.error / "w", topic.ready / "w2")
    assert all(ls(s.ready) == ["g", "h", "w", "w2"] for s in subs)
    assert ls(topic.success) == ["g", "h", "w", "w2"]
    assert nlink(subs[1].ready / "w2") == 9
    wait_until(lambda: nlink(other.error / "w") == 9, timeout=5,
               what="the source's link count to show all 9 messages")

    # subscribers consume their copies independently
    subs[0].claim("g")
    subs[0].finish("g")
    assert ls(subs[0].success) == ["g"]
    assert ls(subs[1].ready) == ["g", "h", "w", "w2"]
    assert read(subs[1].ready / "g") == data
