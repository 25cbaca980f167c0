from __future__ import annotations

import pytest

from spoolfs.core.errors import Invalid, NameTooLong, NotPermitted
from spoolfs.core.names import NAME_MAX, check_ident, check_message_name, free_name


def test_message_names_are_bytes_up_to_255() -> None:
    for name in (b"a", b"with space", b"new\nline", b"\xff\xfe", b"x" * 255):
        assert check_message_name(name) == name
    with pytest.raises(NameTooLong):
        check_message_name(b"x" * 256)
    for bad in (b"", b".", b"..", b"a/b", b"a\0b"):
        with pytest.raises(Invalid):
            check_message_name(bad)


def test_idents() -> None:
    assert check_ident(b"orders-2.v1_x", "queue") == "orders-2.v1_x"
    for bad in (b".hidden", b"", b"a b", b"x" * 65, "é".encode()):
        with pytest.raises(NotPermitted):
            check_ident(bad, "queue")


class Taken:
    """A directory's names, counting the lookups made."""

    def __init__(self, names: set[bytes]) -> None:
        self.names, self.asked = names, 0

    def __call__(self, name: bytes) -> bool:
        self.asked += 1
        return name in self.names


def test_a_free_name_is_the_name_or_the_next_numbered_copy() -> None:
    assert free_name(b"f", Taken(set())) == b"f"
    assert free_name(b"f", Taken({b"f"})) == b"f.~1~"
    assert free_name(b"f", Taken({b"f", b"f.~1~"})) == b"f.~2~"
    assert free_name(b"f", Taken({b"f", b"f.~1~", b"f.~2~"})) == b"f.~3~"
    gap = Taken({b"f", b"f.~1~", b"f.~3~", b"f.~4~"})
    assert free_name(b"f", gap) not in gap.names, "a name never replaces another"
    long = b"x" * NAME_MAX
    got = free_name(long, Taken({long}))
    assert got == b"x" * (NAME_MAX - 4) + b".~1~" and len(got) == NAME_MAX


def test_a_free_name_beside_many_copies_takes_few_lookups() -> None:
    """A name reused by a producer (``latest.json``) gathers numbered copies in error/ or
    success/; each automatic move beside 100,000 of them looked up all 100,000 names in the
    write transaction. It looks up a few dozen, and still takes the next number."""
    taken = Taken({b"latest.json"} | {b"latest.json.~%d~" % n for n in range(1, 100_001)})
    assert free_name(b"latest.json", taken) == b"latest.json.~100001~"
    assert taken.asked <= 40, taken.asked
