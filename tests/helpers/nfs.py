"""An NFS server for the tests: nfs-ganesha (FSAL VFS) exporting a spoolfs mount on loopback,
with the export block of mount-examples/ganesha.conf, and rpcbind (started if none runs,
stopped after). This kernel has no NFS server or client: the clients are libnfs
(helpers/nfsclient.py). Never skipped: a server that cannot start fails the test with its
log.

The server takes the machine's port 2049, and the suite runs in two processes: a test holds
``port_2049()`` (a lock file) from before its server starts until it has stopped, and a test
that needs the port while another holds it waits its turn."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from helpers.nfsclient import NfsClient
from helpers.waiting import patience

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "mount-examples" / "ganesha.conf"
GANESHA = "/usr/bin/ganesha.nfsd"
PSEUDO = "/spool"
LOOPBACK = "127.0.0.1"
LOCK = "/tmp/spoolfs-test-nfs-port.lock"


def take_port_2049() -> IO[str]:
    """The machine's NFS port for this test, once no other test holds it (a lock held until
    the returned file is closed)."""
    lock = open(LOCK, "a")  # noqa: SIM115 (held open by the caller: the lock)
    deadline = time.monotonic() + patience(120)
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() >= deadline:
                lock.close()
                raise AssertionError(f"another test has held port 2049 ({LOCK}) for "
                                     f"{patience(120):g} s") from None
            time.sleep(0.05)


@contextlib.contextmanager
def port_2049() -> Iterator[None]:
    """Hold the machine's NFS port (see the module's docstring) for the ``with`` block."""
    lock = take_port_2049()
    try:
        yield
    finally:
        lock.close()


def pids(name: str) -> list[int]:
    """The processes named ``name`` (pgrep -x)."""
    found = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def client(version: int, timeout_ms: int = 20000) -> NfsClient:
    """A client of the export on loopback, speaking NFS ``version``."""
    return NfsClient(LOOPBACK, PSEUDO, version, timeout_ms=timeout_ms)


def config_for(export: Path) -> str:
    """mount-examples/ganesha.conf with ``Path`` set to ``export``, on loopback only."""
    text = EXAMPLE.read_text()
    text = re.sub(r"(?m)^(\s*)Path = .*;$", rf"\1Path = {export};", text)
    return text.replace("NFS_CORE_PARAM {", "NFS_CORE_PARAM {\n    Bind_addr = 127.0.0.1;", 1)


class NfsServer:
    def __init__(self, export: Path, workdir: Path) -> None:
        self.export = export
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.conf = self.dir / "ganesha.conf"
        self.log = self.dir / "ganesha.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._rpcbind: subprocess.Popen[bytes] | None = None
        self._port: IO[str] | None = None

    def start(self) -> NfsServer:
        """Start the server (again, after ``stop``); the port is held until ``close``."""
        if not os.path.exists(GANESHA):
            raise AssertionError("nfs-ganesha is not installed: apt-get install nfs-ganesha "
                                 "nfs-ganesha-vfs rpcbind libnfs-utils")
        if self._port is None:
            self._port = take_port_2049()
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> NfsServer:
        if pids("ganesha.nfsd"):
            raise AssertionError("another ganesha.nfsd runs (port 2049 is taken)")
        if not pids("rpcbind"):
            self._rpcbind = subprocess.Popen(["rpcbind", "-f", "-w"],
                                             stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL)
            time.sleep(0.3)
        self.conf.write_text(config_for(self.export))
        self.proc = subprocess.Popen(
            [GANESHA, "-F", "-f", str(self.conf), "-L", str(self.log),
             "-p", str(self.dir / "ganesha.pid"), "-N", "NIV_EVENT"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + patience(60)
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ganesha.nfsd exited {self.proc.returncode}\n{self.tail()}")
            try:
                client(3, timeout_ms=2000).close()
                return self
            except OSError as e:
                last = e
                time.sleep(0.3)
        raise AssertionError(f"ganesha did not answer: {last}\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        if not self.log.exists():
            return "(no ganesha log)"
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def client(self, version: int) -> NfsClient:
        return client(version)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL; its descriptors in the mount are closed once it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=patience(20))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._rpcbind is not None:
            self._rpcbind.terminate()
            self._rpcbind.wait()
            self._rpcbind = None
        if self._port is not None:
            self._port.close()
            self._port = None
