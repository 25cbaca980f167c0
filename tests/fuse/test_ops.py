"""The FUSE handlers called directly, without a kernel: errno mapping, lookup counts and
forget, readdir cookies, publishing at close, rename refusals. Milliseconds per test; what only a
kernel shows (its caches, real processes closing files) stays in tests/integration."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from collections.abc import Awaitable
from pathlib import Path
from time import monotonic
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from helpers.kernel import Ctx, Fs
from spoolfs.core import errors
from spoolfs.core.rules import State
from spoolfs.fuse import ops as ops_module
from spoolfs.fuse import virtual
from spoolfs.service.spool import RENAME_EXCHANGE, RENAME_NOREPLACE
from spoolfs.service.spool_core import SpoolCore
from spoolfs.store.base import WAIT_R, Entry, Steps


def _spool_errors() -> list[type[errors.SpoolError]]:
    found, todo = [], [errors.SpoolError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__name__)


async def _errno_of(call: Awaitable[object]) -> int:
    with pytest.raises(pyfuse3.FUSEError) as caught:
        await call
    return caught.value.errno


# ---- errno mapping -------------------------------------------------------------------------

@pytest.mark.parametrize("cls", _spool_errors(), ids=lambda c: c.__name__)
async def test_every_refusal_is_its_errno_and_one_log_line(
        fs: Fs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        cls: type[errors.SpoolError]) -> None:
    async def refuse(parent: int, name: bytes, who: object = None) -> None:
        raise cls("the reason")

    monkeypatch.setattr(fs.spool, "find", refuse)
    with caplog.at_level(logging.INFO, logger=ops_module.__name__):
        assert await _errno_of(fs.ops.lookup(fs[State.READY], b"m", Ctx())) == cls.errno
    lines = [r.getMessage() for r in caplog.records if r.name == ops_module.__name__]
    assert len(lines) == 1, lines
    assert lines[0].startswith("refused lookup(") and "the reason" in lines[0]
    assert errno.errorcode[cls.errno] in lines[0]
    # where, and who asked: the path in the mount, never an inode number
    assert f"ready/m): {errno.errorcode[cls.errno]} (the reason) uid=0 pid={os.getpid()}" \
        in lines[0]


async def test_a_refusal_whose_paths_cannot_be_read_is_still_its_errno(
        fs: Fs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The store gone (a database stopped): the refusal's log line cannot name paths, and
    must still be a line and the errno, not an exception out of the handler (which would end
    the FUSE session and fail every later request with ECONNABORTED)."""
    async def refuse(parent: int, name: bytes, who: object = None) -> None:
        raise errors.StoreFailure("database unavailable")

    def unreadable(*args: object) -> None:
        raise errors.StoreFailure("database unavailable")

    monkeypatch.setattr(fs.spool, "find", refuse)
    monkeypatch.setattr(fs.spool, "path_of", unreadable)
    with caplog.at_level(logging.INFO, logger=ops_module.__name__):
        assert await _errno_of(fs.ops.lookup(fs[State.READY], b"m", Ctx())) == errno.EIO
    lines = [r.getMessage() for r in caplog.records if r.name == ops_module.__name__]
    assert len(lines) == 1 and lines[0].startswith("refused lookup(inode "), lines
    assert "/m): EIO (database unavailable)" in lines[0]


async def test_a_missing_name_is_a_cached_negative_entry_without_a_log_line(
        fs: Fs, caplog: pytest.LogCaptureFixture) -> None:
    # the kernel looks names up before every create: a missing name is not news, and the
    # kernel may keep the answer (a negative entry: inode 0) as long as it keeps names
    with caplog.at_level(logging.INFO, logger=ops_module.__name__):
        attr = await fs.ops.lookup(fs[State.READY], b"none", Ctx())
    assert attr.st_ino == 0 and attr.entry_timeout == ops_module.TIMEOUT > 0
    assert [r for r in caplog.records if r.name == ops_module.__name__] == []


@pytest.mark.parametrize("shared", [False, True], ids=["embedded", "shared"])
async def test_a_shared_stores_queues_and_views_keep_their_names_longer(
        fs: Fs, monkeypatch: pytest.MonkeyPatch, shared: bool) -> None:
    """On a shared store the kernel may keep the name of a queue, a state directory or a
    consumer's view for STRUCTURE_TIMEOUT: every change to one is a transaction the mount
    makes itself or its follower sees (and drops the name). A message's name, every
    attribute, and every name on an embedded store (whose other daemons no one follows)
    keep TIMEOUT."""
    monkeypatch.setattr(fs.spool.store, "shared", shared)
    ops = ops_module.Operations(fs.spool)
    longer = ops_module.STRUCTURE_TIMEOUT if shared else ops_module.TIMEOUT
    assert longer >= ops_module.TIMEOUT
    view = await ops.mkdir(fs[State.WORKING], b"c1", 0o755, Ctx())
    await fs.upload(fs[State.READY], b"m", b"data")
    for parent, name, timeout in ((pyfuse3.ROOT_INODE, b"q", longer),
                                  (fs.queue, b"working", longer),
                                  (fs[State.WORKING], b"c1", longer),
                                  (fs[State.READY], b"m", ops_module.TIMEOUT)):
        attr = await ops.lookup(parent, name, Ctx())
        assert (attr.entry_timeout, attr.attr_timeout) == (timeout, ops_module.TIMEOUT), name
    assert view.entry_timeout == longer
    assert (await ops.lookup(fs.queue, b"nothing", Ctx())).entry_timeout == ops_module.TIMEOUT


@pytest.mark.parametrize("exists", [False, True], ids=["absent", "present"])
async def test_an_answer_read_while_a_name_was_dropped_is_not_kept(
        fs: Fs, monkeypatch: pytest.MonkeyPatch, exists: bool) -> None:
    """On a database server the loop answers other requests while a lookup waits for its
    row, and meanwhile a transition may drop a name from the kernel's cache (a lease run out,
    another host's claim). The row read may be older than that: the kernel gets it without a
    timeout, so that it asks again, rather than keeping a name that is gone (or missing one
    that came) for a second."""
    ready = fs[State.READY]
    if exists:
        await fs.upload(ready, b"m", b"x")
    reading, answer = trio.Event(), trio.Event()
    real = fs.spool.r.lookup_steps
    servers: list[socket.socket] = []  # the "server's" end of each read's socket

    def slow(parent: int, name: bytes) -> Steps[Entry | None]:
        found = yield from real(parent, name)
        reading.set()
        r, w = socket.socketpair()
        try:
            servers.append(w)
            yield r.fileno(), WAIT_R  # the loop goes on until the "server" answers
        finally:
            r.close()
        return found

    monkeypatch.setattr(fs.spool.r, "lookup_steps", slow)
    async with trio.open_nursery() as nursery:
        async def look() -> None:
            got.append(await fs.ops.lookup(ready, b"m", Ctx()))
            answer.set()
        got: list[pyfuse3.EntryAttributes] = []
        nursery.start_soon(look)
        await reading.wait()
        fs.ops._drop_name(ready, b"other")  # a transition's, while the row was on its way
        servers[0].send(b".")
        await answer.wait()
    servers[0].close()
    assert got[0].entry_timeout == 0 and (got[0].st_ino != 0) == exists
    if exists:
        assert got[0].attr_timeout == 0
    # with nothing dropped meanwhile, the answer is kept as ever
    monkeypatch.undo()
    again = await fs.ops.lookup(ready, b"m", Ctx())
    assert again.entry_timeout == ops_module.TIMEOUT


