"""An NFS client in user space: libnfs (Debian's libnfs13) through ctypes, for the tests of a
spool exported over NFS (this kernel has no NFS client). Each call is synchronous; a failure
is an ``OSError`` with the errno the server answered."""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import time
from typing import Any

_lib: Any = None


def _libnfs() -> Any:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libnfs.so.13", use_errno=True)
        vp, cp, c_int, u64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64
        pp = ctypes.POINTER(ctypes.c_void_p)
        for name, args, res in [
            ("nfs_init_context", [], vp), ("nfs_destroy_context", [vp], None),
            ("nfs_get_error", [vp], cp), ("nfs_set_version", [vp, c_int], c_int),
            ("nfs_set_timeout", [vp, c_int], None),
            ("nfs4_set_client_name", [vp, cp], None), ("nfs4_set_verifier", [vp, cp], None),
            ("nfs_mount", [vp, cp, cp], c_int), ("nfs_umount", [vp], c_int),
            ("nfs_open", [vp, cp, c_int, pp], c_int),
            ("nfs_create", [vp, cp, c_int, c_int, pp], c_int),
            ("nfs_pwrite", [vp, vp, u64, u64, ctypes.c_char_p], c_int),
            ("nfs_pread", [vp, vp, u64, u64, ctypes.c_void_p], c_int),
            ("nfs_fsync", [vp, vp], c_int), ("nfs_close", [vp, vp], c_int),
            ("nfs_rename", [vp, cp, cp], c_int), ("nfs_unlink", [vp, cp], c_int),
            ("nfs_mkdir", [vp, cp], c_int), ("nfs_stat64", [vp, cp, ctypes.c_void_p], c_int),
            ("nfs_utimes", [vp, cp, ctypes.c_void_p], c_int),
            ("nfs_opendir", [vp, cp, pp], c_int), ("nfs_readdir", [vp, vp], vp),
            ("nfs_closedir", [vp, vp], None),
        ]:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        _lib = lib
    return _lib


class _Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class _Dirent(ctypes.Structure):
    _fields_ = [("next", ctypes.c_void_p), ("name", ctypes.c_char_p)]


_contexts = itertools.count()


class NfsClient:
    """One client (one libnfs context, one mount of ``export`` on ``server``), speaking NFS
    ``version`` 3 or 4. Paths are relative to the export. Each NFSv4 client has a name and
    verifier of its own: two contexts under one name would be one client to the server, and
    the second one's SETCLIENTID would expire the first one's state (NFS4ERR_EXPIRED)."""

    def __init__(self, server: str, export: str, version: int, timeout_ms: int = 20000
                 ) -> None:
        self.lib = _libnfs()
        self.version = version
        self.ctx = self.lib.nfs_init_context()
        if not self.ctx:
            raise OSError(errno.ENOMEM, "nfs_init_context failed")
        self.lib.nfs_set_timeout(self.ctx, timeout_ms)
        ident = f"spoolfs-test-{os.getpid()}-{next(_contexts)}"
        self.lib.nfs4_set_client_name(self.ctx, ident.encode())
        self.lib.nfs4_set_verifier(self.ctx, ident[-8:].rjust(8, "0").encode())
        self._check(self.lib.nfs_set_version(self.ctx, version), "set_version")
        self._check(self.lib.nfs_mount(self.ctx, server.encode(), export.encode()), "mount")

    def __repr__(self) -> str:
        return f"NfsClient(v{self.version})"

    def _check(self, rc: int, what: str, path: str = "") -> int:
        if rc < 0:
            msg = (self.lib.nfs_get_error(self.ctx) or b"").decode(errors="replace")
            raise OSError(-rc, f"NFSv{self.version} {what} {path}: {msg}")
        return rc

    @staticmethod
    def _p(path: str) -> bytes:
        return ("/" + path.lstrip("/")).encode()

    def write_file(self, path: str, data: bytes, *, sync: bool = True) -> None:
        """Create (or truncate) ``path``, write ``data``, COMMIT it (``sync``), close."""
        fh = ctypes.c_void_p()
        self._check(self.lib.nfs_create(self.ctx, self._p(path),
                                        os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644,
                                        ctypes.byref(fh)), "create", path)
        try:
            off = 0
            while off < len(data):
                chunk = data[off:off + (1 << 20)]
                n = self._check(self.lib.nfs_pwrite(self.ctx, fh, off, len(chunk), chunk),
                                "write", path)
                off += n
            if sync:
                self._check(self.lib.nfs_fsync(self.ctx, fh), "commit", path)
        finally:
            self._check(self.lib.nfs_close(self.ctx, fh), "close", path)

    def read_file(self, path: str, limit: int = 1 << 24) -> bytes:
        fh = ctypes.c_void_p()
        self._check(self.lib.nfs_open(self.ctx, self._p(path), os.O_RDONLY, ctypes.byref(fh)),
                    "open", path)
        try:
            out = b""
            buf = ctypes.create_string_buffer(1 << 20)
            while len(out) < limit:
                n = self._check(self.lib.nfs_pread(self.ctx, fh, len(out), len(buf), buf),
                                "read", path)
                if n == 0:
                    break
                out += buf.raw[:n]
            return out
        finally:
            self.lib.nfs_close(self.ctx, fh)

    def rename(self, old: str, new: str) -> None:
        self._check(self.lib.nfs_rename(self.ctx, self._p(old), self._p(new)), "rename",
                    f"{old} -> {new}")

    def unlink(self, path: str) -> None:
        self._check(self.lib.nfs_unlink(self.ctx, self._p(path)), "remove", path)

    def mkdir(self, path: str) -> None:
        self._check(self.lib.nfs_mkdir(self.ctx, self._p(path)), "mkdir", path)

    def touch(self, path: str) -> None:
        """Set the times to now (SETATTR), as ``touch`` does: a claim's heartbeat."""
        now = time.time()
        times = (_Timeval * 2)(*[_Timeval(int(now), int(now % 1 * 1e6))] * 2)
        self._check(self.lib.nfs_utimes(self.ctx, self._p(path), times), "setattr", path)

    def exists(self, path: str) -> bool:
        """``[ -e path ]``: a LOOKUP and GETATTR of ``path`` (False when it is not there)."""
        st = ctypes.create_string_buffer(256)  # struct nfs_stat_64: 18 64-bit fields
        try:
            self._check(self.lib.nfs_stat64(self.ctx, self._p(path), st), "stat", path)
        except FileNotFoundError:
            return False
        return True

    def listdir(self, path: str) -> list[str]:
        d = ctypes.c_void_p()
        self._check(self.lib.nfs_opendir(self.ctx, self._p(path), ctypes.byref(d)), "readdir",
                    path)
        names = []
        try:
            while True:
                ent = self.lib.nfs_readdir(self.ctx, d)
                if not ent:
                    break
                name = _Dirent.from_address(ent).name.decode(errors="surrogateescape")
                if name not in (".", ".."):
                    names.append(name)
        finally:
            self.lib.nfs_closedir(self.ctx, d)
        return names

    def close(self) -> None:
        if self.ctx:
            self.lib.nfs_destroy_context(self.ctx)
            self.ctx = None
