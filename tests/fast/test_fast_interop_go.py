"""Interop with go-libp2p (hivemind's p2pd daemon) with blobnet's fast path on.

Each test starts one p2pd on loopback and one blobnet host, and checks that the connection
really runs our Noise and yamux (not py-libp2p's), then echoes payloads byte-exact over streams
opened from both sides: a 5 KB one and a 16 MiB one, which needs many window updates each way.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from fast_helpers import (
    ECHO,
    Pipe,
    assert_fast,
    echo_roundtrip,
    libp2p_echo_handler,
    make_host,
    muxed_conn_to,
    running,
    serve_echo,
    wait_connected,
)
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from p2pd_client import DaemonClient, StreamInfo, run_daemon

from p2p.transport.fast import FastYamuxStream

pytestmark = pytest.mark.slow

SIZES = (5000, 16 * 1024 * 1024)


async def _go_echo_handler(info: StreamInfo, conn: object) -> None:
    await serve_echo(Pipe.of_daemon(conn))


async def _echo_both_ways(host: object, daemon: DaemonClient, go_id: ID) -> None:
    """Streams opened by blobnet to go, then by go to blobnet, each echoing every size."""
    for size in SIZES:
        payload = os.urandom(size)
        stream = await host.new_stream(go_id, [ECHO])  # type: ignore[attr-defined]
        assert isinstance(stream.muxed_stream, FastYamuxStream)
        assert await echo_roundtrip(Pipe.of_libp2p(stream), payload) == payload
        await stream.close()
    for size in SIZES:
        payload = os.urandom(size)
        info, conn = await daemon.stream_open(host.get_id().to_bytes(), [ECHO])  # type: ignore[attr-defined]
        assert info.proto == ECHO
        try:
            assert await echo_roundtrip(Pipe.of_daemon(conn), payload) == payload
        finally:
            await conn.aclose()


async def test_go_dials_blobnet_fast_path(p2pd_binary: Path, short_dir: Path) -> None:
    host = make_host("fast")
    host.set_stream_handler(ECHO, libp2p_echo_handler)
    with trio.fail_after(40):
        async with (
            run_daemon(p2pd_binary, short_dir) as daemon,
            running(host),
            daemon.stream_handler(short_dir / "h.sock", [ECHO], _go_echo_handler),
        ):
            go_raw_id, _ = await daemon.identify()
            go_id = ID(go_raw_id)
            await daemon.connect(host.get_id().to_bytes(), host.get_addrs())
            muxed = await wait_connected(host, go_id)
            assert_fast(muxed)
            assert not muxed.is_initiator, "go dialled, so blobnet must be the responder"
            await _echo_both_ways(host, daemon, go_id)


async def test_blobnet_dials_go_fast_path(p2pd_binary: Path, short_dir: Path) -> None:
    host = make_host("fast")
    host.set_stream_handler(ECHO, libp2p_echo_handler)
    with trio.fail_after(40):
        async with (
            run_daemon(p2pd_binary, short_dir) as daemon,
            running(host),
            daemon.stream_handler(short_dir / "h.sock", [ECHO], _go_echo_handler),
        ):
            go_raw_id, go_addrs = await daemon.identify()
            go_id = ID(go_raw_id)
            tcp_addrs = [a for a in go_addrs if "/tcp/" in str(a)]
            await host.connect(PeerInfo(go_id, tcp_addrs))
            muxed = muxed_conn_to(host, go_id)
            assert_fast(muxed)
            assert muxed.is_initiator
            await _echo_both_ways(host, daemon, go_id)
