"""The mount table as the daemon reads it: a mount's device, its read-ahead set through sysfs
(never by a stat of the mount point), and the device number an NFS server last saw."""

from __future__ import annotations

import os
from pathlib import Path

from spoolfs import mounttable


def test_the_root_file_system_has_a_device_number() -> None:
    entry = mounttable.find("/")
    assert entry is not None
    major, _, minor = entry.device.partition(":")
    assert major.isdigit() and minor.isdigit() and entry.connection == minor


def test_read_ahead_of_what_is_not_mounted_says_why_in_one_line() -> None:
    why = mounttable.set_read_ahead("/no/such/mount")
    assert why is not None and "\n" not in why and "/no/such/mount" in why


def test_the_device_an_nfs_server_saw_is_kept_per_mount_point(tmp_path: Path) -> None:
    """Each mount point has its own record under the store's own directory; a record is
    replaced whole, never left half written."""
    a = mounttable.device_record("/mnt/a", str(tmp_path))
    b = mounttable.device_record("/mnt/a/b", str(tmp_path))
    assert a != b and os.path.dirname(a) == str(tmp_path / mounttable.EXPORTED_DIR)
    assert mounttable.recorded_device(a) is None
    mounttable.record_device(a, "0:39")
    mounttable.record_device(a, "0:41")
    assert mounttable.recorded_device(a) == "0:41" and mounttable.recorded_device(b) is None
    assert sorted(os.listdir(os.path.dirname(a))) == [os.path.basename(a)]
    assert mounttable.device("/") is not None and mounttable.device(str(tmp_path / "x")) is None
