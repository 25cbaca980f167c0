"""Content in S3 (or any S3-compatible server): the blob store of a spool shared by hosts.

Keys are ``PREFIX/sha256/aa/bb/<sha256 hex>.<blob id>``: named by content, plus the id of the
blob row that owns the object. An object is deleted only when its own row is gone, so a
publish on another host that shares the same content through another row can never lose it
to a deletion (with bare ``<hex>`` keys, a host could find an object about to be deleted,
reference it, and lose it). The cost is an extra copy when two hosts publish the same bytes
at the same moment; the row that loses the race leaves an orphan object that gc removes.

- Write-once: ``PutObject`` with ``IfNoneMatch='*'`` (a 412 means the object exists: it is
  checked by size and taken as stored), multipart above ``MULTIPART`` bytes (the completion
  is conditional too), ``ChecksumSHA256`` so the server verifies every byte it stores.
- An upload is stored before the transaction that references it commits (the blob id is
  reserved from the database first), and never inside a transaction.
- Reads go through a local cache (``cache_dir``, at most ``cache_max`` bytes, least recently
  used evicted): published content never changes, so a cached object is good forever.
- Orphans (objects no row names, e.g. of a transaction that failed after its upload) are
  removed by gc once older than its grace period, which is far longer than any upload's wait
  for its commit.
- Endpoint, region and keys come from the standard AWS settings (``AWS_ENDPOINT_URL``,
  ``AWS_ACCESS_KEY_ID``, ``~/.aws/config`` ...); every call has connect and read timeouts
  and few retries, and a failure is ``StoreFailure`` (EIO) in one line.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions

from spoolfs.blobs import freeing
from spoolfs.blobs.files import CHUNK, PRIVATE_DIR, ObjectInfo, parse_blob_name
from spoolfs.core.errors import StoreFailure

log = logging.getLogger(__name__)

MULTIPART = 16 << 20  # bytes: larger uploads go in parts
PART = 16 << 20
CACHE_MAX = 1 << 30  # bytes of cached content kept by default
#: Objects listed per request (S3's own most).
LIST_PAGE = 1000
#: Objects whose listed size and time ``info`` answers from memory: a few listing pages.
INFO_KEPT = 4096


def _failure(e: BaseException, what: str) -> StoreFailure:
    if isinstance(e, botocore.exceptions.ClientError):
        err = e.response.get("Error", {})
        return StoreFailure(f"S3 {what}: {err.get('Code', '?')} {err.get('Message', '')}".strip())
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return StoreFailure(f"S3 {what}: {first}")


def _code(e: botocore.exceptions.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: botocore.exceptions.ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def parse(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> (bucket, prefix ending in ``/`` or empty)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise StoreFailure(f"{url}: expected s3://BUCKET/PREFIX")
    prefix = parts.path.strip("/")
    return parts.netloc, (prefix + "/") if prefix else ""


class S3Blobs:
    remote = True

    def __init__(self, url: str, cache_dir: str, cache_max: int = CACHE_MAX,
                 client: Any = None) -> None:
        self.url = url
        self.bucket, self.prefix = parse(url)
        self.cache_dir = cache_dir
        self.cache_max = cache_max
        os.makedirs(cache_dir, PRIVATE_DIR, exist_ok=True)
        self.client = client or boto3.session.Session().client(
            "s3", config=botocore.config.Config(
                connect_timeout=5, read_timeout=30, retries={"max_attempts": 3, "mode": "standard"},
                s3={"addressing_style": "path"}))
        self._cache_lock = threading.Lock()
        self._deletions: queue.Queue[tuple[bytes, int] | None] = queue.Queue()
        self._deleter: threading.Thread | None = None
        self._info: OrderedDict[str, ObjectInfo] = OrderedDict()  # the last listed (walk)

    # ---- names ---------------------------------------------------------------------------

    def key(self, sha256: bytes, blob_id: int) -> str:
        h = sha256.hex()
        return f"{self.prefix}sha256/{h[:2]}/{h[2:4]}/{h}.{blob_id}"

    def name(self, sha256: bytes, blob_id: int) -> str:
        """The stored object's name, as ``walk`` lists it: its key."""
        return self.key(sha256, blob_id)

    def path(self, sha256: bytes, blob_id: int) -> str:
        """The cached copy (present after ``fetch``)."""
        h = sha256.hex()
        return os.path.join(self.cache_dir, h[:2], f"{h}.{blob_id}")

    # ---- checks --------------------------------------------------------------------------

    def check(self) -> None:
        """At mount: the bucket is there and these keys may use it (one line if not)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            raise _failure(e, f"bucket {self.bucket}") from e

    # ---- storing -------------------------------------------------------------------------

    def place(self, src: str, sha256: bytes, blob_id: int) -> None:
        """In a transaction: nothing to do, the object was uploaded before it."""

    def upload(self, src: str, sha256: bytes, blob_id: int) -> None:
        """Store the (fsynced) staging file ``src`` as the object of blob ``blob_id``; blocking,
        never inside a transaction. An object already there with the same size is taken as
        this content (keys name their content)."""
        key = self.key(sha256, blob_id)
        size = os.path.getsize(src)
        try:
            if size > MULTIPART:
                self._multipart(src, key, sha256)
            else:
                with open(src, "rb") as f:
                    data = f.read()
                self.client.put_object(
                    Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*",
                    ChecksumSHA256=base64.b64encode(sha256).decode())
        except botocore.exceptions.ClientError as e:
            if _code(e) in ("PreconditionFailed", "ConditionalRequestConflict") \
                    or _status(e) == 412:
                self._check_existing(key, size)
                return
            raise _failure(e, f"upload of {key}") from e
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            raise _failure(e, f"upload of {key}") from e

    def _check_existing(self, key: str, size: int) -> None:
        try:
            got = self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        except Exception as e:
            raise _failure(e, f"check of {key}") from e
        if got != size:
            raise StoreFailure(f"S3 object {key} exists with {got} bytes, not {size}")

    def _multipart(self, src: str, key: str, sha256: bytes) -> None:
        up = self.client.create_multipart_upload(Bucket=self.bucket, Key=key,
                                                 ChecksumAlgorithm="SHA256")
        uid = up["UploadId"]
        try:
            parts = []
            with open(src, "rb") as f:
                n = 1
                while chunk := f.read(PART):
                    r = self.client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=uid, PartNumber=n, Body=chunk,
                        ChecksumSHA256=base64.b64encode(hashlib.sha256(chunk).digest()).decode())
                    parts.append({"PartNumber": n, "ETag": r["ETag"],
                                  "ChecksumSHA256": r["ChecksumSHA256"]})
                    n += 1
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts},
                IfNoneMatch="*")
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid)
            except Exception:
                pass
            raise

    # ---- reading -------------------------------------------------------------------------

    def fetch(self, sha256: bytes, blob_id: int, size: int) -> str:
        """The local path of the content, downloaded into the cache on a miss (blocking).
        A download is verified against its hash before it is kept."""
        dst = self.path(sha256, blob_id)
        try:
            if os.path.getsize(dst) == size:
                os.utime(dst)  # recently used
                return dst
        except FileNotFoundError:
            pass
        key = self.key(sha256, blob_id)
        os.makedirs(os.path.dirname(dst), PRIVATE_DIR, exist_ok=True)
        tmp = f"{dst}.{threading.get_ident()}.part"
        h = hashlib.sha256()
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            with open(tmp, "wb") as f:
                while chunk := body.read(CHUNK):
                    h.update(chunk)
                    f.write(chunk)
        except FileNotFoundError as e:
            raise StoreFailure(f"cache directory {self.cache_dir} is gone") from e
        except Exception as e:
            _unlink(tmp)
            raise _failure(e, f"read of {key}") from e
        if h.digest() != sha256:
            _unlink(tmp)
            raise StoreFailure(f"S3 object {key} does not match its hash")
        os.replace(tmp, dst)
        self._evict()
        return dst

    def _evict(self) -> None:
        with self._cache_lock:
            files = []
            total = 0
            for d, _, names in os.walk(self.cache_dir):
                for n in names:
                    p = os.path.join(d, n)
                    try:
                        st = os.stat(p)
                    except FileNotFoundError:
                        continue
                    files.append((st.st_mtime_ns, st.st_size, p))
                    total += st.st_size
            for _, size, p in sorted(files):
                if total <= self.cache_max:
                    break
                _unlink(p)  # an open reader keeps its copy until it closes
                total -= size

    def cached_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(d, n))
                   for d, _, names in os.walk(self.cache_dir) for n in names)

    # ---- removing ------------------------------------------------------------------------

    def remove(self, sha256: bytes, blob_id: int) -> None:
        """After the commit that deleted its row: removed in the background (an object left
        by a crash meanwhile is an orphan for gc)."""
        _unlink(self.path(sha256, blob_id))
        self._delete_later(sha256, blob_id)

    def detach(self, sha256: bytes, blob_id: int) -> int | None:
        held = freeing.detach(self.path(sha256, blob_id))  # this host's copy
        self._delete_later(sha256, blob_id)
        return held

    def _delete_later(self, sha256: bytes, blob_id: int) -> None:
        if self._deleter is None:
            self._deleter = threading.Thread(target=self._delete_loop, daemon=True,
                                             name="spoolfs-s3-delete")
            self._deleter.start()
        self._deletions.put((sha256, blob_id))

    def _delete_loop(self) -> None:
        while (item := self._deletions.get()) is not None:
            try:
                self.unlink(self.key(*item))
            except StoreFailure as e:
                log.warning("%s (gc removes it later)", e)

    def unlink(self, name: str) -> bool:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=name)
        except Exception as e:
            raise _failure(e, f"delete of {name}") from e
        return True

    # ---- listing (gc, fsck) --------------------------------------------------------------

    def walk(self) -> Iterator[tuple[str, bytes, int]]:
        """Every object under the prefix: (key, sha256, blob id), a listing page at a time;
        other names get id -1. The listing's size and time of the last ``INFO_KEPT`` objects
        are kept for ``info``: gc asks about the objects it has just been given."""
        kept = self._info = OrderedDict()  # this walk's own: another walk starts its own
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{self.prefix}sha256/",
                PaginationConfig={"PageSize": LIST_PAGE})
            for page in pages:
                for obj in page.get("Contents", []):
                    key = obj["Key"]
                    kept[key] = ObjectInfo(int(obj["LastModified"].timestamp() * 1e9),
                                           int(obj["Size"]), 1)
                    if len(kept) > INFO_KEPT:
                        kept.popitem(last=False)
                    yield (key, *parse_blob_name(key.rsplit("/", 1)[-1]))
        except Exception as e:
            raise _failure(e, f"listing of {self.url}") from e

    def info(self, name: str) -> ObjectInfo | None:
        cached = self._info.get(name)
        if cached is not None:
            return cached
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=name)
        except botocore.exceptions.ClientError as e:
            if _status(e) == 404:
                return None
            raise _failure(e, f"check of {name}") from e
        except Exception as e:
            raise _failure(e, f"check of {name}") from e
        return ObjectInfo(int(head["LastModified"].timestamp() * 1e9), int(head["ContentLength"]),
                          1)

    def digest(self, name: str) -> tuple[bytes, int] | None:
        """SHA-256 and size of an object's bytes (fsck), read from the server."""
        h = hashlib.sha256()
        size = 0
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=name)["Body"]
            while chunk := body.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
        except botocore.exceptions.ClientError as e:
            if _status(e) == 404:
                return None
            raise _failure(e, f"read of {name}") from e
        except Exception as e:
            raise _failure(e, f"read of {name}") from e
        return h.digest(), size

    def close(self) -> None:
        if self._deleter is not None:
            self._deletions.put(None)
            self._deleter.join(timeout=30)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
