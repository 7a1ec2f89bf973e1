"""check_can_listen (shared/http.py): the check a server makes of its address before it builds and joins its stage."""

from __future__ import annotations

import socket

import pytest

from shared.http import check_can_listen
from shared.processes import free_port


def test_a_free_port_and_port_0_pass():
    check_can_listen("127.0.0.1", free_port())
    check_can_listen("127.0.0.1", 0)


def test_a_port_another_socket_listens_on_is_refused_naming_swarm_port():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(ValueError, match=rf"cannot listen on 127\.0\.0\.1:{port}: .*set SWARM_PORT"):
            check_can_listen("127.0.0.1", port)


def test_a_port_whose_last_server_left_connections_in_time_wait_passes():
    """As asyncio's servers bind (SO_REUSEADDR): a server restarted at once gets its port."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server's side closes first: its end waits in TIME_WAIT
            assert client.recv(1) == b""
    with socket.socket() as plain, pytest.raises(OSError):  # the case is real: a bind without the option fails
        plain.bind(("127.0.0.1", port))
    check_can_listen("127.0.0.1", port)


def test_an_address_not_of_this_machine_is_refused_naming_swarm_host():
    with pytest.raises(ValueError, match=r"cannot listen on 192\.0\.2\.1:8100: .*SWARM_HOST must be an address"):
        check_can_listen("192.0.2.1", 8100)  # TEST-NET-1: no machine's address
