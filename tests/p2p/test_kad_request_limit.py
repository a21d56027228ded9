"""Oversized Kademlia requests are refused before they are read or parsed
(p2p.transport.patches.limit_kad_requests, installed with the provider guard).

Regression: py-libp2p reads each inbound request of up to 4 MiB whole and parses it, so an
ADD_PROVIDER naming 400,000 addresses cost the node a protobuf object per address before
the provider guard kept 8 of them. Driven through the DHT's real handler over an in-memory
stream: a request is refused when the stream is reset having given up nothing past the
length prefix.
"""

from __future__ import annotations

import struct
from typing import Any

import trio
import varint
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Message

from p2p.transport import patches
from p2p.transport.host import build_host
from p2p.transport.providers import ProviderLimits, install_provider_guard


def add_provider(peer_id: Any, key: bytes, addresses: int) -> bytes:
    """A varint-prefixed ADD_PROVIDER naming ``peer_id`` at ``addresses`` addresses."""
    message = Message()
    message.type = Message.MessageType.ADD_PROVIDER
    message.key = key
    peer = message.providerPeers.add()
    peer.id = peer_id.to_bytes()
    # /ip4/10.x.x.x/tcp/4001 as bytes: 0x04 + 4 bytes, 0x06 + 2 bytes.
    peer.addrs.extend(
        b"\x04" + struct.pack(">I", 0x0A000000 + i) + b"\x06" + struct.pack(">H", 4001)
        for i in range(addresses)
    )
    data = message.SerializeToString()
    return bytes(varint.encode(len(data))) + data


class Conn:
    def __init__(self, peer_id: Any) -> None:
        self.peer_id = peer_id


class KadStream:
    """The server's end of an inbound Kademlia stream: ``data`` arrives in reads of at
    most what the reader asks for; counts what was taken and how the stream ended."""

    def __init__(self, peer_id: Any, data: bytes) -> None:
        self.muxed_conn = Conn(peer_id)
        self.data = data
        self.taken = 0
        self.was_reset = False
        self.written = b""
        self.metric_send_channel = None

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        n = len(self.data) - self.taken if n is None else n
        out = self.data[self.taken : self.taken + n]
        self.taken += len(out)
        return out

    async def write(self, data: bytes) -> None:
        self.written += bytes(data)

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        self.was_reset = True


def dht() -> KadDHT:
    kad = KadDHT(build_host(create_new_key_pair(), fast=False), DHTMode.SERVER)
    install_provider_guard(kad, ProviderLimits(), local=str(kad.host.get_id()))
    return kad


async def test_an_add_provider_of_400000_addresses_is_refused_unread() -> None:
    kad = dht()
    flooder = create_new_key_pair()
    from libp2p.peer.id import ID

    peer_id = ID.from_pubkey(flooder.public_key)
    request = add_provider(peer_id, b"k" * 32, 400_000)
    assert len(request) > 3 * 1024 * 1024  # under py-libp2p's own 4 MiB limit
    stream = KadStream(peer_id, request)
    with trio.fail_after(10):
        await kad.handle_stream(stream)
    assert stream.was_reset
    assert stream.taken <= 10  # the length prefix, and nothing of the body
    assert not kad.provider_store.providers


async def test_requests_under_the_limit_pass_one_after_another() -> None:
    """Two requests on one stream, each under the limit, are both taken: the framing is
    followed across requests, and a request's addresses are still capped by the guard."""
    kad = dht()
    from libp2p.peer.id import ID

    peer_id = ID.from_pubkey(create_new_key_pair().public_key)
    first = add_provider(peer_id, b"a" * 32, 2)
    second = add_provider(peer_id, b"b" * 32, 5_000)
    assert len(second) < patches.MAX_KAD_REQUEST_BYTES
    stream = KadStream(peer_id, first + second)
    with trio.fail_after(10):
        await kad.handle_stream(stream)
    assert not stream.was_reset
    assert stream.taken == len(first) + len(second)
    records = kad.provider_store.providers
    assert set(records) == {b"a" * 32, b"b" * 32}
    assert len(records[b"b" * 32][str(peer_id)].addresses) <= 8
