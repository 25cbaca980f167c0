"""``spoolfs queue set|show``: a queue's settings (lease, retries, limits, fan-out).

QUEUE is the queue's directory in a mount (``/mnt/spool/orders``, or the root of a ``--queue``
mount): the values go through the ``user.spool.policy`` attribute, so the daemon checks and
stores them in one transaction. ``--store STORE NAME`` writes to the store directly (no mount
needed); running mounts pick the change up within a second.
"""

from __future__ import annotations

import argparse
import errno
import os
from typing import TYPE_CHECKING

from spoolfs.cli.args import Parser
from spoolfs.core import policy as P
from spoolfs.core.errors import Invalid, UserError

if TYPE_CHECKING:
    from spoolfs.store.base import ReadTx, Store, WriteTx

XATTR = "user.spool.policy"


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="spoolfs queue", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    keys = "; ".join(f"{k}: {h}" for k, h in P.HELP.items())
    s = sub.add_parser("set", help="set policy values", epilog=f"keys — {keys}")
    s.add_argument("--store", help="the store directory; QUEUE is then the queue's name")
    s.add_argument("queue", metavar="QUEUE", help="the queue's directory on a mount (or its "
                   "name, with --store)")
    s.add_argument("values", metavar="key=value", nargs="+", help="the settings to change (keys "
                   "below)")
    sh = sub.add_parser("show", help="print the policy in effect")
    sh.add_argument("--store", help="the store directory; QUEUE is then the queue's name")
    sh.add_argument("queue", metavar="QUEUE", help="the queue's directory on a mount (or its "
                    "name, with --store)")
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.command == "set":
        try:
            values = P.parse_assignments(args.values)
        except Invalid as e:
            raise UserError(f"nothing changed: {e}") from None
        if args.store:
            shown = _set_in_store(args.store, args.queue, values)
        else:
            _set_on_mount(args.queue, values)
            shown = _show_on_mount(args.queue)
    else:
        shown = _show_in_store(args.store, args.queue) if args.store \
            else _show_on_mount(args.queue)
    print(shown, end="")
    return 0


def _not_a_queue(path: str, e: OSError) -> UserError:
    if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EPERM, errno.ENOENT, errno.ENOTDIR):
        return UserError(f"{path} is not a queue directory on a spoolfs mount")
    return UserError(f"{path}: {e.strerror}")


def _check_fanout_on_mount(path: str, values: dict[str, str]) -> None:
    """Name a fan-out cycle before the daemon refuses it (it only answers EINVAL): read the
    ``fanout`` of the queues beside this one on the mount."""
    if "fanout" not in values:
        return
    here = os.path.realpath(path)
    parent = os.path.dirname(here)
    graph: dict[str, tuple[str, ...]] = {}
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        try:
            text = os.getxattr(os.path.join(parent, name), XATTR + ".fanout").decode()
        except OSError:
            continue  # not a queue directory
        graph[name] = P.parse("fanout", text)
    graph[os.path.basename(here)] = P.parse("fanout", values["fanout"])
    try:
        P.check_fanout(graph)
    except Invalid as e:
        raise UserError(f"nothing changed: {e}") from None


def _set_on_mount(path: str, values: dict[str, str]) -> None:
    _check_fanout_on_mount(path, values)
    try:
        os.setxattr(path, XATTR, P.format_lines(values).encode())
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise UserError(f"{path}: the daemon refused the values; nothing changed") from None
        raise _not_a_queue(path, e) from None


def _show_on_mount(path: str) -> str:
    try:
        return os.getxattr(path, XATTR).decode()
    except OSError as e:
        raise _not_a_queue(path, e) from None


def _open(store_dir: str) -> Store:
    from spoolfs.store.registry import open_store
    from spoolfs.store.site import require_store

    require_store(store_dir)
    return open_store(store_dir)


def _queue_id(r: ReadTx, name: str) -> int:
    e = r.lookup(1, name.encode())
    if e is None or e.kind != "queue":
        raise UserError(f"no queue {name!r} in the store")
    return int(e.id)


def _set_in_store(store_dir: str, name: str, values: dict[str, str]) -> str:
    from spoolfs.service.policies import check_fanout

    store = _open(store_dir)
    try:
        qid = _queue_id(store.reader(), name)

        def fn(tx: WriteTx) -> None:
            check_fanout(tx, qid, dict(values))
            tx.set_policy(qid, dict(values))

        ok, err = store.run_batch([fn], True)[0]
        if not ok:
            raise UserError(f"nothing changed: {err}")
        return _shown(store.reader(), qid)
    finally:
        store.close()


def _show_in_store(store_dir: str, name: str) -> str:
    """Read-only: beside a running daemon, on a store this user may only read."""
    from spoolfs.store.registry import reading
    from spoolfs.store.site import require_store

    require_store(store_dir)
    with reading(store_dir) as r:
        return _shown(r, _queue_id(r, name))


def _shown(r: ReadTx, qid: int) -> str:
    stored = r.policies().get(qid, {})
    return P.format_lines(P.DEFAULT.with_values(stored).shown())
