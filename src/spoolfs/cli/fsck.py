"""``spoolfs fsck STORE [--repair] [--grace SECONDS]``: check refcounts, hashes, orphans and
schema; with ``--repair``, fix what can be fixed. Safe while the store is mounted; without
``--repair`` it opens the store read-only.

Prints a progress line per 10,000 objects checked (entries, blobs, blob files, staging files),
one line per problem, a summary, then ``fsck: clean`` (exit 0) or ``fsck: N problem(s)`` (exit 1).
With ``--repair``: one ``repaired: ...`` line per fix, a second check (file sizes, not hashes)
and ``fsck: N problem(s) repaired (M fix(es)), clean`` (exit 0), or what is left (exit 1).
"""

from __future__ import annotations

import argparse

from spoolfs.cli.args import Parser, seconds
from spoolfs.core.errors import StoreFailure, StoreFull, UserError
from spoolfs.service import gc
from spoolfs.store.site import require_store


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="spoolfs fsck",
               description="Check a store: reference counts, content hashes, orphans and "
                           "schema. Safe while the store is mounted; read-only without "
                           "--repair. Exit status 0 when clean (or repaired), 1 otherwise.")
    p.add_argument("store", metavar="STORE", help="a store directory or postgresql:// URL")
    p.add_argument("--repair", action="store_true",
                   help="fix reference counts, orphans and lost content (messages whose "
                        "content is gone go to error/ with the reason)")
    p.add_argument("--grace", type=seconds, metavar="SECONDS", default=None,
                   help="orphan files younger than this are left alone (default with --repair: "
                        f"{gc.GRACE_NS // gc.NS})")
    return p


def run(argv: list[str]) -> int:
    from spoolfs.service.fsck import Fsck

    args = parser().parse_args(argv)
    require_store(args.store)
    grace_ns = None if args.grace is None else int(args.grace * gc.NS)
    if args.repair and grace_ns is None:
        grace_ns = gc.GRACE_NS

    try:
        fsck = Fsck(args.store, progress=lambda s: print(s, flush=True), grace_ns=grace_ns,
                    read_only=not args.repair)
        try:
            problems = fsck.check()
            for line in problems:
                print(line)
            for line in fsck.notes:
                print(f"note: {line}")
            print(fsck.summary())
            if not problems:
                print("fsck: clean")
                return 0
            if not args.repair:
                print(f"fsck: {len(problems)} problem(s)")
                return 1
            print(f"fsck: {len(problems)} problem(s); repairing")
            noted = len(fsck.notes)
            fixes = fsck.repair()
            for line in fixes:
                print(f"repaired: {line}")
            for line in fsck.notes[noted:]:
                print(f"note: {line}")
        finally:
            fsck.close()
        # check again; the content hashes were checked already
        again = Fsck(args.store, progress=lambda s: print(s, flush=True), grace_ns=grace_ns,
                     hash_files=False)
        try:
            left = again.check()
        finally:
            again.close()
    except StoreFull:
        raise
    except (StoreFailure, OSError) as e:
        raise UserError(f"fsck of {args.store} failed: {e}") from None
    for line in left:
        print(line)
    for line in again.notes:
        print(f"note: {line}")
    if left:
        print(f"fsck: {len(left)} problem(s) left after repair")
        return 1
    print(f"fsck: {len(problems)} problem(s) repaired ({len(fixes)} fix(es)), clean")
    return 0
