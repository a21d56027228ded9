"""Hostile requests against a real ``blob serve`` process: each gets a clear error or a
reset, memory stays bounded, and other peers are still served."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.server import MAX_STREAMS_PER_PEER
from p2p.blob.shell import BlobClient
from p2p.transport.host import build_host

from .conftest import Cluster, NodeProcess, random_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(240),
    # py-libp2p 0.8.1's host leaves its TCP sockets to the garbage collector on shutdown.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

PROTOCOL = TProtocol(messages.Version.V1_0.protocol_id)


@asynccontextmanager
async def client_host(server: NodeProcess) -> AsyncIterator[Any]:
    host = build_host(create_new_key_pair(), fast=False)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        await host.connect(info_from_p2p_addr(Multiaddr(server.addr)))
        yield host


def frame(header: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


async def reply_or_reset(stream: Any) -> messages.Response | None:
    """The server's error reply, or None when it reset the stream without one."""
    client = proto.ClientConnection()
    # A dummy request lets the client-side parser accept the error reply.
    client.send_request(messages.ManifestRequest("00" * 32))
    with trio.fail_after(20):
        while True:
            try:
                data = await stream.read(65536)
            except Exception:
                return None
            client.receive_data(data)
            event = client.next_event()
            if event is not None or not data:
                return event


async def stream_is_dead(stream: Any) -> bool:
    with trio.fail_after(20):
        try:
            data = await stream.read(65536)
        except Exception:
            return True
        return data == b""


@pytest.fixture
def served(cluster: Cluster, tmp_path: Path) -> tuple[NodeProcess, str]:
    blob_id = cluster.put("a", random_file(tmp_path / "blob", 2 * 1024 * 1024))
    return cluster.serve("a"), blob_id


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        pytest.param(struct.pack(">I", 2**31), messages.ErrorCode.TOO_LARGE, id="oversized-prefix"),
        pytest.param(frame({"t": "launch", "id": b"\0" * 32}), None, id="unknown-type"),
        pytest.param(
            frame({"t": "get", "id": b"\0" * 32, "r": [[i * 2, i * 2 + 1] for i in range(65)]}),
            None,
            id="too-many-ranges",
        ),
    ],
)
async def test_malformed_request_gets_error_and_reset(
    served: tuple[NodeProcess, str], payload: bytes, code: messages.ErrorCode | None
) -> None:
    server, _ = served
    async with client_host(server) as host:
        stream = await host.new_stream(
            info_from_p2p_addr(Multiaddr(server.addr)).peer_id, [PROTOCOL]
        )
        await stream.write(payload)
        reply = await reply_or_reset(stream)
        assert isinstance(reply, messages.ErrorResponse)
        assert (
            reply.code in (code,)
            if code
            else reply.code
            in (
                messages.ErrorCode.BAD_REQUEST,
                messages.ErrorCode.TOO_LARGE,
            )
        )
        assert await stream_is_dead(stream)


async def test_unknown_blob_is_not_found_and_stream_stays_usable(
    served: tuple[NodeProcess, str],
) -> None:
    server, blob_id = served
    async with client_host(server) as host:
        peer = info_from_p2p_addr(Multiaddr(server.addr)).peer_id
        client = BlobClient(await host.new_stream(peer, [PROTOCOL]))
        with trio.fail_after(20):
            reply = await client.manifest("ab" * 32)
            assert isinstance(reply, messages.ErrorResponse)
            assert reply.code == messages.ErrorCode.NOT_FOUND
            manifest = await client.manifest(blob_id)
        assert isinstance(manifest, bytes)


async def test_stream_flood_is_capped_and_others_still_served(
    served: tuple[NodeProcess, str],
) -> None:
    server, blob_id = served
    rss_before = server.rss_kib()
    peer = info_from_p2p_addr(Multiaddr(server.addr)).peer_id
    flood = MAX_STREAMS_PER_PEER + 24
    async with client_host(server) as flooder:
        streams = []
        with trio.fail_after(60):
            for _ in range(flood):
                streams.append(await flooder.new_stream(peer, [PROTOCOL]))
            # The first streams send one byte of a request, so the server holds them open.
            for stream in streams[:MAX_STREAMS_PER_PEER]:
                await stream.write(b"\0")
            refused = 0
            for stream in streams[MAX_STREAMS_PER_PEER:]:
                reply = await reply_or_reset(stream)
                busy = (
                    isinstance(reply, messages.ErrorResponse)
                    and reply.code == messages.ErrorCode.BUSY
                )
                if busy or (reply is None and await stream_is_dead(stream)):
                    refused += 1
        assert refused == flood - MAX_STREAMS_PER_PEER

        # Another peer is served normally while the flood is held open.
        async with client_host(server) as other:
            client = BlobClient(await other.new_stream(peer, [PROTOCOL]))
            with trio.fail_after(30):
                manifest = await client.manifest(blob_id)
            assert isinstance(manifest, bytes)
    assert server.rss_kib() - rss_before < 64 * 1024
