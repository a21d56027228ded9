"""A handshake that does not finish must give its resource-manager slot back.

py-libp2p 0.8.1 releases an upgrade's connection scope only after awaiting the
connection's close, so an upgrade ended by cancellation kept its slot for good; after 512
(``MAX_CONNECTIONS``) every new connection was refused ("Connection denied by resource
manager (pre-upgrade admission)") until restart. A 3-second burst of silent sockets from
40 addresses did it. These tests flood a real host over TCP on loopback (flooders bind
127.0.0.x so they count as other machines) with handshakes dropped by the gate, timed out,
half done (Noise finished, muxer never negotiated) and, for dials, abandoned by their
caller, then wait until the manager's connection count is back at its baseline. The same
host builder serves a relay, so one test runs the relay service on it.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from blobstore import Store
from p2p.blob import messages
from p2p.blob.server import BlobServer
from p2p.blob.shell import BlobClient
from p2p.transport.host import InboundGate, build_host, resource_connections

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(90),
    # py-libp2p 0.8.1 leaves dropped handshakes' sockets to the garbage collector.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

PROTOCOL = TProtocol(messages.Version.V1_0.protocol_id)
# Short enough that a flood of timed-out handshakes ends in a second or two.
HANDSHAKE_TIMEOUT = 0.5
# How long the count may take to come back after the last flooder is gone.
SETTLE = 10.0


async def wait_for(predicate: Any, limit: float, what: str) -> None:
    with trio.move_on_after(limit):
        while not predicate():  # noqa: ASYNC110 - polling a plain counter, bounded
            await trio.sleep(0.05)
        return
    raise AssertionError(f"{what} after {limit} s")


async def settled(host: Any, gate: InboundGate, baseline: int) -> None:
    """The gate has no handshake left and the manager counts what it counted before."""
    await wait_for(
        lambda: not gate.pending and resource_connections(host) == baseline,
        SETTLE,
        f"resource manager holds {resource_connections(host)} connections, "
        f"baseline {baseline}, {len(gate.pending)} handshakes pending",
    )


@asynccontextmanager
async def served_host(tmp_path: Path, gate: InboundGate) -> AsyncIterator[Any]:
    store = Store.open(tmp_path / "server-store")
    blob_id = store.put_bytes(b"x" * 100_000)
    host = build_host(create_new_key_pair(), gate=gate, handshake_timeout=HANDSHAKE_TIMEOUT)
    host.set_stream_handler(PROTOCOL, BlobServer(store).handle_stream)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        host.blob_id = blob_id
        yield host


def port_of(host: Any) -> int:
    return int(str(host.get_addrs()[0]).split("/")[4])


async def fetch_manifest(server: Any) -> None:
    """A legitimate peer from an address no flooder used is served within 5 s."""
    client = build_host(create_new_key_pair())
    async with client.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        with trio.fail_after(5.0):
            addr = Multiaddr(f"{server.get_addrs()[0]}/p2p/{server.get_id()}")
            await client.connect(info_from_p2p_addr(addr))
            stream = await client.new_stream(server.get_id(), [PROTOCOL])
            assert isinstance(await BlobClient(stream).manifest(server.blob_id), bytes)
        await client.get_network().close_peer(server.get_id())


async def silent_burst(port: int, addresses: int, per_address: int, hold: float) -> None:
    """``addresses`` x ``per_address`` sockets that connect and never speak, held ``hold``
    seconds (or until the server closes them)."""

    async def one(source: str) -> None:
        try:
            sock = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
        except OSError:
            return
        async with sock:
            with trio.move_on_after(hold):
                try:
                    while await sock.receive_some(4096):
                        pass
                except trio.BrokenResourceError:
                    pass

    async with trio.open_nursery() as nursery:
        for a in range(addresses):
            for _ in range(per_address):
                nursery.start_soon(one, f"127.0.0.{10 + a}")


async def test_handshakes_the_gate_drops_give_their_slots_back(tmp_path: Path) -> None:
    """Sockets beyond the gate's pending table are dropped mid-handshake (here 8 pending at
    most, 240 sockets from 12 addresses): none may keep its slot for good."""
    gate = InboundGate(max_pending=8, max_pending_per_ip=4)
    async with served_host(tmp_path, gate) as server:
        baseline = resource_connections(server)
        await silent_burst(port_of(server), addresses=12, per_address=20, hold=2.0)
        assert gate.dropped > 0
        await settled(server, gate, baseline)
        await fetch_manifest(server)
        await settled(server, gate, baseline)


async def test_handshakes_that_time_out_give_their_slots_back(tmp_path: Path) -> None:
    gate = InboundGate()
    async with served_host(tmp_path, gate) as server:
        baseline = resource_connections(server)
        await silent_burst(port_of(server), addresses=4, per_address=8, hold=3 * HANDSHAKE_TIMEOUT)
        await settled(server, gate, baseline)
        await fetch_manifest(server)
        await settled(server, gate, baseline)


async def half_handshake(port: int, server_id: ID, source: str, hold: float) -> None:
    """Finish the Noise handshake as a real client would, then never negotiate a muxer."""
    client = build_host(create_new_key_pair())
    sock = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    raw = RawConnection(TrioTCPStream(sock), True)
    try:
        with trio.move_on_after(hold):
            await client.get_network().upgrader.upgrade_security(raw, True, server_id)
            await trio.sleep(hold)
    except Exception:
        pass  # the server dropped us mid-handshake: what the flood expects
    finally:
        await sock.aclose()


async def test_half_done_handshakes_give_their_slots_back(tmp_path: Path) -> None:
    """Peers that finish Noise and stall before yamux, dropped by the gate and timed out."""
    gate = InboundGate(max_pending=4, max_pending_per_ip=4)
    async with served_host(tmp_path, gate) as server:
        baseline = resource_connections(server)
        async with trio.open_nursery() as nursery:
            for n in range(24):
                nursery.start_soon(
                    half_handshake, port_of(server), server.get_id(), f"127.0.0.{10 + n % 6}", 2.0
                )
        await settled(server, gate, baseline)
        await fetch_manifest(server)
        await settled(server, gate, baseline)


async def test_dials_abandoned_mid_handshake_give_their_slots_back() -> None:
    """A dial whose caller gives up while the far end has not answered the handshake (a
    peer that accepts TCP and says nothing) gives the dialler's slot back."""
    host = build_host(create_new_key_pair())
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    silent_port = listeners[0].socket.getsockname()[1]
    held: list[trio.SocketStream] = []

    async def accept_silently() -> None:
        while True:
            held.append(await listeners[0].accept())

    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        baseline = resource_connections(host)
        peer = ID.from_base58(str(build_host(create_new_key_pair()).get_id()))
        info = PeerInfo(peer, [Multiaddr(f"/ip4/127.0.0.1/tcp/{silent_port}")])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_silently)
            for _ in range(20):
                with trio.move_on_after(0.2):
                    await host.connect(info)
            nursery.cancel_scope.cancel()
        for sock in held:
            await sock.aclose()
        await listeners[0].aclose()
        await wait_for(
            lambda: resource_connections(host) == baseline,
            SETTLE,
            f"resource manager holds {resource_connections(host)}, baseline {baseline}",
        )


