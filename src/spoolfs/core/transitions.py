"""Every transition of a message and the fields it changes, as one table (DESIGN §3, §4).

``core.rules`` decides what a user's request means (an ``Action``); this table says, for every
action, user's or daemon's, where the message may come from, where it goes and which
``Entry`` fields it sets or clears. The service applies a row with ``fields_of`` and changes
nothing a row does not name; a row that does not fit (a message not in one of its sources) is
refused before anything changes. Values that depend on a queue's policy (when a lease ends,
when a failed message retries, whether it is abandoned) are computed by ``core.lifecycle`` and
passed in: the table says only which of them applies.

Adding an action is one row here (and its ``Action`` member in ``core.rules``).
"""

from __future__ import annotations

import enum
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any

from spoolfs.core.errors import NotPermitted
from spoolfs.core.lifecycle import LEASE_EXPIRED, AfterFailure
from spoolfs.core.rules import Action, Kind, State


class Stamp(enum.Enum):
    """A time field: ``enqueued_ns``, ``claimed_ns``, ``finished_ns``, ``ctime_ns``."""

    KEEP = "keep"
    SET = "now"
    CLEAR = "clear"


class Attempts(enum.Enum):
    KEEP = "keep"
    ADD = "+1"  # a claim is an attempt
    GIVE_BACK = "-1"  # a release: the attempt was not made (never below 0)
    RESET = "reset"  # a redrive starts over


class Lease(enum.Enum):
    KEEP = "keep"
    START = "start"  # now + the queue's lease_timeout
    CLEAR = "clear"


class Retry(enum.Enum):
    """``retry_ns`` and ``abandoned`` together: they are the outcome of one failure."""

    KEEP = "keep"
    AFTER_FAILURE = "after failure"  # the queue's retry policy decides
    CLEAR = "clear"


class Reason(enum.Enum):
    """``error``, the failure reason (``user.spool.error``)."""

    KEEP = "keep"
    LEASE_EXPIRED = "lease expired"
    GIVEN = "given"  # the reason the caller passes
    CLEAR = "clear"


class Consumer(enum.Enum):
    KEEP = "keep"
    VIEW = "view"  # the consumer view it is moved into (none outside working/<c>/)
    CLEAR = "clear"


class Hidden(enum.Enum):
    KEEP = "keep"
    HIDE = "hide"  # until its last writer closes
    WHILE_WRITTEN = "while written"  # hidden while a writer still holds it, else shown
    SHOW = "show"


class Owner(enum.Enum):
    """A claim makes the claimer the message's owner (its group: the view's, when setgid), so
    that whoever holds a claim may heartbeat (``touch``), annotate (``setfattr``) and chmod it
    under the kernel's checks, however the producer left its mode; a hand-over makes the
    caller the owner. The owner stays when the message moves on."""

    KEEP = "keep"
    TAKE = "take"


@dataclass(frozen=True, slots=True)
class Effects:
    """What a transition changes; every field not named here is kept."""

    enqueued: Stamp = Stamp.KEEP
    claimed: Stamp = Stamp.KEEP
    finished: Stamp = Stamp.KEEP
    attempts: Attempts = Attempts.KEEP
    lease: Lease = Lease.KEEP
    retry: Retry = Retry.KEEP
    error: Reason = Reason.KEEP
    consumer: Consumer = Consumer.KEEP
    hidden: Hidden = Hidden.KEEP
    owner: Owner = Owner.KEEP
    ctime: Stamp = Stamp.SET

    def changes(self) -> dict[str, str]:
        """The effects that change something, by field name: how the docs show a row."""
        return {f: v.value for f in self.__dataclass_fields__
                if (v := getattr(self, f)).value != "keep"}


#: a source of ``None``: the transition makes a new message; a target of ``None``: it deletes one
NEW = None
GONE = None


@dataclass(frozen=True, slots=True)
class Transition:
    action: Action
    sources: frozenset[Kind | None]
    targets: frozenset[State | None]
    effects: Effects = field(default_factory=Effects)
    by_daemon: bool = False  # a move the daemon makes on its own, never a user's request


K, S, A = Kind, State, Action
E = Effects
_ALL = frozenset(Kind)
_UPLOADS = frozenset({K.PARTIAL, K.STAGING})
#: where a finished message lands: no lease, no consumer, no pending retry
#: a deletion changes no field: the row is gone (the caller deletes it)
_GONE = Effects(ctime=Stamp.KEEP)
_DONE = Effects(finished=Stamp.SET, lease=Lease.CLEAR, retry=Retry.CLEAR,
                consumer=Consumer.CLEAR)

