"""The use cases: every operation of DESIGN §3, each one store transaction.

Callers pass store ids (the FUSE layer maps inode 1 to the mount's root). Each method either
completes its transition (durable first, when the rules say so) or raises a ``SpoolError`` and
changes nothing.

``Spool`` is the facade the FUSE layer, the daemon and the lifecycle call. The operations live
in one module per use case, each building on the one before, all sharing the state and the one
transaction helper (``tx``) of ``spool_core``:

- ``spool_core``: state, ``tx``, reading the tree, leases;
- ``publishing``: sealing uploads, arrival in ready/ (duplicates, fan-out);
- ``uploads``: create, open, write, close;
- ``directories``: queues, consumer views, batches;
- ``moving``: rename (the transitions), unlink, link;
- ``attributes``: setattr, xattrs, policies.
"""

from __future__ import annotations

from spoolfs.service.attributes import Attributes
from spoolfs.service.spool_core import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    RENAME_WHITEOUT,
    SPOOL_XATTR,
    Who,
    free_name,
)

__all__ = ["RENAME_EXCHANGE", "RENAME_NOREPLACE", "RENAME_WHITEOUT", "SPOOL_XATTR", "Spool",
           "Who", "free_name"]


class Spool(Attributes):
    """Every operation of the spool, for one mount's daemon."""
