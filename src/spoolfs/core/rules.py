"""The queue's rules: every allowed transition in one table (DESIGN §3).

Pure: no I/O. The service asks ``decide_*`` what an operation means; a refusal raises a
``SpoolError`` carrying the errno and a hint, and the caller changes nothing. The docs' state
table and the exhaustive unit tests read the same tables.
"""

from __future__ import annotations

import enum

from spoolfs.core.errors import Exists, NotPermitted
from spoolfs.core.names import is_staging_name


class State(str, enum.Enum):
    """The five state directories of a queue, in lifecycle order."""

    PARTIAL = "partial"
    READY = "ready"
    WORKING = "working"
    SUCCESS = "success"
    ERROR = "error"


STATES: tuple[State, ...] = tuple(State)


class _Enum(enum.Enum):
    """Hashed as it compares, by identity: ``Enum.__hash__`` is Python code, run at every
    lookup in the tables below (a rename makes a dozen)."""

    __hash__ = object.__hash__


class Kind(_Enum):
    """Where a message sits, as the rules see it: its state, with dot-names in ``ready/``
    (uploads under a staging name, never claimable) told apart."""

    PARTIAL = "partial"
    STAGING = "ready/.staging"
    READY = "ready"
    WORKING = "working"
    SUCCESS = "success"
    ERROR = "error"


_KIND_OF_STATE: dict[State, Kind] = {s: Kind(s.value) for s in State}
_STATE_OF_KIND: dict[Kind, State] = {k: State.READY if k is Kind.STAGING else State(k.value)
                                     for k in Kind}


def kind_of(state: State, name: bytes) -> Kind:
    if state is State.READY and is_staging_name(name):
        return Kind.STAGING
    return _KIND_OF_STATE[state]


def state_of(kind: Kind) -> State:
    return _STATE_OF_KIND[kind]


class Scope(_Enum):
    """How far a rename travels."""

    SAME_DIR = "same directory"
    SAME_QUEUE = "same queue"
    OTHER_QUEUE = "other queue"


class Action(_Enum):
    MOVE = "move"  # plain rename; a waiting message keeps its place in line
    PUBLISH = "publish"
    CLAIM = "claim"
    FINISH = "finish"
    RELEASE = "release"
    REDRIVE = "redrive"
    FORWARD = "forward"
    HANDOVER = "handover"
    DELETE = "delete"
    DISCARD = "discard"  # unlink in working/: finish and discard the input
    UPLOAD = "upload"  # create in partial/ or under a staging name
    DIRECT_PUBLISH = "direct publish"  # create in ready/: appears when the last writer closes
    LINK = "link"  # a new message sharing content, still unpublished
    LINK_PUBLISH = "link publish"  # fan-out: a new published message sharing content
    # Moves the daemon makes on its own (DESIGN §4), never the meaning of a user's request:
    EXPIRE = "expire"  # a lease ran out: working/ -> error/
    RETRY = "retry"  # a failed message with attempts left: error/ -> ready/
    FANOUT = "fanout"  # a publish into a topic: a copy into each subscriber, the original done
    DUPLICATE = "duplicate"  # content already published within the window: straight to success/
    REFUSED = "refused"  # an upload into ready/ not published at close: to partial/
    REPLACED = "replaced"  # a rename onto an existing name released the entry it replaced
    RECOVERED = "recovered"  # at mount: an upload into ready/ never closed before a crash
    REPAIR = "repair"  # fsck --repair: a message whose content is lost, to error/
    RENEW = "renew"  # a claim kept (touch, a read, a handle held open): its lease from now


_S, _Q, _O = Scope.SAME_DIR, Scope.SAME_QUEUE, Scope.OTHER_QUEUE
K = Kind
A = Action

#: (from, to) -> {scope: action}. Anything absent is refused with EPERM (never EXDEV: ``mv``
#: would turn that into copy-and-delete, a duplicate).
RENAMES: dict[tuple[Kind, Kind], dict[Scope, Action]] = {
    (K.PARTIAL, K.PARTIAL): {_S: A.MOVE, _O: A.MOVE},
    (K.PARTIAL, K.STAGING): {_Q: A.MOVE, _O: A.MOVE},
    (K.STAGING, K.PARTIAL): {_Q: A.MOVE, _O: A.MOVE},
    (K.STAGING, K.STAGING): {_S: A.MOVE, _O: A.MOVE},
    (K.PARTIAL, K.READY): {_Q: A.PUBLISH, _O: A.PUBLISH},
    (K.STAGING, K.READY): {_S: A.PUBLISH, _O: A.PUBLISH},
    (K.READY, K.READY): {_S: A.MOVE},
    (K.READY, K.WORKING): {_Q: A.CLAIM},
    (K.WORKING, K.WORKING): {_S: A.MOVE, _Q: A.HANDOVER},
    (K.WORKING, K.SUCCESS): {_Q: A.FINISH},
    (K.WORKING, K.ERROR): {_Q: A.FINISH},
    (K.WORKING, K.READY): {_Q: A.RELEASE},
    (K.ERROR, K.READY): {_Q: A.REDRIVE, _O: A.FORWARD},
    (K.SUCCESS, K.READY): {_Q: A.REDRIVE, _O: A.FORWARD},
    (K.SUCCESS, K.SUCCESS): {_S: A.MOVE},
    (K.ERROR, K.ERROR): {_S: A.MOVE},
}

