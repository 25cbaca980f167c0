"""The SHA-256 of a large upload, computed while it is written.

Publishing seals an upload: its content is hashed (its address) and synced. Hashed at
publish, a large file costs its whole hash there (SHA-256 runs at 350-400 MB/s on a core
without SHA extensions: 0.7 s for 256 MiB, the larger part of a 256 MiB publish). Most
uploads are written front to back, so a thread of the upload's own can hash each part as
soon as it is written, on another core while the writer goes on; publishing then hashes
only what the thread has not reached yet.

The running hash is only a head start: it is used only when every byte of the file is known
to have been hashed as it stands. Writes through this daemon report themselves (``wrote``);
one that does not continue where the last ended (a rewrite, a hole), or a failed one, breaks
the hash. Anything else that changes the file breaks it too: a resize, and an opening for
writing that does not share this hash (another daemon's of the store, or this one's once
the hash is gone), which sets ``REOPENED`` in the file's mode first (a bit the file's use
ignores: the sticky bit of a regular file). A broken hash, or one of a file whose mode
carries the mark, or that is no longer the file the thread read, or shorter than was
written, is dropped; publishing then hashes the whole file, as without it. Where the
staging directory's file system does not keep the mark (``keeps_marks``), no daemon of the
store hashes ahead.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading

from spoolfs.blobs.files import hash_file
from spoolfs.blobs.threads import started

#: The thread is woken once this much more is written, and reads and hashes this much at a
#: time, into one buffer of its own: a thread starts once an upload is this large (smaller
#: ones are hashed at publish: a thread costs more than it saves). Every wake-up, read and
#: hash takes the interpreter lock back once, and while a writer keeps the event loop busy
#: each such hand-over can hold a write up (with 1 MiB steps, about one 1 MiB write in two
#: waited for the lock; with 4 MiB steps, one in five); the tail left to publish is at most
#: this much (4 ms of hashing).
STEP = 4 << 20
#: the mark of a staging file opened for writing other than by its creation
REOPENED = stat.S_ISVTX
#: a thread with nothing to hash for this long ends (a new write starts another)
IDLE_S = 1.0


def keeps_marks(directory: str) -> bool:
    """Whether files in ``directory`` keep ``REOPENED`` once it is set (a file system that
    ignores a chmod would let another daemon's writes go unseen)."""
    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".mark-")
    except OSError:
        return False
    try:
        os.unlink(path)
        os.fchmod(fd, 0o600 | REOPENED)
        return bool(os.fstat(fd).st_mode & REOPENED)
    except OSError:
        return False
    finally:
        os.close(fd)


def mark_reopened(fd: int) -> None:
    """Mark the staging file open on ``fd`` as written other than by its creator, before
    anything writes it through that descriptor (OSError: it could not be marked)."""
    mode = os.fstat(fd).st_mode
    if not mode & REOPENED:
        os.fchmod(fd, stat.S_IMODE(mode) | REOPENED)


class RunningHash:
    """The hash of the file at ``path`` as far as it has been written from its start."""

    __slots__ = ("path", "end", "broken", "_hashed", "_woken", "_hash", "_cond", "_thread",
                 "_stop", "_file")

    def __init__(self, path: str) -> None:
        self.path = path
        self.end = 0  # bytes written front to back so far
        self.broken = False
        self._hashed = 0  # of them, hashed by the thread
        self._woken = 0  # ``end`` when the thread was last woken
        # made with the first thread (most uploads are small: a new upload costs ~0.3 µs, not 4)
        self._hash: hashlib._Hash | None = None
        self._cond: threading.Condition | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._file: tuple[int, int] | None = None  # device and inode the thread read

    def wrote(self, off: int, n: int) -> None:
        """``n`` bytes were written at ``off`` (the event loop: no waiting but for a lock)."""
        if self.broken:
            return
        if off != self.end:
            self.drop()
            return
        self.end = end = off + n
        if end - self._woken >= STEP:
            self._woken = end
            if self._cond is None:
                self._hash = hashlib.sha256()
                self._cond = threading.Condition(threading.Lock())
            with self._cond:
                if self._stop:
                    return
                if self._thread is not None:
                    self._cond.notify()
                    return
                thread = started(self._run, "spoolfs-hash")
                if thread is None:  # no thread to be had: hashed at publish
                    self.broken = self._stop = True
                    return
                self._thread = thread

    def _halt(self) -> threading.Thread | None:
        """Have the thread stop after its step: the thread to join, if any."""
        if self._cond is None:
            return None
        with self._cond:
            self._stop = True
            self._cond.notify()
            return self._thread

    def drop(self, wait: bool = False) -> threading.Thread | None:
        """Give up: the file changed other than by writes at its end. Returns the thread,
        if any, that may still read the file to the end of its step (a few ms), holding it
        open; ``wait``: join it here."""
        self.broken = True
        thread = self._halt()
        if wait and thread is not None:
            thread.join()
        return thread

    def digest(self, fd: int, st: os.stat_result) -> tuple[bytes, int] | None:
        """SHA-256 and size of the whole file, open on ``fd`` (``st``: its status now),
        hashing only what the thread has not; None if the hash is broken, the file was marked
        reopened, is not the one the thread read, or is shorter than was written, or if
        nothing was hashed ahead (a small upload). Blocking (a worker thread); the hash
        cannot be used again."""
        thread = self._halt()
        if thread is not None:
            thread.join()
        usable = (not self.broken and self._hash is not None and not st.st_mode & REOPENED
                  and self._file == (st.st_dev, st.st_ino) and st.st_size >= self.end)
        self.broken = True  # used up
        if not usable:
            return None
        sha, size = hash_file(fd, self._hash, self._hashed)
        return (sha, size) if os.fstat(fd).st_size == size else None

    def _run(self) -> None:
        cond, hashing = self._cond, self._hash
        assert cond is not None and hashing is not None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # gone already
            self.broken = True
            return
        try:
            st = os.fstat(fd)
            if self._file is None:
                self._file = (st.st_dev, st.st_ino)
            elif self._file != (st.st_dev, st.st_ino):  # after an idle end: another file
                self.broken = True
                return
            buf = bytearray(STEP)
            while True:
                with cond:
                    while self._hashed + STEP > self.end and not self._stop:
                        if not cond.wait(IDLE_S) and self._hashed + STEP > self.end:
                            self._thread = None  # idle: a later write starts another
                            return
                    if self._stop:
                        return
                    todo = self.end - self._hashed
                todo -= todo % STEP  # whole steps: the tail is hashed at publish
                while todo > 0 and not self._stop:
                    if os.preadv(fd, [buf], self._hashed) != STEP:  # shorter than written:
                        self.broken = True  # it was cut
                        return
                    hashing.update(buf)
                    self._hashed += STEP
                    todo -= STEP
        except OSError:
            self.broken = True
        finally:
            os.close(fd)
