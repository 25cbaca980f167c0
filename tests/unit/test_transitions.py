"""The transition table (core/transitions.py): every action has its rows, every decision of
core.rules lands on a row, and applying a row changes exactly the fields it names."""

from __future__ import annotations

import pytest

from spoolfs.core import rules
from spoolfs.core import transitions as T
from spoolfs.core.errors import NotPermitted
from spoolfs.core.lifecycle import LEASE_EXPIRED, AfterFailure
from spoolfs.core.rules import Action, Kind, State

NOW = 1_000


def test_every_action_has_a_row() -> None:
    assert {row.action for row in T.TRANSITIONS} == set(Action)


@pytest.mark.parametrize(("pair", "by_scope"), list(rules.RENAMES.items()))
def test_every_allowed_rename_is_a_row(pair: tuple[Kind, Kind],
                                       by_scope: dict[rules.Scope, Action]) -> None:
    src, dst = pair
    for action in by_scope.values():
        assert src in T.transition(action, rules.state_of(dst)).sources


def test_every_create_link_and_unlink_is_a_row() -> None:
    for kind, action in [*rules.CREATES.items(), *rules.LINKS.items()]:
        assert None in T.transition(action, rules.state_of(kind)).sources
    for kind, action in rules.UNLINKS.items():
        assert kind in T.transition(action, None).sources
    for kind in rules.REPLACEABLE:
        assert kind in T.transition(Action.REPLACED, None).sources


def test_a_refused_event_changes_nothing() -> None:
    """A row applied to a message outside its sources raises before computing anything."""
    with pytest.raises(NotPermitted, match="claim does not start from working"):
        T.fields_of(T.transition(Action.CLAIM, State.WORKING), Kind.WORKING, T.Context(NOW))
    with pytest.raises(NotPermitted, match="does not start from nothing"):
        T.fields_of(T.transition(Action.FINISH, State.SUCCESS), None, T.Context(NOW))


def test_a_claim_stamps_counts_leases_and_takes_ownership() -> None:
    ctx = T.Context(NOW, attempts=2, lease_end=NOW + 10, consumer="w", owner=(7, 8))
    assert T.fields_of(T.transition(Action.CLAIM, State.WORKING), Kind.READY, ctx) == {
        "claimed_ns": NOW, "ctime_ns": NOW, "attempts": 3, "lease_ns": NOW + 10,
        "consumer": "w", "uid": 7, "gid": 8}


def test_finishing_to_success_clears_the_reason_and_to_error_keeps_it() -> None:
    ctx = T.Context(NOW, after=AfterFailure(NOW + 5, False))
    ok = T.fields_of(T.transition(Action.FINISH, State.SUCCESS), Kind.WORKING, ctx)
    assert ok["error"] is None and ok["retry_ns"] is None and ok["abandoned"] == 0
    failed = T.fields_of(T.transition(Action.FINISH, State.ERROR), Kind.WORKING, ctx)
    assert "error" not in failed and failed["retry_ns"] == NOW + 5 and failed["abandoned"] == 0


def test_expire_records_the_reason_and_the_policy_outcome() -> None:
    ctx = T.Context(NOW, after=AfterFailure(None, True))
    f = T.fields_of(T.transition(Action.EXPIRE, State.ERROR), Kind.WORKING, ctx)
    assert f == {"finished_ns": NOW, "ctime_ns": NOW, "lease_ns": None, "retry_ns": None,
                 "abandoned": 1, "error": LEASE_EXPIRED, "consumer": None}


def test_release_gives_back_an_attempt_never_below_zero() -> None:
    row = T.transition(Action.RELEASE, State.READY)
    assert T.fields_of(row, Kind.WORKING, T.Context(NOW, attempts=1))["attempts"] == 0
    assert T.fields_of(row, Kind.WORKING, T.Context(NOW, attempts=0))["attempts"] == 0


def test_publish_hides_while_a_writer_holds_it() -> None:
    row = T.transition(Action.PUBLISH, State.READY)
    assert T.fields_of(row, Kind.PARTIAL, T.Context(NOW, writing=True))["hidden"] == 1
    assert T.fields_of(row, Kind.PARTIAL, T.Context(NOW))["hidden"] == 0


def test_a_deletion_sets_nothing() -> None:
    for action in (Action.DELETE, Action.DISCARD, Action.REPLACED):
        row = T.transition(action, None)
        assert T.fields_of(row, next(iter(row.sources - {None})), T.Context(NOW)) == {}


def test_only_a_claim_and_a_handover_take_ownership() -> None:
    takers = {row.action for row in T.TRANSITIONS if row.effects.owner is T.Owner.TAKE}
    assert takers == {Action.CLAIM, Action.HANDOVER}
