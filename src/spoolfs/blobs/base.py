"""What the service, gc and fsck need of a blob store: a directory (``BlobDir``) or S3
(``S3Blobs``). Objects are immutable and named by content and blob id."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from spoolfs.blobs.files import ObjectInfo


class BlobStore(Protocol):
    #: content must be stored (``upload``) before the transaction that references it, under
    #: a blob id reserved from the metadata store; False: ``place`` inside the transaction
    remote: bool

    def path(self, sha256: bytes, blob_id: int) -> str:
        """Where the content is read from on this host (after ``fetch``)."""

    def place(self, src: str, sha256: bytes, blob_id: int) -> object:
        """Inside the transaction that inserts the blob's row (not remote)."""

    def upload(self, src: str, sha256: bytes, blob_id: int) -> None:
        """Before that transaction (remote); blocking."""

    def fetch(self, sha256: bytes, blob_id: int, size: int) -> str:
        """Make the content readable at ``path`` (remote: download into a cache); blocking."""

    def remove(self, sha256: bytes, blob_id: int) -> None:
        """After the commit that deleted the blob's row."""

    def detach(self, sha256: bytes, blob_id: int) -> int | None:
        """``remove``, but this host's file may keep its space until a descriptor returned
        is closed (blobs/freeing.py)."""

    def name(self, sha256: bytes, blob_id: int) -> str:
        """The stored object's name, as ``walk`` lists it."""

    def walk(self) -> Iterator[tuple[str, bytes, int]]:
        """Every stored object: (name, sha256, blob id); id -1 for names of no blob. Listed
        as it goes: a store of a million objects is never held in memory at once."""

    def info(self, name: str) -> ObjectInfo | None: ...

    def unlink(self, name: str) -> bool: ...

    def digest(self, name: str) -> tuple[bytes, int] | None:
        """SHA-256 and size of the stored bytes; None when the object is gone."""

    def check(self) -> None:
        """At mount: reachable and usable (``StoreFailure`` in one line if not)."""

    def close(self) -> None: ...
