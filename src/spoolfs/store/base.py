"""The store contract. Engines provide storage primitives and atomic transactions; the queue
rules live above them (service) and in ``core.rules``.

Every transition is one compare-and-set (``WriteTx.move``): it changes one row only if the
message is still where the caller saw it, so no correctness depends on a process-local lock.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

from spoolfs.core.rules import State
from spoolfs.store.reserve import Reserve

T = TypeVar("T")

#: A read that yields what it waits for instead of waiting: each step yields ``(fd, wait)``,
#: a file descriptor and ``WAIT_R``, ``WAIT_W`` or both, and is sent back which of them it
#: got (the same bits); the read's value is its return. Sans-I/O, so that the store knows no
#: event loop: an engine whose reads never wait returns at once, without a step.
Steps = Generator[tuple[int, int], int, T]
WAIT_R = 1
WAIT_W = 2

#: a change as a shared store logs it: entry, parent, name, old parent, old name (None where
#: a change has no place: a directory's times, a row that was not a name)
ChangeRow = tuple[int, int | None, bytes | None, int | None, bytes | None]

ENTRY_COLUMNS = (
    "id", "parent", "name", "kind", "queue", "state", "hidden", "blob", "staged", "size",
    "mode", "uid", "gid", "mtime_ns", "ctime_ns", "created_ns", "enqueued_ns", "claimed_ns",
    "finished_ns", "attempts", "consumer", "error", "lease_ns", "retry_ns", "abandoned",
    "duplicate_of", "atime_ns",
)  # fmt: skip


_STATES = {s.value: s for s in State}


def _state(value: str | None) -> State | None:
    """A row's state (a dictionary's lookup: ``State(value)`` costs ten times more, on every
    row read); ValueError for a value no state has, as ``State`` gives."""
    if value is None:
        return None
    found = _STATES.get(value)
    return found if found is not None else State(value)


#: what a listing reads of each entry: the fields of its attributes (``Entry.listed``)
LISTED_COLUMNS = ("id", "parent", "name", "kind", "state", "hidden", "staged", "size", "mode",
                  "uid", "gid", "mtime_ns", "ctime_ns", "atime_ns")


@dataclass(slots=True)
class Entry:
    id: int
    parent: int | None
    name: bytes
    kind: str
    queue: int | None
    state: State | None
    hidden: bool
    blob: int | None
    staged: bool
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    ctime_ns: int
    created_ns: int
    enqueued_ns: int | None
    claimed_ns: int | None
    finished_ns: int | None
    attempts: int
    consumer: str | None
    error: bytes | None
    lease_ns: int | None
    retry_ns: int | None
    abandoned: bool
    duplicate_of: int | None
    atime_ns: int | None  # None: the access time is the modification time
    refs: int | None = None  # references to its blob: the link count

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Entry:
        e = cls(*row)
        e.name = bytes(e.name)
        e.state = _state(e.state)
        e.hidden = bool(e.hidden)
        e.staged = bool(e.staged)
        e.abandoned = bool(e.abandoned)
        return e

    @classmethod
    def listed(cls, row: Sequence[Any]) -> Entry:
        """An entry as a listing reads it (``LISTED_COLUMNS``, then the blob's reference
        count): what its attributes show; its queue fields are not read."""
        (eid, parent, name, kind, state, hidden, staged, size, mode, uid, gid, mtime_ns,
         ctime_ns, atime_ns, refs) = row
        return cls(eid, parent, bytes(name), kind, None, _state(state),
                   bool(hidden), None, bool(staged), size, mode, uid, gid, mtime_ns, ctime_ns,
                   0, None, None, None, 0, None, None, None, None, False, None, atime_ns, refs)

    @property
    def is_message(self) -> bool:
        return self.kind == "message"


@dataclass(slots=True)
class Blob:
    id: int
    sha256: bytes
    size: int
    refcount: int
    data: bytes | None


class ReadTx(abc.ABC):
    """Queries; each sees a committed state of the store."""

    @abc.abstractmethod
    def get(self, entry_id: int) -> Entry | None: ...

    @abc.abstractmethod
    def lookup(self, parent: int, name: bytes) -> Entry | None: ...

    def rename_reads(self, parent: int, name: bytes, new_parent: int, new_name: bytes
                     ) -> tuple[Entry | None, Entry | None, Entry | None]:
        """``lookup(parent, name)``, ``get(new_parent)`` and ``lookup(new_parent,
        new_name)``: what a rename reads before its transaction (the row it moves, the
        directory it moves it into, what has the name there). A database server's engine
        reads them in one round trip."""
        return (self.lookup(parent, name), self.get(new_parent),
                self.lookup(new_parent, new_name))

    def get_with_blob(self, entry_id: int) -> tuple[Entry | None, Blob | None]:
        """``get(entry_id)``, and the blob row of its content (None without one): what an
        open reads. A database server's engine reads both in one round trip."""
        e = self.get(entry_id)
        return e, (self.blob(e.blob) if e is not None and e.blob is not None else None)

    # The same reads as steps (``Steps``), for the event loop's hottest requests: an engine
    # that waits on a server overrides them, so that the loop answers others meanwhile.

    def lookup_steps(self, parent: int, name: bytes) -> Steps[Entry | None]:
        return self.lookup(parent, name)
        yield  # (a generator without a step)

    def names_steps(self, parent: int, limit: int) -> Steps[list[bytes]]:
        """The names of up to ``limit`` of ``parent``'s children, hidden or not (every name
        taken there, when fewer come back)."""
        return [e.name for e in self.children(parent)[:limit]]
        yield

    def subdirs_steps(self, parent: int) -> Steps[int]:
        return self.subdirs(parent)
        yield

    def get_steps(self, entry_id: int) -> Steps[Entry | None]:
        return self.get(entry_id)
        yield

    def get_with_blob_steps(self, entry_id: int) -> Steps[tuple[Entry | None, Blob | None]]:
        return self.get_with_blob(entry_id)
        yield

    def rename_reads_steps(self, parent: int, name: bytes, new_parent: int, new_name: bytes
                           ) -> Steps[tuple[Entry | None, Entry | None, Entry | None]]:
        return self.rename_reads(parent, name, new_parent, new_name)
        yield

    @abc.abstractmethod
    def children(self, parent: int) -> list[Entry]: ...

    @abc.abstractmethod
    def page(self, parent: int, after: int, limit: int) -> list[Entry]:
        """Up to ``limit`` visible children of ``parent`` whose id is above ``after``, in id
        order (a listing read in pages: each costs what a page costs, however deep the
        directory, and names that come and go never shift the others)."""

    def listing(self, parent: int, after: int, limit: int) -> list[Entry]:
        """``page``, each entry read as a listing shows it (``Entry.listed``: half the
        columns, so a page costs less to read; a directory listing reads nothing else)."""
        return self.page(parent, after, limit)

    @abc.abstractmethod
    def has_children(self, parent: int) -> bool: ...

    @abc.abstractmethod
    def subdirs(self, parent: int) -> int:
        """How many visible directories ``parent`` holds (a directory's link count is 2 more),
        counted without reading the messages beside them."""

    @abc.abstractmethod
    def subdirectories(self, parent: int) -> list[Entry]:
        """The visible directories ``parent`` holds (the consumer views of working/), in id
        order, read without the messages beside them."""

    @abc.abstractmethod
    def blob(self, blob_id: int) -> Blob | None: ...

    @abc.abstractmethod
    def xattrs(self, entry_id: int) -> dict[bytes, bytes]: ...

    @abc.abstractmethod
    def history(self, entry_id: int) -> list[tuple[Any, ...]]: ...

    @abc.abstractmethod
    def due_leases(self, now_ns: int, limit: int) -> list[Entry]:
        """Messages whose lease ran out at or before ``now_ns``, soonest first."""

    @abc.abstractmethod
    def due_retries(self, now_ns: int, limit: int) -> list[Entry]:
        """Messages in error/ whose retry time is at or before ``now_ns``, soonest first."""

    @abc.abstractmethod
    def finished_before(self, queue: int, state: State, before_ns: int, limit: int
                        ) -> list[Entry]:
        """Messages of ``queue`` in ``state`` finished before ``before_ns`` and not waiting
        for a retry, oldest first."""

    @abc.abstractmethod
    def published_with(self, queue: int, blob_id: int, since_ns: int, besides: int
                       ) -> Entry | None:
        """The earliest message of ``queue`` (other than ``besides``) sharing ``blob_id`` that
        entered ``ready/`` at or after ``since_ns``: the original of a duplicate."""

    @abc.abstractmethod
    def stats(self) -> list[tuple[Any, ...]]:
        """Per queue, state and consumer view: (queue id, state, consumer, count, bytes,
        oldest time, soonest lease end, abandoned, waiting for a retry). The oldest time is
        the creation in partial/, the entry into ready/ (staging names left out), the claim in
        working/, the finish in success/ and error/. Unpublished uploads are left out."""

    @abc.abstractmethod
    def uploads(self, after: int, limit: int) -> list[tuple[int, int, str]]:
        """(id, queue, state) of the visible messages whose content is still a staging file
        (its size is the file's, not the row's), by id above ``after``: at most ``limit``."""

    @abc.abstractmethod
    def sharing(self, blob_id: int, limit: int) -> list[int]:
        """Ids of entries referencing ``blob_id`` (at most ``limit``)."""

    @abc.abstractmethod
    def policies(self) -> dict[int, dict[str, str]]:
        """Stored policy values of every queue: queue id -> key -> canonical text."""

    def blob_by_sha(self, sha256: bytes) -> Blob | None:
        """The blob holding this content (write transactions of every engine; reads of a
        shared store's, to skip storing content that is there already)."""
        raise NotImplementedError(f"{type(self).__name__} answers this in transactions only")

    @abc.abstractmethod
    def meta(self, key: str) -> str | None:
        """A setting of the store itself (``schema_version``, ``blobs``: where content is
        kept); None when unset."""

    @abc.abstractmethod
    def all_entries(self) -> list[Entry]: ...

    # What recovery judges, a page at a time (``after``: the last id of the previous page;
    # at most ``limit`` rows, by id), found by index without reading every row.

    @abc.abstractmethod
    def unclosed_uploads(self, after: int, limit: int) -> list[Entry]:
        """Uploads into ``ready/`` not yet closed (hidden, staged): being written, or left by
        a crash. Found among the staged rows, not among uploads left in ``partial/``."""

    @abc.abstractmethod
    def staged_among(self, entry_ids: Sequence[int]) -> set[int]:
        """Of ``entry_ids`` (a page), those of entries whose content is still staged."""

    @abc.abstractmethod
    def unreferenced_blobs(self, after: int, limit: int) -> list[Blob]:
        """Blob rows no message holds any more."""

    @abc.abstractmethod
    def highest_entry_id(self) -> int:
        """The highest entry id the store has given, to a row or a reservation: every later
        row and reservation takes a higher one (0 when none was given)."""

    @abc.abstractmethod
    def all_blobs(self) -> list[Blob]: ...


