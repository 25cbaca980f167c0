"""Queue paths: a queue's state directories and the moves between them, made with real
``mv``/``cp`` processes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from helpers.procs import ok

STATES = ("partial", "ready", "working", "success", "error")


class Queue:
    """Paths of one queue plus the shell steps of its lifecycle (each step a real process)."""

    def __init__(self, path: Path, scratch: Path) -> None:
        self.path = path
        self.scratch = scratch
        self.name = path.name
        scratch.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"Queue({self.path})"

    @classmethod
    def create(cls, parent: Path, name: str, scratch: Path) -> Queue:
        ok("mkdir", str(parent / name))
        return cls(parent / name, scratch)

    @property
    def partial(self) -> Path:
        return self.path / "partial"

    @property
    def ready(self) -> Path:
        return self.path / "ready"

    @property
    def working(self) -> Path:
        return self.path / "working"

    @property
    def success(self) -> Path:
        return self.path / "success"

    @property
    def error(self) -> Path:
        return self.path / "error"

    def state(self, name: str) -> Path:
        return self.path / name

    def consumer(self, name: str = "w1") -> Path:
        """The consumer view ``working/NAME`` (``mkdir`` registers it)."""
        view = self.working / name
        if not view.exists():
            ok("mkdir", str(view))
        return view

    def source(self, data: bytes) -> Path:
        """A file outside the mount holding ``data`` (what ``cp`` copies in)."""
        fd, name = tempfile.mkstemp(dir=self.scratch, prefix="src-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return Path(name)

    def put(self, name: str, data: bytes | None = None) -> bytes:
        """Upload into ``partial/`` with ``cp``."""
        data = make_content(name) if data is None else data
        ok("cp", "--", str(self.source(data)), str(self.partial / name))
        return data

    def publish(self, name: str, data: bytes | None = None) -> bytes:
        """``cp`` into ``partial/``, then ``mv`` to ``ready/``."""
        data = self.put(name, data)
        ok("mv", "--", str(self.partial / name), str(self.ready / name))
        return data

    def claim(self, name: str, consumer: str = "w1") -> Path:
        view = self.consumer(consumer)
        ok("mv", "--", str(self.ready / name), str(view) + "/")
        return view / name

    def finish(self, name: str, consumer: str = "w1", to: str = "success") -> Path:
        ok("mv", "--", str(self.working / consumer / name), str(self.state(to)) + "/")
        return self.state(to) / name

    def populate(self) -> dict[str, Path]:
        """One message in every state: partial/p, ready/r, working/w1/w, success/s, error/e."""
        self.put("p", b"partial content\n")
        for name in ("r", "w", "s", "e"):
            self.publish(name, f"message {name}\n".encode())
        self.claim("w")
        for name, to in (("s", "success"), ("e", "error")):
            self.claim(name)
            self.finish(name, to=to)
        return {"partial": self.partial / "p", "ready": self.ready / "r",
                "working": self.working / "w1" / "w", "success": self.success / "s",
                "error": self.error / "e"}


def make_content(name: str | bytes, size: int = 0) -> bytes:
    """Distinct content for a message: its name, then ``size`` random bytes."""
    head = os.fsencode(name) + b"\n"
    return head + os.urandom(size)

