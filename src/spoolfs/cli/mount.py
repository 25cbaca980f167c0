"""``spoolfs [STORE] MOUNTPOINT``: returns once the mount is ready (the daemon forks before its
event loop starts) or prints one line and exits non-zero."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from spoolfs.core.errors import UserError
from spoolfs.runtime import default_store


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spoolfs", usage="spoolfs [STORE] MOUNTPOINT [options]",
                                description="Mount a spool: a durable work queue "
                                "driven by mv, cp, ln and rm. Subcommands: umount, fsck, bench.")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="[STORE] MOUNTPOINT; STORE defaults to /var/lib/spoolfs for root")
    p.add_argument("--queue", help="root the mount at one queue (created if missing)")
    p.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    p.add_argument("-o", dest="options", action="append", default=[],
                   help="FUSE mount options, comma-separated (e.g. allow_other)")
    p.add_argument("--log-file", help="log to this file")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if len(args.paths) > 2:
        raise UserError("expected [STORE] MOUNTPOINT", 2)
    store = os.path.abspath(args.paths[0] if len(args.paths) == 2 else default_store())
    options = [o for opt in args.options for o in opt.split(",") if o]
    from spoolfs import daemon

    mountpoint = daemon.check_mountpoint(args.paths[-1])
    if args.foreground:
        from spoolfs.cli.logsetup import setup

        setup(args.log_level, args.log_file, True)
        daemon.serve(store, mountpoint, args.queue, options)
        return 0
    return _daemonize(args, store, mountpoint, options)


def _daemonize(args: argparse.Namespace, store: str, mountpoint: str, options: list[str]) -> int:
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        with os.fdopen(r, "rb") as pipe:
            msg = pipe.read().decode(errors="replace")
        if msg == "ok":
            return 0
        os.waitpid(pid, 0)
        raise UserError(msg.strip() or "the daemon exited before the mount was ready")
    # Child: a new session, detached from the terminal; the event loop starts only now.
    os.close(r)
    os.setsid()
    code = 0
    try:
        from spoolfs import daemon
        from spoolfs.cli.logsetup import setup

        setup(args.log_level, args.log_file, False)

        def ready() -> None:
            os.write(w, b"ok")
            os.close(w)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.close(devnull)

        daemon.serve(store, mountpoint, args.queue, options, ready)
    except UserError as e:
        _tell(w, e.message)
        code = e.exit_code
    except BaseException as e:
        _tell(w, f"daemon failed: {e}")
        traceback.print_exc()
        code = 1
    os._exit(code)


def _tell(w: int, msg: str) -> None:
    try:
        os.write(w, msg.encode())
        os.close(w)
    except OSError:
        print(f"spoolfs: {msg}", file=sys.stderr)
