"""The one way a message changes state: apply a row of ``core.transitions`` in a transaction.

Every mover (the use cases of ``service.spool``, the lifecycle timer, recovery) calls
``apply`` or ``make``: the row says which fields change, the caller only where the message
goes and the values its policy computed. Each call also writes the history row, so the
history's actions are exactly the table's.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from spoolfs.core import rules
from spoolfs.core.rules import Action, State
from spoolfs.core.transitions import Context, fields_of, transition
from spoolfs.store.base import Entry, WriteTx

#: the moves of the transaction function running now, as (action, queue id): the committer
#: counts them once their transaction has committed (service/committer.py)
MOVED: ContextVar[list[tuple[str, int | None]] | None] = ContextVar("moved", default=None)

#: the names the transaction function running now made that no request of the kernel's asked
#: for, as (parent, name): the committer has them dropped from the kernel's cache once their
#: transaction has committed (a negative entry for them may be cached there)
NAMED: ContextVar[list[tuple[int, bytes]] | None] = ContextVar("named", default=None)
#: the actions that make such names: a topic's copies in its subscribers' ready/, a topic's
#: message or a skipped duplicate moved to success/, an upload refused at its close moved to
#: partial/ (the lifecycle's moves drop their names themselves: service/lifecycle.py)
UNASKED = frozenset({Action.FANOUT, Action.DUPLICATE, Action.REFUSED})

#: who asked: (uid, pid) of the caller; (None, None) for the daemon's own moves
By = tuple[int | None, int | None]
DAEMON: By = (None, None)


def place(e: Entry) -> str:
    assert e.state is not None
    return f"{e.state.value}/{e.consumer}" if e.consumer else e.state.value


def apply(tx: WriteTx, cur: Entry, action: Action, to: State | None, ctx: Context, by: By, *,
          into: tuple[int, bytes] | None = None, src: str | None = None,
          dst: str | None = None, why: str | None = None, history: bool = True,
          free: bool = False, **extra: Any) -> bool:
    """In a transaction: ``action`` on message ``cur`` into state ``to`` (None: it is being
    deleted, by the caller). With ``into`` (parent, name) it moves there, a compare-and-set on
    ``cur``'s parent and name (False: it moved meanwhile, nothing changed); without, it
    changes in place; ``free``: False also when another row has that name (nothing
    changed). ``extra``: fields that are no effect of the table (the queue a rename
    enters, the original of a duplicate). ``history=False``: no history row (a lease renewed
    by every read would drown the transitions)."""
    assert cur.state is not None
    fields = fields_of(transition(action, to), rules.kind_of(cur.state, cur.name), ctx)
    if to is not None:
        fields.update(extra)
        if into is not None:
            assert cur.parent is not None
            if not tx.move(cur.id, cur.parent, cur.name, *into, free=free, state=to, **fields):
                return False
            if action in UNASKED:
                _named(*into)
        else:
            tx.update(cur.id, **fields)
    _record(action, extra.get("queue", cur.queue), fields)
    if not history:
        return True
    if dst is None and to is not None:
        consumer = fields.get("consumer", cur.consumer)
        dst = f"{to.value}/{consumer}" if consumer else to.value
    tx.add_history(cur.id, ctx.now, action.value, place(cur) if src is None else src, dst,
                   by[0], by[1], why)
    return True


def make(tx: WriteTx, action: Action, to: State, ctx: Context, by: By, *,
         src: str | None = None, why: str | None = None, history: bool = True,
         **row: Any) -> Entry:
    """In a transaction: a new message (an upload, a link, a subscriber's copy) made by
    ``action`` in state ``to``; ``row`` are its own fields (name, content, owner, ...). A
    plain upload is not in the history (``history=False``): it is no transition yet."""
    fields = fields_of(transition(action, to), None, ctx)
    e = tx.insert(state=to, **row, **fields)
    _record(action, row.get("queue"), fields)
    if action in UNASKED:
        _named(row["parent"], row["name"])
    if history:
        tx.add_history(e.id, ctx.now, action.value, src, to.value, by[0], by[1], why)
    return e


def _record(action: Action, queue: int | None, fields: dict[str, Any]) -> None:
    moved = MOVED.get()
    if moved is not None:
        moved.append((action.value, queue))
        if fields.get("abandoned"):
            moved.append(("abandon", queue))


def _named(parent: int, name: bytes) -> None:
    named = NAMED.get()
    if named is not None:
        named.append((parent, name))