async def test_the_name_of_an_unpublished_upload_is_enoent_never_cached(fs: Fs) -> None:
    """An upload into ready/ being written may appear at any close: its name is "no such
    file" for now, an answer the kernel must not keep."""
    ready = fs[State.READY]
    fi, _ = await fs.ops.create(ready, b"m", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    assert await _errno_of(fs.ops.lookup(ready, b"m", Ctx())) == errno.ENOENT
    await fs.ops.release(fi.fh)


@pytest.mark.parametrize("handler", ["lookup", "mkdir", "unlink", "rename", "getxattr"])
async def test_an_unexpected_exception_is_eio_with_its_traceback_logged(
        fs: Fs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        handler: str) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the store broke")

    async def broken_async(*args: object, **kwargs: object) -> None:
        broken()

    ready = fs[State.READY]
    await fs.upload(ready, b"m", b"x")
    for name in ("lookup", "get", "settle", "mkdir", "unlink", "rename"):
        monkeypatch.setattr(fs.spool, name, broken_async if name in (
            "settle", "mkdir", "unlink", "rename") else broken)
    calls = {
        "lookup": lambda: fs.ops.lookup(ready, b"m", Ctx()),
        "mkdir": lambda: fs.ops.mkdir(fs[State.WORKING], b"c", 0o755, Ctx()),
        "unlink": lambda: fs.ops.unlink(ready, b"m", Ctx()),
        "rename": lambda: fs.ops.rename(ready, b"m", ready, b"n", 0, Ctx()),
        "getxattr": lambda: fs.ops.getxattr(ready, b"user.spool.state", Ctx()),
    }
    with caplog.at_level(logging.INFO, logger=ops_module.__name__):
        assert await _errno_of(calls[handler]()) == errno.EIO
    logged = [r for r in caplog.records if r.name == ops_module.__name__]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR
    assert logged[0].getMessage().startswith(f"internal error in {handler}(")
    assert logged[0].exc_info is not None and logged[0].exc_info[0] is RuntimeError


async def test_a_request_on_an_unknown_handle_is_eio_not_a_crash(fs: Fs) -> None:
    assert await _errno_of(fs.ops.read(999, 0, 10)) == errno.EIO
    assert await _errno_of(fs.ops.write(999, 0, b"x")) == errno.EIO


async def test_written_content_is_logged_as_its_size_only(
        fs: Fs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fi, _ = await fs.ops.create(fs[State.PARTIAL], b"u", 0o644, os.O_WRONLY, Ctx())

    def refuse(*args: object) -> int:
        raise errors.NoSpace("disk full")

    monkeypatch.setattr(fs.spool.guard, "check", refuse)
    with caplog.at_level(logging.INFO, logger=ops_module.__name__):
        assert await _errno_of(fs.ops.write(fi.fh, 0, b"secret payload")) == errno.ENOSPC
    text = caplog.text
    assert "secret" not in text
    assert "refused write(q/partial/u, <14 bytes>): ENOSPC (disk full)\n" in text
    monkeypatch.undo()
    await fs.ops.release(fi.fh)


# ---- refusals through the handlers ----------------------------------------------------------

async def test_rename_refusals_change_nothing(fs: Fs) -> None:
    ready, success = fs[State.READY], fs[State.SUCCESS]
    a = await fs.upload(ready, b"a", b"1")
    await fs.upload(ready, b"b", b"2")
    assert await _errno_of(fs.ops.rename(ready, b"a", success, b"a", 0, Ctx())) == errno.EPERM
    assert await _errno_of(fs.ops.rename(ready, b"a", ready, b"b", 0, Ctx())) == errno.EEXIST
    assert await _errno_of(
        fs.ops.rename(ready, b"a", ready, b"c", RENAME_NOREPLACE | RENAME_EXCHANGE, Ctx())
    ) == errno.EINVAL
    assert await _errno_of(
        fs.ops.rename(ready, b"a", ready, b"x" * 256, 0, Ctx())) == errno.ENAMETOOLONG
    assert await _errno_of(fs.ops.rename(ready, b"none", ready, b"c", 0, Ctx())) == errno.ENOENT
    assert sorted(await fs.names(ready)) == [b"a", b"b"]
    assert await fs.names(success) == []
    assert (await fs.ops.lookup(ready, b"a", Ctx())).st_ino == a
    assert await fs.read_all(a) == b"1"


async def test_creating_where_nothing_may_be_created_is_eperm(fs: Fs) -> None:
    for st in (State.WORKING, State.SUCCESS, State.ERROR):
        assert await _errno_of(
            fs.ops.create(fs[st], b"n", 0o644, os.O_WRONLY, Ctx())) == errno.EPERM
    assert await _errno_of(fs.ops.symlink(fs[State.READY], b"s", b"t", Ctx())) == errno.EPERM
    assert await _errno_of(
        fs.ops.mknod(fs[State.READY], b"p", 0o010644, 0, Ctx())) == errno.EPERM


async def test_published_content_is_refused_for_writing_at_open(fs: Fs) -> None:
    ino = await fs.upload(fs[State.READY], b"m", b"data")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC):
        assert await _errno_of(fs.ops.open(ino, flags, Ctx())) == errno.EPERM
    assert await fs.read_all(ino) == b"data"


async def test_the_status_directory_is_read_only(fs: Fs) -> None:
    attr = await fs.ops.lookup(pyfuse3.ROOT_INODE, virtual.DIR_NAME, Ctx())
    assert attr.st_ino == virtual.DIR
    name = next(iter(virtual.FILES))
    ino = (await fs.ops.lookup(virtual.DIR, name, Ctx())).st_ino
    assert await _errno_of(fs.ops.open(ino, os.O_WRONLY, Ctx())) == errno.EPERM
    assert await _errno_of(fs.ops.lookup(virtual.DIR, b"none", Ctx())) == errno.ENOENT


async def test_mkdir_applies_the_callers_umask(fs: Fs) -> None:
    attr = await fs.ops.mkdir(fs[State.WORKING], b"c", 0o777, Ctx(umask=0o027))
    assert attr.st_mode & 0o777 == 0o750


# ---- lookup counts and forget ---------------------------------------------------------------

async def test_an_unlinked_entry_answers_until_the_kernel_forgets_it(fs: Fs) -> None:
    partial = fs[State.PARTIAL]
    ino = await fs.upload(partial, b"u", b"abc")  # create: one lookup
    assert (await fs.ops.lookup(partial, b"u", Ctx())).st_ino == ino  # two
    await fs.ops.unlink(partial, b"u", Ctx())
    attr = await fs.ops.getattr(ino, Ctx())
    assert attr.st_nlink == 0 and attr.st_size == 3
    await fs.ops.forget([(ino, 1)])
    assert (await fs.ops.getattr(ino, Ctx())).st_nlink == 0
    await fs.ops.forget([(ino, 1)])
    assert await _errno_of(fs.ops.getattr(ino, Ctx())) == errno.ENOENT


async def test_readdir_entries_count_as_lookups(fs: Fs) -> None:
    partial = fs[State.PARTIAL]
    ino = await fs.upload(partial, b"u", b"abc")
    await fs.ops.forget([(ino, 1)])  # the create's lookup
    assert await fs.names(partial) == [b"u"]  # the listing's
    await fs.ops.unlink(partial, b"u", Ctx())
    assert (await fs.ops.getattr(ino, Ctx())).st_nlink == 0
    await fs.ops.forget([(ino, 1)])
    assert await _errno_of(fs.ops.getattr(ino, Ctx())) == errno.ENOENT


async def test_forget_never_raises(fs: Fs) -> None:
    ino = await fs.upload(fs[State.READY], b"m", b"x")
    await fs.ops.forget([(ino, 5), (123456, 1), (pyfuse3.ROOT_INODE, 1), (virtual.DIR, 2)])
    await fs.ops.forget([(ino, 1)])
    assert (await fs.ops.getattr(ino, Ctx())).st_ino == ino  # still linked: still there


# ---- readdir cookies ------------------------------------------------------------------------

async def test_readdir_resumes_at_its_cookie_while_the_directory_changes(fs: Fs) -> None:
    ready = fs[State.READY]
    before = [b"m%d" % i for i in range(7)]
    for name in before:
        await fs.upload(ready, name, name)
    fh = await fs.ops.opendir(ready, Ctx())
    seen: list[bytes] = []
    cookie = 0
    fs.listing.replies.clear()
    for _round in range(20):
        fs.listing.room = 3  # the kernel's buffer is full after three entries
        await fs.ops.readdir(fh, cookie, None)
        if not fs.listing.replies:
            break
        seen += [name for name, _, _ in fs.listing.replies]
        cookie = fs.listing.replies[-1][2]
        fs.listing.replies.clear()
        # the directory changes between two readdir calls of one listing (for the first
        # pages: a producer that never stops would make any listing endless, as on ext4)
        if _round < 3:
            await fs.ops.unlink(ready, seen[-1], Ctx())
            await fs.upload(ready, b"new%d" % len(seen), b"n")
    else:
        raise AssertionError("the listing did not end")
    await fs.ops.releasedir(fh)
    # each entry that was there from the start once: none skipped, none repeated; entries
    # made meanwhile come after (entry order), each at most once
    assert [n for n in seen if n in before] == before
    assert len(seen) == len(set(seen))
    assert all(n.startswith(b"new") for n in seen if n not in before)


async def _list_in_replies(fs: Fs, fh: int, room: int) -> list[bytes]:
    """A whole listing, ``room`` entries per readdir (the kernel's buffer)."""
    seen: list[bytes] = []
    cookie = 0
    while replies := await fs.readdir(fh, cookie, room):
        seen += [name for name, _, _ in replies]
        cookie = replies[-1][2]
    return seen


def _pages_read(fs: Fs, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows each page read from the store returned, in order."""
    read: list[int] = []
    listing = fs.spool.r.listing

    def counted(parent: int, after: int, limit: int) -> list[Entry]:
        rows = listing(parent, after, limit)
        read.append(len(rows))
        return rows

    monkeypatch.setattr(fs.spool.r, "listing", counted)
    return read


async def test_a_listing_reads_each_entry_from_the_store_once(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel takes fewer entries per readdir than a page holds: what it did not take is
    its next readdir's, not read again (on a database server a page costs milliseconds)."""
    ready = fs[State.READY]
    names = [b"m%03d" % i for i in range(2 * ops_module.PAGE + 50)]
    for name in names:
        await fs.upload(ready, name, b"x")
    now = monotonic()
    monkeypatch.setattr(ops_module, "monotonic", lambda: now)  # however slow the machine
    read = _pages_read(fs, monkeypatch)
    fh = await fs.ops.opendir(ready, Ctx())
    assert await _list_in_replies(fs, fh, 100) == names
    await fs.ops.releasedir(fh)
    assert read == [ops_module.PAGE, ops_module.PAGE, 50]


async def test_a_listing_reads_again_after_a_change_or_a_pause(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a page read and the kernel did not take yet is not kept past a change this daemon
    commits (a name it removed must not come back), nor long (another daemon's changes)."""
    ready = fs[State.READY]
    for i in range(12):
        await fs.upload(ready, b"m%03d" % i, b"x")
    clock = [monotonic()]
    monkeypatch.setattr(ops_module, "monotonic", lambda: clock[0])
    read = _pages_read(fs, monkeypatch)
    fh = await fs.ops.opendir(ready, Ctx())
    cookie = 0

    async def three() -> list[bytes]:
        nonlocal cookie
        replies = await fs.readdir(fh, cookie, 3)  # the kernel's buffer full after three
        if replies:
            cookie = replies[-1][2]
        return [n for n, _, _ in replies]

    assert await three() == [b"m000", b"m001", b"m002"] and read == [12]
    assert await three() == [b"m003", b"m004", b"m005"] and read == [12]  # the rest
    await fs.ops.unlink(ready, b"m006", Ctx())  # read with the page, not sent yet
    assert await three() == [b"m007", b"m008", b"m009"] and read == [12, 5]
    clock[0] += ops_module.TIMEOUT
    assert await three() == [b"m010", b"m011"] and read == [12, 5, 2]
    assert await three() == [] and read == [12, 5, 2]  # the end, known
    await fs.ops.releasedir(fh)


async def test_a_listing_keeps_nothing_read_while_a_commit_is_under_way(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit in a worker thread (a database server) may or may not be seen by a read
    meanwhile: a page read then is read again."""
    ready = fs[State.READY]
    for i in range(6):
        await fs.upload(ready, b"m%03d" % i, b"x")
    now = monotonic()
    monkeypatch.setattr(ops_module, "monotonic", lambda: now)
    read = _pages_read(fs, monkeypatch)
    fh = await fs.ops.opendir(ready, Ctx())
    fs.spool.committer.started += 1  # as while a batch commits in its thread
    cookie = (await fs.readdir(fh, 0, 3))[-1][2]
    fs.spool.committer.started -= 1
    assert [n for n, _, _ in await fs.readdir(fh, cookie, 3)] == [b"m003", b"m004", b"m005"]
    assert read == [6, 3]
    await fs.ops.releasedir(fh)


async def test_a_cookie_past_the_end_lists_nothing(fs: Fs) -> None:
    ready = fs[State.READY]
    await fs.upload(ready, b"m", b"x")
    fh = await fs.ops.opendir(ready, Ctx())
    await fs.ops.readdir(fh, 10, None)
    await fs.ops.releasedir(fh)
    assert fs.listing.replies == []


# ---- publishing at close --------------------------------------------------------------------

async def test_a_file_created_in_ready_appears_at_its_openers_flush(fs: Fs) -> None:
    ready = fs[State.READY]
    fi, attr = await fs.ops.create(ready, b"m", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    assert attr.entry_timeout == 0  # the kernel must not cache a name ready/ does not show
    await fs.ops.write(fi.fh, 0, b"hello ")
    await fs.ops.write(fi.fh, 6, b"world")
    assert await fs.names(ready) == []
    assert await _errno_of(fs.ops.lookup(ready, b"m", Ctx())) == errno.ENOENT
    await fs.ops.flush(fi.fh)
    assert await fs.names(ready) == [b"m"]
    # later writes through a copy of the descriptor are refused: the message is published
    assert await _errno_of(fs.ops.write(fi.fh, 11, b"!")) == errno.EPERM
    await fs.ops.release(fi.fh)
    ino = (await fs.ops.lookup(ready, b"m", Ctx())).st_ino
    assert ino == attr.st_ino
    assert await fs.read_all(ino) == b"hello world"
    assert await fs.ops.getxattr(ino, b"user.spool.state", Ctx()) == b"ready"


async def test_a_flush_while_the_opener_holds_the_file_does_not_publish(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    ready = fs[State.READY]
    fi, _ = await fs.ops.create(ready, b"m", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    await fs.ops.write(fi.fh, 0, b"data")
    # a child closing an inherited copy: the opener (this process, running) still holds it
    monkeypatch.setattr(ops_module, "_holds", lambda pid, ino: True)
    await fs.ops.flush(fi.fh)
    assert await fs.names(ready) == []
    await fs.ops.release(fi.fh)  # the last handle: published now
    assert await fs.names(ready) == [b"m"]


async def test_the_first_open_of_published_content_drops_what_the_kernel_cached_before(
        fs: Fs) -> None:
    """A message keeps its inode when it is published, and the kernel may hold pages of it
    read while it was an upload (another mount's writer may have written it since): the
    first open of the published content here drops them (no ``keep_cache``); later opens
    keep what is cached, as its bytes never change now."""
    partial, ready = fs[State.PARTIAL], fs[State.READY]
    ino = await fs.upload(partial, b"m", b"v1")
    fi = await fs.ops.open(ino, os.O_RDONLY, Ctx())  # a reader of the upload: pages cached
    assert not fi.keep_cache
    await fs.ops.release(fi.fh)
    await fs.ops.rename(partial, b"m", ready, b"m", 0, Ctx())
    opens = []
    for _ in range(2):
        fi = await fs.ops.open(ino, os.O_RDONLY, Ctx())
        opens.append(fi.keep_cache)
        await fs.ops.release(fi.fh)
    assert opens == [False, True]
    await fs.ops.forget([(ino, 1000)])  # the kernel let the inode go, and its pages with it
    ino = (await fs.ops.lookup(ready, b"m", Ctx())).st_ino
    fi = await fs.ops.open(ino, os.O_RDONLY, Ctx())
    assert not fi.keep_cache
    await fs.ops.release(fi.fh)


async def test_names_a_publish_makes_elsewhere_are_dropped_from_the_kernels_cache(
        fs: Fs) -> None:
    """A publish can make names the kernel never asked for, where it may hold a negative
    entry (a consumer's ``-e`` test a moment before): a topic's copies in its subscribers'
    ``ready/``, the topic's message in ``success/``, a skipped duplicate in ``success/``, an
    upload refused at its close in ``partial/``. Each is dropped from the kernel's cache once
    the publish commits, as the lifecycle's moves are."""
    topic, success = fs[State.READY], fs[State.SUCCESS]
    sub = await fs.ops.mkdir(pyfuse3.ROOT_INODE, b"sub", 0o755, Ctx())
    sub_ready = (await fs.ops.lookup(sub.st_ino, b"ready", Ctx())).st_ino
    await fs.ops.setxattr(fs.queue, b"user.spool.policy.fanout", b"sub", Ctx())
    for d, name in ((sub_ready, b"job"), (success, b"job")):
        assert (await fs.ops.lookup(d, name, Ctx())).st_ino == 0  # cached as absent
    await fs.upload(topic, b"job", b"x")
    assert (sub_ready, b"job") in fs.kernel.invalidated_entries
    assert (success, b"job") in fs.kernel.invalidated_entries
    await fs.ops.setxattr(fs.queue, b"user.spool.policy.fanout", b"", Ctx())
    await fs.ops.setxattr(fs.queue, b"user.spool.policy.duplicates", b"skip", Ctx())
    await fs.upload(topic, b"again", b"y")
    await fs.upload(topic, b"dup", b"y")
    assert await fs.names(success) == [b"job", b"dup"]
    assert (success, b"dup") in fs.kernel.invalidated_entries


async def test_a_link_whose_name_went_on_at_once_is_not_kept_by_the_kernel(fs: Fs) -> None:
    """``ln f topic/ready/g``: the topic's message goes on to ``success/`` in the link's own
    transaction, so the name the reply gives the kernel is gone already. Its entry has no
    timeout: the kernel asks again rather than keep it until the daemon's drop of it lands
    (which a loaded machine delays past the next ``stat``)."""
    topic, success = fs[State.READY], fs[State.SUCCESS]
    sub = await fs.ops.mkdir(pyfuse3.ROOT_INODE, b"sub", 0o755, Ctx())
    src = await fs.upload(topic, b"src", b"x")
    await fs.ops.setxattr(fs.queue, b"user.spool.policy.fanout", b"sub", Ctx())
    attr = await fs.ops.link(src, topic, b"g", Ctx())
    assert attr.entry_timeout == 0 and attr.st_ino != 0
    assert await fs.names(success) == [b"g"] and sub.st_ino
    plain = await fs.ops.link(src, fs[State.PARTIAL], b"h", Ctx())  # stays where made
    assert plain.entry_timeout == ops_module.TIMEOUT


async def test_an_upload_not_published_yet_is_not_read_through_a_name_still_cached(
        fs: Fs) -> None:
    """``mv`` of an upload still written into ``ready/``: the kernel holds the new name until
    the daemon's drop of it lands (later still while that waits for a directory's lock). A
    reader's open through it finds no such file, as a lookup would, rather than the
    unfinished bytes; the writer writes on and its close publishes."""
    partial, ready = fs[State.PARTIAL], fs[State.READY]
    fi, attr = await fs.ops.create(partial, b"u", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    await fs.ops.write(fi.fh, 0, b"hal")
    await fs.ops.rename(partial, b"u", ready, b"u", 0, Ctx())
    assert await _errno_of(fs.ops.open(attr.st_ino, os.O_RDONLY, Ctx())) == errno.ENOENT
    await fs.ops.write(fi.fh, 3, b"f of it\n")
    await fs.ops.flush(fi.fh)
    await fs.ops.release(fi.fh)
    assert await fs.read_all(attr.st_ino) == b"half of it\n"


async def test_publishing_a_file_still_open_drops_its_cached_name(fs: Fs) -> None:
    partial, ready = fs[State.PARTIAL], fs[State.READY]
    fi, _ = await fs.ops.create(partial, b"u", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    await fs.ops.write(fi.fh, 0, b"abc")
    await fs.ops.rename(partial, b"u", ready, b"u", 0, Ctx())
    assert (ready, b"u") in fs.kernel.invalidated_entries
    assert await fs.names(ready) == []  # hidden until the writer closes
    await fs.ops.flush(fi.fh)
    await fs.ops.release(fi.fh)
    assert await fs.names(ready) == [b"u"]
    assert await fs.read_all((await fs.ops.lookup(ready, b"u", Ctx())).st_ino) == b"abc"


async def test_a_claim_and_finish_through_the_handlers(fs: Fs) -> None:
    ready, success = fs[State.READY], fs[State.SUCCESS]
    ino = await fs.upload(ready, b"m", b"payload")
    view = (await fs.ops.mkdir(fs[State.WORKING], b"w1", 0o755, Ctx())).st_ino
    await fs.ops.rename(ready, b"m", view, b"m", 0, Ctx())
    assert await fs.ops.getxattr(ino, b"user.spool.attempts", Ctx()) == b"1"
    assert await _errno_of(fs.ops.rename(ready, b"m", view, b"m", 0, Ctx())) == errno.ENOENT
    await fs.ops.rename(view, b"m", success, b"m", 0, Ctx())
    assert await fs.names(success) == [b"m"]
    assert await fs.read_all(ino) == b"payload"


# ---- link counts of shared content -----------------------------------------------------------

async def test_removing_shared_content_tells_the_kernel_of_fresh_counts_only(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Identical content is stored once and ``st_nlink`` counts the messages sharing it, so an
    ``rm`` of one changes every other's count. The kernel is told of the others whose
    attributes it may still hold (given within TIMEOUT), and of at most STALE_MAX of them:
    an ``rm`` among thousands of identical messages costs what it costs among a few."""
    ready = fs[State.READY]
    inos = [await fs.upload(ready, b"m%d" % i, b"same") for i in range(SpoolCore.STALE_MAX * 2)]
    fs.kernel.invalidated_inodes.clear()
    await fs.ops.unlink(ready, b"m0", Ctx())  # the kernel was given every count just now
    told = fs.kernel.invalidated_inodes
    assert 0 < len(told) <= SpoolCore.STALE_MAX and inos[0] not in told

    later = ops_module.monotonic() + ops_module.FRESH + 1
    monkeypatch.setattr(ops_module, "monotonic", lambda: later)
    told.clear()
    await fs.ops.unlink(ready, b"m1", Ctx())  # every count it was given has expired
    assert told == []
    attr = await fs.ops.lookup(ready, b"m2", Ctx())  # asked again: told of this one
    assert attr.st_nlink == len(inos) - 2
    await fs.ops.unlink(ready, b"m3", Ctx())
    assert told == [inos[2]]


async def _lookup_once_started(fs: Fs, events: list[str], started: str) -> None:
    """Once an event beginning with ``started`` is noted (a slow call under way), a lookup
    through the same handlers; its answer noted."""
    import trio

    while not any(e.startswith(started) for e in events):
        await trio.sleep(0.001)
    await fs.ops.lookup(fs[State.READY], b"none", Ctx())
    events.append("lookup answered")


async def test_an_fsync_on_disk_leaves_the_other_requests_answered(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer's fsync (the write, fsync, rename pattern of atomic writers) can take as long
    as the disk needs for the file's dirty pages: the mount's other requests go on meanwhile."""
    import time

    import trio

    fi, _ = await fs.ops.create(fs[State.PARTIAL], b"f", 0o644, os.O_WRONLY, Ctx())
    await fs.ops.write(fi.fh, 0, b"data")
    events: list[str] = []
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        events.append("fsync start")
        time.sleep(0.2)
        real_fsync(fd)
        events.append("fsync end")
    monkeypatch.setattr(os, "fsync", slow_fsync)

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(_lookup_once_started, fs, events, "fsync start")
            await fs.ops.fsync(fi.fh, False)
            events.append("fsync answered")
    assert events == ["fsync start", "lookup answered", "fsync end", "fsync answered"]
    monkeypatch.setattr(os, "fsync", real_fsync)
    await fs.ops.release(fi.fh)


def _dropped_from_cache(fd: int) -> bool:
    """Drop a file's pages from the page cache; whether its first page is gone (asked with
    ``RWF_NOWAIT``). ``POSIX_FADV_DONTNEED`` leaves a page still on a per-CPU list: tried a
    few times."""
    import time

    for _ in range(20):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        time.sleep(0.01)
    return False


async def test_a_read_from_the_disk_leaves_the_other_requests_answered(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A message's bytes not in the page cache (a backlog read after a reboot, content the
    kernel let go) are read in a worker thread: a lookup is answered meanwhile. Bytes in the
    page cache are read at once, on the loop."""
    import threading
    import time

    import trio

    from spoolfs.service.content import Handle

    data = os.urandom(256 * 1024)  # past the inline size: a blob file
    ino = await fs.upload(fs[State.READY], b"m", data)
    fi = await fs.ops.open(ino, os.O_RDONLY, Ctx())
    h = fs.ops._handles[fi.fh]
    assert h.fd is not None and h.data is None
    os.fsync(h.fd)
    events: list[str] = []
    real_read = Handle.read

    def slow_read(self: Handle, off: int, size: int) -> bytes:
        events.append("disk read " + ("on the loop" if threading.current_thread()
                                      is threading.main_thread() else "in a thread"))
        time.sleep(0.2)
        return real_read(self, off, size)
    monkeypatch.setattr(Handle, "read", slow_read)

    real_preadv = os.preadv
    if not _dropped_from_cache(h.fd):  # the kernel kept a page (a per-CPU list holds it):
        # the page cache's answer as it would be once dropped
        def uncached(fd: int, bufs: list[bytearray], off: int, flags: int = 0) -> int:
            if flags & os.RWF_NOWAIT:
                raise BlockingIOError(errno.EAGAIN, "not cached")
            return real_preadv(fd, bufs, off, flags)
        monkeypatch.setattr(os, "preadv", uncached)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(_lookup_once_started, fs, events, "disk read")
            got = bytes(await fs.ops.read(fi.fh, 0, len(data)))
    assert got == data
    assert events == ["disk read in a thread", "lookup answered"]
    monkeypatch.setattr(os, "preadv", real_preadv)
    events.clear()
    assert bytes(await fs.ops.read(fi.fh, 0, len(data))) == data  # cached now: read at once
    assert bytes(await fs.ops.read(fi.fh, 1000, 10)) == data[1000:1010]
    assert bytes(await fs.ops.read(fi.fh, len(data) - 5, 100)) == data[-5:]  # the end
    assert events == []
    await fs.ops.release(fi.fh)


async def test_opening_content_whose_path_is_not_cached_leaves_the_other_requests_answered(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A message's content file whose path the kernel no longer caches (a store of many
    contents, a cold disk) is looked up on the disk: it is opened in a worker thread, and a
    lookup is answered meanwhile. A path in the cache is opened at once, on the loop."""
    import threading
    import time

    import trio

    from spoolfs.blobs import opening

    data = os.urandom(64 * 1024)  # past the inline size: a blob file
    ino = await fs.upload(fs[State.READY], b"m", data)
    events: list[str] = []
    real_open, real_cached = os.open, opening.open_cached

    def cold(path: str, flags: int = os.O_RDONLY) -> int | None:
        events.append("cached open tried")
        return None  # as RESOLVE_CACHED says of a path not in the cache

    def slow_open(path: str, flags: int, mode: int = 0o777) -> int:
        if "/blobs/" in str(path):
            events.append("disk open " + ("on the loop" if threading.current_thread()
                                          is threading.main_thread() else "in a thread"))
            time.sleep(0.2)
        return real_open(path, flags, mode)

    monkeypatch.setattr(opening, "open_cached", cold)
    monkeypatch.setattr(os, "open", slow_open)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(_lookup_once_started, fs, events, "disk open")
            fi = await fs.ops.open(ino, os.O_RDONLY, Ctx())
    assert events == ["cached open tried", "disk open in a thread", "lookup answered"]
    assert bytes(await fs.ops.read(fi.fh, 0, len(data))) == data
    await fs.ops.release(fi.fh)

    monkeypatch.setattr(opening, "open_cached", real_cached)  # the kernel's own answer: the
    events.clear()  # path was just looked up
    fi = await fs.ops.open(ino, os.O_RDONLY, Ctx())
    assert events == []  # opened through openat2, on the loop
    assert bytes(await fs.ops.read(fi.fh, 0, len(data))) == data
    await fs.ops.release(fi.fh)


async def test_content_removed_while_a_thread_opens_it_is_enoent(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a worker thread opens a content file whose path was not cached, the loop goes
    on: an ``rm`` of that message may commit and remove the file first. The open then says
    what a lookup would (ENOENT), not EIO."""
    import threading

    import trio

    from spoolfs.blobs import opening
    from spoolfs.service.content import Content

    ino = await fs.upload(fs[State.READY], b"m", os.urandom(64 * 1024))  # a blob file
    removed, opening_started = threading.Event(), threading.Event()
    real_open = Content.open

    def open_after_rm(self: Content, *args: object) -> object:
        opening_started.set()
        assert removed.wait(10)
        return real_open(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(opening, "open_cached", lambda path, flags=os.O_RDONLY: None)
    monkeypatch.setattr(Content, "open", open_after_rm)

    async def rm_meanwhile() -> None:
        await trio.to_thread.run_sync(opening_started.wait, 10)
        await fs.ops.unlink(fs[State.READY], b"m", Ctx())
        removed.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(rm_meanwhile)
            assert await _errno_of(fs.ops.open(ino, os.O_RDONLY, Ctx())) == errno.ENOENT


def test_a_range_with_a_page_not_cached_is_read_off_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_cached`` answers only a range the page cache holds whole: one whose first and
    last pages are cached but not a page between (evicted, or read by another reader at both
    ends) goes to a worker thread, as a range not cached at all does. At the end of the file
    a short answer is the whole answer."""
    from spoolfs.service.content import Handle

    page = 4096
    data = os.urandom(8 * page + 100)
    (tmp_path / "f").write_bytes(data)
    hole = range(3 * page, 4 * page)  # not in the page cache
    real_preadv = os.preadv

    def preadv(fd: int, bufs: list[bytearray], off: int, flags: int = 0) -> int:
        if not flags & os.RWF_NOWAIT:
            return real_preadv(fd, bufs, off, flags)
        if off in hole:
            raise BlockingIOError(errno.EAGAIN, "not cached")
        if off < hole.start:  # as the kernel does: what is cached before the first page not
            (buf,) = bufs
            return real_preadv(fd, [memoryview(buf)[:hole.start - off]], off, flags)
        return real_preadv(fd, bufs, off, flags)

    monkeypatch.setattr(os, "preadv", preadv)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        h = Handle(1, fd, None, False)
        assert h.read_cached(0, 8 * page) is None  # its ends cached, the hole between
        assert h.read_cached(hole.start + 10, page) is None
        assert bytes(h.read_cached(0, 3 * page) or b"") == data[:3 * page]
        assert bytes(h.read_cached(5 * page, 1 << 20) or b"") == data[5 * page:]  # the end
        assert h.read_cached(len(data), page) == b""  # past the end: nothing, at once
        assert h.read(0, 8 * page) == data[:8 * page]  # the thread's read: the disk's
    finally:
        os.close(fd)


async def _upload(fs: Fs, name: bytes, size: int) -> None:
    """An upload in partial/ written through the handlers, closed."""
    fi, _ = await fs.ops.create(fs[State.PARTIAL], name, 0o644, os.O_WRONLY, Ctx())
    for off in range(0, size, 1 << 20):
        assert await fs.ops.write(fi.fh, off, b"z" * (1 << 20)) == 1 << 20
    await fs.ops.flush(fi.fh)
    await fs.ops.release(fi.fh)


async def test_an_upload_whose_sync_failed_is_never_published(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel reports a failed writeback to one fsync only: the publish that saw it fails
    (EIO), and so does every later one of that upload, whose content may have lost a part,
    until it is removed; nothing is published that the disk did not take."""
    real_fsync, failures = os.fsync, [1]

    def fsync(fd: int) -> None:
        if failures:  # the seal's, once: as the kernel reports a writeback error
            failures.pop()
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    await _upload(fs, b"big", 2 << 20)
    monkeypatch.setattr(os, "fsync", fsync)
    for _ in range(2):
        assert await _errno_of(fs.ops.rename(fs[State.PARTIAL], b"big", fs[State.READY],
                                             b"big", 0, Ctx())) == errno.EIO
    assert failures == []
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert (await fs.ops.lookup(fs[State.PARTIAL], b"big", Ctx())).st_size == 2 << 20
    assert (await fs.ops.lookup(fs[State.READY], b"big", Ctx())).st_ino == 0  # no such name
    await fs.ops.unlink(fs[State.PARTIAL], b"big", Ctx())  # written again, it publishes
    await _upload(fs, b"big", 2 << 20)
    await fs.ops.rename(fs[State.PARTIAL], b"big", fs[State.READY], b"big", 0, Ctx())


async def test_an_upload_whose_early_sync_failed_is_never_published(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A very large upload is synced while it is written (blobs/writeback.py); an early sync
    that failed saw the error the seal's fsync no longer would: the publish fails all the
    same."""
    from spoolfs.blobs import writeback
    from spoolfs.service import content

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    wb = writeback.Writeback(sync=failing)
    monkeypatch.setattr(content, "WRITEBACK", wb)
    monkeypatch.setattr(content, "SYNC_STEP", writeback.STEP)
    await _upload(fs, b"big", writeback.STEP)
    wb.drain()
    for _ in range(2):
        assert await _errno_of(fs.ops.rename(fs[State.PARTIAL], b"big", fs[State.READY],
                                             b"big", 0, Ctx())) == errno.EIO
    await fs.ops.unlink(fs[State.PARTIAL], b"big", Ctx())


async def test_a_small_publish_waiting_for_early_syncs_leaves_the_loop_free(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload written large, cut small and published at once is sealed from memory; once
    the daemon has seen a sync fail, the seal waits for the syncs of the old bytes still
    under way (a failed one refuses it). That wait is in a worker thread: the mount's other
    requests go on meanwhile."""
    import threading

    import trio

    from spoolfs.blobs import writeback
    from spoolfs.service import content

    release, events = threading.Event(), []

    def slow_failing(fd: int) -> None:
        events.append("early sync")
        release.wait(10)
        raise OSError(errno.EIO, "Input/output error")

    wb = writeback.Writeback(sync=slow_failing)
    monkeypatch.setattr(content, "WRITEBACK", wb)
    monkeypatch.setattr(content, "SYNC_STEP", writeback.STEP)
    wb.failed("another upload")  # this daemon saw a sync fail before
    await _upload(fs, b"big", writeback.STEP)
    attr = await fs.ops.lookup(fs[State.PARTIAL], b"big", Ctx())
    fields = SimpleNamespace(update_size=True, update_mode=False, update_uid=False,
                             update_gid=False, update_atime=False, update_mtime=False)
    await fs.ops.setattr(attr.st_ino, SimpleNamespace(st_size=10), fields, None, Ctx())

    async def answered_then_released() -> None:
        await _lookup_once_started(fs, events, "early sync")
        release.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(answered_then_released)
            assert await _errno_of(fs.ops.rename(fs[State.PARTIAL], b"big", fs[State.READY],
                                                 b"big", 0, Ctx())) == errno.EIO
            events.append("publish refused")
    assert events == ["early sync", "lookup answered", "publish refused"]


async def test_a_sync_failing_after_its_upload_went_is_forgotten(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload removed while its early sync runs: if that sync then fails, nothing of the
    failure stays in the daemon's memory (every later seal would ask for it)."""
    import threading

    from spoolfs.blobs import writeback
    from spoolfs.service import content

    release, started = threading.Event(), threading.Event()

    def slow_failing(fd: int) -> None:
        started.set()
        release.wait(10)
        raise OSError(errno.EIO, "Input/output error")

    wb = writeback.Writeback(sync=slow_failing)
    monkeypatch.setattr(content, "WRITEBACK", wb)
    monkeypatch.setattr(content, "SYNC_STEP", writeback.STEP)
    await _upload(fs, b"big", writeback.STEP)
    assert started.wait(10)
    await fs.ops.unlink(fs[State.PARTIAL], b"big", Ctx())
    release.set()
    wb.drain()
    assert not wb.any_failed()


def _failing_once(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """``os.<name>`` fails once with EIO, as the kernel reports a lost writeback; what is left
    of the failure (empty once it happened)."""
    real, failures = getattr(os, name), [1]

    def sync(fd: int) -> None:
        if failures:
            failures.pop()
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, name, sync)
    return failures


def _staging_path(fs: Fs, ino: int) -> str:
    return fs.spool.content.staging.path(fs.ops._sid(ino))


def _staging_mode(fs: Fs, ino: int) -> int:
    return os.stat(_staging_path(fs, ino)).st_mode


async def test_a_writers_own_failed_fsync_fails_every_publish_of_its_upload(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's fsync is told of the lost writeback (EIO), and no later sync of the file
    will be: the upload, however small, is never published, and the staging file is marked
    so; removed and written again, it publishes."""
    from spoolfs.blobs import writeback

    fi, attr = await fs.ops.create(fs[State.PARTIAL], b"f", 0o644, os.O_WRONLY, Ctx())
    await fs.ops.write(fi.fh, 0, b"a line\n")
    failures = _failing_once(monkeypatch, "fdatasync")
    assert await _errno_of(fs.ops.fsync(fi.fh, True)) == errno.EIO
    assert failures == []
    await fs.ops.flush(fi.fh)
    await fs.ops.release(fi.fh)
    assert writeback.failed_before(_staging_mode(fs, attr.st_ino))
    for _ in range(2):
        assert await _errno_of(fs.ops.rename(fs[State.PARTIAL], b"f", fs[State.READY], b"f", 0,
                                             Ctx())) == errno.EIO
    assert (await fs.ops.lookup(fs[State.PARTIAL], b"f", Ctx())).st_size == 7
    await fs.ops.unlink(fs[State.PARTIAL], b"f", Ctx())
    await fs.upload(fs[State.PARTIAL], b"f", b"a line\n")
    await fs.ops.rename(fs[State.PARTIAL], b"f", fs[State.READY], b"f", 0, Ctx())


async def test_an_upload_whose_sync_failed_publishes_once_written_whole_again(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer's retry, ``cp`` over the file then ``mv``: the open cuts it to nothing
    (``O_TRUNC``), so the bytes the failed sync may have lost are gone, and the content
    written since is synced by its own seal. A cut that leaves some of the bytes keeps the
    refusal."""
    from spoolfs.blobs import writeback

    fi, attr = await fs.ops.create(fs[State.PARTIAL], b"f", 0o644, os.O_WRONLY, Ctx())
    await fs.ops.write(fi.fh, 0, b"a line\n")
    _failing_once(monkeypatch, "fdatasync")
    assert await _errno_of(fs.ops.fsync(fi.fh, True)) == errno.EIO
    await fs.ops.flush(fi.fh)
    await fs.ops.release(fi.fh)
    cut = SimpleNamespace(st_size=3)
    fields = SimpleNamespace(update_size=True, update_mode=False, update_uid=False,
                             update_gid=False, update_atime=False, update_mtime=False)
    await fs.ops.setattr(attr.st_ino, cut, fields, None, Ctx())
    assert writeback.failed_before(_staging_mode(fs, attr.st_ino))
    assert await _errno_of(fs.ops.rename(fs[State.PARTIAL], b"f", fs[State.READY], b"f", 0,
                                         Ctx())) == errno.EIO
    fi = await fs.ops.open(attr.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
    await fs.ops.write(fi.fh, 0, b"again\n")
    await fs.ops.flush(fi.fh)
    await fs.ops.release(fi.fh)
    assert not writeback.failed_before(_staging_mode(fs, attr.st_ino))
    await fs.ops.rename(fs[State.PARTIAL], b"f", fs[State.READY], b"f", 0, Ctx())
    assert (await fs.ops.lookup(fs[State.READY], b"f", Ctx())).st_size == 6


async def test_a_mark_made_while_the_seal_syncs_refuses_the_publish(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another daemon's early sync of the same upload may take the kernel's one report of a
    lost write while this daemon's seal runs, and mark the file: the seal looks at the mark
    again once its own sync is done."""
    await _upload(fs, b"big", 2 << 20)
    attr = await fs.ops.lookup(fs[State.PARTIAL], b"big", Ctx())
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)  # no error here: the other daemon's sync took it
        path = _staging_path(fs, attr.st_ino)
        os.chmod(path, os.stat(path).st_mode | stat.S_ISGID)

    monkeypatch.setattr(os, "fsync", fsync)
    assert await _errno_of(fs.ops.rename(fs[State.PARTIAL], b"big", fs[State.READY], b"big", 0,
                                         Ctx())) == errno.EIO
    assert (await fs.ops.lookup(fs[State.READY], b"big", Ctx())).st_ino == 0


async def test_a_failed_sync_is_remembered_by_a_daemon_started_again(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon started again has no memory of a failed sync, and the kernel reports it no
    more: the mark on the staging file still refuses the publish."""
    from spoolfs.blobs import writeback
    from spoolfs.service import content

    await _upload(fs, b"big", 2 << 20)
    failures = _failing_once(monkeypatch, "fsync")
    assert await _errno_of(fs.ops.rename(fs[State.PARTIAL], b"big", fs[State.READY], b"big", 0,
                                         Ctx())) == errno.EIO
    assert failures == []
    monkeypatch.setattr(content, "WRITEBACK", writeback.Writeback())  # the memory, gone
    assert await _errno_of(fs.ops.rename(fs[State.PARTIAL], b"big", fs[State.READY], b"big", 0,
                                         Ctx())) == errno.EIO
    assert (await fs.ops.lookup(fs[State.READY], b"big", Ctx())).st_ino == 0


async def test_a_direct_upload_whose_sync_failed_goes_to_partial_at_close(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``cp`` into ``ready/`` whose content the disk may not hold: its close fails (EIO)
    and the upload is shown in ``partial/`` with its bytes and the reason in its history,
    never stranded unseen in ``ready/``."""
    fi, _ = await fs.ops.create(fs[State.READY], b"m", 0o644, os.O_WRONLY, Ctx())
    for off in range(0, 2 << 20, 1 << 20):
        await fs.ops.write(fi.fh, off, b"z" * (1 << 20))
    failures = _failing_once(monkeypatch, "fsync")
    assert await _errno_of(fs.ops.flush(fi.fh)) == errno.EIO
    assert failures == []
    assert (fs[State.PARTIAL], b"m") in fs.kernel.invalidated_entries  # a name it never asked
    await fs.ops.release(fi.fh)
    assert await fs.names(fs[State.READY]) == []
    attr = await fs.ops.lookup(fs[State.PARTIAL], b"m", Ctx())
    assert attr.st_size == 2 << 20
    history = await fs.ops.getxattr(attr.st_ino, b"user.spool.history", Ctx())
    assert b"a sync of it failed" in history or b"failed: [Errno 5]" in history, history
    assert await _errno_of(fs.ops.rename(fs[State.PARTIAL], b"m", fs[State.READY], b"m", 0,
                                         Ctx())) == errno.EIO


async def test_an_nfs_commit_whose_sync_failed_shows_the_upload_in_partial(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """An NFS client's COMMIT is what publishes its upload into ``ready/``: one whose sync
    fails (EIO to the client) shows the upload in ``partial/`` at once, as a local ``cp``'s
    close does, rather than leaving it unseen until the server lets its descriptor go."""
    server = Ctx(pid=4242)
    fs.ops._nfs_threads = {4242: True}
    fi, _ = await fs.ops.create(fs[State.READY], b"n", 0o644, os.O_WRONLY, server)
    await fs.ops.write(fi.fh, 0, b"from a client\n")
    failures = _failing_once(monkeypatch, "fsync")
    assert await _errno_of(fs.ops.fsync(fi.fh, False)) == errno.EIO
    assert failures == []
    assert await fs.names(fs[State.READY]) == []
    assert (await fs.ops.lookup(fs[State.PARTIAL], b"n", Ctx())).st_size == 14
    await fs.ops.flush(fi.fh)
    await fs.ops.release(fi.fh)
    assert await fs.names(fs[State.PARTIAL]) == [b"n"]
    assert await fs.names(fs[State.READY]) == []


async def test_writes_the_disk_holds_back_leave_the_other_requests_answered(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """When dirty pages outrun the disk the kernel pauses each writer (dirty-page throttling).
    A write that waited marks the disk slow: the next writes run in a worker thread, and a
    lookup is answered meanwhile; once the disk has kept up for a while, writes are back on
    the loop (a thread's hand-off costs more than a write into the page cache)."""
    import threading
    import time

    import trio

    from spoolfs.service import writepace

    fi, _ = await fs.ops.create(fs[State.PARTIAL], b"f", 0o644, os.O_WRONLY, Ctx())
    events: list[str] = []
    delay = [0.0]
    real_pwrite = os.pwrite

    def pwrite(fd: int, buf: bytes, off: int) -> int:
        events.append("write " + ("on the loop" if threading.current_thread()
                                  is threading.main_thread() else "in a thread"))
        time.sleep(delay[0])
        return real_pwrite(fd, buf, off)
    monkeypatch.setattr(os, "pwrite", pwrite)

    assert await fs.ops.write(fi.fh, 0, b"a" * 100) == 100  # quick: on the loop
    fs.spool.write_pace.off_loop_until = 0  # (however long a loaded machine took for it)
    delay[0] = 0.05
    assert await fs.ops.write(fi.fh, 100, b"b" * 100) == 100  # it waited, on the loop
    assert events == ["write on the loop"] * 2
    events.clear()
    delay[0] = 0.2
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(_lookup_once_started, fs, events, "write")
            assert await fs.ops.write(fi.fh, 200, b"c" * 100) == 100
            events.append("write answered")
    assert events == ["write in a thread", "lookup answered", "write answered"]

    events.clear()
    delay[0] = 0.0
    later = time.monotonic_ns() + writepace.OFF_LOOP_NS + 1
    monkeypatch.setattr(writepace, "monotonic_ns", lambda: later)
    assert await fs.ops.write(fi.fh, 300, b"d") == 1
    assert events == ["write on the loop"]
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    await fs.ops.release(fi.fh)
    attr = await fs.ops.lookup(fs[State.PARTIAL], b"f", Ctx())
    assert attr.st_size == 301


async def test_a_write_slow_without_waiting_stays_on_the_loop(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write can take long without waiting on the disk: its thread lost the CPU to another
    (or, on a virtual machine, the host took the machine's CPU away for a while). A worker
    thread would not make that faster, only each write dearer: the writes stay on the loop.
    Only a write that slept (the kernel's dirty-page throttling) sends them to threads: the
    thread's voluntary context switches tell (``getrusage``; fixed here, as another thread
    of this process could make the busy one wait for the interpreter lock, which is a
    sleep too)."""
    import resource
    import threading
    import time

    from spoolfs.service import writepace

    before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    time.sleep(0.001)  # what the write pace counts: a sleep is a voluntary switch
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw > before

    class NeverSlept:
        ru_nvcsw = 7
    monkeypatch.setattr(writepace, "getrusage", lambda who: NeverSlept)
    fi, _ = await fs.ops.create(fs[State.PARTIAL], b"f", 0o644, os.O_WRONLY, Ctx())
    where: list[bool] = []
    real_pwrite = os.pwrite

    def busy_pwrite(fd: int, buf: bytes, off: int) -> int:
        where.append(threading.current_thread() is threading.main_thread())
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:  # 50 ms of the CPU's time, no sleep
            pass
        return real_pwrite(fd, buf, off)
    monkeypatch.setattr(os, "pwrite", busy_pwrite)

    for i in range(3):
        assert await fs.ops.write(fi.fh, 100 * i, b"a" * 100) == 100
    assert where == [True] * 3
    assert fs.spool.write_pace.off_loop_until == 0
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    await fs.ops.release(fi.fh)


async def test_removing_content_never_frees_its_space_on_the_loop(
        fs: Fs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Freeing a removed file's blocks can take long (with ``discard``, 0.4 s for 256 MiB on
    this kind of machine): on the loop's thread no call drops the last reference of a file
    larger than ``freeing.SMALL``, neither ``rm`` of a message (its blob file), of an upload
    (its staging file), nor the last close of a message removed while it was read."""
    import threading

    from spoolfs.blobs import freeing

    def last_of_large(st: os.stat_result, links: int, but: int = -1) -> bool:
        """Whether dropping a name or descriptor (``but``) of a file with ``links`` names
        left frees it, and that takes long: no other descriptor here holds it."""
        if st.st_nlink != links or not freeing.is_large(st):
            return False
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                other = os.fstat(fd)
            except OSError:
                continue
            if fd != but and (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                return False
        return True

    freed_on_loop: list[str] = []
    real_unlink, real_close = os.unlink, os.close

    def unlink(path: str, *args: object, **kw: object) -> None:
        if threading.current_thread() is threading.main_thread() and not args and not kw \
                and last_of_large(os.lstat(path), 1):
            freed_on_loop.append(f"unlink {path}")
        real_unlink(path, *args, **kw)  # type: ignore[arg-type]

    def close(fd: int) -> None:
        if threading.current_thread() is threading.main_thread():
            try:
                st = os.fstat(fd)
            except OSError:
                st = None
            if st is not None and last_of_large(st, 0, fd):
                freed_on_loop.append(f"close of a removed file ({st.st_size} bytes)")
        real_close(fd)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "close", close)

    ready, partial = fs[State.READY], fs[State.PARTIAL]
    big = os.urandom(256 * 1024)  # past the inline size: blob files
    read_ino = await fs.upload(ready, b"read", big)
    await fs.upload(ready, b"plain", big[::-1])
    fi = await fs.ops.open(read_ino, os.O_RDONLY, Ctx())
    assert bytes(await fs.ops.read(fi.fh, 0, 10)) == big[:10]
    await fs.ops.unlink(ready, b"read", Ctx())  # removed while a consumer reads it
    await fs.ops.unlink(ready, b"plain", Ctx())
    assert bytes(await fs.ops.read(fi.fh, 10, 10)) == big[10:20]  # still readable
    await fs.ops.release(fi.fh)  # the last close of the removed message
    up, _ = await fs.ops.create(partial, b"half", 0o644, os.O_WRONLY, Ctx())
    await fs.ops.write(up.fh, 0, big)
    await fs.ops.release(up.fh)
    await fs.ops.unlink(partial, b"half", Ctx())  # an upload: its staging file
    monkeypatch.setattr(os, "unlink", real_unlink)
    monkeypatch.setattr(os, "close", real_close)
    assert freed_on_loop == []
    for d in (ready, partial):
        assert [e.name for e in fs.spool.listdir(d)] == []