class WriteTx(ReadTx):
    """Primitives inside one atomic transaction."""

    # Every primitive that adds a visible name to a directory or removes one (insert, move,
    # delete, and an update that publishes a hidden row) also sets that directory's mtime and
    # ctime to now, in the same transaction: a directory's time shows when its names changed.

    @abc.abstractmethod
    def insert(self, **fields: Any) -> Entry:
        """A new row; its ``id`` is the next free one unless given (one of
        ``reserve_entry_ids``)."""

    def insert_unless_named(self, **fields: Any) -> Entry | None:
        """``insert``, unless a row has the name already (``parent``, ``name``): then None,
        and nothing changes. A database server's engine does both in one round trip."""
        if self.lookup(fields["parent"], fields["name"]) is not None:
            return None
        return self.insert(**fields)

    @abc.abstractmethod
    def reserve_entry_ids(self, n: int) -> list[int]:
        """``n`` entry ids, ascending, that no row has and, once this transaction commits,
        no insert without an ``id`` will take: for rows inserted later with one
        (service/staging_pool.py)."""

    @abc.abstractmethod
    def move(self, entry_id: int, parent: int, name: bytes, new_parent: int, new_name: bytes,
             *, free: bool = False, **fields: Any) -> bool:
        """Compare-and-set: move ``entry_id`` only if it is still ``parent/name``; with
        ``free``, only if no other row has the name ``new_parent/new_name`` either (no
        lookup first: one statement)."""

    @abc.abstractmethod
    def update(self, entry_id: int, **fields: Any) -> bool: ...

    @abc.abstractmethod
    def delete(self, entry_id: int) -> bool: ...

    @abc.abstractmethod
    def set_policy(self, queue: int, values: dict[str, str | None]) -> None:
        """Store policy values of a queue; ``None`` removes a key (back to its default)."""

    @abc.abstractmethod
    def set_meta(self, key: str, value: str) -> None: ...

    @abc.abstractmethod
    def drop_history(self, entry_id: int) -> None: ...

    @abc.abstractmethod
    def set_xattr(self, entry_id: int, name: bytes, value: bytes) -> None: ...

    @abc.abstractmethod
    def remove_xattr(self, entry_id: int, name: bytes) -> bool: ...

    @abc.abstractmethod
    def copy_xattrs(self, src: int, dst: int) -> None: ...

    @abc.abstractmethod
    def blob_by_sha(self, sha256: bytes) -> Blob | None: ...

    @abc.abstractmethod
    def blob_insert(self, sha256: bytes, size: int, data: bytes | None,
                    blob_id: int | None = None, refs: int = 0) -> int:
        """A new blob row with ``refs`` references (a publish's content: 1, counted as it is
        inserted); ``blob_id``: one from ``Store.reserve_blob_id``, under which a remote blob
        store already holds the content."""

    @abc.abstractmethod
    def blob_ref(self, blob_id: int, delta: int) -> int:
        """Add ``delta`` to the reference count; returns the new count."""

    def blob_take(self, sha256: bytes, size: int, data: bytes | None,
                  blob_id: int | None = None) -> tuple[int, bool]:
        """One more reference on the blob holding this content: the row that holds it
        already, or a new row with one reference (``blob_insert``). Its id, and whether the
        row is new. An engine whose transactions may insert the same content at once
        (several hosts) does it in one statement that waits for the other's row."""
        blob = self.blob_by_sha(sha256)
        if blob is not None:
            self.blob_ref(blob.id, 1)
            return blob.id, False
        return self.blob_insert(sha256, size, data, blob_id=blob_id, refs=1), True

    def attach_blob(self, entry_id: int, sha256: bytes, size: int, data: bytes | None,
                    mtime_ns: int, blob_id: int | None = None) -> tuple[int, bool]:
        """``blob_take``, and the entry pointed at that blob (its ``size``, ``mtime_ns``;
        no longer staged): a published upload's content attached. The blob's id, and
        whether its row is new. A database server's engine does both in one statement."""
        bid, new = self.blob_take(sha256, size, data, blob_id=blob_id)
        self.update(entry_id, blob=bid, staged=0, size=size, mtime_ns=mtime_ns)
        return bid, new

    @abc.abstractmethod
    def blob_delete(self, blob_id: int) -> None: ...

    @abc.abstractmethod
    def add_history(self, entry_id: int, at_ns: int, action: str, src: str | None,
                    dst: str | None, uid: int | None, pid: int | None,
                    reason: str | None) -> None: ...


