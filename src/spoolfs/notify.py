"""systemd's readiness protocol (sd_notify(3)), by hand: under ``Type=notify`` the service
manager names a Unix datagram socket in ``$NOTIFY_SOCKET``; each message is one datagram of
newline-separated ``KEY=VALUE`` assignments (``READY=1``, ``STOPPING=1``, ``STATUS=...``,
``MAINPID=...``). A name starting with ``@`` is in the abstract namespace.

Outside such a service (no ``NOTIFY_SOCKET``) every call is a no-op. A failure to notify is
logged and otherwise ignored: it must never take the mount down."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("spoolfs")


def notify(*assignments: str) -> bool:
    """Send ``assignments`` to the service manager; True when a datagram went out."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address[0] == "@":
        address = "\0" + address[1:]
    elif address[0] != "/":
        log.warning("NOTIFY_SOCKET=%s: only Unix sockets are supported, not notifying", address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.send("\n".join(assignments).encode())
    except OSError as e:
        log.warning("cannot notify the service manager at %s: %s",
                    os.environ.get("NOTIFY_SOCKET"), e)
        return False
    return True
