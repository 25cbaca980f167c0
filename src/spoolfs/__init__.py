"""spoolfs: a FUSE filesystem that is a durable work queue."""

__version__ = "0.1.0"
