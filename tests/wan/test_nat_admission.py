"""A blobnet relay serves admitted peers only, and only for signalling.

Three real libp2p hosts in one process over TCP on 127.0.0.1: a relay trusting one
authority, and two peers. A reservation needs a valid admission certificate for the very
peer ID that Noise authenticated; a stolen certificate, one from an unknown authority, an
expired one, or none, is refused with the reason. A circuit between admitted peers works
and is cut at the relay's byte limit, so bulk data cannot ride on a relay."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited
from multiaddr import Multiaddr

from identity import AdmissionCertificate, Authority, MachineKey, TrustStore
from identity.signer import SoftwareSigner
from p2p.nat.punch import MAX_PUNCHES, punch_circuits
from p2p.nat.relay import (
    REACH_PROTOCOL,
    AdmissionBook,
    AdmittedRelay,
    RelayRefused,
    control_limits,
    dial_via_relay,
    nat_services,
    present_certificate,
    relay_service,
    reserve,
)
from p2p.transport.host import build_host

pytestmark = pytest.mark.timeout(60)

BULK = TProtocol("/blobnet-test/bulk/1.0.0")
LIMIT = 256 * 1024  # a small circuit byte limit, so the cut comes quickly
# The relay reads up to one Noise frame (64 KiB) at a time and counts a read before it
# finds the read over the limit.
FRAME = 65536


def _certificate(authority: Authority, peer_id: str, *, valid_for: int = 3600) -> bytes:
    now = int(time.time())
    cert: AdmissionCertificate = authority.admit(
        peer_id,
        operator="op",
        kernel_class="cpu",
        not_before=now - 60,
        not_after=now + valid_for,
        serial=now,
    )
    return cert.encode()


@asynccontextmanager
async def _host() -> AsyncIterator[IHost]:
    host = build_host(MachineKey.generate().libp2p_keypair())
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        yield host


def _addr(host: IHost) -> str:
    return str(host.get_addrs()[0])


@asynccontextmanager
async def _world() -> AsyncIterator[tuple[Authority, AdmittedRelay, IHost, IHost, str]]:
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    trust = TrustStore(frozenset({authority.public_key_bytes}))
    async with (
        _host() as relay_host,
        _host() as a,
        _host() as b,
        relay_service(relay_host, trust=trust, limits=control_limits(max_bytes=LIMIT)) as relay,
    ):
        yield authority, relay, a, b, _addr(relay_host)


async def test_a_reservation_needs_a_valid_certificate_for_the_peer_that_asks() -> None:
    async with _world() as (authority, relay, a, b, relay_addr):
        # No certificate shown: refused, with what to do about it.
        with pytest.raises(RelayRefused, match=r"RESERVATION_REFUSED.*--certificate"):
            await reserve(a, relay_addr)
        stolen = _certificate(authority, str(a.get_id()))
        with pytest.raises(RelayRefused, match="does not admit peer"):
            await reserve(b, relay_addr, certificate=stolen)  # a's certificate, b's key
        rogue = Authority(SoftwareSigner(MachineKey.generate()))
        with pytest.raises(RelayRefused, match="does not trust"):
            await reserve(b, relay_addr, certificate=_certificate(rogue, str(b.get_id())))
        expired = _certificate(authority, str(b.get_id()), valid_for=-30)
        with pytest.raises(RelayRefused, match="expired"):
            await reserve(b, relay_addr, certificate=expired)
        assert relay.refused == [str(a.get_id())]

        reservation = await reserve(a, relay_addr, certificate=stolen)  # a's own: accepted
        assert reservation.relay == str(relay.host.get_id())
        assert reservation.max_bytes == LIMIT
        assert reservation.circuit_addrs == (f"{relay_addr}/p2p-circuit/p2p/{a.get_id()}",)


async def test_only_admitted_peers_open_circuits_and_a_circuit_is_cut_at_its_byte_limit() -> None:
    async with _world() as (authority, relay, a, b, relay_addr):
        sent = trio.Event()
        received: list[int] = []

        async def bulk(stream: INetStream) -> None:
            try:
                for _ in range(64):  # 4 MiB, far over the limit
                    await stream.write(b"x" * 65536)
            except Exception:  # the relay resets the circuit: expected
                pass
            finally:
                sent.set()

        a.set_stream_handler(BULK, bulk)
        async with nat_services(a):
            reservation = await reserve(
                a, relay_addr, certificate=_certificate(authority, str(a.get_id()))
            )
            circuit = reservation.circuit_addrs[0]
            with pytest.raises(RelayRefused, match=r"PERMISSION_DENIED.*--certificate"):
                await dial_via_relay(b, circuit)  # b has shown no certificate
            await present_certificate(
                b, relay.host.get_id(), _certificate(authority, str(b.get_id()))
            )
            relayed = await dial_via_relay(b, circuit)
            assert relayed.max_bytes == LIMIT  # the relay states its limit to the dialler
            stream = await b.new_stream(a.get_id(), [BULK])
            with trio.fail_after(30):
                try:
                    while data := await stream.read(65536):
                        received.append(len(data))
                except Exception:  # the reset arrives as an error: expected
                    pass
                await sent.wait()
        assert 0 < sum(received) < LIMIT
        assert LIMIT - FRAME <= relay.relayed_bytes < LIMIT + FRAME


def test_the_admission_book_forgets_nobody_early_and_holds_a_bounded_number() -> None:
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    book = AdmissionBook(TrustStore(frozenset({authority.public_key_bytes})), capacity=1)
    first, second = MachineKey.generate().peer_id, MachineKey.generate().peer_id
    now = time.time()
    assert book.present(first, _certificate(authority, first, valid_for=100), now) is None
    assert book.admitted(first, now + 99) and not book.admitted(first, now + 101)
    full = book.present(second, _certificate(authority, second), now)
    assert full is not None and "full" in full
    # Once the first certificate has expired its slot is free again.
    assert book.present(second, _certificate(authority, second), now + 200) is None
    assert book.admitted(second, now + 200) and len(book) == 1


class _Peer:
    """What p2p.nat.punch needs of a node: its host, and a way to dial an address."""

    def __init__(self, host: IHost) -> None:
        self.host = host

    async def connect(self, addr: str) -> str:
        info = info_from_p2p_addr(Multiaddr(addr))
        await self.host.connect(info)
        return str(info.peer_id)


async def test_a_reachable_peer_behind_a_circuit_address_is_upgraded_by_a_direct_dial() -> None:
    """DCUtR's first step: a peer that is reachable after all (here on loopback) is
    dialled directly, no hole punch needed; the relayed connection is then closed, so
    nothing more can flow through the relay."""
    async with _world() as (authority, _relay, a, b, relay_addr):
        async with nat_services(a):
            cert_a = _certificate(authority, str(a.get_id()))
            circuit = (await reserve(a, relay_addr, certificate=cert_a)).circuit_addrs[0]
            cert_b = _certificate(authority, str(b.get_id()))
            [punch] = await punch_circuits(_Peer(b), [circuit], certificate=cert_b)
        assert punch.path == "direct", punch.reason
        assert punch.peer == str(a.get_id())
        conns = b.get_network().get_connections(a.get_id())
        assert conns and all(
            "/p2p-circuit" not in str(addr) for c in conns for addr in c.get_transport_addresses()
        )


async def _connect_status(host: IHost, relay: IHost, target: IHost) -> tuple[str, INetStream]:
    """Ask the relay for a circuit to ``target``; its answer, and the hop stream (a
    circuit lives as long as that stream)."""
    stream = await host.new_stream(relay.get_id(), [HOP_PROTOCOL])
    connect = HopMessage(type=HopMessage.CONNECT, peer=CircuitPeerId(id=target.get_id().to_bytes()))
    await write_delimited_msg(stream, connect)
    reply = await read_delimited_msg(stream, HopMessage)
    return StatusCode(reply.status).name, stream


async def test_circuits_are_capped_per_peer_even_when_connects_arrive_together() -> None:
    """With one circuit per peer allowed, two CONNECTs to one peer sent at once get one
    circuit (py-libp2p counts a circuit only once it is set up, so both passed its
    check); a source with a circuit open gets none to a second peer; closing the
    circuit frees both slots at once."""
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    trust = TrustStore(frozenset({authority.public_key_bytes}))
    limits = control_limits(max_circuits_per_peer=1)
    async with (
        _host() as relay_host,
        _host() as a,
        _host() as b,
        _host() as c,
        relay_service(relay_host, trust=trust, limits=limits) as relay,
        nat_services(a),
        nat_services(c),
    ):
        relay_addr = _addr(relay_host)
        for peer in (a, b, c):
            await peer.connect(info_from_p2p_addr(Multiaddr(relay_addr)))
            cert = _certificate(authority, str(peer.get_id()))
            await present_certificate(peer, relay_host.get_id(), cert)
        await reserve(a, relay_addr)
        await reserve(c, relay_addr)
        answers: list[tuple[str, INetStream]] = []

        async def ask(target: IHost) -> None:
            answers.append(await _connect_status(b, relay_host, target))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, a)
                nursery.start_soon(ask, a)
            assert sorted(name for name, _ in answers) == ["OK", "RESOURCE_LIMIT_EXCEEDED"]
            [held] = [stream for name, stream in answers if name == "OK"]
            assert relay.open_circuits() == 1
            refused, _ = await _connect_status(b, relay_host, c)  # b holds a circuit already
            assert refused == "RESOURCE_LIMIT_EXCEEDED"
            await held.reset()
            for _ in range(500):  # torn down within a few event-loop turns
                if not relay.open_circuits():
                    break
                await trio.sleep(0.01)
            ok, stream = await _connect_status(b, relay_host, c)
            assert ok == "OK"
            await stream.reset()


async def _ask_dial_back(host: IHost, relay: IHost, port: int) -> str:
    stream = await host.new_stream(relay.get_id(), [REACH_PROTOCOL])
    await stream.write(encode_varint_prefixed(str(port).encode()))
    reply = await read_varint_prefixed_bytes_limited(stream, 512)
    return reply.decode()


async def test_a_peer_gets_one_dial_back_at_a_time() -> None:
    """Each dial-back may take seconds a port (a NAT answers nothing): a peer asking
    on many streams at once must not have the relay dial for each. Here the first
    dial-back hangs on a port that accepts TCP but never speaks Noise; a second
    request meanwhile is refused at once."""
    async with _world() as (authority, relay, a, _b, relay_addr):
        await a.connect(info_from_p2p_addr(Multiaddr(relay_addr)))
        await present_certificate(a, relay.host.get_id(), _certificate(authority, str(a.get_id())))
        silent = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = silent[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_ask_dial_back, a, relay.host, port)
            with trio.fail_after(10):
                for _ in range(1000):  # the relay takes the first request
                    if relay.dialling:
                        break
                    await trio.sleep(0.01)
                assert relay.dialling == {str(a.get_id())}
                second = await _ask_dial_back(a, relay.host, port)
            assert second == "refused: a dial-back for this peer is already running"
            nursery.cancel_scope.cancel()
        for listener in silent:
            await listener.aclose()


async def test_a_reservation_is_always_for_the_peer_that_asks_never_one_it_names() -> None:
    """py-libp2p reserves for the peer ID a RESERVE names, when it names one: an
    admitted peer could then make a peer that was never admitted reachable, or fill
    the relay's reservations with made-up IDs."""
    async with _world() as (authority, relay, a, b, relay_addr):
        await b.connect(info_from_p2p_addr(Multiaddr(relay_addr)))
        await present_certificate(b, relay.host.get_id(), _certificate(authority, str(b.get_id())))
        stream = await b.new_stream(relay.host.get_id(), [HOP_PROTOCOL])
        named = HopMessage(type=HopMessage.RESERVE, peer=CircuitPeerId(id=a.get_id().to_bytes()))
        await write_delimited_msg(stream, named)
        reply = await read_delimited_msg(stream, HopMessage)
        await stream.reset()
        assert StatusCode(reply.status) == StatusCode.OK
        assert relay.resource_manager.has_reservation(b.get_id())
        assert not relay.resource_manager.has_reservation(a.get_id())  # a never admitted


