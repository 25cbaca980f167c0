"""Argument parsing shared by every command: one line per error, plain-words types."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from spoolfs.cli.exits import Exit


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (and exit ``Exit.USAGE``), and whose
    description may be a module's docstring: its reST quotes are dropped from the help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("description"):
            kwargs["description"] = kwargs["description"].replace("``", "")
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message} (see {self.prog} --help)\n")
        sys.exit(Exit.USAGE)


def seconds(text: str) -> float:
    """A number of seconds, zero or more."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, not {text!r}")
    return v


def positive_seconds(text: str) -> float:
    """A number of seconds above zero."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, not {text!r}")
    return v


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, not {text!r}")
    return v
