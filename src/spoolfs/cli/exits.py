"""Every exit status of the command line, in one place (docs/cli.md lists them)."""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    """What every command returns."""

    OK = 0  #: done
    FAILURE = 1  #: the command ran and failed (one line on stderr says why)
    USAGE = 2  #: the command line is wrong: an unknown command, a bad argument
    INTERRUPTED = 130  #: stopped by Ctrl-C (SIGINT)


class Check(IntEnum):
    """What ``spoolfs status --check`` returns, as Nagios and its kin read it."""

    OK = 0  #: no threshold crossed
    WARNING = 1  #: a queue is behind: an age, error or per-consumer threshold crossed
    CRITICAL = 2  #: the store's disk is below min_free: writes will soon be refused
    UNKNOWN = 3  #: the status could not be read (no mount, no store, a dead daemon)


DESCRIPTIONS = {
    "Exit": "every command",
    "Check": "spoolfs status --check",
}
