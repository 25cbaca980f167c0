"""The suite's own servers start on ports nothing else holds: one whose port a listener took
between the choice and the server's bind starts again on others (the first start only, for
PostgreSQL: a restart keeps the port its clients know)."""

from __future__ import annotations

import socket

import pytest

from helpers.pgserver import PgServer
from helpers.ports import RESERVED, _ephemeral_start, free_port
from helpers.s3server import GRPC_OFFSET, S3Server


def _hold(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_free_ports_are_below_the_ephemeral_range_with_their_twins() -> None:
    for _ in range(50):
        port = free_port(GRPC_OFFSET)
        assert port >= 1024 and port + GRPC_OFFSET < _ephemeral_start()
        assert not {port, port + GRPC_OFFSET} & RESERVED  # (the NFS server's)


def test_an_s3_server_whose_port_was_taken_starts_on_another() -> None:
    server = S3Server()
    taken = server.ports["s3"]
    with _hold(taken):
        try:
            server.start()
            assert server.ports["s3"] != taken
            assert server.client().list_buckets()["Buckets"] == []  # type: ignore[attr-defined]
        finally:
            server.close()


def test_a_postgresql_server_whose_port_was_taken_starts_on_another() -> None:
    server = PgServer()
    taken = server.port
    with _hold(taken):
        try:
            server.start()
            assert server.port != taken
            server.new_database()
            server.stop()
            server.start()  # its second start keeps the port
            assert server.port != taken and server.running()
        finally:
            server.close()


def test_the_nfs_servers_ports_are_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NFS server of the suite takes 2049 (and 20048) by number: a port, or a twin,
    drawn there is passed over even while it is free."""
    import helpers.ports as ports

    drawn = iter([2049, 20048 - GRPC_OFFSET, 3001])
    monkeypatch.setattr(ports.random, "randint", lambda a, b: next(drawn))
    monkeypatch.setattr(ports, "_is_free", lambda port: True)
    assert free_port(GRPC_OFFSET) == 3001
