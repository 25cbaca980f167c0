"""Open files: reading sealed content, writing staging files, sealing uploads into blobs."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import cast

from spoolfs.blobs import StagingDir, freeing, hash_file, opening
from spoolfs.blobs.base import BlobStore
from spoolfs.blobs.running import RunningHash, keeps_marks, mark_reopened
from spoolfs.blobs.writeback import (
    STEP,
    SYNC_STEP,
    WRITEBACK,
    cut_to_nothing,
    failed_before,
    mark_failed,
)
from spoolfs.core.errors import (
    NoSpace,
    NotPermitted,
    Remote,
    SpoolError,
    StoreFailure,
    SyncFailed,
    TooLarge,
)
from spoolfs.store.base import Blob, Entry, ReadTx, WriteTx

#: Content up to this size lives inline in the metadata store: one fsync for data and metadata,
#: and no blob files to create and delete for the typical small message.
INLINE_MAX = 16 * 1024
#: running hashes kept at most (uploads written here and not yet published or removed); the
#: oldest is dropped first (its upload is then hashed whole at publish)
RUNNING_MAX = 1024
#: From this size on, sealing an upload syncs its file while it hashes it (both let go of the
#: interpreter): a 256 MiB publish then takes the longer of the two, ~350 ms here, instead of
#: their sum, ~560 ms. Below it a thread costs more than it saves.
OVERLAP_MIN = 1 << 20


def _refused_unsynced(entry_id: int) -> SyncFailed:
    """The refusal of a seal of an upload a sync of which failed (marked or remembered)."""
    return SyncFailed(f"staging file of {entry_id}: a sync of it failed: its content may not "
                      "be on disk; remove it, or write it whole again")


def _sync(fd: int, key: str, datasync: bool = False) -> None:
    """fsync a staging file; a failure is kept under its ``key`` (its path) and marked on the
    file: the kernel reports it once, and this upload's content may have lost a part
    (blobs/writeback.py)."""
    try:
        if datasync:
            os.fdatasync(fd)
        else:
            os.fsync(fd)
    except OSError as e:
        mark_failed(fd)
        WRITEBACK.failed(key)
        raise SyncFailed(f"sync of staging file {os.path.basename(key)} failed: {e}") from e


@contextmanager
def _syncing(fd: int, key: str) -> Iterator[None]:
    """``_sync`` in another thread while the body runs; its error, if any, raised after."""
    failed: list[StoreFailure] = []

    def sync() -> None:
        try:
            _sync(fd, key)
        except StoreFailure as e:
            failed.append(e)

    thread = threading.Thread(target=sync, name="spoolfs-seal-sync", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if failed:
        raise failed[0]


@dataclass(slots=True)
class Sealed:
    """Content made durable and addressed, ready to be attached in a transaction."""

    sha256: bytes
    size: int
    mtime_ns: int  # the upload's last write (or touch): the message's modification time
    data: bytes | None  # inline content, or None: the staging file becomes the blob file
    staging_path: str
    #: a remote blob store's: the id the content was stored under before the transaction
    blob_id: int | None = None


class Cut:
    """A resize of an upload's staging file, open on ``fd`` (``Content.resize``): ``make``
    it (blocking), or ``abandon`` it if it was never begun; either closes ``fd``, once."""

    __slots__ = ("entry_id", "fd", "size", "key", "begun")

    def __init__(self, entry_id: int, fd: int, size: int, key: str) -> None:
        self.entry_id, self.fd, self.size, self.key = entry_id, fd, size, key
        self.begun = False

    def make(self) -> None:
        """Cut the file; one cut to nothing is no longer refused for a sync that failed
        before (its bytes are gone: ``writeback.cut_to_nothing``)."""
        self.begun = True
        try:
            os.ftruncate(self.fd, self.size)
            if self.size == 0:
                cut_to_nothing(self.fd, self.key, WRITEBACK)
        except OSError as err:
            raise staging_error(err, f"resize of staging file {self.entry_id}") from err
        finally:
            os.close(self.fd)

    def abandon(self) -> None:
        if not self.begun:
            self.begun = True
            os.close(self.fd)


def staging_error(e: OSError, what: str) -> SpoolError:
    """The refusal a failed write or resize of a staging file means to the caller: the
    store's disk is full, or the size is beyond what one file there can hold (the caller's
    request, as on any file system), or else the store failed."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace("store disk full")
    if e.errno == errno.EFBIG:
        return TooLarge(f"{what}: beyond the store's largest file")
    return StoreFailure(f"{what} failed: {e}")