async def test_a_fetch_punches_a_bounded_number_of_circuits_the_first_given_first() -> None:
    """A DHT answer or a ticket can name any number of circuit addresses; a fetch
    punches at most MAX_PUNCHES of them at once, in the order given."""
    async with _host() as relay_host, _host() as b:
        relay_addr = _addr(relay_host)  # a host, but no relay service: every punch fails
        circuits = [
            f"{relay_addr}/p2p-circuit/p2p/{MachineKey.generate().peer_id}"
            for _ in range(MAX_PUNCHES + 4)
        ]
        with trio.fail_after(30):
            punches = await punch_circuits(_Peer(b), circuits, punch_timeout=1)
        assert [p.addr for p in punches] == circuits[:MAX_PUNCHES]
        assert all(p.path != "direct" and p.reason for p in punches)


async def test_a_circuit_that_ends_leaves_another_circuit_to_the_same_peer_alone() -> None:
    """Two fetchers reach one provider through the relay at once (a swarm punching to
    a NATed seeder). py-libp2p files circuits under the provider's peer ID, so the
    first circuit to end closed the second one's streams, and that fetcher's relayed
    connection died before it could hole-punch (seen on the NAT testbed)."""
    echo = TProtocol("/blobnet-test/echo/1.0.0")
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    trust = TrustStore(frozenset({authority.public_key_bytes}))

    async def handle(stream: INetStream) -> None:
        try:
            await stream.write(await stream.read(64))
            await stream.close()
        except Exception:  # the other side went away: nothing to echo to
            pass

    async with (
        _host() as relay_host, _host() as a, _host() as b, _host() as c,
        relay_service(relay_host, trust=trust, limits=control_limits()) as relay,
        background_trio_service(CircuitV2Protocol(a, allow_hop=False)),  # stop side only
    ):  # fmt: skip
        relay_addr = _addr(relay_host)
        a.set_stream_handler(echo, handle)
        for peer in (a, b, c):
            await peer.connect(info_from_p2p_addr(Multiaddr(relay_addr)))
            cert = _certificate(authority, str(peer.get_id()))
            await present_certificate(peer, relay_host.get_id(), cert)
        circuit = (await reserve(a, relay_addr)).circuit_addrs[0]
        with trio.fail_after(30):
            first = await dial_via_relay(b, circuit)
            second = await dial_via_relay(c, circuit)
            # The provider ends b's circuit (say b punched through and DCUtR closes the
            # relayed leg).
            for conn in a.get_network().get_connections(b.get_id()):
                await conn.close()
            assert first.conn is not None
            for _ in range(500):  # the relay's clean-up of b's circuit runs
                if relay.open_circuits() <= 1:
                    break
                await trio.sleep(0.01)
            assert relay.open_circuits() == 1  # c's, which must outlive b's
            # Only the circuit leads to a (no DCUtR here, and c forgets a's own
            # addresses), so the echo below crosses c's circuit or nothing.
            c.get_peerstore().clear_addrs(a.get_id())
            stream = await c.new_stream(a.get_id(), [echo])
            await stream.write(b"still here")
            assert await stream.read(64) == b"still here"
            assert stream.muxed_conn is second.conn.muxed_conn
