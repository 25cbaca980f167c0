"""Message names are bytes (DESIGN §2): any byte but '/' and NUL, up to 255 of them, exactly kept.

Names travel through argv as bytes (no decoding anywhere), and listings are read as bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.mounts import Mount
from helpers.procs import ok
from helpers.queues import Queue

pytestmark = pytest.mark.fuse

NAMES = [
    b"with space.txt",
    b" leading and trailing ",
    b"new\nline",
    b"tab\there",
    b"caf\xc3\xa9 \xe2\x82\xac.csv",        # valid UTF-8
    b"invalid \xff\xfe utf-8",              # not UTF-8
    b"lone \xc3 continuation",
    b"\x01\x02control\x7f",
    b"-dash-first",
    b"*?[glob]{a,b}",
    b"quote'\"back\\slash",
    b"x" * 255,
    "é".encode() * 127 + b"z",             # 255 bytes, 128 characters
    b"dots..in..the.middle.",     # (a leading dot would be a staging name in ready/)
    b"%s%n",
]


def listing(path: Path) -> set[bytes]:
    return set(os.listdir(os.fsencode(path)))


def test_odd_names_round_trip_through_the_lifecycle(mount: Mount, queue: Queue,
                                                    tmp_path: Path) -> None:
    view = queue.consumer("w1")
    src = tmp_path / "src"
    src.mkdir()
    contents = {}
    for i, name in enumerate(NAMES):
        contents[name] = b"%d:" % i + name
        (src / str(i)).write_bytes(contents[name])

    def path(directory: Path, name: bytes) -> bytes:
        return os.fsencode(directory) + b"/" + name

    for i, name in enumerate(NAMES):
        ok("cp", "--", src / str(i), path(queue.partial, name))
    assert listing(queue.partial) == set(NAMES)

    for name in NAMES:
        ok("mv", "--", path(queue.partial, name), os.fsencode(queue.ready) + b"/")
    assert listing(queue.partial) == set()
    assert listing(queue.ready) == set(NAMES)

    for name in NAMES:
        ok("mv", "--", path(queue.ready, name), os.fsencode(view) + b"/")
    assert listing(queue.ready) == set()
    assert listing(view) == set(NAMES)
    for name in NAMES:
        assert ok("cat", "--", path(view, name)) == contents[name], name

    for name in NAMES:
        ok("mv", "--", path(view, name), os.fsencode(queue.success) + b"/")
    assert listing(view) == set()
    assert listing(queue.success) == set(NAMES)

    # `ls` shows them too: NUL-separated output is the exact bytes
    out = ok("ls", "-A", "--zero", queue.success)
    assert set(n for n in out.split(b"\0") if n) == set(NAMES)

    mount.restart()
    assert listing(queue.success) == set(NAMES)
    for name in NAMES:
        assert ok("cat", "--", path(queue.success, name)) == contents[name], name


def test_names_differing_only_in_invalid_bytes_are_distinct(queue: Queue) -> None:
    names = [b"n\xff", b"n\xfe", b"n\xc3\xbf", b"n?"]  # \xc3\xbf is the UTF-8 of U+00FF
    for i, name in enumerate(names):
        src = queue.source(b"%d" % i)
        ok("cp", "--", src, os.fsencode(queue.partial) + b"/" + name)
        ok("mv", "--", os.fsencode(queue.partial) + b"/" + name, os.fsencode(queue.ready) + b"/")
    assert listing(queue.ready) == set(names)
    for i, name in enumerate(names):
        assert ok("cat", os.fsencode(queue.ready) + b"/" + name) == b"%d" % i
