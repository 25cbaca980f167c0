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
the hash. Anything else that changes the file breaks it too: a resize, and any other opening
for writing, by this daemon or another one of the store, which sets ``REOPENED`` in the
file's mode first (a bit the file's use ignores: the sticky bit of a regular file). A broken
hash, or one of a file whose mode carries the mark, is dropped; publishing then hashes the
whole file, as without it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading

from spoolfs.blobs.files import CHUNK, hash_file

#: the thread starts once an upload is this large (smaller ones are hashed at publish: a
#: thread costs more than it saves)
START = 1 << 20
#: the mark of a staging file opened for writing other than by its creation
REOPENED = stat.S_ISVTX
#: a thread with nothing to hash for this long ends (a new write starts another)
IDLE_S = 1.0


def mark_reopened(fd: int) -> None:
    """Mark the staging file open on ``fd`` as written other than by its creator, before
    anything writes it through that descriptor (OSError: it could not be marked)."""
    mode = os.fstat(fd).st_mode
    if not mode & REOPENED:
        os.fchmod(fd, stat.S_IMODE(mode) | REOPENED)


class RunningHash:
    """The hash of the file at ``path`` as far as it has been written from its start."""

    __slots__ = ("path", "end", "broken", "_hashed", "_woken", "_hash", "_cond", "_thread",
                 "_stop")

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

    def wrote(self, off: int, n: int) -> None:
        """``n`` bytes were written at ``off`` (the event loop: no waiting but for a lock)."""
        if self.broken:
            return
        if off != self.end:
            self.drop()
            return
        self.end = end = off + n
        if end >= START and end - self._woken >= CHUNK:
            self._woken = end
            if self._cond is None:
                self._hash = hashlib.sha256()
                self._cond = threading.Condition(threading.Lock())
            with self._cond:
                if self._stop:
                    return
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="spoolfs-hash",
                                                    daemon=True)
                    self._thread.start()
                else:
                    self._cond.notify()

    def drop(self) -> None:
        """Give up: the file changed other than by writes at its end (or is gone)."""
        self.broken = True
        if self._cond is not None:
            with self._cond:
                self._stop = True
                self._cond.notify()

    def digest(self, fd: int, mode: int) -> tuple[bytes, int] | None:
        """SHA-256 and size of the whole file, open on ``fd`` (``mode``: its mode now),
        hashing only what the thread has not; None if the hash is broken or the file was
        marked reopened, or nothing was hashed ahead (a small upload). Blocking (a worker
        thread); the hash cannot be used again."""
        if self._cond is not None:
            with self._cond:  # the thread stops after its chunk: the rest is hashed here
                self._stop = True
                self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        usable = not self.broken and self._hash is not None and not mode & REOPENED
        self.broken = True  # used up
        return hash_file(fd, self._hash, self._hashed) if usable else None

    def _run(self) -> None:
        cond, hashing = self._cond, self._hash
        assert cond is not None and hashing is not None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # gone already
            self.broken = True
            return
        try:
            while True:
                with cond:
                    while self._hashed + CHUNK > self.end and not self._stop:
                        if not cond.wait(IDLE_S) and self._hashed + CHUNK > self.end:
                            self._thread = None  # idle: a later write starts another
                            return
                    if self._stop:
                        return
                    todo = self.end - self._hashed
                todo -= todo % CHUNK  # whole chunks: the tail is hashed at publish
                while todo > 0 and not self._stop:
                    chunk = os.pread(fd, CHUNK, self._hashed)
                    if len(chunk) != CHUNK:  # shorter than written: it was cut
                        self.broken = True
                        return
                    hashing.update(chunk)
                    self._hashed += CHUNK
                    todo -= CHUNK
        except OSError:
            self.broken = True
        finally:
            os.close(fd)
