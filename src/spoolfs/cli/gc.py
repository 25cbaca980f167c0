"""``spoolfs gc STORE [--grace SECONDS] [-v]``: remove what crashes leave behind — blob rows no
message references, blob files no row names, staging files without an upload — in two phases
(found, then checked again under the store's write lock). Safe while the store is mounted.

Orphan files younger than the grace period (default 600 s) are left alone. Prints one line per
removal with ``-v`` and always a summary; exits 0.
"""

from __future__ import annotations

import argparse

from spoolfs.cli.args import Parser, seconds
from spoolfs.core.errors import StoreFailure, StoreFull, UserError
from spoolfs.service import gc
from spoolfs.store.site import require_store


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="spoolfs gc",
               description="Remove what crashes leave behind: content no message refers to, "
                           "files no record names, uploads that were never finished. Each is "
                           "found first, then checked again under the store's write lock: safe "
                           "while the store is mounted.")
    p.add_argument("store", metavar="STORE", help="a store directory or postgresql:// URL")
    p.add_argument("--grace", type=seconds, metavar="SECONDS", default=gc.GRACE_NS / gc.NS,
                   help=f"leave orphan files younger than this (default {gc.GRACE_NS // gc.NS})")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per removal")
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    require_store(args.store)
    try:
        report = gc.collect(args.store, grace_ns=int(args.grace * gc.NS))
    except StoreFull:
        raise
    except StoreFailure as e:
        raise UserError(f"cannot collect in store {args.store}: {e}") from None
    except OSError as e:
        raise UserError(f"gc of {args.store} failed: {e}") from None
    if args.verbose:
        for line in report.lines:
            print(line)
    print(f"gc: {report.summary()}")
    return 0
