"""``spoolfs format STORE [--blobs LOCATION]``: create a new, empty store.

STORE is a directory (missing or empty) for the embedded store, or a PostgreSQL URL whose
database exists and holds no store yet; ``--blobs`` then says where its content goes
(``s3://BUCKET/PREFIX`` or a directory every host shares). Mounting a store named on the
command line never creates one, so a mistyped path is an error rather than a new, empty spool.
The default store (``spoolfs MOUNTPOINT``) is the exception: it is made on first use."""

from __future__ import annotations

import argparse
import os

from spoolfs.cli.args import Parser
from spoolfs.cli.exits import Exit
from spoolfs.core.errors import UserError
from spoolfs.store.private import DIR_MODE
from spoolfs.store.registry import open_store, store_layout
from spoolfs.store.site import BLOBS_KEY, is_url, place_of, shown


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="spoolfs format", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", metavar="STORE", help="a directory, or postgresql://USER@HOST/DB")
    p.add_argument("--blobs", metavar="s3://BUCKET/PREFIX|DIR",
                   help="where a postgresql:// store keeps content (required for one)")
    return p


def make_store(store: str) -> None:
    """Create the embedded store directory ``store``: missing, or an empty directory."""
    if store_layout(store).is_store():
        raise UserError(f"{store} is a store already")
    if os.path.exists(store):
        if not os.path.isdir(store):
            raise UserError(f"{store} exists and is not a directory")
        if os.listdir(store):
            raise UserError(f"{store} is not empty: a new store goes in an empty directory")
        try:  # made beforehand (mkdir): the owner's alone from the start
            os.chmod(store, DIR_MODE)
        except OSError as e:
            raise UserError(f"{store}: cannot make it private to its owner: {e.strerror}") from e
    open_store(store).close()


def make_shared_store(url: str, blobs: str | None) -> None:
    """Create the schema of a multi-host store and record where its content goes."""
    if blobs is None:
        raise UserError(f"{shown(url)}: a postgresql:// store needs --blobs s3://BUCKET/PREFIX "
                        "or --blobs DIR (a directory every host shares)", Exit.USAGE)
    store = open_store(url)
    try:
        if store.reader().meta(BLOBS_KEY) is not None:
            raise UserError(f"{shown(url)} is a store already")
        place_of(url, store, blobs)
    finally:
        store.close()


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if is_url(args.store):
        make_shared_store(args.store, args.blobs)
    else:
        if args.blobs is not None:
            raise UserError("--blobs is for a postgresql:// store; a directory store keeps its "
                            "content inside", Exit.USAGE)
        make_store(os.path.abspath(args.store))
    print(f"spoolfs: made store {shown(args.store)}")
    return Exit.OK
