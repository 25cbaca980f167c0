"""``--metrics-listen HOST:PORT``: the daemon answers ``GET /metrics`` (Prometheus text) and
``GET /status`` (JSON) over HTTP, on its own event loop, from the same snapshot as
``MOUNT/.spool/``. A tiny HTTP/1.0 responder: one request per connection.

Without a host (``:9464``) it listens on loopback only: the status names every queue and its
depth, which is nobody else's business unless the admin says so (``0.0.0.0:9464``). The socket
is bound before the file system is mounted, so a port already in use is one line of error and
no mount."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from spoolfs.core.errors import UserError
from spoolfs.service import status

log = logging.getLogger(__name__)

MAX_REQUEST = 8192
TIMEOUT_S = 5.0


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--metrics-listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
    return host.strip("[]") or "127.0.0.1", int(port)


def bind(listen: str) -> list[socket.socket]:
    """Listening sockets for ``HOST:PORT`` (every address the host name has), or a one-line
    ``UserError`` (the port in use, an unknown host)."""
    host, port = parse_listen(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--metrics-listen {listen}: {e.strerror}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _name, addr in dict.fromkeys(infos):
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(64)
    except OSError as e:
        for s in socks:
            s.close()
        raise UserError(f"--metrics-listen {listen}: cannot listen: {e.strerror}") from None
    return socks


async def serve(socks: list[socket.socket], snapshot: Callable[[], Awaitable[dict[str, Any]]], *,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async def handle(stream: trio.SocketStream) -> None:
        try:
            request = b""
            with trio.move_on_after(TIMEOUT_S) as waited:
                while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    request += chunk
            if waited.cancelled_caught:
                return  # no request in time: hang up
            # Not under the timeout: a snapshot of a deep spool may take longer (off the loop).
            parts = request.split(b" ", 2)
            path = parts[1].split(b"?")[0] if len(parts) > 1 else b""
            if parts[0] != b"GET":
                code, ctype, body = b"405 Method Not Allowed", b"text/plain", b"GET only\n"
            elif path == b"/metrics":
                code, ctype = b"200 OK", CONTENT_TYPE_LATEST.encode()
                body = status.metrics(await snapshot())
            elif path == b"/status":
                code, ctype = b"200 OK", b"application/json"
                body = json.dumps(await snapshot(), indent=1).encode() + b"\n"
            else:
                code, ctype, body = b"404 Not Found", b"text/plain", b"/metrics or /status\n"
            with trio.move_on_after(TIMEOUT_S):
                await stream.send_all(b"HTTP/1.0 " + code + b"\r\nContent-Type: " + ctype +
                                      b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                                      % len(body) + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            log.debug("metrics connection: %s", e)
        finally:
            await stream.aclose()

    listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in socks]
    for s in socks:
        host, port = s.getsockname()[:2]
        log.info("metrics: serving http://%s/metrics",
                 f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    task_status.started()
    await trio.serve_listeners(handle, listeners)
