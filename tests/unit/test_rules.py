"""The transition table, exhaustively: every (from, to, scope) is either a listed action or
EPERM, and every other decision follows its table."""

from __future__ import annotations

import errno
import itertools

import pytest

from spoolfs.core import rules
from spoolfs.core.errors import Exists, NotPermitted
from spoolfs.core.rules import Action, DirKind, Kind, Scope, State

K = Kind
EXPECTED = {
    (K.PARTIAL, K.PARTIAL, Scope.SAME_DIR): Action.MOVE,
    (K.PARTIAL, K.PARTIAL, Scope.OTHER_QUEUE): Action.MOVE,
    (K.PARTIAL, K.STAGING, Scope.SAME_QUEUE): Action.MOVE,
    (K.PARTIAL, K.STAGING, Scope.OTHER_QUEUE): Action.MOVE,
    (K.STAGING, K.PARTIAL, Scope.SAME_QUEUE): Action.MOVE,
    (K.STAGING, K.PARTIAL, Scope.OTHER_QUEUE): Action.MOVE,
    (K.STAGING, K.STAGING, Scope.SAME_DIR): Action.MOVE,
    (K.STAGING, K.STAGING, Scope.OTHER_QUEUE): Action.MOVE,
    (K.PARTIAL, K.READY, Scope.SAME_QUEUE): Action.PUBLISH,
    (K.PARTIAL, K.READY, Scope.OTHER_QUEUE): Action.PUBLISH,
    (K.STAGING, K.READY, Scope.SAME_DIR): Action.PUBLISH,
    (K.STAGING, K.READY, Scope.OTHER_QUEUE): Action.PUBLISH,
    (K.READY, K.READY, Scope.SAME_DIR): Action.MOVE,
    (K.READY, K.WORKING, Scope.SAME_QUEUE): Action.CLAIM,
    (K.WORKING, K.WORKING, Scope.SAME_DIR): Action.MOVE,
    (K.WORKING, K.WORKING, Scope.SAME_QUEUE): Action.HANDOVER,
    (K.WORKING, K.SUCCESS, Scope.SAME_QUEUE): Action.FINISH,
    (K.WORKING, K.ERROR, Scope.SAME_QUEUE): Action.FINISH,
    (K.WORKING, K.READY, Scope.SAME_QUEUE): Action.RELEASE,
    (K.ERROR, K.READY, Scope.SAME_QUEUE): Action.REDRIVE,
    (K.ERROR, K.READY, Scope.OTHER_QUEUE): Action.FORWARD,
    (K.SUCCESS, K.READY, Scope.SAME_QUEUE): Action.REDRIVE,
    (K.SUCCESS, K.READY, Scope.OTHER_QUEUE): Action.FORWARD,
    (K.SUCCESS, K.SUCCESS, Scope.SAME_DIR): Action.MOVE,
    (K.ERROR, K.ERROR, Scope.SAME_DIR): Action.MOVE,
}


@pytest.mark.parametrize("src,dst,scope", list(itertools.product(Kind, Kind, Scope)))
def test_every_rename(src: Kind, dst: Kind, scope: Scope) -> None:
    want = EXPECTED.get((src, dst, scope))
    if want is None:
        with pytest.raises(NotPermitted) as exc:
            rules.decide_rename(src, dst, scope)
        assert exc.value.errno == errno.EPERM  # never EXDEV: mv would copy
    else:
        assert rules.decide_rename(src, dst, scope) is want


def test_nothing_is_ever_exdev() -> None:
    assert all(a is not None for scopes in rules.RENAMES.values() for a in scopes.values())


@pytest.mark.parametrize("dst", list(Kind))
def test_replace_uploads_and_finished_never_pending(dst: Kind) -> None:
    if dst in (K.PARTIAL, K.STAGING, K.SUCCESS, K.ERROR):
        rules.decide_replace(dst, False)
    else:
        with pytest.raises(Exists):
            rules.decide_replace(dst, False)
    rules.decide_replace(dst, True)  # renaming onto itself is always fine


@pytest.mark.parametrize("kind", list(Kind))
def test_create_link_unlink(kind: Kind) -> None:
    assert rules.decide_unlink(kind) is (Action.DISCARD if kind is K.WORKING else Action.DELETE)
    if kind in (K.PARTIAL, K.STAGING, K.READY):
        assert rules.decide_create(kind) is (
            Action.DIRECT_PUBLISH if kind is K.READY else Action.UPLOAD)
        assert rules.decide_link(kind) is (
            Action.LINK_PUBLISH if kind is K.READY else Action.LINK)
    else:
        with pytest.raises(NotPermitted):
            rules.decide_create(kind)
        with pytest.raises(NotPermitted):
            rules.decide_link(kind)


@pytest.mark.parametrize("kind,hidden,staged",
                         list(itertools.product(Kind, [False, True], [False, True])))
def test_modify(kind: Kind, hidden: bool, staged: bool) -> None:
    allowed = (kind in (K.PARTIAL, K.STAGING) or hidden) and staged
    if allowed:
        rules.decide_modify(kind, hidden, staged)
    else:
        with pytest.raises(NotPermitted):
            rules.decide_modify(kind, hidden, staged)


def test_kind_of_staging_names() -> None:
    assert rules.kind_of(State.READY, b".x") is K.STAGING
    assert rules.kind_of(State.READY, b"x") is K.READY
    assert rules.kind_of(State.PARTIAL, b".x") is K.PARTIAL
    assert rules.state_of(K.STAGING) is State.READY


@pytest.mark.parametrize("parent,state", [(d, s) for d in DirKind for s in [None, *State]])
def test_mkdir(parent: DirKind, state: State | None) -> None:
    if parent is DirKind.ROOT:
        assert rules.decide_mkdir(parent, state) is DirKind.QUEUE
    elif parent is DirKind.STATE and state is State.WORKING:
        assert rules.decide_mkdir(parent, state) is DirKind.CONSUMER
    else:
        with pytest.raises(NotPermitted):
            rules.decide_mkdir(parent, state)


@pytest.mark.parametrize("kind", list(DirKind))
def test_rmdir_and_dir_rename(kind: DirKind) -> None:
    if kind in (DirKind.QUEUE, DirKind.CONSUMER):
        rules.decide_rmdir(kind)
        rules.decide_dir_rename(kind, True)
        with pytest.raises(NotPermitted):
            rules.decide_dir_rename(kind, False)
    else:
        with pytest.raises(NotPermitted):
            rules.decide_rmdir(kind)
        with pytest.raises(NotPermitted):
            rules.decide_dir_rename(kind, True)


def test_durability() -> None:
    for a in (Action.PUBLISH, Action.CLAIM, Action.FINISH, Action.RELEASE, Action.REDRIVE,
              Action.FORWARD, Action.DIRECT_PUBLISH, Action.LINK_PUBLISH, Action.DISCARD):
        assert a in rules.DURABLE
    assert Action.UPLOAD not in rules.DURABLE
