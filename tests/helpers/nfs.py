"""An NFS server for the tests: nfs-ganesha (FSAL VFS) exporting a spoolfs mount on loopback,
with the export block of mount-examples/ganesha.conf, and rpcbind (started if none runs,
stopped after). This kernel has no NFS server or client: the clients are libnfs
(helpers/nfsclient.py). Never skipped: a server that cannot start fails the test with its
log."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from helpers.nfsclient import NfsClient
from helpers.waiting import patience

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "mount-examples" / "ganesha.conf"
GANESHA = "/usr/bin/ganesha.nfsd"
PSEUDO = "/spool"
LOOPBACK = "127.0.0.1"


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

    def start(self) -> NfsServer:
        if not os.path.exists(GANESHA):
            raise AssertionError("nfs-ganesha is not installed: apt-get install nfs-ganesha "
                                 "nfs-ganesha-vfs rpcbind libnfs-utils")
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
