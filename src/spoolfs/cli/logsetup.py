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
from io import TextIOWrapper
from typing import cast

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: sd-daemon(3) priority prefixes
PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
              logging.CRITICAL: 2}


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prio = PRIORITIES.get(record.levelno, 6)
        # every line of a multi-line message (a traceback) becomes an entry of its own
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).splitlines())


class PrivateFileHandler(logging.handlers.WatchedFileHandler):
    """A log file only its owner may read: refusals name files, and the log is the queue's
    history in prose. A new file is made 0600; an existing one loses any permission for others
    (an admin's 0640 for a log-reading group stays). Reopened when it is renamed or removed
    (logrotate without ``copytruncate``): the next line goes to a new file of that name."""

    def _open(self) -> TextIOWrapper:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                     0o600)
        try:
            mode = os.fstat(fd).st_mode
            if mode & 0o007:
                os.fchmod(fd, stat.S_IMODE(mode) & ~0o007)
        except OSError:
            pass  # not ours to change (a shared log of another user): write to it as it is
        # the handler's mode is text ('a'): open() returns a TextIOWrapper
        return cast(TextIOWrapper, open(fd, self.mode, encoding=self.encoding,
                                        errors=self.errors))


def stderr_is_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = stream.partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):
        return False


#: where a daemonized spoolfs logs (syslog, hence the journal), when it exists
SYSLOG = "/dev/log"
#: the syslog tag of each line: the program and its pid, as syslog(3) writes them
SYSLOG_FORMAT = "spoolfs[%(process)d]: %(levelname)s %(message)s"

QUIET_LIBRARIES = ("botocore", "boto3", "urllib3", "s3transfer", "psycopg", "psycopg.pool")


def setup(level: str, log_file: str | None, foreground: bool) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    handler: logging.Handler
    if log_file:
        handler = PrivateFileHandler(log_file)
        handler.setFormatter(logging.Formatter(FORMAT))
    elif foreground:
        handler = logging.StreamHandler(sys.stderr)
        if stderr_is_journal():
            handler.setFormatter(JournalFormatter("%(levelname)s %(name)s: %(message)s"))
        else:
            handler.setFormatter(logging.Formatter(FORMAT))
    elif os.path.exists(SYSLOG):
        handler = logging.handlers.SysLogHandler(
            address=SYSLOG, facility=logging.handlers.SysLogHandler.LOG_DAEMON)
        handler.setFormatter(logging.Formatter(SYSLOG_FORMAT))
    else:
        handler = logging.NullHandler()
    root.addHandler(handler)
    # The store's client libraries log every retry with a traceback at DEBUG: their warnings
    # are enough; what failed reaches the log once, as spoolfs's own line.
    for noisy in QUIET_LIBRARIES:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
