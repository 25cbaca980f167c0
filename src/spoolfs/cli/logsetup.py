"""Logging: stderr in the foreground, a file when asked, syslog when daemonized.

In the foreground under systemd, stderr is the journal: systemd says so in ``$JOURNAL_STREAM``
(the device and inode of that stream). Lines then carry no time stamp (the journal adds its own)
and start with a ``<N>`` syslog priority, which journald turns into the entry's level."""

from __future__ import annotations

import logging
import logging.handlers
import os
import stat
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: sd-daemon(3) priority prefixes
PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
              logging.CRITICAL: 2}


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prio = PRIORITIES.get(record.levelno, 6)
        # every line of a multi-line message (a traceback) becomes an entry of its own
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).splitlines())


def stderr_is_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = stream.partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):
        return False


def setup(level: str, log_file: str | None, foreground: bool) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    handler: logging.Handler
    tightened = ""
    if log_file:
        tightened = _private_log(log_file)
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter(FORMAT))
    elif foreground:
        handler = logging.StreamHandler(sys.stderr)
        if stderr_is_journal():
            handler.setFormatter(JournalFormatter("%(levelname)s %(name)s: %(message)s"))
        else:
            handler.setFormatter(logging.Formatter(FORMAT))
    elif os.path.exists("/dev/log"):
        handler = logging.handlers.SysLogHandler(
            address="/dev/log", facility=logging.handlers.SysLogHandler.LOG_DAEMON)
        handler.setFormatter(logging.Formatter("spoolfs[%(process)d]: %(levelname)s %(message)s"))
    else:
        handler = logging.NullHandler()
    root.addHandler(handler)
    if tightened:
        logging.getLogger("spoolfs").warning("log file %s was open to other users: %s",
                                             log_file, tightened)


#: A log names messages, queues and users: the file is 0600 when spoolfs makes it. An existing
#: one keeps read access for its group (an admin's ``adm`` log group, say), never more.
LOG_MODE = 0o600
LOG_MODE_MAX = 0o640


def _private_log(path: str) -> str:
    """Make ``path`` (0600 when new) and take away what goes beyond 0640; returns the change
    made, or ""."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, LOG_MODE)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & ~LOG_MODE_MAX:
            os.fchmod(fd, mode & LOG_MODE_MAX)
            return f"mode {mode:04o}->{mode & LOG_MODE_MAX:04o}"
        return ""
    finally:
        os.close(fd)
