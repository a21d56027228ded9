"""Silent sockets and idle connections must not lock a real peer out.

py-libp2p 0.8.1 counts handshaking sockets against one slot counter, waits 10 s for a
handshake and never gives a slot back; ``p2p.transport.host.InboundGate`` replaces it. The unit
tests drive the gate's bookkeeping directly; the others run a real host over TCP on 127.0.0.1,
with flooders binding other loopback addresses (127.0.0.2, 127.0.0.3) so they count as
other machines.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from blobstore import Store
from p2p.blob import messages
from p2p.blob.server import BlobServer
from p2p.blob.shell import BlobClient
from p2p.transport import host as host_mod
from p2p.transport.host import InboundGate, address_key, build_host

PROTOCOL = TProtocol(messages.Version.V1_0.protocol_id)


# --- The gate's bookkeeping ---------------------------------------------------------------


def never_dropped() -> None:
    raise AssertionError("this handshake must not be dropped")


def test_pending_handshakes_per_address_are_capped() -> None:
    gate = InboundGate(max_pending=100, max_pending_per_ip=2)
    assert gate.admit("10.0.0.1", 0.0, never_dropped).token is not None
    assert gate.admit("10.0.0.1", 0.0, never_dropped).token is not None
    refused = gate.admit("10.0.0.1", 0.0, never_dropped)
    assert refused.token is None
    assert "10.0.0.1" in refused.reason
    # Another address is unaffected.
    assert gate.admit("10.0.0.2", 0.0, never_dropped).token is not None


def test_full_pending_table_drops_the_oldest_socket_of_the_busiest_address() -> None:
    gate = InboundGate(max_pending=3, max_pending_per_ip=10)
    dropped: list[str] = []
    gate.admit("flood", 1.0, lambda: dropped.append("flood-1"))
    gate.admit("flood", 2.0, lambda: dropped.append("flood-2"))
    gate.admit("peer", 0.5, lambda: dropped.append("peer"))
    admission = gate.admit("newcomer", 3.0, never_dropped)
    assert admission.token is not None
    # The peer's socket is older, but the flooder's address holds the most slots.
    assert dropped == ["flood-1"]
    assert len(gate.pending) == 3
    assert gate.pending_per_ip == {"flood": 1, "peer": 1, "newcomer": 1}


def test_handshake_slot_is_given_back() -> None:
    gate = InboundGate(max_pending=1, max_pending_per_ip=1)
    for _ in range(1000):  # py-libp2p's own counter ran out after 250 in a node's life
        admission = gate.admit("10.0.0.1", 0.0, never_dropped)
        assert admission.token is not None
        gate.handshake_over(admission.token)
        gate.connected(admission.token, "10.0.0.1", 0.0)
        gate.disconnected(admission.token)
    assert not gate.pending and not gate.established
    assert not gate.pending_per_ip and not gate.established_per_ip


def test_crowded_address_evicts_only_idle_connections_old_enough() -> None:
    gate = InboundGate(max_per_ip=3, high_watermark=100, idle_evict_age=2.0)
    streams = {1: 2, 2: 0, 3: 0}
    gate.connected(1, "a", 0.0)  # busy: has streams
    gate.connected(2, "a", 5.0)  # idle, but only 1 s old at t=6
    gate.connected(3, "a", 1.0)  # idle and old: the victim
    assert gate.room_needed("b") is None
    assert gate.room_needed("a") == "a"
    assert gate.idle_victim("a", 6.0, streams.__getitem__) == 3
    streams[3] = 1
    assert gate.idle_victim("a", 6.0, streams.__getitem__) is None


def test_global_watermark_evicts_from_the_address_with_most_connections() -> None:
    gate = InboundGate(max_per_ip=100, high_watermark=3)
    gate.connected(1, "a", 0.0)
    gate.connected(2, "b", 0.0)
    gate.connected(3, "b", 0.0)
    assert gate.room_needed("c") == "b"


@pytest.mark.parametrize(
    ("ip", "key"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("2001:db8:0:7::1", "2001:db8:0:7::/64"),
        ("2001:db8:0:7:ffff:ffff:ffff:ffff", "2001:db8:0:7::/64"),  # same /64: one source
        ("::ffff:10.1.2.3", "10.1.2.3"),  # IPv4-mapped: the IPv4 address
    ],
)
def test_per_address_limits_count_an_ipv6_source_by_its_64(ip: str, key: str) -> None:
    assert address_key(ip) == key


def test_build_host_configures_libp2p_limits_on_purpose() -> None:
    host = build_host(create_new_key_pair(), fast=False, max_connections_per_peer=5)
    config = host.get_network().connection_config
    assert config.max_connections_per_peer == 5
    assert config.inbound_upgrade_timeout == host_mod.HANDSHAKE_TIMEOUT
    assert config.max_connections == host_mod.MAX_CONNECTIONS
    assert config.high_watermark == host_mod.CONN_HIGH_WATERMARK
    assert config.min_connections == 0  # no auto-dialling to keep a minimum
    assert build_host(
        create_new_key_pair()
    ).get_network().connection_config.max_connections_per_peer == (
        host_mod.MAX_CONNECTIONS_PER_PEER
    )


# --- Real sockets -------------------------------------------------------------------------


@asynccontextmanager
async def blob_server(
    tmp_path: Path,
    gate: InboundGate | None = None,
    handshake_timeout: float = host_mod.HANDSHAKE_TIMEOUT,
) -> AsyncIterator[Any]:
    store = Store.open(tmp_path / "server-store")
    blob_id = store.put_bytes(b"x" * 300_000)
    host = build_host(
        create_new_key_pair(), fast=False, gate=gate, handshake_timeout=handshake_timeout
    )
    host.set_stream_handler(PROTOCOL, BlobServer(store).handle_stream)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        host.blob_id = blob_id
        yield host


def server_port(host: Any) -> int:
    return int(str(host.get_addrs()[0]).split("/")[4])


async def fetch_manifest(server: Any, deadline: float = 20.0) -> bytes | messages.ErrorResponse:
    client = build_host(create_new_key_pair(), fast=False)
    async with client.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        with trio.fail_after(deadline):
            addr = Multiaddr(f"{server.get_addrs()[0]}/p2p/{server.get_id()}")
            await client.connect(info_from_p2p_addr(addr))
            stream = await client.new_stream(server.get_id(), [PROTOCOL])
            reply = await BlobClient(stream).manifest(server.blob_id)
        await client.get_network().close_peer(server.get_id())
        return reply


async def until(predicate: Callable[[], bool]) -> None:
    """Until ``predicate()`` holds; the caller bounds the wait with ``trio.fail_after``.
    The gate is sans-IO and signals nothing, so this polls it."""
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(0.01)


async def silent_sockets(port: int, source: str, count: int) -> list[trio.SocketStream]:
    sockets = []
    for _ in range(count):
        sockets.append(await trio.open_tcp_stream("127.0.0.1", port, local_address=source))
    return sockets


@pytest.mark.parametrize("flooders", [1, 2], ids=["one-address", "two-addresses"])
@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_silent_sockets_do_not_lock_out_a_real_peer(tmp_path: Path, flooders: int) -> None:
    """600 sockets that connect and never handshake (py-libp2p alone admits 512, then
    refuses everyone): the peer that does handshake is still served at once."""
    gate = InboundGate()
    async with blob_server(tmp_path, gate) as server:
        port = server_port(server)
        held = []
        for n in range(flooders):
            held += await silent_sockets(port, f"127.0.0.{2 + n}", 600 // flooders)
        # Every silent socket reached its turn to handshake (rule 6: then the gate, or held
        # for a later turn, or closed).
        with trio.fail_after(30):
            await until(lambda: gate.pacer.arrived >= 600)
        try:
            start = trio.current_time()
            reply = await fetch_manifest(server, deadline=10.0)
            assert isinstance(reply, bytes)
            assert trio.current_time() - start < 5.0
        finally:
            for sock in held:
                await sock.aclose()


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_silent_socket_is_dropped_at_the_handshake_deadline(tmp_path: Path) -> None:
    gate = InboundGate()
    async with blob_server(tmp_path, gate, handshake_timeout=1.0) as server:
        (sock,) = await silent_sockets(server_port(server), "127.0.0.2", 1)
        start = trio.current_time()
        with trio.fail_after(10):
            # The server offers multistream-select, then hears nothing and closes.
            while data := await sock.receive_some(100):
                assert data.startswith(b"\x13/multistream/")
        assert 0.9 < trio.current_time() - start < 3.0
        with trio.fail_after(10):
            await until(lambda: not gate.pending)  # the handler's own clean-up
        await sock.aclose()


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_idle_connections_make_room_for_a_new_peer(tmp_path: Path) -> None:
    """An address at its connection cap (here 3, the real one is 128) evicts an idle
    connection for a newcomer, never one with an open stream; the slots come back when
    peers leave."""
    gate = InboundGate(max_per_ip=3, idle_evict_age=0.2)
    async with blob_server(tmp_path, gate) as server:
        addr = Multiaddr(f"{server.get_addrs()[0]}/p2p/{server.get_id()}")
        async with trio.open_nursery() as nursery:
            clients = []
            for _ in range(3):
                client = build_host(create_new_key_pair(), fast=False)
                await nursery.start(run_host, client)
                await client.connect(info_from_p2p_addr(addr))
                clients.append(client)
            # The first client holds a stream open (a request in progress): not idle.
            busy = await clients[0].new_stream(server.get_id(), [PROTOCOL])
            await busy.write(b"\0")

            def three_old_enough() -> bool:  # established, and idle long enough to go
                now = trio.current_time()
                ages = [now - conn.since for conn in gate.established.values()]
                return len(ages) == 3 and min(ages) >= gate.idle_evict_age

            with trio.fail_after(10):
                await until(three_old_enough)
            reply = await fetch_manifest(server, deadline=10.0)
            assert isinstance(reply, bytes)
            assert gate.evicted == 1
            # The busy client kept its connection.
            assert server.get_network().get_connections(clients[0].get_id())
            nursery.cancel_scope.cancel()


async def run_host(host: Any, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        task_status.started()
        await trio.sleep_forever()