class Handle:
    """One open file. Content outlives unlink: the handle holds its fd or its bytes."""

    __slots__ = ("entry_id", "fd", "data", "writable", "sealed", "opener", "done",
                 "lease_checked", "lease_id", "lease_seen", "queue", "nfs", "kicked",
                 "checks_setid", "opener_uid", "setid_clear_at", "running", "shares", "private",
                 "sync_key")

    def __init__(self, entry_id: int, fd: int | None, data: bytes | None, writable: bool,
                 sealed: bool = True) -> None:
        self.entry_id = entry_id
        self.sealed = sealed  # immutable content: the kernel may keep it cached
        self.fd = fd
        self.data = data
        self.writable = writable
        self.opener = 0  # pid of the process that opened it
        self.done = False  # its upload was published when the opener closed it: no more writes
        self.lease_checked = 0.0  # monotonic time a read last looked at the lease
        self.lease_id = entry_id  # the message whose lease an open handle holds (a batch's)
        #: the end of that lease as the open read it (None: none then), and its queue
        self.lease_seen: tuple[int | None, int] | None = None
        self.queue: int | None = None  # its queue: the disk guard's policy
        self.nfs = False  # held by an NFS server for its clients (service/uploads.py)
        self.kicked = 0  # its writeback was last started up to this offset
        #: each write first clears the set-user-ID and set-group-ID bits its opener may not
        #: keep (service/uploads.py): the kernel does not, for writes that bypass its cache
        self.checks_setid = False
        self.opener_uid = 0
        #: the spool's count of mode changes when this handle last saw no set-ID bits
        self.setid_clear_at = -1
        #: the upload's content hashed while it is written (blobs/running.py), if it is
        self.running: RunningHash | None = None
        #: it counts in this daemon's share of the upload's writers' lock (service/writers.py)
        self.shares = False
        #: an upload made hidden in ready/ here: no other daemon can reach it to write it
        self.private = False
        #: an upload's staging path: the key its early syncs are kept under (writeback.py)
        self.sync_key: str | None = None

    def read(self, off: int, size: int) -> bytes:
        if self.data is not None:
            return self.data[off:off + size]
        assert self.fd is not None
        return os.pread(self.fd, size, off)

    def read_cached(self, off: int, size: int) -> bytes | bytearray | None:
        """``read``, if the page cache holds the whole range; None when the disk would be read
        (or the file system cannot say), which the caller then does off the event loop. One
        ``RWF_NOWAIT`` read: the kernel copies what is cached up to the first page that is
        not, so a short answer before the end of the file means a page is missing, at either
        end of the range or anywhere between."""
        if self.data is not None:
            return self.data[off:off + size]
        assert self.fd is not None
        want = min(size, os.fstat(self.fd).st_size - off)
        if want <= 0:
            return b""
        buf = bytearray(want)
        try:
            got = os.preadv(self.fd, [buf], off, os.RWF_NOWAIT)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
                return None
            raise
        return buf if got == want else None

    def write(self, off: int, buf: bytes) -> int:
        self.may_write()
        return self.wrote(off, self.pwrite(off, buf))

    def may_write(self) -> None:
        if not self.writable or self.fd is None:
            raise NotPermitted("published content is immutable")
        if self.done:
            raise NotPermitted("this upload was already published when its opener closed it")

    def pwrite(self, off: int, buf: bytes) -> int:
        """The write itself, after ``may_write``: the part that may wait on the disk (a
        worker thread may run it; ``wrote`` then follows on the event loop)."""
        assert self.fd is not None
        try:
            return os.pwrite(self.fd, buf, off)
        except OSError as e:
            if self.running is not None:
                self.running.drop()
            raise staging_error(e, "staging write") from e

    def wrote(self, off: int, n: int) -> int:
        """After ``pwrite``: the running hash and the early writeback learn of it."""
        if self.running is not None:
            self.running.wrote(off, n)
        end = off + n
        if end - self.kicked >= STEP and self.fd is not None:  # a large upload: on disk by
            # the time it is published, and durable but for the last SYNC_STEP
            sync = self.sync_key if end // SYNC_STEP > self.kicked // SYNC_STEP else None
            WRITEBACK.kick(self.fd, self.kicked, end - self.kicked, sync)
            self.kicked = end
        return n

    def sync(self, datasync: bool) -> None:
        """The writer's own fsync (blocking): a failure fails every publish of the upload, as
        one of its other syncs does (``_sync``)."""
        assert self.fd is not None
        if self.sync_key is not None:
            _sync(self.fd, self.sync_key, datasync)
        elif datasync:
            os.fdatasync(self.fd)
        else:
            os.fsync(self.fd)

    def staged_size_and_mtime(self) -> tuple[int, int] | None:
        """Size and modification time of an upload's staging file as this handle sees it
        (the file may be unlinked already: the descriptor keeps it); None for sealed content."""
        if self.fd is None or self.sealed:
            return None
        st = os.fstat(self.fd)
        return st.st_size, st.st_mtime_ns

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close_unless_holding(self) -> int | None:
        """``close``, unless the descriptor may free a large removed file (a message removed
        while it was read): then it is returned, to be closed off the event loop. A small
        removed one (an upload's staging file, removed at its publish) is freed by a thread
        of its own (blobs/freeing.py)."""
        fd, self.fd = self.fd, None
        return None if fd is None else freeing.close_small(fd)