#: a finished message sent back (to its queue or another): a new message in all but its content
_START_OVER = Effects(enqueued=Stamp.SET, finished=Stamp.CLEAR, attempts=Attempts.RESET,
                      retry=Retry.CLEAR, error=Reason.CLEAR, consumer=Consumer.CLEAR)


def _t(action: Action, sources: AbstractSet[Kind | None], targets: AbstractSet[State | None],
       effects: Effects = Effects(), by_daemon: bool = False) -> Transition:
    return Transition(action, frozenset(sources), frozenset(targets), effects, by_daemon)


TRANSITIONS: tuple[Transition, ...] = (
    # ---- a user's requests (core.rules decides which one a rename, create, link or unlink is)
    _t(A.UPLOAD, {NEW}, {S.PARTIAL, S.READY}),
    _t(A.DIRECT_PUBLISH, {NEW}, {S.READY}, E(hidden=Hidden.HIDE)),
    # a rename from partial/ (``defer``: its writer still holds it, it appears at the last
    # close), or an upload into ready/ appearing at its last close
    _t(A.PUBLISH, {K.PARTIAL, K.STAGING, K.READY}, {S.READY},
       E(enqueued=Stamp.SET, hidden=Hidden.WHILE_WRITTEN)),
    _t(A.MOVE, set(Kind), {*State}, E(consumer=Consumer.VIEW)),
    _t(A.CLAIM, {K.READY}, {S.WORKING},
       E(claimed=Stamp.SET, attempts=Attempts.ADD, lease=Lease.START, consumer=Consumer.VIEW,
         owner=Owner.TAKE)),
    _t(A.HANDOVER, {K.WORKING}, {S.WORKING}, E(consumer=Consumer.VIEW, owner=Owner.TAKE)),
    _t(A.FINISH, {K.WORKING}, {S.SUCCESS}, replace(_DONE, error=Reason.CLEAR)),
    _t(A.FINISH, {K.WORKING}, {S.ERROR},  # the reason is the consumer's user.spool.error
       replace(_DONE, retry=Retry.AFTER_FAILURE)),
    _t(A.RELEASE, {K.WORKING}, {S.READY},
       E(attempts=Attempts.GIVE_BACK, lease=Lease.CLEAR, consumer=Consumer.CLEAR)),
    _t(A.REDRIVE, {K.SUCCESS, K.ERROR}, {S.READY}, _START_OVER),
    _t(A.FORWARD, {K.SUCCESS, K.ERROR}, {S.READY}, _START_OVER),
    _t(A.LINK, {NEW}, {S.PARTIAL, S.READY}),
    _t(A.LINK_PUBLISH, {NEW}, {S.READY}, E(enqueued=Stamp.SET)),
    _t(A.DELETE, set(Kind) - {K.WORKING}, {GONE}, _GONE),
    _t(A.DISCARD, {K.WORKING}, {GONE}, _GONE),
    # a rename onto an existing name releases the entry it replaces
    _t(A.REPLACED, _UPLOADS | {K.SUCCESS, K.ERROR}, {GONE}, _GONE),
    # ---- the daemon's own moves (DESIGN §4, §5)
    _t(A.EXPIRE, {K.WORKING}, {S.ERROR},
       replace(_DONE, retry=Retry.AFTER_FAILURE, error=Reason.LEASE_EXPIRED), by_daemon=True),
    # the reason it failed stays: it tells why the message came back
    _t(A.RETRY, {K.ERROR}, {S.READY},
       E(enqueued=Stamp.SET, finished=Stamp.CLEAR, retry=Retry.CLEAR, consumer=Consumer.CLEAR),
       by_daemon=True),
    # each subscriber's copy, then the original, done
    _t(A.FANOUT, {NEW}, {S.READY}, E(enqueued=Stamp.SET), by_daemon=True),
    _t(A.FANOUT, {K.READY}, {S.SUCCESS}, replace(_DONE, error=Reason.CLEAR), by_daemon=True),
    _t(A.DUPLICATE, {K.READY}, {S.SUCCESS}, replace(_DONE, error=Reason.CLEAR),
       by_daemon=True),
    _t(A.REFUSED, {K.READY}, {S.PARTIAL}, E(hidden=Hidden.SHOW), by_daemon=True),
    # recovery keeps the upload's change time: nothing was done to it since the crash
    _t(A.RECOVERED, {K.READY}, {S.PARTIAL}, E(hidden=Hidden.SHOW, ctime=Stamp.KEEP),
       by_daemon=True),
    _t(A.REPAIR, _ALL, {S.ERROR}, replace(_DONE, error=Reason.GIVEN, hidden=Hidden.SHOW),
       by_daemon=True),
    _t(A.RENEW, {K.WORKING}, {S.WORKING}, E(lease=Lease.START, ctime=Stamp.KEEP), by_daemon=True),
)

