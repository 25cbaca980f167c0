"""Blob files are immutable and named ``blobs/ab/cd/<sha256>.<blob id>``: the id makes a file
that is being deleted (its last reference gone) distinct from a later blob of the same content,
so deleting after the commit can never remove live data. Small blobs live inline in the
metadata store and never touch this directory.

Staging files ``staging/<entry id>`` hold the content of uploads until it is sealed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, TypeVar

from spoolfs.blobs import freeing
from spoolfs.core.errors import StoreFailure

log = logging.getLogger(__name__)
T = TypeVar("T")
#: how often a new upload's staging file is made again when a remover took it meanwhile
RECREATE_TRIES = 100

CHUNK = 1 << 20
#: the store is its owner's alone (store/private.py); files are made 0600
PRIVATE_DIR = 0o700


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_file(fd: int, h: hashlib._Hash | None = None, off: int = 0) -> tuple[bytes, int]:
    """SHA-256 and size of an open file, read from the start (or: ``h`` has hashed its
    first ``off`` bytes; the rest is read from there)."""
    if h is None:
        h = hashlib.sha256()
    while True:
        chunk = os.pread(fd, CHUNK, off)
        if not chunk:
            return h.digest(), off
        h.update(chunk)
        off += len(chunk)


class ObjectInfo(NamedTuple):
    """What gc and fsck need to know of a stored blob object."""

    stored_ns: int  # when it was last stored or linked (mtime, or ctime when later)
    size: int
    links: int  # names of the same bytes (a blob file still linked as a staging file: 2)


def file_info(path: str) -> ObjectInfo | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    # ctime, not mtime: link() (placing a blob) and every write set it, touch -d cannot undo it
    return ObjectInfo(max(st.st_ctime_ns, st.st_mtime_ns), st.st_size, st.st_nlink)


class BlobDir:
    """``remote``: the directory is shared by several hosts' daemons (``--blobs DIR`` of a
    database store). Its content is then stored before the transaction that references it
    (``upload``, under a blob id reserved beforehand), as for any remote blob store, since
    no lock of the store covers the directory; by copy when it is on another file system
    than this host's staging directory."""

    def __init__(self, root: str, remote: bool = False) -> None:
        self.root = root
        self.remote = remote
        os.makedirs(root, PRIVATE_DIR, exist_ok=True)

    def path(self, sha256: bytes, blob_id: int) -> str:
        hexd = sha256.hex()
        return os.path.join(self.root, hexd[:2], hexd[2:4], f"{hexd}.{blob_id}")

    def _made_dir_for(self, sha256: bytes, blob_id: int) -> str:
        """The blob's path, its directory made (and made durable) on first use."""
        dst = self.path(sha256, blob_id)
        d = os.path.dirname(dst)
        if not os.path.isdir(d):
            os.makedirs(d, PRIVATE_DIR, exist_ok=True)
            fsync_dir(os.path.dirname(d))
            fsync_dir(self.root)
        return dst

    def place(self, src: str, sha256: bytes, blob_id: int) -> str:
        """Hard-link an fsynced staging file into place and make the new entry durable. The
        staging file stays, so a rolled-back transaction loses nothing."""
        dst = self._made_dir_for(sha256, blob_id)
        d = os.path.dirname(dst)
        try:
            os.link(src, dst)
        except FileExistsError:  # left by a rolled-back transaction that had this id
            os.unlink(dst)
            os.link(src, dst)
        fsync_dir(d)
        return dst

    def upload(self, src: str, sha256: bytes, blob_id: int) -> None:
        """Before the transaction (a shared directory): store ``src`` under its id, durably."""
        dst = self._made_dir_for(sha256, blob_id)
        d = os.path.dirname(dst)
        try:
            os.link(src, dst)
        except FileExistsError:
            if os.path.getsize(dst) != os.path.getsize(src):
                raise
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            tmp = f"{dst}.{os.getpid()}.part"
            with open(src, "rb") as fi, open(tmp, "wb") as fo:
                shutil.copyfileobj(fi, fo, CHUNK)
                fo.flush()
                os.fsync(fo.fileno())
            os.replace(tmp, dst)
        fsync_dir(d)

    def fetch(self, sha256: bytes, blob_id: int, size: int) -> str:
        """The local path of the content: the file itself."""
        return self.path(sha256, blob_id)

    def remove(self, sha256: bytes, blob_id: int) -> None:
        try:
            os.unlink(self.path(sha256, blob_id))
        except FileNotFoundError:
            pass

    def detach(self, sha256: bytes, blob_id: int) -> int | None:
        return freeing.detach(self.path(sha256, blob_id))

    def name(self, sha256: bytes, blob_id: int) -> str:
        """The stored object's name, as ``walk`` lists it: its path."""
        return self.path(sha256, blob_id)

    def info(self, name: str) -> ObjectInfo | None:
        return file_info(name)

    def unlink(self, name: str) -> bool:
        try:
            os.unlink(name)
        except FileNotFoundError:
            return False
        return True

    def digest(self, name: str) -> tuple[bytes, int] | None:
        try:
            fd = os.open(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return hash_file(fd)
        finally:
            os.close(fd)

    def check(self) -> None:
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreFailure(f"blob directory {self.root} is not writable")

    def close(self) -> None:
        pass

    def walk(self) -> Iterator[tuple[str, bytes, int]]:
        """Every blob file: (path, sha256, id), a directory at a time. Files with other names
        are reported with id -1."""
        yield from _walk_files(self.root)


def parse_blob_name(name: str) -> tuple[bytes, int]:
    """(sha256, blob id) of an object named ``<sha256 hex>.<id>``; (b"", -1) for any other
    name (an id no row can have included)."""
    hexd, _, bid = name.partition(".")
    try:
        sha, i = bytes.fromhex(hexd), int(bid)
    except ValueError:
        return b"", -1
    return (sha, i) if 0 <= i < 1 << 63 else (b"", -1)


def _walk_files(top: str) -> Iterator[tuple[str, bytes, int]]:
    """``BlobDir.walk`` below ``top``: the directory's files, then its subdirectories'. Each
    directory is read whole (a few entries: the layout spreads files over 65,536) and closed
    before its files are handed out, and gc removes some of them. Kinds come from the
    directory entries (no ``stat`` per directory, as ``os.walk`` makes). A symbolic link to a
    directory is neither walked nor reported, as ``os.walk`` does; a directory that cannot be
    read is skipped with a warning."""
    try:
        with os.scandir(top) as it:
            entries = list(it)
    except FileNotFoundError:  # removed meanwhile (or no blob yet)
        return
    except OSError as err:
        log.warning("blob walk: %s skipped: %s", top, err)
        return
    subdirs = []
    for ent in entries:
        if ent.is_dir():
            if not ent.is_symlink():
                subdirs.append(ent.path)
            continue
        yield (ent.path, *parse_blob_name(ent.name))
    del entries
    for d in subdirs:
        yield from _walk_files(d)


class StagingDir:
    """``staging/<bucket>/<entry id>``: the bucket is the id's high bits, so each directory
    sees at most ``BUCKET`` creates and deletes. On ext4, creating files in a directory where
    many were recently deleted gets many times slower (freed inodes are scanned past), and every
    upload's staging file is deleted at publish; new buckets are new directories."""

    BUCKET_BITS = 12

    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(root, PRIVATE_DIR, exist_ok=True)
        self._made: set[int] = set()

    def adopt_flat_layout(self) -> int:
        """Move staging files of the older flat layout (``staging/<id>``) into their buckets
        (at mount, before anything else uses them). Returns how many moved."""
        moved = 0
        for f in os.listdir(self.root):
            if f.isdigit() and os.path.isfile(os.path.join(self.root, f)):
                self._bucket(int(f))
                os.replace(os.path.join(self.root, f), self.path(int(f)))
                moved += 1
        return moved

    def clock_ns(self, wait_s: float = 0.02) -> int:
        """Now, as the file system stamps a file it changes (its clock's tick, its timestamps'
        granularity): a file changed from now on has a ctime of this or later, one changed
        before has an earlier one. Waits for the next tick, ``wait_s`` at most (10-16 µs here,
        where the kernel stamps a file looked at since in a finer grain); then files changed
        in the last tick before count as changed after."""
        def stamp() -> int:
            os.utime(self.root)
            return os.stat(self.root).st_ctime_ns
        first, end = stamp(), time.monotonic() + wait_s
        while True:
            now = stamp()
            if now > first or time.monotonic() >= end:
                return now
            time.sleep(0.001)

    def bucket_of(self, entry_id: int) -> int:
        """The number of the bucket (directory) that holds ``entry_id``'s file."""
        return entry_id >> self.BUCKET_BITS

    def _bucket_dir(self, bucket: int) -> str:
        return os.path.join(self.root, f"{bucket:x}")

    def _bucket(self, entry_id: int) -> str:
        b = self.bucket_of(entry_id)
        d = self._bucket_dir(b)
        if b not in self._made:
            os.makedirs(d, PRIVATE_DIR, exist_ok=True)
            self._made.add(b)
        return d

    def path(self, entry_id: int) -> str:
        return os.path.join(self._bucket_dir(self.bucket_of(entry_id)), str(entry_id))

    def create(self, entry_id: int) -> int:
        """An empty staging file for a new upload (its bucket made on first use), open for
        reading and writing: its descriptor."""
        self._bucket(entry_id)
        return os.open(self.path(entry_id), os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)

    def create_locked(self, entry_id: int) -> int:
        """``create``, then locked (shared), and still its id's file once locked: a remover
        (``remove_unheld``) takes the file's lock before it unlinks it, so a file it removed
        between the ``open`` and the lock is found unlinked here, and made again."""
        for _ in range(RECREATE_TRIES):
            fd = self.create(entry_id)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if self._names(fd, entry_id) is not None:
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise OSError(errno.EAGAIN, "staging file removed again and again as it was made",
                      self.path(entry_id))

    def _names(self, fd: int, entry_id: int) -> os.stat_result | None:
        """The stat of ``fd`` if ``entry_id``'s path still names that file."""
        st = os.fstat(fd)
        try:
            now = os.lstat(self.path(entry_id))
        except FileNotFoundError:
            return None
        return st if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev) else None

    def remove_unheld(self, entry_id: int, orphaned: Callable[[os.stat_result], bool]
                      ) -> os.stat_result | None:
        """Remove the staging file if no daemon holds it and ``orphaned`` (asked with its stat,
        while this holds its lock) says so; its stat if removed. Its lock is held until it
        is unlinked: an upload that made the file meanwhile finds it gone once it gets its
        lock (``create_locked``), and one that holds it keeps it."""
        try:
            fd = self._unheld(entry_id)
        except FileNotFoundError:
            return None
        if fd is None:
            return None  # held
        try:
            st = self._names(fd, entry_id)
            if st is None or not orphaned(st):
                return None
            os.unlink(self.path(entry_id))
            return st
        finally:
            os.close(fd)

    def open_bucket(self, entry_id: int) -> int:
        """A descriptor of the directory of ``entry_id``'s bucket (made on first use), for
        ``create_held``: the caller closes it."""
        return os.open(self._bucket(entry_id), os.O_RDONLY | os.O_DIRECTORY)

    def create_held(self, entry_id: int, bucket: int) -> int:
        """``create``, but the file is locked (shared) before its name appears: nothing that
        judges staging files by their lock (recovery, gc, fsck: ``held``) ever finds it
        unheld, though no transaction covers its making. Made unnamed (``O_TMPFILE``), locked,
        then linked in (``bucket``: the descriptor of its bucket's directory). OSError where
        the file system cannot (the caller makes its files the other way)."""
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o600, dir_fd=bucket)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            # a directory descriptor makes os.link call linkat(), which can follow the link
            # in /proc to the unnamed file (link() would not)
            try:
                os.link(f"/proc/self/fd/{fd}", str(entry_id), dst_dir_fd=bucket)
            except FileExistsError:  # an id used again after a power cut lost its row
                for _ in range(RECREATE_TRIES):  # (a sweep may hold the leftover a moment)
                    self.remove_unheld(entry_id, lambda st: True)
                    try:
                        os.link(f"/proc/self/fd/{fd}", str(entry_id), dst_dir_fd=bucket)
                        break
                    except FileExistsError:
                        time.sleep(0.001)
                else:
                    raise
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open(self, entry_id: int, create: bool = False) -> int:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        if create:
            self._bucket(entry_id)
        return os.open(self.path(entry_id), flags, 0o600)

    def touch(self, entry_id: int, atime_ns: int | None, mtime_ns: int | None,
              create: bool = True) -> None:
        """Set an upload's access and modification times (they are the staging file's); None
        keeps the one it names. ``create``: make the file if it is missing."""
        fd = self.open(entry_id, create=create)
        try:
            st = os.fstat(fd)
            os.utime(fd, ns=(st.st_atime_ns if atime_ns is None else atime_ns,
                             st.st_mtime_ns if mtime_ns is None else mtime_ns))
        finally:
            os.close(fd)

    def held(self, entry_id: int) -> bool:
        """Whether a daemon holds the staging file (a lock on it, shared): an upload being
        written, or a new upload's file made ahead (service/staging_pool.py). Not left over
        from a crash, whatever any row says."""
        try:
            fd = self._unheld(entry_id)
        except FileNotFoundError:
            return False
        if fd is None:
            return True
        os.close(fd)
        return False

    def _unheld(self, entry_id: int) -> int | None:
        """The staging file open and locked (exclusive), or None if a daemon holds it;
        FileNotFoundError if there is none. (A link in its place is locked through: its
        path names another file, which ``remove_unheld`` leaves.)"""
        fd = os.open(self.path(entry_id), os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        except BaseException:
            os.close(fd)
            raise
        return fd

    def remove(self, entry_id: int) -> None:
        try:
            os.unlink(self.path(entry_id))
        except FileNotFoundError:
            pass

    def detach(self, entry_id: int) -> int | None:
        """``remove``; a large file may keep its space until a descriptor returned is closed
        (blobs/freeing.py)."""
        return freeing.detach(self.path(entry_id))

    def sizes(self, items: Iterable[T], key: Callable[[T], int]) -> Iterator[tuple[T, int | None]]:
        """Each item with the size of its id's staging file (``key`` gives the id; None: no
        such file). Each file is looked up in its bucket's open directory, opened again only
        when the bucket changes: items in id order cost a name's lookup each, not a path's
        walk (the status snapshot sizes every upload: 3.3-4.8 µs a file here against
        6.0-7.6)."""
        bucket, fd = -1, -1
        try:
            for item in items:
                eid = key(item)
                if self.bucket_of(eid) != bucket:
                    if fd >= 0:
                        os.close(fd)
                    bucket, fd = self.bucket_of(eid), -1
                    try:
                        fd = os.open(self._bucket_dir(bucket),
                                     os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    except OSError:
                        pass  # no bucket: none of its files
                try:
                    size = None if fd < 0 else \
                        os.stat(str(eid), dir_fd=fd, follow_symlinks=False).st_size
                except OSError:
                    size = None
                yield item, size
        finally:
            if fd >= 0:
                os.close(fd)

    def ids(self, lo: int = 0, hi: int | None = None) -> Iterator[int]:
        """The ids of the staging files, a bucket at a time: gc and fsck hold a bucket's
        names (``BUCKET_BITS``) and their page, however many uploads are left in ``partial/``.
        Only those from ``lo`` to ``hi`` (both included; no end when None): the buckets
        outside are not read."""
        for b in os.listdir(self.root):
            try:
                n = int(b, 16)
            except ValueError:
                n = None  # no bucket's name: read, whatever the range
            if n is not None and (n < self.bucket_of(lo) or hi is not None
                                  and n > self.bucket_of(hi)):
                continue
            try:
                names = os.listdir(os.path.join(self.root, b))
            except (NotADirectoryError, FileNotFoundError):
                continue
            for f in names:
                if f.isdigit() and lo <= (sid := int(f)) and (hi is None or sid <= hi):
                    yield sid
