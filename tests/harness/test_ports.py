"""The dev cluster's components listen on ports no outgoing connection can hold first."""

from __future__ import annotations

import socket

from lorajob_devcluster import process


def test_component_ports_are_free_and_below_the_ephemeral_range():
    ephemeral_from = int(process.EPHEMERAL_RANGE.read_text().split()[0])
    ports = {process.free_loopback_port() for _ in range(20)}
    assert all(process.LOWEST_PORT <= port < ephemeral_from for port in ports), sorted(ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", port))