_INDEX: dict[tuple[Action, State | None], Transition] = {}
for _row in TRANSITIONS:
    for _to in _row.targets:
        assert (_row.action, _to) not in _INDEX, f"two rows for {_row.action} -> {_to}"
        _INDEX[(_row.action, _to)] = _row


def transition(action: Action, to: State | None) -> Transition:
    """The row of ``action`` into ``to`` (None: a deletion). A missing row is a bug."""
    return _INDEX[(action, to)]


@dataclass(frozen=True, slots=True)
class Context:
    """The values a row's effects may need, computed by the caller from its policy."""

    now: int
    attempts: int = 0  # the message's attempts before the transition
    lease_end: int | None = None  # for Lease.START
    after: AfterFailure | None = None  # for Retry.AFTER_FAILURE
    consumer: str | None = None  # for Consumer.VIEW
    owner: tuple[int, int] | None = None  # (uid, gid) for Owner.TAKE
    writing: bool = False  # for Hidden.WHILE_WRITTEN
    reason: bytes | None = None  # for Reason.GIVEN


_STAMPS = {"enqueued": "enqueued_ns", "claimed": "claimed_ns", "finished": "finished_ns",
           "ctime": "ctime_ns"}


def fields_of(t: Transition, source: Kind | None, ctx: Context) -> dict[str, Any]:
    """The ``Entry`` fields ``t`` sets, for a message of kind ``source`` (None: a new one).
    NotPermitted, with nothing computed, when the message is not in one of ``t``'s sources."""
    if source not in t.sources:
        where = source.value if source is not None else "nothing"
        raise NotPermitted(f"{t.action.value} does not start from {where}")
    fx = t.effects
    out: dict[str, Any] = {}
    for name, column in _STAMPS.items():
        stamp: Stamp = getattr(fx, name)
        if stamp is Stamp.SET:
            out[column] = ctx.now
        elif stamp is Stamp.CLEAR:
            out[column] = None
    if fx.attempts is Attempts.ADD:
        out["attempts"] = ctx.attempts + 1
    elif fx.attempts is Attempts.GIVE_BACK:
        out["attempts"] = max(ctx.attempts - 1, 0)
    elif fx.attempts is Attempts.RESET:
        out["attempts"] = 0
    if fx.lease is Lease.START:
        assert ctx.lease_end is not None, f"{t.action.value} starts a lease: pass lease_end"
        out["lease_ns"] = ctx.lease_end
    elif fx.lease is Lease.CLEAR:
        out["lease_ns"] = None
    if fx.retry is Retry.AFTER_FAILURE:
        assert ctx.after is not None, f"{t.action.value} applies the retry policy: pass after"
        out.update(retry_ns=ctx.after.retry_ns, abandoned=int(ctx.after.abandoned))
    elif fx.retry is Retry.CLEAR:
        out.update(retry_ns=None, abandoned=0)
    if fx.error is Reason.LEASE_EXPIRED:
        out["error"] = LEASE_EXPIRED
    elif fx.error is Reason.GIVEN:
        out["error"] = ctx.reason
    elif fx.error is Reason.CLEAR:
        out["error"] = None
    if fx.consumer is Consumer.VIEW:
        out["consumer"] = ctx.consumer
    elif fx.consumer is Consumer.CLEAR:
        out["consumer"] = None
    if fx.hidden is not Hidden.KEEP:
        out["hidden"] = int(fx.hidden is Hidden.HIDE
                            or (fx.hidden is Hidden.WHILE_WRITTEN and ctx.writing))
    if fx.owner is Owner.TAKE:
        assert ctx.owner is not None, f"{t.action.value} takes ownership: pass owner"
        out["uid"], out["gid"] = ctx.owner
    return out