async def test_the_relays_host_gives_slots_back(tmp_path: Path) -> None:
    """``blob relay`` runs the relay service on a node's host, with the default gate and
    handshake deadline: a burst (600 silent sockets from 40 addresses, most
    dropped by the gate) and half-done handshakes leave its count at its baseline."""
    from p2p.nat.relay import relay_service
    from p2p.node.node import open_node

    store = Store.open(tmp_path / "relay-store")
    async with (
        open_node(store, listen=("/ip4/127.0.0.1/tcp/0",), dht=False) as node,
        relay_service(node.host, admitted=lambda peer: False),
    ):
        baseline = resource_connections(node.host)
        port = port_of(node.host)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(silent_burst, port, 40, 15, hold=3.0))
            for n in range(12):
                nursery.start_soon(
                    half_handshake, port, node.host.get_id(), f"127.0.0.{60 + n % 6}", 3.0
                )
        await wait_for(
            lambda: resource_connections(node.host) == baseline,
            SETTLE,
            f"resource manager holds {resource_connections(node.host)}, baseline {baseline}",
        )


async def test_a_socket_its_peer_closed_is_known_gone_before_any_handshake() -> None:
    """After a burst of silent sockets stops, the kernel keeps handing over the flooders'
    closed connections for seconds (a full accept queue, closes retransmitted into it);
    each took a full handshake attempt, and while the queue stayed full a new peer's SYN
    was dropped and retried a second later: a legit get after the bursts took 10 s."""
    from p2p.transport.host import peer_gone

    accepted: list[trio.SocketStream] = []
    arrived = trio.Event()

    async def keep(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        arrived.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), keep, 0
        )
        port = listeners[0].socket.getsockname()[1]
        quiet = await trio.open_tcp_stream("127.0.0.1", port)
        await arrived.wait()
        assert not peer_gone(TrioTCPStream(accepted[0]))  # silent, but there
        arrived = trio.Event()
        leaving = await trio.open_tcp_stream("127.0.0.1", port)
        await leaving.aclose()
        await arrived.wait()
        gone = TrioTCPStream(accepted[1])
        await wait_for(lambda: peer_gone(gone), SETTLE, "a closed peer not seen gone")
        await quiet.send_all(b"/multistream/1.0.0\n")
        assert not peer_gone(TrioTCPStream(accepted[0]))  # talking
        await quiet.aclose()
        nursery.cancel_scope.cancel()


async def test_closed_sockets_skip_the_gate_and_the_handshake(tmp_path: Path) -> None:
    """Sockets closed by their peer before the host took them are closed at once (rule
    5), not admitted for a handshake that can only read end of file."""
    gate = InboundGate()
    async with served_host(tmp_path, gate) as server:
        baseline = resource_connections(server)
        # Blocking stdlib sockets, so the host's accept loop cannot run before they close
        # (after a flood they were closed long before the host took them).
        for _ in range(CLOSED_SOCKETS):
            socket.create_connection(("127.0.0.1", port_of(server))).close()
        await wait_for(
            lambda: gate.gone + gate.admitted >= CLOSED_SOCKETS,
            SETTLE,
            f"{gate.gone + gate.admitted} of {CLOSED_SOCKETS} closed sockets reached the gate",
        )
        assert gate.gone == CLOSED_SOCKETS
        assert gate.admitted == 0
        await settled(server, gate, baseline)
        await fetch_manifest(server)


# Sockets connected and closed before the host accepts them.
CLOSED_SOCKETS = 10
