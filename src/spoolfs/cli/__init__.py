"""The command line: ``spoolfs [STORE] MOUNTPOINT`` mounts; subcommands live in one module each."""

from __future__ import annotations

import importlib
import sys

from spoolfs.core.errors import SpoolError, UserError

SUBCOMMANDS = {
    "umount": "spoolfs.cli.umount",
    "fsck": "spoolfs.cli.fsck",
    "gc": "spoolfs.cli.gc",
    "bench": "spoolfs.cli.bench",
    "queue": "spoolfs.cli.queue",
    "status": "spoolfs.cli.status",
    "history": "spoolfs.cli.history",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    module = SUBCOMMANDS.get(argv[0]) if argv else None
    try:
        if module is not None:
            return int(importlib.import_module(module).run(argv[1:]) or 0)
        from spoolfs.cli import mount

        return mount.run(argv)
    except UserError as e:
        print(f"spoolfs: {e.message}", file=sys.stderr)
        return e.exit_code
    except SpoolError as e:  # the store refused (its disk full, say): one line, no traceback
        print(f"spoolfs: {e.hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
