"""An in-memory metadata engine with the embedded engine's semantics (unique names, foreign
keys, cascades, never-reused ids), for fast service tests. Nothing survives ``close``.

A batch works on a copy of the committed state and publishes it at commit: readers see only
committed states, and a failed function's savepoint is the copy taken before it."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from spoolfs.core.errors import SpoolError, StoreFailure
from spoolfs.core.rules import State
from spoolfs.store.base import ENTRY_COLUMNS, Blob, Entry, ReadTx, Store, WriteTx

_DEFAULTS = {"hidden": 0, "staged": 0, "size": 0, "uid": 0, "gid": 0, "attempts": 0,
             "abandoned": 0}
_REQUIRED = ("name", "kind", "mode", "mtime_ns", "ctime_ns", "created_ns")


class IntegrityError(ValueError):
    """A constraint the embedded engine's schema enforces: the function's changes roll back."""


@dataclass
class _State:
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    blobs: dict[int, list[Any]] = field(default_factory=dict)  # id -> [sha, size, refs, data]
    xattrs: dict[int, dict[bytes, bytes]] = field(default_factory=dict)
    history: list[tuple[int, tuple[Any, ...]]] = field(default_factory=list)
    policies: dict[int, dict[str, str]] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)
    next_entry: int = 1
    next_blob: int = 1


def _raw(v: Any) -> Any:
    return v.value if isinstance(v, State) else v


class MemoryRead(ReadTx):
    def __init__(self, state: _State) -> None:
        self.s = state

    def _entry(self, row: dict[str, Any]) -> Entry:
        b = self.s.blobs.get(row["blob"]) if row["blob"] is not None else None
        return Entry.from_row([row[c] for c in ENTRY_COLUMNS] + [b[2] if b else None])

    def _where(self, pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        return [r for _, r in sorted(self.s.entries.items()) if pred(r)]

    def get(self, entry_id: int) -> Entry | None:
        row = self.s.entries.get(entry_id)
        return self._entry(row) if row else None

    def lookup(self, parent: int, name: bytes) -> Entry | None:
        rows = self._where(lambda r: r["parent"] == parent and r["name"] == name)
        return self._entry(rows[0]) if rows else None

    def children(self, parent: int) -> list[Entry]:
        return [self._entry(r) for r in self._where(lambda r: r["parent"] == parent)]

    def page(self, parent: int, after: int, limit: int) -> list[Entry]:
        rows = self._where(lambda r: r["parent"] == parent and r["id"] > after
                           and not r["hidden"])
        return [self._entry(r) for r in rows[:limit]]

    def has_children(self, parent: int) -> bool:
        return any(r["parent"] == parent for r in self.s.entries.values())

    def subdirs(self, parent: int) -> int:
        return len(self.subdirectories(parent))

    def subdirectories(self, parent: int) -> list[Entry]:
        return [self._entry(r) for r in self._where(
            lambda r: r["parent"] == parent and not r["hidden"]
            and (r["mode"] & 0o170000) == 0o040000)]

    def blob(self, blob_id: int) -> Blob | None:
        b = self.s.blobs.get(blob_id)
        return Blob(blob_id, *b) if b else None

    def xattrs(self, entry_id: int) -> dict[bytes, bytes]:
        return dict(self.s.xattrs.get(entry_id, {}))

    def history(self, entry_id: int) -> list[tuple[Any, ...]]:
        return [h for e, h in self.s.history if e == entry_id]

    def _due(self, col: str, now_ns: int, limit: int) -> list[Entry]:
        rows = self._where(lambda r: r[col] is not None and r[col] <= now_ns)
        return [self._entry(r) for r in sorted(rows, key=lambda r: r[col])[:limit]]

    def due_leases(self, now_ns: int, limit: int) -> list[Entry]:
        return self._due("lease_ns", now_ns, limit)

    def due_retries(self, now_ns: int, limit: int) -> list[Entry]:
        return self._due("retry_ns", now_ns, limit)

    def finished_before(self, queue: int, state: State, before_ns: int, limit: int
                        ) -> list[Entry]:
        rows = self._where(lambda r: r["queue"] == queue and r["state"] == state.value
                           and r["finished_ns"] is not None and r["finished_ns"] < before_ns
                           and r["kind"] == "message" and r["retry_ns"] is None)
        return [self._entry(r) for r in sorted(rows, key=lambda r: r["finished_ns"])[:limit]]

    def published_with(self, queue: int, blob_id: int, since_ns: int, besides: int
                       ) -> Entry | None:
        rows = self._where(lambda r: r["blob"] == blob_id and r["queue"] == queue
                           and r["id"] != besides and r["kind"] == "message"
                           and r["enqueued_ns"] is not None and r["enqueued_ns"] >= since_ns)
        return self._entry(min(rows, key=lambda r: r["enqueued_ns"])) if rows else None

    def stats(self) -> list[tuple[Any, ...]]:
        groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for r in self._where(lambda r: r["kind"] == "message" and not r["hidden"]):
            groups.setdefault((r["queue"], r["state"], r["consumer"]), []).append(r)
        out = []
        for (queue, state, consumer), rows in groups.items():
            def since(r: dict[str, Any]) -> int | None:
                if r["state"] == "partial":
                    return r["created_ns"]  # type: ignore[no-any-return]
                if r["state"] == "ready":
                    return None if r["name"][:1] == b"." else cast(int | None, r["enqueued_ns"])
                return cast(int | None,
                            r["claimed_ns"] if r["state"] == "working" else r["finished_ns"])

            def least(vals: list[Any]) -> Any:
                vals = [v for v in vals if v is not None]
                return min(vals) if vals else None

            out.append((queue, state, consumer, len(rows), sum(r["size"] for r in rows),
                        least([since(r) for r in rows]), least([r["lease_ns"] for r in rows]),
                        sum(r["abandoned"] for r in rows),
                        sum(r["retry_ns"] is not None for r in rows)))
        return out

    def uploads(self, after: int, limit: int) -> list[tuple[int, int, str]]:
        return [(r["id"], r["queue"], r["state"]) for r in self._where(
            lambda r: r["staged"] and r["kind"] == "message" and not r["hidden"]
            and r["id"] > after)[:limit]]

    def sharing(self, blob_id: int, limit: int) -> list[int]:
        return [r["id"] for r in self._where(lambda r: r["blob"] == blob_id)][:limit]

    def policies(self) -> dict[int, dict[str, str]]:
        return {q: dict(v) for q, v in self.s.policies.items() if v}

    def meta(self, key: str) -> str | None:
        return self.s.meta.get(key)

    def all_entries(self) -> list[Entry]:
        return [self._entry(r) for r in self._where(lambda r: True)]

    def unclosed_uploads(self, after: int, limit: int) -> list[Entry]:
        return [self._entry(r) for r in self._where(
            lambda r: bool(r["staged"] and r["hidden"]) and r["id"] > after)[:limit]]

    def staged_among(self, entry_ids: Sequence[int]) -> set[int]:
        return {i for i in entry_ids if (r := self.s.entries.get(i)) and r["staged"]}

    def unreferenced_blobs(self, after: int, limit: int) -> list[Blob]:
        return [b for b in self.all_blobs() if b.refcount == 0 and b.id > after][:limit]

    def highest_entry_id(self) -> int:
        return self.s.next_entry - 1

    def all_blobs(self) -> list[Blob]:
        return [Blob(i, *b) for i, b in sorted(self.s.blobs.items())]


def _check_fields(fields: dict[str, Any], insert: bool = False) -> dict[str, Any]:
    for k in fields:
        if k not in ENTRY_COLUMNS or (k == "id" and not insert):
            raise ValueError(f"unknown entry column {k}")
    return {k: _raw(v) for k, v in fields.items()}


class MemoryWrite(MemoryRead, WriteTx):
    def _check_row(self, row: dict[str, Any], eid: int) -> None:
        if row["parent"] is not None and row["parent"] not in self.s.entries:
            raise IntegrityError("FOREIGN KEY constraint failed (parent)")
        if row["blob"] is not None and row["blob"] not in self.s.blobs:
            raise IntegrityError("FOREIGN KEY constraint failed (blob)")
        for k in _REQUIRED + tuple(_DEFAULTS):
            if row[k] is None:
                raise IntegrityError(f"NOT NULL constraint failed: entries.{k}")
        for other in self.s.entries.values():
            if other["id"] != eid and other["parent"] == row["parent"] \
                    and other["name"] == row["name"]:
                raise IntegrityError("UNIQUE constraint failed: entries.parent, entries.name")

    def insert(self, **fields: Any) -> Entry:
        vals = _check_fields(fields, insert=True)
        for k in _REQUIRED:
            if k not in vals:
                raise IntegrityError(f"NOT NULL constraint failed: entries.{k}")
        row = {c: vals.get(c, _DEFAULTS.get(c)) for c in ENTRY_COLUMNS}
        eid = row["id"] if row["id"] is not None else self.s.next_entry
        if eid in self.s.entries:
            raise IntegrityError("UNIQUE constraint failed: entries.id")
        row["id"] = eid
        row["name"] = bytes(cast(bytes, row["name"]))
        self._check_row(row, eid)
        self.s.entries[eid] = row
        self.s.next_entry = max(self.s.next_entry, eid + 1)
        if not row["hidden"]:
            self._dir_changed(row["parent"])
        return self._entry(row)

    def reserve_entry_ids(self, n: int) -> list[int]:
        first = self.s.next_entry
        self.s.next_entry += n
        return list(range(first, first + n))

    def _dir_changed(self, *dirs: int | None) -> None:
        now = time.time_ns()
        for d in dict.fromkeys(dirs):
            if d is not None and d in self.s.entries:
                self.s.entries[d].update(mtime_ns=now, ctime_ns=now)

    def _set(self, entry_id: int, vals: dict[str, Any]) -> None:
        row = dict(self.s.entries[entry_id], **vals)
        self._check_row(row, entry_id)
        self.s.entries[entry_id] = row

    def move(self, entry_id: int, parent: int, name: bytes, new_parent: int, new_name: bytes,
             *, free: bool = False, **fields: Any) -> bool:
        vals = _check_fields(fields)
        row = self.s.entries.get(entry_id)
        if row is None or row["parent"] != parent or row["name"] != name:
            return False
        there = self.lookup(new_parent, new_name) if free else None
        if there is not None and there.id != entry_id:
            return False
        was_hidden = bool(row["hidden"])
        self._set(entry_id, {"parent": new_parent, "name": bytes(new_name), **vals})
        self._dir_changed(None if was_hidden else parent,
                          None if fields.get("hidden", was_hidden) else new_parent)
        return True

    def update(self, entry_id: int, **fields: Any) -> bool:
        vals = _check_fields(fields)
        row = self.s.entries.get(entry_id)
        if row is None:
            return False
        appears = "hidden" in fields and not fields["hidden"] and bool(row["hidden"])
        self._set(entry_id, vals)
        if appears:
            self._dir_changed(self.s.entries[entry_id]["parent"])
        return True

    def delete(self, entry_id: int) -> bool:
        row = self.s.entries.get(entry_id)
        if row is None:
            return False
        if self.has_children(entry_id):
            raise IntegrityError("FOREIGN KEY constraint failed (children)")
        del self.s.entries[entry_id]
        self.s.xattrs.pop(entry_id, None)
        self.s.policies.pop(entry_id, None)
        if not row["hidden"]:
            self._dir_changed(row["parent"])
        return True

    def set_policy(self, queue: int, values: dict[str, str | None]) -> None:
        if queue not in self.s.entries:
            raise IntegrityError("FOREIGN KEY constraint failed (queue)")
        p = self.s.policies.setdefault(queue, {})
        for key, value in values.items():
            if value is None:
                p.pop(key, None)
            else:
                p[key] = value

    def set_meta(self, key: str, value: str) -> None:
        self.s.meta[key] = value

    def drop_history(self, entry_id: int) -> None:
        self.s.history = [h for h in self.s.history if h[0] != entry_id]

    def set_xattr(self, entry_id: int, name: bytes, value: bytes) -> None:
        if entry_id not in self.s.entries:
            raise IntegrityError("FOREIGN KEY constraint failed (xattr)")
        self.s.xattrs.setdefault(entry_id, {})[bytes(name)] = bytes(value)

    def remove_xattr(self, entry_id: int, name: bytes) -> bool:
        return self.s.xattrs.get(entry_id, {}).pop(bytes(name), None) is not None

    def copy_xattrs(self, src: int, dst: int) -> None:
        for name, value in self.xattrs(src).items():
            self.set_xattr(dst, name, value)

    def blob_by_sha(self, sha256: bytes) -> Blob | None:
        for i, b in self.s.blobs.items():
            if b[0] == sha256:
                return Blob(i, *b)
        return None

    def blob_insert(self, sha256: bytes, size: int, data: bytes | None,
                    blob_id: int | None = None, refs: int = 0) -> int:
        if self.blob_by_sha(sha256) is not None:
            raise IntegrityError("UNIQUE constraint failed: blobs.sha256")
        if blob_id is not None and blob_id in self.s.blobs:
            raise IntegrityError("UNIQUE constraint failed: blobs.id")
        bid = self.s.next_blob if blob_id is None else blob_id
        self.s.next_blob = max(self.s.next_blob, bid + 1)
        self.s.blobs[bid] = [bytes(sha256), size, refs, data]
        return bid

    def blob_ref(self, blob_id: int, delta: int) -> int:
        b = self.s.blobs.get(blob_id)
        if b is None:
            raise StoreFailure(f"blob {blob_id} is missing")
        if b[2] + delta < 0:
            raise IntegrityError("CHECK constraint failed: refcount >= 0")
        b[2] += delta
        return int(b[2])

    def blob_delete(self, blob_id: int) -> None:
        if any(r["blob"] == blob_id for r in self.s.entries.values()):
            raise IntegrityError("FOREIGN KEY constraint failed (blob)")
        self.s.blobs.pop(blob_id, None)

    def add_history(self, entry_id: int, at_ns: int, action: str, src: str | None,
                    dst: str | None, uid: int | None, pid: int | None,
                    reason: str | None) -> None:
        self.s.history.append((entry_id, (at_ns, action, src, dst, uid, pid, reason)))


class MemoryStore(Store):
    def __init__(self) -> None:
        now = time.time_ns()
        self._state = _State()
        self._lock = threading.Lock()  # one batch at a time
        MemoryWrite(self._state).insert(id=1, parent=None, name=b"", kind="root", mode=0o40755,
                                        mtime_ns=now, ctime_ns=now, created_ns=now)

    def reader(self) -> ReadTx:
        return _LiveRead(self)

    @contextmanager
    def scan(self) -> Iterator[ReadTx]:
        yield MemoryRead(self._state)  # committed states are never changed in place

    def run_batch(self, fns: Sequence[Callable[[WriteTx], Any]], durable: bool,
                  wait: bool = True) -> list[tuple[bool, Any]]:
        with self._lock:
            work = copy.deepcopy(self._state)
            results: list[tuple[bool, Any]] = []
            for fn in fns:
                saved = copy.deepcopy(work)
                try:
                    res = fn(MemoryWrite(work))
                except (SpoolError, OSError, ValueError, ArithmeticError, TypeError) as e:
                    work = saved
                    results.append((False, e))
                else:
                    results.append((True, res))
            self._state = work  # the commit
        return results

    def close(self) -> None:
        pass


class _LiveRead(MemoryRead):
    """``reader()``: always the latest committed state."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    @property
    def s(self) -> _State:  # type: ignore[override]  # read live, where a snapshot holds one
        return self._store._state