class StoreBusy(Exception):
    """``run_batch(..., wait=False)`` found another writer holding the store: nothing ran."""


class Store(abc.ABC):
    #: the metadata reserve of a store kept on a local disk (store/reserve.py); None for an
    #: engine whose metadata lives elsewhere
    reserve: Reserve | None = None
    #: run_batch waits on the network (a database server): never call it on the event loop
    blocking: bool = False
    #: ``run_batch(durable=False)`` commits without waiting for the disk, and ``sync()`` then
    #: makes every commit made so far durable: one sync, off the event loop, serves many
    #: commits while new ones go on
    deferred_sync: bool = False
    #: several hosts share the store: each host's recovery judges only its own files
    shared: bool = False
    #: told of each batch's changes as the change log has them (entry, parent, name, old
    #: parent, old name), in order, once it committed (True) or failed at a point where it
    #: may have (False); called in the committing thread (an engine with a change log)
    on_commit: Callable[[list[ChangeRow], bool], None] | None = None

    @abc.abstractmethod
    def reader(self) -> ReadTx:
        """Queries for the calling thread (the event loop); never blocks on writers."""

    @abc.abstractmethod
    def scan(self) -> AbstractContextManager[ReadTx]:
        """Queries for a worker thread, on a read-only connection of their own and all from
        one committed state: a long scan (the status snapshot) never holds up ``reader()``
        or the writers. One scan runs at a time; others wait for it."""

    @abc.abstractmethod
    def run_batch(self, fns: Sequence[Callable[[WriteTx], Any]], durable: bool,
                  wait: bool = True) -> list[tuple[bool, Any]]:
        """Run each function in its own savepoint of one transaction and commit once (fsynced
        when ``durable``). Returns ``(True, result)`` or ``(False, exception)`` per function;
        a failed function's changes are rolled back, the others commit. One batch runs at a
        time. A failing commit raises ``StoreFailure`` and nothing is applied. With
        ``wait=False`` it never waits for another writer: it raises ``StoreBusy`` before
        running anything instead."""

    def sync(self) -> None:
        """With ``deferred_sync``: make every transaction committed so far durable (called in
        a worker thread, while the event loop goes on committing)."""
        raise NotImplementedError(f"{type(self).__name__} syncs at every durable commit")

    def reserve_blob_id(self) -> int:
        """A blob id no row has or will take (for content stored before its row commits)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no remote content")

    @abc.abstractmethod
    def close(self) -> None: ...


class GcTx(abc.ABC):
    """The queries garbage collection needs, inside one ``Maintenance`` transaction."""

    @abc.abstractmethod
    def files_named(self, blob_ids: Sequence[int]) -> dict[int, bytes]:
        """Of ``blob_ids`` (a page: a few hundred, each a parameter of one query), those of
        blob rows whose content is a blob file: id -> sha256."""

    @abc.abstractmethod
    def unreferenced_blobs(self, after: int, limit: int) -> list[int]:
        """Ids above ``after`` of blob rows that no entry references, in order; at most
        ``limit`` (a page: go on from the last)."""

    @abc.abstractmethod
    def staged_among(self, entry_ids: Sequence[int]) -> set[int]:
        """Of ``entry_ids`` (a page), those of entries whose content is an upload's staging
        file."""

    @abc.abstractmethod
    def is_staged(self, entry_id: int) -> bool: ...

    @abc.abstractmethod
    def names_blob_file(self, sha256: bytes, blob_id: int) -> bool:
        """Whether blob file ``<sha256>.<blob_id>`` is the file of a blob row."""

    @abc.abstractmethod
    def delete_unreferenced_blob(self, blob_id: int) -> tuple[bytes, int, int, bool] | None:
        """Delete the blob row if it exists and no entry references it; returns what it was
        (sha256, size, refcount, whether its content is a file), or None if it stays."""


class FsckTx(GcTx):
    """What ``fsck`` checks and repairs, inside one ``Maintenance`` transaction."""

    @abc.abstractmethod
    def integrity_ok(self) -> bool: ...

    @abc.abstractmethod
    def dangling(self) -> list[tuple[Any, ...]]: ...

    @abc.abstractmethod
    def schema_version(self) -> str | None: ...

    # Whole-table passes go a page at a time (``after``: the last id of the previous page;
    # at most ``limit`` rows, by id): what fsck holds does not grow with the store.

    @abc.abstractmethod
    def tree_page(self, after: int, limit: int
                  ) -> list[tuple[int, int | None, bytes, str, int, int | None, bool, bool]]:
        """Entries by id: id, parent, name, kind, mode, blob, staged, parent exists."""

    @abc.abstractmethod
    def blob_references(self, after: int, limit: int) -> list[tuple[int, int, int]]:
        """Blob rows by id: id, refcount, entries that reference it."""

    @abc.abstractmethod
    def missing_blob_rows(self) -> list[tuple[int, int]]:
        """Blob ids that entries reference but no row has, with how many reference each."""

    @abc.abstractmethod
    def file_blobs_named(self, blob_ids: Sequence[int]) -> dict[int, tuple[bytes, int]]:
        """Of ``blob_ids`` (a page), the rows whose content is a file: id -> (sha256, size)."""

    @abc.abstractmethod
    def file_blobs_page(self, after: int, limit: int) -> list[tuple[int, bytes, int]]:
        """Blob rows whose content is a file, by id: id, sha256, size."""

    @abc.abstractmethod
    def inline_blobs_page(self, after: int, limit: int) -> list[tuple[int, bytes, bytes]]:
        """Blob rows whose content is in the row, by id: id, sha256, content."""

    @abc.abstractmethod
    def blob_content(self, blob_id: int) -> tuple[bytes, int, bytes | None] | None: ...

    @abc.abstractmethod
    def blob_id_by_sha(self, sha256: bytes) -> tuple[int, bytes | None] | None: ...

    @abc.abstractmethod
    def insert_empty_blob(self, sha256: bytes) -> int: ...

    @abc.abstractmethod
    def make_blob_empty(self, blob_id: int) -> None: ...

    @abc.abstractmethod
    def delete_blob(self, blob_id: int) -> None: ...

    @abc.abstractmethod
    def blob_exists(self, blob_id: int) -> bool: ...

    @abc.abstractmethod
    def references(self, blob_id: int) -> int: ...

    @abc.abstractmethod
    def repoint(self, old: int, new: int, refs: int) -> None: ...

    @abc.abstractmethod
    def rebuild_file_blob(self, blob_id: int, sha256: bytes, size: int, refs: int) -> None: ...

    @abc.abstractmethod
    def holders(self, blob_id: int | None = None, entry_id: int | None = None
                ) -> list[tuple[int, str, bytes]]: ...

    @abc.abstractmethod
    def give_blob(self, entry_id: int, blob_id: int) -> None: ...

    @abc.abstractmethod
    def link(self, entry_id: int) -> tuple[str, int | None, bytes] | None: ...

    @abc.abstractmethod
    def place(self, entry_id: int) -> tuple[int, bytes, int, str, str | None, bytes | None]: ...

    @abc.abstractmethod
    def set_error(self, entry_id: int, error: bytes) -> None: ...

    @abc.abstractmethod
    def state_dir(self, queue: int, name: bytes) -> int | None: ...

    @abc.abstractmethod
    def name_taken(self, parent: int, name: bytes) -> bool: ...

    @abc.abstractmethod
    def move_entry(self, entry_id: int, parent: int, name: bytes, fields: dict[str, Any]
                   ) -> None:
        """Put an entry at (parent, name) with ``fields`` (a transition row's effects, which
        the caller computed: no field policy lives here)."""

    @abc.abstractmethod
    def add_history(self, entry_id: int, at_ns: int, action: str, src: str, dst: str, pid: int,
                    reason: str) -> None: ...

    @abc.abstractmethod
    def refcount_and_references(self, blob_id: int) -> tuple[int, int] | None: ...

    @abc.abstractmethod
    def set_refcount(self, blob_id: int, refcount: int) -> None: ...


class Maintenance(abc.ABC):
    """Offline-safe access for ``gc`` and ``fsck``: a connection of their own, next to any
    daemon that has the store mounted. ``write()`` holds the store's write lock: no daemon
    commits meanwhile."""

    #: the queries ``read()`` and ``write()`` yield; valid only inside one of them
    tx: FsckTx
    #: the schema version this spoolfs writes for the engine (fsck compares the stored one)
    version: int

    @abc.abstractmethod
    def read(self) -> AbstractContextManager[FsckTx]:
        """One consistent snapshot for several queries (takes no write lock)."""

    @abc.abstractmethod
    def write(self) -> AbstractContextManager[FsckTx]:
        """One write transaction holding the store's write lock; rolled back on an error."""

    def prune_changes(self, older_than_s: float) -> int:
        """Drop change-log rows older than this (an engine shared by hosts keeps one);
        returns how many."""
        return 0

    @abc.abstractmethod
    def close(self) -> None: ...


def by_id(page: Callable[[int, int], Sequence[T]], size: int) -> Iterator[T]:
    """Every row a paged query gives, ``size`` at a time: ``page(after, limit)`` gives the rows
    with ids above ``after``, the id first in each. What the caller holds is a page."""
    after = -(1 << 63)
    while True:
        rows = page(after, size)
        yield from rows
        if len(rows) < size:
            return
        after = rows[-1][0]  # type: ignore[index]
