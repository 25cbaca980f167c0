"""``spoolfs fsck STORE``: check refcounts, hashes, orphans and schema; exit 1 if anything is
wrong."""

from __future__ import annotations

import argparse

from spoolfs.core.errors import UserError


def run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="spoolfs fsck")
    p.add_argument("store")
    args = p.parse_args(argv)
    from spoolfs.service.fsck import Fsck

    import os
    if not os.path.exists(os.path.join(args.store, "meta.db")):
        raise UserError(f"{args.store} is not a spoolfs store (no meta.db)")
    problems = Fsck(args.store, progress=print).run()
    for line in problems:
        print(line)
    print(f"fsck: {len(problems)} problem(s)" if problems else "fsck: clean")
    return 1 if problems else 0
