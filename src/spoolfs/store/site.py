"""Where a spool's parts are: its metadata store, its content, this host's own directory.

An embedded store keeps all three in one store directory. A store named by URL (PostgreSQL)
keeps metadata in the database, content where its first mount recorded (``--blobs``: an S3
prefix or a directory every host shares), and uploads in progress plus a read cache in a
directory of this host's own (``local``), which the disk guard watches.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from spoolfs.blobs import BlobDir, StagingDir
from spoolfs.blobs.layout import StoreLayout
from spoolfs.core.errors import UserError
from spoolfs.store.base import Store, WriteTx
from spoolfs.store.registry import open_store, split

#: the store setting that names where content lives
BLOBS_KEY = "blobs"


def shown(url: str) -> str:
    """``url`` with any password removed: for logs, ``fsname`` and status output."""
    if not split(url)[0]:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = (f"{parts.username}@" if parts.username else "") + host + (
        f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def local_dir_for(url: str, base: str) -> str:
    """This host's directory for the store ``url``, under ``base``: a readable name plus a
    digest of the whole URL, so two databases never share one."""
    parts = urlsplit(shown(url))
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_",
                      f"{parts.hostname or 'local'}_{parts.port or ''}_{parts.path.strip('/')}")
    digest = hashlib.sha256(shown(url).encode()).hexdigest()[:12]
    return os.path.join(base, f"{readable.strip('_')}-{digest}")


@dataclass
class Site:
    name: str  # the store as its user named it, without a password
    store: Store
    blobs: BlobDir
    staging: StagingDir
    local: str  # this host's own directory (staging, cache): the disk guard watches it
    #: whether every daemon of the store shares this host's staging directory and a write
    #: lock (the embedded store); a shared store's recovery judges only its own host's files
    embedded: bool
    blobs_location: str = field(default="")

    def close(self) -> None:
        self.store.close()


def open_site(url: str, blobs: str | None = None, local_base: str | None = None) -> Site:
    """Open the store ``url`` with its content. ``blobs`` is where a shared store keeps
    content: recorded by the first mount, refused when it differs from the record."""
    if not split(url)[0]:
        layout = StoreLayout(url)
        if blobs is not None and os.path.abspath(blobs) != layout.blobs:
            raise UserError(f"{url}: an embedded store keeps its content in its own directory; "
                            "--blobs is for a store named by URL")
        store = open_store(url)
        return Site(url, store, BlobDir(layout.blobs), StagingDir(layout.staging), url, True,
                    layout.blobs)
    store = open_store(url)
    try:
        location = _blobs_location(store, url, blobs)
        local = local_dir_for(url, local_base or default_local_base())
        os.makedirs(local, 0o700, exist_ok=True)
        return Site(shown(url), store, _blob_store(location),
                    StagingDir(os.path.join(local, "staging")), local, False, location)
    except BaseException:
        store.close()
        raise


def default_local_base() -> str:
    """Beside the default embedded store: ``/var/lib/spoolfs-remote`` for root,
    ``~/.local/share/spoolfs-remote`` for others."""
    from spoolfs.runtime import default_store

    return os.path.join(os.path.dirname(default_store()), "spoolfs-remote")


def _blobs_location(store: Store, url: str, given: str | None) -> str:
    recorded = store.reader().meta(BLOBS_KEY)
    if given is not None and not given.startswith("s3://"):
        given = os.path.abspath(given)
    if recorded is None:
        if given is None:
            raise UserError(f"{shown(url)}: the first mount of this store needs --blobs "
                            "s3://BUCKET/PREFIX or --blobs DIR (a directory every host shares)")

        def record(tx: WriteTx) -> str:
            now = tx.meta(BLOBS_KEY)
            if now is None:
                tx.set_meta(BLOBS_KEY, given)
                return given
            return now  # another host recorded it first

        ok, value = store.run_batch([record], durable=True)[0]
        if not ok:
            raise value
        recorded = value
    if given is not None and given != recorded:
        raise UserError(f"{shown(url)} keeps its content in {recorded}, not {given}")
    assert recorded is not None
    return recorded


def _blob_store(location: str) -> BlobDir:
    if location.startswith("s3://"):
        raise UserError(f"{location}: S3 content is not available in this build")
    return BlobDir(location)
