"""A node's connections (p2p.node.connections.Connections), built on a bare libp2p host
without a node: lanes to a provider are capped, a stream that names no lane goes on the
control lane (rule 2), and a provider's circuit addresses are found where it is known only
by them. One real blob server over loopback answers the streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from blobstore import Store, blob_id_of
from p2p.blob.server import BlobServer
from p2p.blob.shell import BlobClient
from p2p.fetch.striping import StripeConfig
from p2p.node.connections import MAX_CONNECTIONS_PER_PROVIDER, Connections
from p2p.transport.host import build_host

LOOPBACK = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
DATA = b"served over every lane"
# Room for the lanes and the first connection, as the node makes (SWARM_CONNECTIONS_PER_PEER).
PER_PEER = MAX_CONNECTIONS_PER_PROVIDER + 2


@asynccontextmanager
async def seeder_and_fetcher(tmp_path: Path) -> AsyncIterator[tuple[str, Connections]]:
    """A blob server's address, and Connections on a host of their own."""
    store = Store.open(tmp_path / "seed")
    store.put_bytes(DATA)
    seeder = build_host(create_new_key_pair(), max_connections_per_peer=PER_PEER)
    BlobServer(store).install(seeder)
    fetcher = build_host(create_new_key_pair(), max_connections_per_peer=PER_PEER)
    async with seeder.run(listen_addrs=LOOPBACK), fetcher.run(listen_addrs=LOOPBACK):
        addr = f"{seeder.get_addrs()[0]}/p2p/{seeder.get_id()}"
        yield addr, Connections(fetcher, None, stripe=StripeConfig())


def connection_of(stream: Any) -> Any:
    return stream.stream.muxed_conn


async def test_lanes_are_capped_and_a_stream_with_no_lane_takes_the_control_lane(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        async with seeder_and_fetcher(tmp_path) as (addr, connections):
            peer = await connections.connect(addr)
            assert connections.connection_count(peer) == 1
            added = [
                await connections.add_connection(peer)
                for _ in range(MAX_CONNECTIONS_PER_PROVIDER + 1)
            ]
            assert added == [True] * MAX_CONNECTIONS_PER_PROVIDER + [False]
            assert connections.connection_count(peer) == 1 + MAX_CONNECTIONS_PER_PROVIDER
            bulk = [
                await connections.open_blob_stream_on(peer, lane)
                for lane in range(1, 2 + MAX_CONNECTIONS_PER_PROVIDER)
            ]
            lanes = {id(connection_of(s)) for s in bulk}
            assert len(lanes) == MAX_CONNECTIONS_PER_PROVIDER  # lanes 1 and n + 1: one
            assert connection_of(bulk[0]) is connection_of(bulk[-1])
            # py-libp2p alone would put the next stream on a connection with the most
            # streams, a bulk lane; a stream that names none goes on the first connection.
            control = await connections.open_blob_stream(peer)
            first = await connections.open_blob_stream_on(peer, 0)
            assert connection_of(control) is connection_of(first)
            assert id(connection_of(control)) not in lanes
            answer = await BlobClient(control).manifest(blob_id_of([DATA]))
            assert isinstance(answer, bytes)  # a real stream, answered


async def test_circuit_addresses_are_those_of_a_peer_not_connected_directly(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        async with seeder_and_fetcher(tmp_path) as (addr, connections):
            peer = await connections.connect(addr)
            assert connections.may_fetch_from(peer)  # a direct connection
            assert connections.circuit_addrs(peer) == []  # connected: nothing to punch
            natted = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
            relay = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
            circuit = f"/ip4/10.0.0.1/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{natted}"
            connections.host.get_peerstore().add_addrs(
                ID.from_base58(natted),
                [Multiaddr(circuit), Multiaddr("/ip4/192.168.1.5/tcp/4001")],
                3600,
            )
            assert connections.circuit_addrs(natted) == [circuit]
            assert connections.may_fetch_from(natted)  # not connected: ask it once reached
