"""Mount options: the kernel's permission checks exactly when other users can enter."""

from spoolfs.daemon import fuse_options


def test_permission_checks_follow_allow_other() -> None:
    assert "default_permissions" not in fuse_options("/s", [])
    assert "default_permissions" in fuse_options("/s", ["allow_other"])
    assert "default_permissions" in fuse_options("/s", ["allow_root"])
    assert "default_permissions" in fuse_options("/s", ["default_permissions"])
    assert {"fsname=/s", "subtype=spoolfs", "ro"} <= fuse_options("/s", ["ro", ""])
