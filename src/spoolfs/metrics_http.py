"""``--metrics-listen HOST:PORT``: the daemon answers ``GET /metrics`` (Prometheus), ``GET
/status`` (JSON) and ``GET /`` (a status page, statuspage.py) over HTTP, from the same snapshot
as ``MOUNT/.spool/``. prometheus_client's own exposition (content negotiation, OpenMetrics,
gzip) writes ``/metrics``; a WSGI server of the standard library, in threads of its own,
serves the requests. Each request asks the event loop for the snapshot and the metric
families (gathered there, never read from another thread while the loop changes them).

Without a host (``:9464``) it listens on loopback only: the status names every queue and its
depth, which is nobody else's business unless the admin says so (``0.0.0.0:9464``). The socket
is bound before the file system is mounted, so a port already in use is one line of error and
no mount."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import trio
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from spoolfs import statuspage
from spoolfs.core.errors import UserError
from spoolfs.service import status

log = logging.getLogger(__name__)

#: how long a request waits for the event loop's snapshot before it is answered 503
SNAPSHOT_TIMEOUT_S = 30.0


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


Snapshot = tuple[dict[str, Any], list[Any]]
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        log.debug("metrics: %s " + format, self.address_string(), *args)


def make_app(fetch: Callable[[], Snapshot]) -> Callable[[dict[str, Any], StartResponse],
                                                          Iterable[bytes]]:
    """The WSGI application: ``fetch()`` returns the snapshot and its metric families."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _reply(start_response, "405 Method Not Allowed", "text/plain",
                          b"GET only\n", [("Allow", "GET, HEAD")])
        if path not in ("/", "/metrics", "/status"):
            return _reply(start_response, "404 Not Found", "text/plain",
                          b"/, /metrics or /status\n")
        try:
            snap, families = fetch()
        except (trio.RunFinishedError, trio.TooSlowError, trio.Cancelled) as e:
            return _reply(start_response, "503 Service Unavailable", "text/plain",
                          f"no status now: {type(e).__name__}\n".encode())
        if path == "/metrics":
            registry = CollectorRegistry(auto_describe=False)
            registry.register(status.Families(families))
            return make_wsgi_app(registry)(environ, start_response)  # type: ignore[no-any-return]
        if path == "/status":
            return _reply(start_response, "200 OK", "application/json",
                          json.dumps(snap, indent=1).encode() + b"\n")
        return _reply(start_response, "200 OK", "text/html; charset=utf-8",
                      statuspage.render(snap))

    return app


def _reply(start_response: StartResponse, code: str, ctype: str, body: bytes,
           extra: list[tuple[str, str]] | None = None) -> list[bytes]:
    start_response(code, [("Content-Type", ctype), ("Content-Length", str(len(body))),
                          ("Cache-Control", "no-store"), *(extra or [])])
    return [body]


def _server(sock: socket.socket, app: Any) -> WSGIServer:
    """A threading WSGI server on a socket bound already (before the mount)."""
    server = ThreadingWSGIServer(sock.getsockname()[:2], _Quiet, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    host, port = sock.getsockname()[:2]
    server.server_name, server.server_port = host, port
    server.setup_environ()
    server.set_app(app)
    return server


async def serve(socks: list[socket.socket], snapshot: Callable[[], Awaitable[dict[str, Any]]], *,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled (at unmount); the servers' threads end with it."""
    token = trio.lowlevel.current_trio_token()

    async def gather() -> Snapshot:
        with trio.fail_after(SNAPSHOT_TIMEOUT_S):
            snap = await snapshot()
        return snap, status.families(snap)

    app = make_app(lambda: trio.from_thread.run(gather, trio_token=token))
    servers = [_server(s, app) for s in socks]
    for server in servers:
        host, port = server.server_name, server.server_port
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                         name=f"metrics-http-{port}", daemon=True).start()
        log.info("metrics: serving http://%s/metrics",
                 f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    task_status.started()
    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            for server in servers:
                await trio.to_thread.run_sync(server.shutdown)
                server.server_close()
