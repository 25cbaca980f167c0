"""Where a spool's parts are: its metadata store, its content, this host's own directory.

An embedded store keeps all three in one store directory. A store named by URL (PostgreSQL)
keeps metadata in the database, content where its first mount recorded (``--blobs``: an S3
prefix or a directory every host shares), and uploads in progress in a directory of this
host's own (``local``), which the disk guard and status watch.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from spoolfs.blobs import BlobDir, StagingDir
from spoolfs.blobs.base import BlobStore
from spoolfs.blobs.layout import StoreLayout
from spoolfs.core.errors import UserError
from spoolfs.store.base import Maintenance, Store, WriteTx
from spoolfs.store.registry import open_maintenance, open_store, split

#: the store setting that names where content lives
BLOBS_KEY = "blobs"


def shown(url: str) -> str:
    """``url`` with any password removed: for logs, ``fsname`` and status output."""
    if not split(url)[0]:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = (f"{parts.username}@" if parts.username else "") + (parts.hostname or "") + (
        f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def is_url(store: str) -> bool:
    return bool(split(store)[0])


def local_dir_for(url: str, base: str) -> str:
    """This host's directory for the store ``url``, under ``base``: a readable name plus a
    digest of the whole URL, so two databases never share one."""
    parts = urlsplit(shown(url))
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_",
                      f"{parts.hostname or 'local'}_{parts.port or ''}_{parts.path.strip('/')}")
    digest = hashlib.sha256(shown(url).encode()).hexdigest()[:12]
    return os.path.join(base, f"{readable.strip('_')}-{digest}")


def default_local_base() -> str:
    """Beside the default embedded store: ``/var/lib/spoolfs-remote`` for root,
    ``~/.local/share/spoolfs-remote`` for others."""
    from spoolfs.runtime import default_store

    return os.path.join(os.path.dirname(default_store()), "spoolfs-remote")


@dataclass(frozen=True)
class Place:
    url: str  # as given: a store directory, or a URL (which may carry a password)
    blobs: BlobStore
    staging: StagingDir
    #: this host's own directory: staging files, the read cache, fsck's lost+found; the disk
    #: guard and status watch its disk
    local: str
    #: every daemon of the store shares one staging directory and a write lock (the embedded
    #: store); a shared store's daemons judge only their own host's files
    embedded: bool
    blobs_location: str

    @property
    def name(self) -> str:
        """The store as its user named it, without a password."""
        return shown(self.url)

    @property
    def lost_found(self) -> str:
        return os.path.join(self.local, "lost+found")

    def maintenance(self, read_only: bool = False) -> Maintenance:
        """gc and fsck's own access to the store's metadata (never creating a store)."""
        return open_maintenance(self.url, read_only)


def embedded(store_dir: str) -> Place:
    layout = StoreLayout(store_dir)
    return Place(store_dir, BlobDir(layout.blobs), StagingDir(layout.staging), store_dir, True,
                 layout.blobs)


def place_of(url: str, store: Store | None = None, blobs: str | None = None,
             local_base: str | None = None) -> Place:
    """Where the store ``url`` keeps its parts. For a URL the blob location comes from the
    store's record (``store``, or one opened for the purpose); ``blobs`` is recorded by a
    first mount and refused when it differs from the record."""
    if not is_url(url):
        place = embedded(url)
        if blobs is not None and os.path.abspath(blobs) != place.blobs_location:
            raise UserError(f"{url}: an embedded store keeps its content in its own directory;"
                            " --blobs is for a store named by URL")
        return place
    own = store is None
    s = open_store(url) if store is None else store
    try:
        location = _blobs_location(s, url, blobs)
    finally:
        if own:
            s.close()
    local = local_dir_for(url, local_base or default_local_base())
    os.makedirs(local, 0o700, exist_ok=True)
    return Place(url, _blob_store(location, local), StagingDir(os.path.join(local, "staging")),
                 local, False, location)


def as_place(where: str | Place) -> Place:
    return where if isinstance(where, Place) else place_of(where)


def _blobs_location(store: Store, url: str, given: str | None) -> str:
    recorded = store.reader().meta(BLOBS_KEY)
    if given is not None and not given.startswith("s3://"):
        given = os.path.abspath(given)
    if recorded is None:
        if given is None:
            raise UserError(f"{shown(url)}: the first mount of this store needs --blobs "
                            "s3://BUCKET/PREFIX or --blobs DIR (a directory every host shares)")
        first = given

        def record(tx: WriteTx) -> str:
            now = tx.meta(BLOBS_KEY)
            if now is None:
                tx.set_meta(BLOBS_KEY, first)
                return first
            return now  # another host recorded it first

        ok, value = store.run_batch([record], durable=True)[0]
        if not ok:
            raise value
        recorded = str(value)
    if given is not None and given != recorded:
        raise UserError(f"{shown(url)} keeps its content in {recorded}, not {given}")
    return recorded


def _blob_store(location: str, local: str) -> BlobStore:
    """The content of a shared store: S3, or a directory every host shares (both stored
    before the transaction that references them)."""
    if location.startswith("s3://"):
        from spoolfs.blobs.s3 import S3Blobs

        return S3Blobs(location, os.path.join(local, "cache"))
    return BlobDir(location, remote=True)


def require_store(store: str) -> None:
    """Refuse, in one line, a store path that holds no store (a URL is tried when opened:
    its engine says in one line why it cannot be reached)."""
    if not is_url(store) and not StoreLayout(store).is_store():
        gone = "" if os.path.exists(store) else " (there is nothing there)"
        raise UserError(f"{store} is not a spoolfs store{gone}; spoolfs format {store} makes "
                        "a new one")