#: Renaming onto an existing name replaces it for uploads (the producer's scratch: editors and
#: ``sed -i`` save that way) and finished messages; a pending message (``ready/``,
#: ``working/``) is never silently replaced.
REPLACEABLE: frozenset[Kind] = frozenset({K.PARTIAL, K.STAGING, K.SUCCESS, K.ERROR})

#: unlink, per kind.
UNLINKS: dict[Kind, Action] = {
    K.PARTIAL: A.DELETE,  # abort an upload
    K.STAGING: A.DELETE,
    K.READY: A.DELETE,  # withdraw
    K.WORKING: A.DISCARD,  # seed 001: a consumer removes its input
    K.SUCCESS: A.DELETE,  # purge
    K.ERROR: A.DELETE,
}

#: create, per kind of the new name.
CREATES: dict[Kind, Action] = {
    K.PARTIAL: A.UPLOAD,
    K.STAGING: A.UPLOAD,
    K.READY: A.DIRECT_PUBLISH,
}

#: link, per kind of the new name (the source may be any message).
LINKS: dict[Kind, Action] = {
    K.PARTIAL: A.LINK,
    K.STAGING: A.LINK,
    K.READY: A.LINK_PUBLISH,
}

#: Content may change (write, truncate) only while a message is unpublished. Metadata (mode,
#: owner, times) may change in every state, as the kernel's permission checks allow.
MUTABLE: frozenset[Kind] = frozenset({K.PARTIAL, K.STAGING})

#: Where ``setxattr`` of a header or of the failure reason is allowed.
HEADER_KINDS: frozenset[Kind] = MUTABLE
ERROR_REASON_KINDS: frozenset[Kind] = frozenset({K.WORKING})

#: Transitions that must be on disk before the call returns. Uploads in progress need not be,
#: nor a renewed lease (a crash loses at most an extension: the claim still holds its old one).
DURABLE: frozenset[Action] = frozenset(A) - {A.UPLOAD, A.LINK, A.RENEW}


def scope_of(same_dir: bool, same_queue: bool) -> Scope:
    if same_dir:
        return _S
    return _Q if same_queue else _O


def decide_rename(src: Kind, dst: Kind, scope: Scope) -> Action:
    """What renaming a message from ``src`` to ``dst`` means, or NotPermitted."""
    action = RENAMES.get((src, dst), {}).get(scope)
    if action is None:
        raise NotPermitted(f"rename {src.value} -> {dst.value} ({scope.value}) "
                           "is not a queue transition")
    return action


def decide_replace(dst: Kind, same_entry: bool) -> None:
    """Renaming onto an existing name: allowed (the old entry is released) or EEXIST."""
    if not same_entry and dst not in REPLACEABLE:
        raise Exists(f"{dst.value}: a pending message is never replaced")


def decide_unlink(kind: Kind) -> Action:
    return UNLINKS[kind]


def decide_create(kind: Kind) -> Action:
    action = CREATES.get(kind)
    if action is None:
        raise NotPermitted(f"cannot create files in {kind.value}/")
    return action


def decide_link(dst: Kind) -> Action:
    action = LINKS.get(dst)
    if action is None:
        raise NotPermitted(f"links may only be made into partial/ or ready/, not {dst.value}/")
    return action


def decide_modify(kind: Kind, hidden: bool, staged: bool) -> None:
    """Writes and truncation: only unpublished content (or an upload into
    ``ready/`` that has not appeared yet) that no link shares yet (a link seals content)."""
    if kind not in MUTABLE and not hidden:
        raise NotPermitted(f"{kind.value}: published content is immutable")
    if not staged:
        raise NotPermitted(f"{kind.value}: content shared by a link is immutable")


def is_claimable(kind: Kind) -> bool:
    return kind is Kind.READY


# ---- directories ---------------------------------------------------------------------------


class DirKind(_Enum):
    ROOT = "root"
    QUEUE = "queue"
    STATE = "state"
    CONSUMER = "consumer"


def decide_mkdir(parent: DirKind, parent_state: State | None) -> DirKind:
    """mkdir at the root makes a queue; in ``working/`` a consumer view; elsewhere EPERM."""
    if parent is DirKind.ROOT:
        return DirKind.QUEUE
    if parent is DirKind.STATE and parent_state is State.WORKING:
        return DirKind.CONSUMER
    raise NotPermitted("directories are only made at the root (a queue) "
                       "or in working/ (a consumer)")


def decide_dir_rename(kind: DirKind, same_parent: bool) -> None:
    """A queue may be renamed at the root, a consumer within its ``working/``."""
    if kind in (DirKind.QUEUE, DirKind.CONSUMER) and same_parent:
        return
    raise NotPermitted(f"a {kind.value} directory cannot be moved there")


def decide_rmdir(kind: DirKind) -> None:
    if kind not in (DirKind.QUEUE, DirKind.CONSUMER):
        raise NotPermitted(f"a {kind.value} directory cannot be removed")
