"""The command line: ``spoolfs [STORE] MOUNTPOINT`` mounts; every other word is a command, in
a module of its own (``COMMANDS``: the module and its one-line summary)."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Protocol, cast

from spoolfs import __version__
from spoolfs.cli.exits import Exit
from spoolfs.core.errors import SpoolError, UserError

#: command -> (module, one-line summary); ``spoolfs --help`` lists them in this order
COMMANDS: dict[str, tuple[str, str]] = {
    "mount": ("spoolfs.cli.mount", "mount a spool (the same as spoolfs [STORE] MOUNTPOINT)"),
    "umount": ("spoolfs.cli.umount", "unmount and wait for the daemon to finish"),
    "format": ("spoolfs.cli.format", "create a new, empty store"),
    "status": ("spoolfs.cli.status", "queues, consumers and disk at a glance; --check for "
               "monitoring"),
    "history": ("spoolfs.cli.history", "every transition of a message"),
    "queue": ("spoolfs.cli.queue", "show or set a queue's lease, retries and limits"),
    "fsck": ("spoolfs.cli.fsck", "check a store, and repair it with --repair"),
    "gc": ("spoolfs.cli.gc", "remove content no message refers to any more"),
    "bench": ("spoolfs.cli.bench", "compare spoolfs with plain directories on this disk"),
}


class Command(Protocol):
    def run(self, argv: list[str]) -> int: ...


def usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: spoolfs [STORE] MOUNTPOINT [options]",
             "       spoolfs COMMAND [arguments]",
             "",
             "A durable work queue you drive with mv, cp, ln and rm.",
             "",
             "commands:"]
    lines += [f"  {c:<{width}}  {summary}" for c, (_, summary) in COMMANDS.items()]
    lines += ["",
              "options:",
              "  -h, --help     show this help and exit",
              "  -V, --version  show the version and exit",
              "",
              "spoolfs COMMAND --help tells more of each command."]
    return "\n".join(lines) + "\n"


def _is_mount_form(word: str) -> bool:
    """``spoolfs WORD ...`` mounts when WORD is a path or a store URL, not a mistyped command."""
    return (word.startswith("-") or "/" in word or ":" in word or os.path.isdir(word))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.stderr.write(usage())
        return Exit.USAGE
    first = argv[0]
    if first in ("-h", "--help"):
        sys.stdout.write(usage())
        return Exit.OK
    if first in ("-V", "--version"):
        print(f"spoolfs {__version__}")
        return Exit.OK
    if first in COMMANDS:
        module, args = COMMANDS[first][0], argv[1:]
    elif _is_mount_form(first):
        module, args = COMMANDS["mount"][0], argv
    else:
        near = difflib.get_close_matches(first, COMMANDS, n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        print(f"spoolfs: unknown command {first!r}{hint} (see spoolfs --help)", file=sys.stderr)
        return Exit.USAGE
    try:
        command = cast(Command, importlib.import_module(module))
        return int(command.run(args) or 0)
    except UserError as e:
        print(f"spoolfs: {e.message}", file=sys.stderr)
        return e.exit_code
    except SpoolError as e:  # the store refused (its disk full, say): one line, no traceback
        print(f"spoolfs: {e.hint}", file=sys.stderr)
        return Exit.FAILURE
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
