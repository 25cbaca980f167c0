"""Names: queue and consumer names, message names as bytes."""

from __future__ import annotations

import re
from collections.abc import Callable

from spoolfs.core.errors import Invalid, NameTooLong, NotPermitted

NAME_MAX = 255
_IDENT = re.compile(rb"[A-Za-z0-9_.-]{1,64}")


def check_message_name(name: bytes) -> bytes:
    """Message names are any bytes but ``/`` and NUL, at most 255 bytes (the kernel lets longer
    names through, so the daemon checks)."""
    if len(name) > NAME_MAX:
        raise NameTooLong(f"name of {len(name)} bytes exceeds {NAME_MAX}")
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise Invalid(f"invalid name {name!r}")
    return name


def check_ident(name: bytes, what: str) -> str:
    """Queue and consumer names: 1-64 bytes of ``[A-Za-z0-9._-]``, not starting with a dot."""
    if len(name) > NAME_MAX:
        raise NameTooLong(f"{what} name of {len(name)} bytes exceeds {NAME_MAX}")
    if not _IDENT.fullmatch(name) or name.startswith(b"."):
        raise NotPermitted(f"invalid {what} name {name!r}: 1-64 of [A-Za-z0-9._-], no leading dot")
    return name.decode("ascii")


def free_name(name: bytes, taken: Callable[[bytes], bool]) -> bytes:
    """``name``, or ``name.~N~`` when it is taken: what an automatic move (or a repair) calls a
    message, which never replaces anything. N is one past the last of an unbroken run of
    numbered copies, found in a few dozen lookups however many copies there are (doubling,
    then halving the gap); where copies were removed from the middle, some free N."""
    if not taken(name):
        return name

    def copy(n: int) -> bytes:
        suffix = b".~%d~" % n
        return name[:NAME_MAX - len(suffix)] + suffix

    if not taken(copy(1)):
        return copy(1)
    low, high = 1, 2  # copy(low) is taken
    while taken(copy(high)):
        low, high = high, high * 2
    while high - low > 1:  # copy(low) taken, copy(high) free
        mid = (low + high) // 2
        if taken(copy(mid)):
            low = mid
        else:
            high = mid
    return copy(high)


def is_staging_name(name: bytes) -> bool:
    """A leading dot in ``ready/`` marks an upload under a staging name: never claimable."""
    return name.startswith(b".")
