"""Logging: stderr in the foreground, a file when asked, syslog when daemonized."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup(level: str, log_file: str | None, foreground: bool) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    handler: logging.Handler
    if log_file:
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter(FORMAT))
    elif foreground:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
    elif os.path.exists("/dev/log"):
        handler = logging.handlers.SysLogHandler(address="/dev/log")
        handler.setFormatter(logging.Formatter("spoolfs[%(process)d]: %(levelname)s %(message)s"))
    else:
        handler = logging.NullHandler()
    root.addHandler(handler)
