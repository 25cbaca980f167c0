"""Helpers for the tests, one module per thing they help with:

- ``waiting``: polling with a deadline stretched for a slow machine;
- ``procs``: commands, the spoolfs CLI and background shells, run as users run them;
- ``mounts``: a real spoolfs daemon and its mount;
- ``queues``: a queue's directories and the moves between them;
- ``inspection``: listings, contents, xattrs, snapshots, exact errnos, raw system calls;
- ``spool``: the service on a store in ``tmp_path``, without a kernel (tests/service).

The real-mount helpers drive the mount the way users do: the daemon is started as
``[sys.executable, "-m", "spoolfs", ...]`` and the tree is changed by real ``mv``/``cp``/``ln``
processes. Python ``os`` calls are used only where a process cannot express the check (an exact
errno, ``renameat2`` flags, holding a file open across a rename).

Tests import from the modules; this package exports nothing itself.
"""
