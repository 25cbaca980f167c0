"""The mount table as the daemon reads it: a mount's device, and its read-ahead set through
sysfs (never by a stat of the mount point)."""

from __future__ import annotations

from spoolfs import mounttable


def test_the_root_file_system_has_a_device_number() -> None:
    entry = mounttable.find("/")
    assert entry is not None
    major, _, minor = entry.device.partition(":")
    assert major.isdigit() and minor.isdigit() and entry.connection == minor


def test_read_ahead_of_what_is_not_mounted_says_why_in_one_line() -> None:
    why = mounttable.set_read_ahead("/no/such/mount")
    assert why is not None and "\n" not in why and "/no/such/mount" in why
