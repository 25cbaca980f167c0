"""``spoolfs [STORE] MOUNTPOINT``: returns once the mount is ready (the daemon forks before its
event loop starts) or prints one line and exits non-zero.

The same command line serves ``mount -t fuse.spoolfs STORE MOUNTPOINT -o OPTS`` and
``/etc/fstab``: mount(8) runs mount.fuse3, which runs ``spoolfs STORE MOUNTPOINT -o OPTS``. So
spoolfs's own settings can be ``-o`` options too (``queue=``, ``log_level=``, ``log_file=``),
and the options that only mean something to mount(8), fstab or systemd are dropped instead of
being handed to FUSE, which would refuse them.

Under systemd ``Type=notify`` (``$NOTIFY_SOCKET`` set) the serving process sends ``READY=1``
with its pid once the mount is live, and ``STOPPING=1`` when the session ends."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import traceback

from spoolfs.cli.args import Parser
from spoolfs.cli.exits import Exit
from spoolfs.core.errors import SpoolError, UserError
from spoolfs.core.names import check_ident
from spoolfs.notify import notify
from spoolfs.runtime import default_store
from spoolfs.store.registry import split as split_url
from spoolfs.store.site import require_store, shown

log = logging.getLogger("spoolfs")

LEVELS = ("debug", "info", "warning", "error")

#: ``-o NAME=VALUE`` options that stand for spoolfs's own ``--queue``, ``--log-level`` and
#: ``--log-file`` (fstab and mount(8) can pass nothing else).
OWN_OPTIONS = ("queue", "log_level", "log_file", "blobs")

#: Options for mount(8), fstab or systemd (mount(8) and mount.fuse3 strip most, not when
#: spoolfs is run by hand), and VFS flags libfuse does not take: dropped. libfuse itself takes
#: rw, ro, dev, nodev, suid, nosuid, exec, noexec, sync, async, dirsync, atime and noatime
#: (mount.fuse3 adds dev and suid unless told nodev, nosuid) besides its own (allow_other,
#: default_permissions, ...); whatever is not dropped here goes to the daemon as given.
IGNORED_OPTIONS = frozenset({
    "defaults", "auto", "noauto", "user", "users", "nouser", "owner", "group", "nofail",
    "_netdev", "diratime", "nodiratime", "relatime", "norelatime", "strictatime",
    "nostrictatime", "lazytime", "nolazytime", "iversion", "noiversion", "mand", "nomand",
    "silent", "loud", "symfollow", "nosymfollow",
})
IGNORED_PREFIXES = ("x-", "comment=")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="spoolfs", usage="spoolfs [STORE] MOUNTPOINT [options]",
               description="Mount a spool: a durable work queue driven by mv, cp, ln and rm. "
               "Returns once the mount is ready. Other commands: spoolfs --help.")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="[STORE] MOUNTPOINT. STORE is a store directory made by spoolfs format "
                   "(without STORE: the default store, made on first use: /var/lib/spoolfs for "
                   "root, ~/.local/share/spoolfs for others) or postgresql://USER@HOST:PORT/DB "
                   "(password from ~/.pgpass or PGPASSWORD)")
    p.add_argument("--blobs", metavar="s3://BUCKET/PREFIX|DIR",
                   help="where a postgresql:// store keeps content, given at its first mount "
                   "(later mounts read it from the store); S3 endpoint and keys from the "
                   "standard AWS settings")
    p.add_argument("--queue", help="root the mount at one queue (created if missing)")
    p.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    p.add_argument("-o", dest="options", action="append", default=[],
                   help="mount options, comma-separated: FUSE's (e.g. allow_other), "
                   "strict_roles, nfs_export (the mount is exported to NFS clients), "
                   "shared_mmap (uploads may be mapped shared and written through the "
                   "mapping: slower large writes), and "
                   "queue=Q, log_level=L, log_file=F, blobs=B for the options of those names; "
                   "fstab's and systemd's (nofail, _netdev, x-systemd.*, ...) are ignored")
    p.add_argument("--log-file", help="log to this file")
    p.add_argument("--log-level", choices=LEVELS, help="default: info")
    p.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve /metrics (Prometheus) and /status (JSON) over HTTP; "
                   "without a HOST (:9464) on loopback only")
    return p


def split_options(raw: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """``-o`` values -> (spoolfs's own settings, options for the daemon, ignored options)."""
    own: dict[str, str] = {}
    passed: list[str] = []
    ignored: list[str] = []
    for opt in (o for value in raw for o in value.split(",") if o):
        key, eq, value = opt.partition("=")
        if key in OWN_OPTIONS:
            if not eq or not value:
                raise UserError(f"mount option {key} needs a value: {key}=...", Exit.USAGE)
            own[key] = value  # the last one wins, as with mount(8)
        elif opt in IGNORED_OPTIONS or opt.startswith(IGNORED_PREFIXES):
            ignored.append(opt)
        else:
            passed.append(opt)
    return own, passed, ignored


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if len(args.paths) > 2:
        raise UserError("expected [STORE] MOUNTPOINT", Exit.USAGE)
    own, options, ignored = split_options(args.options)
    for key, value in own.items():
        given = getattr(args, key)
        if given is not None and given != value:
            raise UserError(f"--{key.replace('_', '-')} {given} and -o {key}={value} disagree",
                            Exit.USAGE)
        setattr(args, key, value)
    if args.queue is not None:
        try:
            check_ident(args.queue.encode(), "queue")
        except SpoolError as e:
            raise UserError(f"--queue {args.queue!r}: {e.hint}", Exit.USAGE) from None
    args.log_level = args.log_level or "info"
    if args.log_level not in LEVELS:
        raise UserError(f"log_level={args.log_level}: expected one of {', '.join(LEVELS)}",
                        Exit.USAGE)
    if args.log_file:
        args.log_file = os.path.abspath(args.log_file)
    store = args.paths[0] if len(args.paths) == 2 else default_store()
    if not split_url(store)[0]:  # a URL names its engine: never a path under the cwd
        store = os.path.abspath(store)
        # A store named on purpose must exist (a typo makes no new, empty spool); the default
        # store is made on first use, named or not (the fstab and unit examples name it).
        if len(args.paths) == 2 and store != os.path.abspath(default_store()):
            require_store(store)
    if re.fullmatch(r"/dev/fd/\d+", args.paths[-1]):
        raise UserError("mount option drop_privileges (a mount point passed as /dev/fd/N) "
                        "is not supported", Exit.USAGE)
    from spoolfs import daemon

    mountpoint = daemon.check_mountpoint(args.paths[-1])
    if args.metrics_listen:
        from spoolfs.metrics_http import parse_listen

        parse_listen(args.metrics_listen)  # a bad value is one line, before anything starts
    if args.foreground:
        from spoolfs.cli.logsetup import setup

        setup(args.log_level, args.log_file, True)
        _log_ignored(ignored)
        daemon.serve(store, mountpoint, args.queue, options,
                     lambda notes: _ready(store, mountpoint, args.queue),  # (notes: logged)
                     metrics_listen=args.metrics_listen, blobs=args.blobs)
        return 0
    return _daemonize(args, store, mountpoint, options, ignored)


def _log_ignored(ignored: list[str]) -> None:
    if ignored:
        log.debug("ignored mount options (not for FUSE): %s", ",".join(ignored))


def _ready(store: str, mountpoint: str, queue: str | None) -> None:
    """The mount is live: tell systemd, when run by a ``Type=notify`` service. ``MAINPID``
    names the serving process, which is not the one systemd started when spoolfs forked."""
    where = f"queue {queue} of {shown(store)}" if queue else shown(store)
    notify("READY=1", f"MAINPID={os.getpid()}", f"STATUS=mounted {where} on {mountpoint}")


def _daemonize(args: argparse.Namespace, store: str, mountpoint: str, options: list[str],
               ignored: list[str]) -> int:
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        with os.fdopen(r, "rb") as pipe:
            msg = pipe.read().decode(errors="replace")
        if msg.partition("\n")[0] == "ok":  # then the warnings the operator should see
            for note in msg.splitlines()[1:]:
                print(f"spoolfs: warning: {note}", file=sys.stderr)
            return 0
        os.waitpid(pid, 0)
        raise UserError(msg.strip() or "the daemon exited before the mount was ready")
    # Child: a new session, detached from the terminal; the event loop starts only now.
    os.close(r)
    os.setsid()
    os.chdir("/")  # never keeps the caller's directory busy (it could not be unmounted)
    code = 0
    try:
        from spoolfs import daemon
        from spoolfs.cli.logsetup import setup

        setup(args.log_level, args.log_file, False)
        _log_ignored(ignored)

        def ready(notes: list[str]) -> None:
            _ready(store, mountpoint, args.queue)  # before the parent exits
            os.write(w, "\n".join(["ok", *notes]).encode())
            os.close(w)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.close(devnull)

        daemon.serve(store, mountpoint, args.queue, options, ready,
                     metrics_listen=args.metrics_listen, blobs=args.blobs)
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
