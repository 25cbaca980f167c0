from __future__ import annotations

import pytest

from spoolfs.core.errors import Invalid, NameTooLong, NotPermitted
from spoolfs.core.names import check_ident, check_message_name


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
