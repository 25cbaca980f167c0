"""Queue policies as the daemon sees them: a cache of the store's ``policies`` table, refreshed
by the lifecycle timer (so a change made by another daemon or by ``spoolfs queue set --store``
takes effect within a tick), and the ``user.spool.policy*`` attributes of a queue directory."""

from __future__ import annotations

import logging

from spoolfs.core import policy as P
from spoolfs.core.errors import Invalid, NoAttribute
from spoolfs.core.policy import DEFAULT, Policy
from spoolfs.store.base import ReadTx

log = logging.getLogger(__name__)

XATTR = b"user.spool.policy"


class Policies:
    def __init__(self, reader: ReadTx) -> None:
        self._r = reader
        self._stored: dict[int, dict[str, str]] = {}
        self._by_queue: dict[int, Policy] = {}
        self.refresh()

    def refresh(self) -> None:
        stored = self._r.policies()
        if stored == self._stored:
            return
        by_queue = {}
        for queue, values in stored.items():
            p = DEFAULT
            for key, text in values.items():
                try:
                    p = p.with_values({key: text})
                except Invalid as e:  # written by a newer or broken tool: keep the default
                    log.warning("queue %d: ignoring stored policy %s=%r: %s", queue, key, text, e)
            by_queue[queue] = p
        self._stored, self._by_queue = stored, by_queue

    def of(self, queue: int | None) -> Policy:
        return self._by_queue.get(queue, DEFAULT) if queue is not None else DEFAULT

    def queues(self) -> list[tuple[int, Policy]]:
        """Queues with stored settings (the only ones that can have a retention)."""
        return list(self._by_queue.items())

    # ---- the attributes of a queue directory -----------------------------------------------

    @staticmethod
    def xattr_names() -> list[bytes]:
        return [XATTR] + [XATTR + b"." + k.encode() for k in P.KEYS]

    def getxattr(self, queue: int, name: bytes) -> bytes:
        shown = self.of(queue).shown()
        if name == XATTR:
            return P.format_lines(shown).encode()
        key = self._key(name)
        return shown[key].encode()

    @staticmethod
    def changes(name: bytes, value: bytes | None) -> dict[str, str | None]:
        """The stored values a set (``value``) or remove (``None``) of ``name`` makes;
        ``Invalid`` with a clear message, before anything is changed."""
        try:
            text = value.decode() if value is not None else None
        except UnicodeDecodeError as e:
            raise Invalid("policy values are text") from e
        if name == XATTR:
            if text is None:
                return {k: None for k in P.KEYS}  # remove all: back to the defaults
            return dict(P.parse_lines(text))
        key = name[len(XATTR) + 1:].decode(errors="replace") if name.startswith(XATTR + b".") \
            else name.decode(errors="replace")
        if text is None:
            return {Policies._key(name): None}
        return dict(P.parse_assignments([f"{key}={text}"]))

    @staticmethod
    def _key(name: bytes) -> str:
        key = name[len(XATTR) + 1:].decode(errors="replace") if name.startswith(XATTR + b".") \
            else ""
        if key not in P.KEYS:
            raise NoAttribute(f"no policy {name!r}; keys: {', '.join(P.KEYS)}")
        return key


def check_fanout(r: ReadTx, queue: int, changes: dict[str, str | None]) -> None:
    """Refuse a change of ``queue``'s ``fanout`` that would make a cycle, given what every
    queue of the store has stored (``Invalid``, nothing changed)."""
    if "fanout" not in changes:
        return
    stored = r.policies()
    stored.setdefault(queue, {})
    graph: dict[str, tuple[str, ...]] = {}
    for qid, values in stored.items():
        e = r.get(qid)
        if e is None:
            continue
        text = changes["fanout"] if qid == queue else values.get("fanout")
        graph[e.name.decode(errors="replace")] = P.parse("fanout", text) if text else ()
    P.check_fanout(graph)
