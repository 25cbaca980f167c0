"""Free loopback ports for the servers the tests start.

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from its ephemeral range,
the same range every outgoing connection of the suite (boto3, psycopg, the daemons) takes
its local port from: a server told to listen on one can find it taken by a client's socket
in the moment between the choice and its own bind. These ports come from below that range
(their twins too), checked free, so only another listener can take them; a server that
still finds its port taken is started again on others (``port_taken``)."""

from __future__ import annotations

import random
import socket

#: ports other servers of the suite take by number (the NFS server's, helpers/nfs.py), never
#: handed out here even while free
RESERVED = frozenset({2049, 20048})
TAKEN = ("address already in use",  # the kernel's EADDRINUSE, as PostgreSQL and Go print it
         "cannot be used")  # SeaweedFS's own check of a port given by flag


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*twins: int) -> int:
    """A free port below the ephemeral range whose twins (port + each offset) are free too."""
    top = _ephemeral_start() - 1 - max(twins, default=0)
    if top < 2048:
        raise AssertionError(f"no room below the ephemeral ports for offsets {twins}")
    for _ in range(500):
        port = random.randint(1024, top)
        if all(port + t not in RESERVED and _is_free(port + t) for t in (0, *twins)):
            return port
    raise AssertionError("no free loopback port below the ephemeral range")


def port_taken(error: str) -> bool:
    """Whether a server's failure to start (its message and log) was a port already taken."""
    text = error.lower()
    return any(t in text for t in TAKEN)