class Content:
    def __init__(self, blobs: BlobStore, staging: StagingDir, inline_max: int = INLINE_MAX,
                 local_uploads: bool = False) -> None:
        """``local_uploads``: the staging directory is this host's alone (a store shared by
        several hosts): an upload whose staging file is not here is another host's
        (``Remote``), never one to make an empty file for."""
        self.blobs = blobs
        self.staging = staging
        self.local_uploads = local_uploads
        #: content up to this size lives in the metadata store, in the transaction that
        #: publishes it (a shared store's too: no object stored first, none fetched to read)
        self.inline_max = inline_max
        #: uploads written here since made, by id, each with its content hashed so far (an
        #: OrderedDict: the oldest leaves in one call, whatever a worker thread does meanwhile)
        self._running: OrderedDict[int, RunningHash] = OrderedDict()
        #: whether uploads are hashed while written (blobs/running.py): the staging files
        #: keep the mark that tells another daemon's running hash of a writer it cannot see
        self.hashes_ahead = keeps_marks(staging.root)

    def open(self, r: ReadTx, entry: Entry, writable: bool, blob: Blob | None = None
             ) -> Handle:
        """A handle on the message's content; ``blob``: its blob row, when the caller read
        it already (``fetch``)."""
        h = self._open(r, entry, writable, blob, cached_only=False)
        assert h is not None  # (only a cached-only open leaves it to another thread)
        return h

    def open_cached(self, r: ReadTx, entry: Entry, writable: bool, blob: Blob | None = None
                    ) -> Handle | None:
        """``open`` for the event loop: None where the content's file would be looked up on
        the disk (its path not in the kernel's cache: blobs/opening.py), for a worker thread
        to ``open``."""
        return self._open(r, entry, writable, blob, cached_only=True)

    def _open(self, r: ReadTx, entry: Entry, writable: bool, blob: Blob | None,
              cached_only: bool) -> Handle | None:
        if entry.staged:
            fd = self._staging_file(entry.id)
            h = Handle(entry.id, fd, None, writable, sealed=False)
            if writable:
                h.sync_key = self.staging.path(entry.id)
                # Marks the upload as in progress for recovery run by another daemon.
                fcntl.flock(fd, fcntl.LOCK_SH)
                h.running = self._running.get(entry.id)
                if h.running is None and self.hashes_ahead:  # none may miss its writes
                    try:
                        mark_reopened(fd)
                    except OSError as e:
                        h.close()
                        raise StoreFailure(f"staging file of {entry.id}: {e}") from e
            return h
        if entry.blob is None:
            return Handle(entry.id, None, b"", False)
        if blob is None or blob.id != entry.blob:
            blob = r.blob(entry.blob)
        if blob is None:
            raise StoreFailure(f"content of message {entry.id} is missing")
        if blob.data is not None:
            return Handle(entry.id, None, bytes(blob.data), False)
        path = self.blobs.path(blob.sha256, blob.id)
        try:
            got = opening.open_cached(path) if cached_only else os.open(path, os.O_RDONLY)
        except OSError as e:
            raise StoreFailure(f"blob file of message {entry.id}: {e}") from e
        return None if got is None else Handle(entry.id, got, None, False)

    @contextmanager
    def _staging_errors(self, entry_id: int) -> Iterator[None]:
        """A failure on an upload's staging file as the caller's refusal: a file missing
        here is another host's upload (``Remote``) where uploads are this host's alone."""
        try:
            yield
        except FileNotFoundError as e:
            if self.local_uploads:
                raise self.remote(entry_id) from e
            raise StoreFailure(f"staging file of {entry_id}: {e}") from e
        except OSError as e:
            raise staging_error(e, f"staging file of {entry_id}") from e

    def _staging_file(self, entry_id: int) -> int:
        """An upload's staging file, open for reading and writing (made if missing, unless
        it is another host's: ``Remote``)."""
        with self._staging_errors(entry_id):
            return self.staging.open(entry_id, create=not self.local_uploads)

    @staticmethod
    def remote(entry_id: int) -> Remote:
        return Remote(f"upload {entry_id} is being written on another host: only that host "
                      "can read, write, publish or link it")

    def touch(self, entry_id: int, atime_ns: int | None, mtime_ns: int | None) -> None:
        """Set an upload's times (its staging file's)."""
        with self._staging_errors(entry_id):
            self.staging.touch(entry_id, atime_ns, mtime_ns, create=not self.local_uploads)

    def new_upload(self, entry_id: int, made: int | None = None) -> Handle:
        """The empty staging file of a new upload, created and held for writing. Called in
        the transaction that inserts the upload's row, so that from the moment the row is
        committed another daemon's recovery finds it in use (never a crash leftover).
        ``made``: the file's held descriptor, made ahead (service/staging_pool.py); its
        times become now, as a new file's are."""
        try:
            if made is not None:
                os.utime(made)
                fd = made
            else:
                fd = self.staging.create_locked(entry_id)
        except OSError as e:
            raise staging_error(e, f"staging file of {entry_id}") from e
        h = Handle(entry_id, fd, None, True, sealed=False)
        h.sync_key = path = self.staging.path(entry_id)
        if self.hashes_ahead:
            if len(self._running) >= RUNNING_MAX:
                try:
                    self._running.popitem(last=False)[1].drop()
                except KeyError:  # emptied meanwhile
                    pass
            h.running = self._running[entry_id] = RunningHash(path)
        return h

    def forget(self, entry_id: int, wait: bool = False) -> threading.Thread | None:
        """Drop the running hash of an upload (removed, resized, rolled back). Returns its
        thread, if any, that may still read the file to the end of its step; ``wait``: join
        it here."""
        running = self._running.pop(entry_id, None)
        return running.drop(wait) if running is not None else None

    def resize(self, entry_id: int, size: int) -> Cut | None:
        """Resize an upload's staging file (its size is the file's: no transaction). A cut
        that may free more than a block (``freeing.frees_much``: it frees as a removal does,
        0.4 s for 256 MiB with ``discard``) is returned, to be made in a worker thread; else
        it is made here. The file is opened here either way: the cut holds it open, however
        the upload fares meanwhile (removed, it is freed when the cut lets go)."""
        self.forget(entry_id)  # (its thread stops after its step: no need to wait)
        cut = Cut(entry_id, self._staging_file(entry_id), size, self.staging.path(entry_id))
        try:
            if self.hashes_ahead:  # a running hash of another daemon may not miss it either
                mark_reopened(cut.fd)
            much = freeing.frees_much(os.fstat(cut.fd), size)
        except OSError as err:
            cut.abandon()
            raise staging_error(err, f"resize of staging file {entry_id}") from err
        if much:
            return cut
        cut.make()
        return None

    @staticmethod
    def seal_may_wait() -> bool:
        """Whether a seal of even a small upload may wait for the disk: once a sync failure is
        kept, it waits for its upload's early syncs still queued or under way (an upload
        written large and cut small has some) before it answers."""
        return WRITEBACK.any_failed()

    def seal(self, entry_id: int) -> Sealed:
        """Hash and fsync an upload's staging file (blocking: run off the event loop for big
        files; a large one is synced while it is hashed). The file stays where it is until
        the transaction that attaches it commits."""
        path = self.staging.path(entry_id)
        running = self._running.pop(entry_id, None)
        try:
            with self._staging_errors(entry_id):
                fd = os.open(path, os.O_RDONLY | (0 if self.local_uploads else os.O_CREAT),
                             0o600)
        except SpoolError:
            if running is not None:
                running.drop()
            raise
        try:
            st = os.fstat(fd)
            if failed_before(st.st_mode) or WRITEBACK.any_failed() and \
                    WRITEBACK.sync_failed(path):  # an error the kernel told once
                raise _refused_unsynced(entry_id)
            if st.st_size <= self.inline_max:  # inline: read once, hash what was read
                small = os.pread(fd, self.inline_max + 1, 0)
                if len(small) <= self.inline_max:
                    return Sealed(hashlib.sha256(small).digest(), len(small), st.st_mtime_ns,
                                  small, path)
            overlap = st.st_size >= max(OVERLAP_MIN, self.inline_max + 1)
            with _syncing(fd, path) if overlap else nullcontext():
                ahead = running.digest(fd, st) if running is not None else None
                sha, size = ahead if ahead is not None else hash_file(fd)
            data = os.pread(fd, size, 0) if size <= self.inline_max else None
            if data is None and not overlap:
                _sync(fd, path)
            # an early sync's, told once; or a mark another daemon's made while this ran
            if WRITEBACK.sync_failed(path) or failed_before(os.fstat(fd).st_mode):
                raise _refused_unsynced(entry_id)
        finally:
            os.close(fd)
            if running is not None:
                running.drop()
        return Sealed(sha, size, st.st_mtime_ns, data, path)

    def seal_and_store(self, entry_id: int, reserve_id: Callable[[], int],
                       r: ReadTx | None = None) -> Sealed:
        """``seal``, then ``store``."""
        return self.store(self.seal(entry_id), reserve_id, r)

    def store(self, sealed: Sealed, reserve_id: Callable[[], int], r: ReadTx | None = None
              ) -> Sealed:
        """For a remote blob store, store sealed content that is not inline under a blob id
        reserved for it: before the transaction that attaches it (blocking). Content already
        stored (the same bytes published before, found through ``r``) is not stored again."""
        if r is not None and sealed.data is None and r.blob_by_sha(sealed.sha256) is not None:
            return sealed  # attach shares it (if it is gone by then, the publish fails: EIO)
        if self.blobs.remote and sealed.data is None:
            sealed.blob_id = reserve_id()
            self.blobs.upload(sealed.staging_path, sealed.sha256, sealed.blob_id)
        return sealed

    def fetch(self, r: ReadTx, entry: Entry, blob: Blob | None = None) -> Blob | None:
        """Make a published message's content readable here (a remote store: into the local
        cache; blocking); its blob row (``blob`` if given), for ``open``."""
        if not self.blobs.remote or entry.staged or entry.blob is None:
            return None
        if blob is None:
            blob = r.blob(entry.blob)
        if blob is not None and blob.data is None:
            self.blobs.fetch(blob.sha256, blob.id, blob.size)
        return blob

    def attach(self, tx: WriteTx, entry_id: int, sealed: Sealed) -> None:
        """In a transaction: point the message at the content, sharing an existing blob. (An
        object stored for it that another row's identical content makes unneeded is an
        orphan: gc removes it after its grace period.)"""
        data = sealed.data if sealed.blob_id is None else None
        bid, new = tx.attach_blob(entry_id, sealed.sha256, sealed.size, data, sealed.mtime_ns,
                                  blob_id=sealed.blob_id)
        if new and sealed.blob_id is None and sealed.data is None:
            if self.blobs.remote:  # (raised in the transaction: the new row goes with it)
                raise StoreFailure("content for a remote blob store was not stored first")
            self.blobs.place(sealed.staging_path, sealed.sha256, bid)

    def release(self, tx: WriteTx, entry: Entry, cleanup: list[tuple[str, object]]) -> None:
        """In a transaction: drop a message's hold on its content. Files are removed by
        ``cleanup`` after the commit, so a rollback loses nothing."""
        if entry.staged:
            cleanup.append(("staging", entry.id))
        if entry.blob is not None and tx.blob_ref(entry.blob, -1) == 0:
            blob = tx.blob(entry.blob)
            tx.blob_delete(entry.blob)
            if blob is not None and blob.data is None:
                cleanup.append(("blob", (blob.sha256, blob.id)))

    def cleanup(self, items: list[tuple[str, object]],
                open_here: bool = False) -> freeing.Held:
        """Remove the files of what a committed transaction deleted: their names go now; what
        is returned holds the space of large ones until freed (blobs/freeing.py), with the
        running hash of a staging file that still reads it. ``open_here``: a handle of this
        daemon holds the staging files open, and its last close frees them (off the loop):
        only their names go."""
        held = freeing.Held()
        try:
            for kind, what in items:
                reader = None
                if kind == "staging":
                    reader = self.forget(cast(int, what))
                    # (rare: no path made for every removal)
                    if WRITEBACK.any_failed() or WRITEBACK.any_pending():
                        WRITEBACK.forget(self.staging.path(cast(int, what)))
                    if open_here:
                        self.staging.remove(cast(int, what))
                        continue
                    fd = self.staging.detach(cast(int, what))
                else:
                    sha, bid = cast(tuple[bytes, int], what)
                    fd = self.blobs.detach(sha, bid)
                if fd is not None:
                    held.fds.append(fd)
                    if reader is not None:
                        held.readers.append(reader)
        except BaseException:
            freeing.close_all(held.fds)
            raise
        return held
