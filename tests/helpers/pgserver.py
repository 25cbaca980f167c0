"""A PostgreSQL server for the tests: the distribution's, started in a temporary directory as
the unprivileged ``postgres`` user (PostgreSQL refuses to run as root), on loopback only, on a
free port; each test gets a database of its own. Never skipped: a server that cannot start
fails the test with its log."""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg

from helpers.ports import free_port, port_taken

BIN_GLOB = "/usr/lib/postgresql/*/bin"
USER = "postgres"


def bindir() -> str:
    found = sorted(glob.glob(BIN_GLOB))
    if not found:
        raise AssertionError("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin): "
                             "apt-get install postgresql")
    return found[-1]


class PgServer:
    def __init__(self, durable: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="spoolfs-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = free_port()
        self.durable = durable
        self._started = False
        self._names = itertools.count(1)
        shutil.chown(self.dir, USER)
        os.chmod(self.dir, 0o700)

    def _as_user(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
        cmd = [os.path.join(bindir(), argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", USER, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, timeout=timeout)

    def _check(self, res: subprocess.CompletedProcess[bytes], what: str) -> None:
        if res.returncode != 0:
            log = self.log.read_text(errors="replace") if self.log.exists() else ""
            raise AssertionError(f"PostgreSQL {what} failed ({res.returncode}):\n"
                                 f"{res.stdout.decode(errors='replace')}"
                                 f"{res.stderr.decode(errors='replace')}\n{log[-3000:]}")

    def start(self, attempts: int = 3) -> PgServer:
        """Start the server. Its first start, where another listener took the port meanwhile,
        starts again on another; a start after that keeps the port its clients know."""
        for attempt in range(1, attempts + 1):
            try:
                self._start()
            except AssertionError as e:
                if (self._started or attempt == attempts
                        or not port_taken(str(e))):
                    raise
                self.port = free_port()
                continue
            self._started = True
            return self
        raise AssertionError("unreachable")

    def _start(self) -> None:
        if not self.data.exists():
            self._check(self._as_user("initdb", "-D", str(self.data), "-A", "trust", "-U", USER,
                                      "--no-sync", "-E", "UTF8"), "initdb")
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if not self.durable:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._check(self._as_user("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts,
                                  "-w", "-t", "60", "start"), "start")

    def stop(self, mode: str = "fast") -> None:
        self._as_user("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def running(self) -> bool:
        return self._as_user("pg_ctl", "-D", str(self.data), "status").returncode == 0

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        if self.data.exists():
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
