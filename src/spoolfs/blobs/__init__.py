"""Content on disk: content-addressed blob files and mutable staging files for uploads."""

from spoolfs.blobs.files import BlobDir, StagingDir, fsync_dir, hash_file

__all__ = ["BlobDir", "StagingDir", "fsync_dir", "hash_file"]
