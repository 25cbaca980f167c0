"""Anonymous device numbers, as a mount made again after a restart gets one.

The kernel gives each new FUSE (or tmpfs) mount the lowest anonymous device number free
(major 0). An NFS server's file handles for a FUSE mount carry that number, so its clients
keep their handles across a restart of the spool only when the new mount gets the old
number. On a quiet machine it does; in the suite, another process of the suite mounts and
unmounts meanwhile. ``mount_with_device`` stands for the quiet machine: it holds every
lower number free with a small tmpfs of its own, so that the old number is the lowest one
free when the spool mounts, and mounts again if another mount took it first (its caller
holds ``helpers.mounts.mounting`` alone, which keeps the suite's own mounts out).
``mount_without_device`` makes the other case on purpose: it holds the old number while the
spool mounts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from helpers.mounts import Mount
from helpers.waiting import patience

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
#: no test needs more than this many numbers held at once
MOST_HELD = 2000


def anonymous_minor(path: Path) -> int:
    st = os.stat(path)
    assert os.major(st.st_dev) == 0, f"{path} is not on an anonymous device: {st.st_dev:#x}"
    return os.minor(st.st_dev)


class _Holders:
    """Small tmpfs mounts under ``base``, each holding one device number."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.held: list[Path] = []
        self._made = 0

    def take(self) -> tuple[Path, int]:
        self._made += 1
        path = self.base / f"hold{self._made}"
        path.mkdir(parents=True, exist_ok=True)
        if _libc.mount(b"none", os.fsencode(path), b"tmpfs", 0, b"size=4k") != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")
        return path, anonymous_minor(path)

    @staticmethod
    def give_back(path: Path) -> None:
        if _libc.umount2(os.fsencode(path), 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount {path}: {os.strerror(err)}")
        path.rmdir()

    def fill_below(self, minor: int) -> bool:
        """Hold every number below ``minor`` that is free; whether ``minor`` itself is free
        (found, then given back at once). False when another mount holds it."""
        while len(self.held) < MOST_HELD:
            path, got = self.take()
            if got < minor:
                self.held.append(path)
                continue
            self.give_back(path)
            return got == minor
        raise AssertionError(f"{MOST_HELD} device numbers below {minor} are free")

    def hold(self, minor: int, deadline: float) -> None:
        """Hold ``minor`` (and every number below it that is free), waiting for another
        mount that holds it to let it go."""
        while len(self.held) < MOST_HELD:
            path, got = self.take()
            if got <= minor:
                self.held.append(path)
                if got == minor:
                    return
                continue
            self.give_back(path)
            if time.monotonic() > deadline:
                raise AssertionError(f"device 0:{minor} still taken by another mount")
            time.sleep(0.05)
        raise AssertionError(f"{MOST_HELD} device numbers below {minor} are free")

    def close(self) -> None:
        while self.held:
            self.give_back(self.held.pop())


@contextmanager
def _holders(base: Path) -> Iterator[_Holders]:
    h = _Holders(base)
    try:
        yield h
    finally:
        h.close()


def mount_with_device(m: Mount, minor: int, scratch: Path, timeout: float = 30.0) -> int:
    """Mount ``m`` (unmounted) so that it gets the anonymous device number ``minor`` again;
    where its log was when the mount that got it started."""
    deadline = time.monotonic() + patience(timeout)
    tries = 0
    while True:
        tries += 1
        with _holders(scratch) as h:
            if h.fill_below(minor):
                since = m.log_size()
                m.start()
                if anonymous_minor(m.path) == minor:
                    return since
                m.umount()  # another mount took the number first: again
        if time.monotonic() > deadline:
            raise AssertionError(f"device 0:{minor} still taken by another mount after "
                                 f"{tries} tries")
        time.sleep(0.1)


@contextmanager
def numbers_below_held(minor: int, scratch: Path) -> Iterator[None]:
    """For the block, hold every number below ``minor`` that is free (``minor`` itself still
    in use): once ``minor`` is freed, the next mount made gets it (the README's restart lines,
    which mount by themselves)."""
    with _holders(scratch) as h:
        h.fill_below(minor)
        yield


def mount_without_device(m: Mount, minor: int, scratch: Path, timeout: float = 30.0) -> None:
    """Mount ``m`` (unmounted) so that it gets another number than ``minor``."""
    with _holders(scratch) as h:
        h.hold(minor, time.monotonic() + patience(timeout))
        m.start()
    assert anonymous_minor(m.path) != minor
