"""Opening a store from a path or URL: engines registered by scheme.

A plain path (no ``scheme:`` prefix) is a store directory on the embedded SQLite engine. A
URL names its engine by scheme; an unknown scheme is refused with one line, never taken for a
local directory of that name."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from spoolfs.blobs.layout import StoreLayout
from spoolfs.core.errors import StoreFailure
from spoolfs.store.base import Maintenance, ReadTx, Store

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


class UnknownEngine(StoreFailure):
    """A store URL whose scheme no engine serves: EIO, nothing opened."""


@dataclass(frozen=True, slots=True)
class Engine:
    open: Callable[[str], Store]
    #: gc and fsck's access (read-only when asked); None for an engine that keeps nothing
    maintenance: Callable[[str, bool], Maintenance] | None = None
    #: a read-only view of an existing store; None: the engine's ``open`` is safe to share
    reading: Callable[[str], AbstractContextManager[ReadTx]] | None = None


ENGINES: dict[str, Engine] = {}


def register(scheme: str, engine: Engine) -> None:
    ENGINES[scheme] = engine


def split(url: str) -> tuple[str, str]:
    """(scheme, rest); a plain path is ``("", path)``."""
    m = _SCHEME.match(url)
    if m is None:
        return "", url
    return m.group(1).lower(), url[m.end():]


def _engine(url: str) -> tuple[Engine, str]:
    scheme, rest = split(url)
    engine = ENGINES.get(scheme)
    if engine is None:
        known = ", ".join(sorted(f"{s}:" for s in ENGINES if s)) or "none"
        raise UnknownEngine(f"{url}: no store engine for scheme {scheme!r} "
                            f"(engines: a directory path, {known})")
    return engine, rest


def open_store(url: str) -> Store:
    """Open (or create) the store ``url`` names."""
    engine, rest = _engine(url)
    return engine.open(rest)


def open_maintenance(url: str, read_only: bool = False) -> Maintenance:
    """gc and fsck's own connection to an existing store (never creates one); ``read_only``:
    one that cannot write (a check without repair)."""
    engine, rest = _engine(url)
    if engine.maintenance is None:
        raise UnknownEngine(f"{url}: this engine keeps nothing to check or collect")
    return engine.maintenance(rest, read_only)


@contextmanager
def reading(url: str) -> Iterator[ReadTx]:
    """Read an existing store without writing to it (``spoolfs status``): beside a running
    daemon, on a store this user may only read, never making or upgrading one."""
    engine, rest = _engine(url)
    if engine.reading is not None:
        with engine.reading(rest) as r:
            yield r
        return
    store = engine.open(rest)
    try:
        yield store.reader()
    finally:
        store.close()


def store_layout(store_dir: str) -> StoreLayout:
    return StoreLayout(store_dir)


def _open_sqlite(store_dir: str) -> Store:
    from spoolfs.store.sqlite import open_store as open_dir

    return open_dir(store_dir)


def _maintain_sqlite(store_dir: str, read_only: bool) -> Maintenance:
    from spoolfs.store.reserve import Reserve
    from spoolfs.store.sqlite_maint import SqliteMaintenance

    layout = StoreLayout(store_dir)
    if not layout.is_store():
        raise FileNotFoundError(f"{store_dir} is not a spoolfs store (no meta.db)")
    return SqliteMaintenance(layout.meta_db, Reserve(store_dir), read_only=read_only)


def _read_sqlite(store_dir: str) -> AbstractContextManager[ReadTx]:
    from spoolfs.store.reserve import Reserve
    from spoolfs.store.sqlite import reading as read_dir

    layout = StoreLayout(store_dir)
    if not layout.is_store():
        raise FileNotFoundError(f"{store_dir} is not a spoolfs store (no meta.db)")
    return read_dir(layout.meta_db, Reserve(store_dir))


def _open_memory(rest: str) -> Store:
    from spoolfs.store.memory import MemoryStore

    return MemoryStore()


register("", Engine(_open_sqlite, _maintain_sqlite, _read_sqlite))
register("memory", Engine(_open_memory))


def _open_postgres(rest: str) -> Store:
    from spoolfs.store.postgres import open_store as open_pg

    return open_pg("postgresql:" + rest)


def _maintain_postgres(rest: str, read_only: bool) -> Maintenance:
    from spoolfs.store.pg_maint import open_maintenance as maintain_pg

    return maintain_pg("postgresql:" + rest)  # each check runs in its own snapshot


# libpq names both schemes; the URL goes to libpq whole (password from ~/.pgpass, PGPASSWORD)
register("postgresql", Engine(_open_postgres, _maintain_postgres))
register("postgres", Engine(_open_postgres, _maintain_postgres))
