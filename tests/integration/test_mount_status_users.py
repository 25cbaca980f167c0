"""``MOUNT/.spool/status`` and ``.spool/metrics`` read by real processes of two unprivileged
users through ``-o allow_other``: each sees only the queues whose directory it may search
(owner, group, supplementary groups, others), root sees all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.mounts import MountFactory
from helpers.procs import ok
from helpers.users import AS_CONSUMER, AS_CONSUMER_ALONE, AS_PRODUCER, CONSUMERS, PRODUCER

pytestmark = pytest.mark.fuse


def shown(argv: list[str], mnt: Path) -> tuple[list[str], set[str]]:
    """The queues of ``.spool/status``, and the queue labels of ``.spool/metrics``, as the
    process ``argv`` (a setpriv prefix, or nothing for root) reads them."""
    snap = json.loads(ok(*argv, "cat", mnt / ".spool/status"))
    text = ok(*argv, "cat", mnt / ".spool/metrics").decode()
    labels = {s.labels["queue"] for f in text_string_to_metric_families(text)
              for s in f.samples if "queue" in s.labels}
    return sorted(snap["queues"]), labels


def test_a_user_sees_only_the_queues_it_may_enter(users: None, mounter: MountFactory,
                                                   open_dir: Path, tmp_path: Path) -> None:
    m = mounter(tmp_path / "store", open_dir / "mnt", extra=["-o", "allow_other"])
    for name in ("open", "private", "consumers", "producers"):
        ok("mkdir", m.path / name)
    ok("chmod", "0755", m.path / "open")
    ok("chmod", "0700", m.path / "private")  # root's alone
    ok("chown", f"root:{CONSUMERS}", m.path / "consumers")
    ok("chmod", "0750", m.path / "consumers")  # the consumers' group
    ok("chown", f"{PRODUCER}:root", m.path / "producers")
    ok("chmod", "0704", m.path / "producers")  # readable by all, searchable by its owner
    ok("touch", m.path / "private/ready/secret")

    everything = ["consumers", "open", "private", "producers"]
    assert shown([], m.path) == (everything, set(everything))
    assert shown(AS_PRODUCER, m.path) == (["open", "producers"], {"open", "producers"})
    assert shown(AS_CONSUMER, m.path) == (["consumers", "open"], {"consumers", "open"}), \
        "a supplementary group did not count"
    assert shown(AS_CONSUMER_ALONE, m.path) == (["open"], {"open"})
    # Nothing of a hidden queue shows, not even its name.
    assert b"private" not in ok(*AS_CONSUMER, "cat", m.path / ".spool/status")
