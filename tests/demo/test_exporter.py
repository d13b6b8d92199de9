"""The demo's check that its exporter port is free."""

from __future__ import annotations

import socket

from support import free_port

from ampscope.demo.exporter import _port_is_free


def test_a_listening_port_is_taken_and_time_wait_leftovers_are_not() -> None:
    port = free_port()
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    assert not _port_is_free(port), "a listener holds it"
    # The server side closes first, as an exporter shutting down does: its end of the
    # connection lingers in TIME_WAIT on this port after the listener is gone.
    accepted.close()
    server.close()
    client.close()
    assert _port_is_free(port), "only lingering connections remain; uvicorn could bind"
