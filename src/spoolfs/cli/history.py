"""``spoolfs history FILE...``: every transition of a message on a mount — when, what, from
where to where, by whom (uid and pid, or the daemon itself) and why."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from spoolfs.cli.args import Parser
from spoolfs.core.errors import UserError


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="spoolfs history", description=__doc__)
    p.add_argument("files", metavar="FILE", nargs="+", help="a message on a spoolfs mount")
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    for i, path in enumerate(args.files):
        try:
            text = os.getxattr(path, "user.spool.history").decode(errors="replace")
        except OSError as e:
            if e.errno in (errno.ENODATA, errno.ENOTSUP):
                raise UserError(f"{path} is not a message on a spoolfs mount") from None
            raise UserError(f"{path}: {e.strerror}") from None
        if len(args.files) > 1:
            print(f"{'' if i == 0 else chr(10)}{path}:")
        sys.stdout.write(text)
    return 0
