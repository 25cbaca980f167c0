"""``--metrics-listen HOST:PORT``: the daemon answers ``GET /metrics`` (Prometheus text) and
``GET /status`` (JSON) over HTTP, on its own event loop, from the same snapshot as
``MOUNT/.spool/``. A tiny HTTP/1.0 responder: one request per connection."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
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
    return host.strip("[]") or "0.0.0.0", int(port)


async def serve(listen: str, snapshot: Callable[[], dict[str, Any]], *,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    host, port = parse_listen(listen)

    async def handle(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(TIMEOUT_S):
                request = b""
                while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    request += chunk
                parts = request.split(b" ", 2)
                path = parts[1].split(b"?")[0] if len(parts) > 1 else b""
                if parts[0] != b"GET":
                    code, ctype, body = b"405 Method Not Allowed", b"text/plain", b"GET only\n"
                elif path == b"/metrics":
                    code, ctype = b"200 OK", CONTENT_TYPE_LATEST.encode()
                    body = status.metrics(snapshot())
                elif path == b"/status":
                    code, ctype = b"200 OK", b"application/json"
                    body = json.dumps(snapshot(), indent=1).encode() + b"\n"
                else:
                    code, ctype, body = b"404 Not Found", b"text/plain", b"/metrics or /status\n"
                await stream.send_all(b"HTTP/1.0 " + code + b"\r\nContent-Type: " + ctype +
                                      b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                                      % len(body) + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            log.debug("metrics connection: %s", e)
        finally:
            await stream.aclose()

    listeners = await trio.open_tcp_listeners(port, host=host)
    log.info("metrics: serving http://%s:%d/metrics", host, port)
    task_status.started()
    await trio.serve_listeners(handle, listeners)
