"""What other peers may store in this node's DHT provider records (p2p.transport.providers).

py-libp2p 0.8.1 kept every address of every ADD_PROVIDER for 48 h: 4 identities x 10
messages naming themselves with 400,000 addresses each took a node from 94 to 1,847 MiB.
The unit tests drive the guard's bookkeeping; the last test sends such messages (smaller:
5,000 addresses each) to a real node over TCP and reads what it kept.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import varint
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from blobstore import Store
from p2p.node.node import open_node
from p2p.transport.host import build_host
from p2p.transport.providers import ProviderGuard, ProviderLimits, usable_address

KAD = TProtocol("/ipfs/kad/1.0.0")


def addrs(n: int, start: int = 1) -> list[Multiaddr]:
    return [
        Multiaddr(f"/ip4/10.0.{i // 250}.{i % 250 + 1}/tcp/4001") for i in range(start, start + n)
    ]


@pytest.mark.parametrize(
    ("addr", "usable"),
    [
        ("/ip4/10.1.2.3/tcp/4001", True),
        ("/ip4/127.0.0.1/tcp/4001", True),  # one machine, several nodes: still dialable
        ("/ip6/2001:db8::1/udp/4001/quic-v1", True),
        ("/dns4/example.org/tcp/4001", True),
        ("/ip4/0.0.0.0/tcp/4001", False),
        ("/ip4/224.0.0.1/tcp/4001", False),
        ("/ip4/255.255.255.255/tcp/4001", False),
        ("/ip6/::/tcp/4001", False),
        ("/ip4/10.1.2.3", False),  # no transport
        ("/unix/tmp/x.sock", False),
    ],
)
def test_only_dialable_routable_addresses_are_kept(addr: str, usable: bool) -> None:
    assert usable_address(Multiaddr(addr)) is usable


def test_a_record_keeps_a_few_addresses() -> None:
    guard = ProviderGuard(ProviderLimits(max_addrs_per_record=8))
    decision = guard.admit(b"k", "flooder", addrs(400), 0.0)
    assert decision.addrs is not None and len(decision.addrs) == 8
    assert guard.bytes < 1024
    assert guard.admit(b"k2", "flooder", [Multiaddr("/ip4/0.0.0.0/tcp/1")], 0.0).addrs is None


def test_one_identity_adds_at_most_its_rate_a_minute() -> None:
    guard = ProviderGuard(ProviderLimits(adds_per_minute=10))
    for n in range(10):
        assert guard.admit(bytes([n]), "p", addrs(1), 0.0).addrs is not None
    assert guard.admit(b"late", "p", addrs(1), 30.0).addrs is None
    assert guard.admit(b"later", "p", addrs(1), 61.0).addrs is not None


def test_a_full_store_drops_the_greediest_identitys_oldest_record() -> None:
    guard = ProviderGuard(ProviderLimits(max_records=10, adds_per_minute=1000))
    for n in range(8):
        guard.admit(bytes([n]), "greedy", addrs(1), float(n))
    guard.admit(b"a", "light", addrs(1), 10.0)
    guard.admit(b"b", "light", addrs(1), 11.0)
    decision = guard.admit(b"new", "newcomer", addrs(1), 12.0)
    assert decision.addrs is not None
    assert decision.drop == [(bytes([0]), "greedy")]
    assert guard.by_peer == {"greedy": 7, "light": 2, "newcomer": 1}
    # The greedy identity cannot push the others out in turn.
    assert guard.admit(b"more", "greedy", addrs(1), 13.0).addrs is None


def test_records_are_forgotten_when_they_expire_and_local_ones_always_fit() -> None:
    guard = ProviderGuard(ProviderLimits(max_records=2, record_ttl=100.0), local="me")
    guard.admit(b"a", "p", addrs(1), 0.0)
    guard.admit(b"b", "q", addrs(1), 50.0)
    assert guard.admit(b"c", "r", addrs(1), 60.0).addrs is None
    assert guard.admit(b"c", "r", addrs(1), 101.0).addrs is not None  # a's record expired
    assert guard.admit(b"mine", "me", [Multiaddr("/ip4/0.0.0.0/tcp/1")], 102.0).addrs
    assert (b"mine", "me") in guard.records


async def add_provider(host: object, node_id: object, key: bytes, addresses: int) -> None:
    message = Message()
    message.type = Message.MessageType.ADD_PROVIDER
    message.key = key
    peer = message.providerPeers.add()
    peer.id = host.get_id().to_bytes()  # type: ignore[attr-defined]
    peer.addrs.extend(a.to_bytes() for a in addrs(addresses))
    data = message.SerializeToString()
    assert len(data) < 4 * 1024 * 1024
    stream = await host.new_stream(node_id, [KAD])  # type: ignore[attr-defined]
    await stream.write(varint.encode(len(data)) + data)
    with trio.move_on_after(10):
        await stream.read(1024)  # the echo
    await stream.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_flood_of_addresses_is_not_stored(tmp_path: Path) -> None:
    """4 identities x 2 ADD_PROVIDERs naming themselves with 5,000 addresses each: the node
    keeps 8 per record, and a legitimate provider's record is still taken."""
    store = Store.open(tmp_path / "store")
    async with open_node(store, listen=("/ip4/127.0.0.1/tcp/0",), dht=True) as node:
        kad = node.dht
        addr = Multiaddr(f"{node.host.get_addrs()[0]}/p2p/{node.host.get_id()}")
        flooders = [build_host(create_new_key_pair(), fast=False) for _ in range(4)]
        async with trio.open_nursery() as nursery:
            for flooder in flooders:
                await nursery.start(run_host, flooder)
                await flooder.connect(info_from_p2p_addr(addr))
            for n in range(2):
                for i, flooder in enumerate(flooders):
                    await add_provider(flooder, node.host.get_id(), bytes([i, n]) * 16, 5_000)
            legit = build_host(create_new_key_pair(), fast=False)
            await nursery.start(run_host, legit)
            await legit.connect(info_from_p2p_addr(addr))
            await add_provider(legit, node.host.get_id(), b"legit" * 8, 2)
            nursery.cancel_scope.cancel()
        records = kad.provider_store.providers
        kept = [len(r.addresses) for held in records.values() for r in held.values()]
        assert kept and max(kept) <= 8
        assert str(legit.get_id()) in records[b"legit" * 8]


async def run_host(
    host: object, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):  # type: ignore[attr-defined]
        task_status.started()
        await trio.sleep_forever()
