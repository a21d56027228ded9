"""Bytes on the wire are counted at the sockets (the update blobs alone are a seventh of the
traffic)."""

from __future__ import annotations

import socket
import sys

import pytest

from p2p.transport.meter import WireMeter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO is Linux")


def test_meter_counts_both_directions_and_keeps_closed_sockets() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    meter = WireMeter()
    before = meter.sample()
    with server, socket.create_connection(server.getsockname()) as client:
        peer, _ = server.accept()
        with peer:
            client.sendall(b"x" * 100_000)
            got = 0
            while got < 100_000:
                got += len(peer.recv(65536))
            peer.sendall(b"y" * 5_000)
            assert len(client.recv(10_000)) > 0
            sent, received = meter.sample()
    # Both ends are in this process: each byte is sent by one socket and received by the
    # other (a sender counts what the peer acknowledged, so it may lag a moment).
    assert received - before[1] == 105_000
    assert 0 < sent - before[0] <= 105_000
    # Closed sockets keep their counts.
    assert meter.sample()[1] >= received
