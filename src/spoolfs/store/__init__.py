"""The metadata store: one narrow transactional interface, engines behind it."""

from spoolfs.store.base import Entry, ReadTx, Store, WriteTx

__all__ = ["Entry", "ReadTx", "Store", "WriteTx"]
