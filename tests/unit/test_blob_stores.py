"""The blob store contract, run against a directory and a real S3 server (SeaweedFS)."""

from __future__ import annotations

import errno
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.s3server import S3Server
from spoolfs.blobs.base import BlobStore
from spoolfs.blobs.files import BlobDir
from spoolfs.blobs.s3 import MULTIPART, S3Blobs
from spoolfs.core.errors import StoreFailure


def staged(tmp_path: Path, data: bytes, name: str = "up") -> tuple[str, bytes]:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p), hashlib.sha256(data).digest()


@pytest.fixture(params=["dir", "s3"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    if request.param == "dir":
        b: BlobStore = BlobDir(str(tmp_path / "blobs"), remote=True)
    else:
        b = S3Blobs(request.getfixturevalue("s3_url"), str(tmp_path / "cache"))
    yield b
    b.close()


def read(b: BlobStore, sha: bytes, bid: int, size: int) -> bytes:
    with open(b.fetch(sha, bid, size), "rb") as f:
        return f.read()


def test_upload_then_read_back(blobs: BlobStore, tmp_path: Path) -> None:
    data = os.urandom(70_000)
    src, sha = staged(tmp_path, data)
    blobs.upload(src, sha, 7)
    assert read(blobs, sha, 7, len(data)) == data
    listed = list(blobs.walk())
    assert [(s, i) for _, s, i in listed] == [(sha, 7)]
    name = listed[0][0]
    assert name == blobs.name(sha, 7)
    info = blobs.info(name)
    assert info is not None and info.size == len(data)
    assert blobs.digest(name) == (sha, len(data))


def test_walk_lists_as_it_goes_and_info_answers_past_what_it_keeps(
        blobs: BlobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc walks a million objects a page at a time: the walk holds none of them, and the
    store's memory of listed sizes is bounded (S3), with ``info`` asking for the rest."""
    monkeypatch.setattr("spoolfs.blobs.s3.INFO_KEPT", 2)
    sizes = {}
    for i in range(5):
        data = b"object %d" % i * (i + 1)
        src, sha = staged(tmp_path, data, f"up{i}")
        blobs.upload(src, sha, 10 + i)
        sizes[blobs.name(sha, 10 + i)] = len(data)
    walk = blobs.walk()
    assert not isinstance(walk, (list, tuple))  # an iterator, listed as it goes
    names = [name for name, _, _ in walk]
    assert sorted(names) == sorted(sizes)
    for name in names:
        info = blobs.info(name)
        assert info is not None and info.size == sizes[name]
    if isinstance(blobs, S3Blobs):
        assert len(blobs._info) <= 2


def test_walk_reads_the_listing_a_page_at_a_time(blobs: BlobStore, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The first object comes before the rest of the listing is read (S3: one page of
    ``LIST_PAGE`` objects per request; a directory: one directory at a time)."""
    monkeypatch.setattr("spoolfs.blobs.s3.LIST_PAGE", 2)
    for i in range(5):
        src, sha = staged(tmp_path, b"paged %d" % i, f"p{i}")
        blobs.upload(src, sha, 20 + i)
    requests: list[int] = []
    if isinstance(blobs, S3Blobs):
        listing = blobs.client.list_objects_v2

        def counted(**kw: object) -> object:
            requests.append(1)
            return listing(**kw)
        monkeypatch.setattr(blobs.client, "list_objects_v2", counted)
    walk = blobs.walk()
    first = next(iter(walk))
    assert first[2] >= 20
    if isinstance(blobs, S3Blobs):
        assert len(requests) == 1
    assert len([first, *walk]) == 5
    if isinstance(blobs, S3Blobs):
        assert len(requests) == 3


def test_walk_reports_only_names_of_blobs_as_blobs(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What else a blob directory may hold: a stray name (id -1, which no row has), an id no
    row can have (past 64 bits: id -1, not an overflow in the lookup), a symbolic link to a
    directory (neither walked nor reported), a directory that cannot be read (skipped, with
    a warning: the walk goes on)."""
    b = BlobDir(str(tmp_path / "blobs"), remote=True)
    src, sha = staged(tmp_path, b"kept")
    b.upload(src, sha, 1)
    kept = b.name(sha, 1)
    (tmp_path / "blobs" / "stray.txt").write_bytes(b"x")
    huge = tmp_path / "blobs" / f"{'ab' * 32}.{1 << 64}"
    huge.write_bytes(b"x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"{'cd' * 32}.5").write_bytes(b"x")
    (tmp_path / "blobs" / "linked").symlink_to(elsewhere)
    unreadable = tmp_path / "blobs" / "ee"
    unreadable.mkdir()
    (unreadable / f"{'ee' * 32}.6").write_bytes(b"x")
    scandir = os.scandir

    def refusing(path: str) -> object:
        if path == str(unreadable):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return scandir(path)
    monkeypatch.setattr("spoolfs.blobs.files.os.scandir", refusing)
    walked = sorted(b.walk())
    assert walked == sorted([(kept, sha, 1), (str(tmp_path / "blobs" / "stray.txt"), b"", -1),
                             (str(huge), b"", -1)])
    assert f"blob walk: {unreadable} skipped" in caplog.text


def test_write_once_an_existing_object_is_taken_as_stored(blobs: BlobStore,
                                                          tmp_path: Path) -> None:
    data = b"same bytes" * 100
    src, sha = staged(tmp_path, data)
    blobs.upload(src, sha, 3)
    blobs.upload(src, sha, 3)  # a retry after a lost answer: fine
    assert read(blobs, sha, 3, len(data)) == data
    other, _ = staged(tmp_path, b"x" * 5, "other")
    with pytest.raises((StoreFailure, OSError)):  # the same key with other bytes never wins
        blobs.upload(other, sha, 3)
    assert read(blobs, sha, 3, len(data)) == data


def test_remove_and_unlink(blobs: BlobStore, tmp_path: Path) -> None:
    src, sha = staged(tmp_path, b"gone soon")
    blobs.upload(src, sha, 1)
    blobs.remove(sha, 1)
    blobs.close()  # waits for background removals

    def gone() -> bool:
        return blobs.info(blobs.name(sha, 1)) is None
    deadline = time.monotonic() + 30
    while not gone():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert list(blobs.walk()) == []


def test_large_content_in_parts(blobs: BlobStore, tmp_path: Path) -> None:
    data = os.urandom(MULTIPART + 3 * 1024 * 1024)
    src, sha = staged(tmp_path, data)
    blobs.upload(src, sha, 11)
    assert blobs.digest(blobs.name(sha, 11)) == (sha, len(data))
    assert read(blobs, sha, 11, len(data)) == data


def test_a_cached_object_reads_without_the_server(tmp_path: Path, s3_url: str,
                                                  s3_server: S3Server) -> None:
    # a server of its own, stopped mid-test
    server = S3Server().start()
    try:
        for k, v in server.env().items():
            os.environ[k] = v
        url = f"s3://{server.new_bucket()}/p"
        b = S3Blobs(url, str(tmp_path / "cache"))
        data = os.urandom(20_000)
        src, sha = staged(tmp_path, data)
        b.upload(src, sha, 5)
        assert read(b, sha, 5, len(data)) == data
        server.close()
        assert read(b, sha, 5, len(data)) == data  # from the cache
        src2, sha2 = staged(tmp_path, b"new", "n")
        t0 = time.monotonic()
        with pytest.raises(StoreFailure) as exc:
            b.upload(src2, sha2, 6)
        assert time.monotonic() - t0 < 60 and "\n" not in str(exc.value)
    finally:
        server.close()
        for k, v in s3_server.env().items():
            os.environ[k] = v


def test_the_cache_keeps_to_its_size(s3_url: str, tmp_path: Path) -> None:
    b = S3Blobs(s3_url, str(tmp_path / "cache"), cache_max=50_000)
    for i in range(5):
        data = os.urandom(20_000)
        src, sha = staged(tmp_path, data, f"f{i}")
        b.upload(src, sha, i + 1)
        assert read(b, sha, i + 1, len(data)) == data
    assert b.cached_bytes() <= 50_000


def test_an_unknown_bucket_is_one_line(s3_server: S3Server, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    b = S3Blobs("s3://no-such-bucket/x", str(tmp_path / "cache"))
    with pytest.raises(StoreFailure) as exc:
        b.check()
    assert "\n" not in str(exc.value) and "no-such-bucket" in str(exc.value)


def test_an_unreachable_endpoint_fails_quickly(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    b = S3Blobs("s3://b/p", str(tmp_path / "cache"))
    t0 = time.monotonic()
    with pytest.raises(StoreFailure):
        b.check()
    assert time.monotonic() - t0 < 60


def test_a_shared_directory_on_another_file_system_is_copied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = BlobDir(str(tmp_path / "blobs"), remote=True)
    data = os.urandom(10_000)
    src, sha = staged(tmp_path, data)

    def no_link(a: str, b: str) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    b.upload(src, sha, 9)
    assert read(b, sha, 9, len(data)) == data
    assert os.stat(b.path(sha, 9)).st_ino != os.stat(src).st_ino
