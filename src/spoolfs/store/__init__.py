"""The metadata store: one narrow transactional interface, engines behind it."""

from spoolfs.store.base import Entry, ReadTx, Store, StoreBusy, WriteTx

__all__ = ["Entry", "ReadTx", "Store", "StoreBusy", "WriteTx"]
