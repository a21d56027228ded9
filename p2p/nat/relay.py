"""Circuit relay v2 for blobnet: a relay that serves admitted peers only, and the client
side (present a certificate, reserve, dial through a relay, upgrade by DCUtR).

Theory of operation
===================

A node behind NAT cannot be dialled. It keeps a connection open to a public *relay* and
asks it for a *reservation* (relay v2 ``RESERVE``); peers then reach it at a circuit
address ``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<node>``: they dial the relay, ask it
to ``CONNECT`` them to the node, and run Noise + yamux end to end over that relayed pipe
(the relay sees only ciphertext). Over the relayed connection both peers run DCUtR: each
tells the other the public address its NAT maps its listen port to (the relay saw it in
identify), and both dial at once, the initiator half a measured RTT after the responder,
so the two SYNs cross (TCP simultaneous open) and both NATs take the other's SYN for the
answer to their own. A fetch then uses the direct connection; the relayed one carries
only signalling and is closed after a grace period.

Relays are for signalling, not bulk: a circuit is capped at ``CIRCUIT_MAX_BYTES`` and
``CIRCUIT_MAX_SECONDS`` (py-libp2p's defaults are 1 GiB and an hour). A fetch that cannot
hole-punch (a symmetric NAT maps each connection to a fresh port, so the address a peer
learned is useless) says so and goes to other providers; only a user who asks for it
fetches through a relay, and only from a relay configured with raised limits.

Admission: keys are free, so a relay that reserved for anyone would carry anyone's
traffic. A peer first presents its admission certificate (``identity``) on
``ADMIT_PROTOCOL``; the relay verifies it against its trust store for the peer ID that
Noise authenticated, and remembers the peer until the certificate expires. ``RESERVE``
from a peer it does not remember is refused (``RESERVATION_REFUSED``), and so, by
default, is ``CONNECT`` from one. py-libp2p's relay takes the reservation's peer ID from
the message when present; ours always uses the connection's authenticated one.

Reachability: an admitted peer may ask the relay to dial it back (``REACH_PROTOCOL``):
the relay dials the IP it sees the peer at, at the ports the peer names, on a fresh
connection, and answers ``public <addr>`` or ``private: ...`` (``p2p.nat.punch`` acts on it).

What py-libp2p 0.8.1 gives and what is ours: its ``CircuitV2Protocol`` (hop and stop
handlers, circuit limits, relaying) and ``DCUtRProtocol`` (the punch) are used as they
are, but for two fixes: a circuit is torn down whole when either direction ends
(``AdmittedRelay._relay_data`` says why), and circuits are counted per destination and
per source from the moment a CONNECT is accepted (py-libp2p counts them only once set
up, so CONNECTs sent together all passed its per-peer cap). The admission gate, the
byte counter, the dial-back, ``reserve`` and ``dial_via_relay`` are ours (py-libp2p's
``CircuitV2Transport`` reserves on every dial and swallows the relay's status codes).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

from blobstore.exitcodes import ExitCode
from identity import MAX_CERTIFICATE_SIZE, TrustStore, verify_certificate
from identity.errors import IdentityError
from p2p.nat.holepunch import install as install_punch_dial
from p2p.transport import patches

log = logging.getLogger(__name__)

ADMIT_PROTOCOL = TProtocol("/blobnet/relay-admit/1.0.0")
# Dial-back: "can you reach me?" The relay dials the asker's observed IP at the ports it
# names, on a fresh connection, and answers what happened (see ``check_reachability``).
REACH_PROTOCOL = TProtocol("/blobnet/reach/1.0.0")

# --- Relay limits (control traffic, not bulk) ---
# go-libp2p's defaults are 2 minutes and 128 KiB per circuit. A blobnet circuit carries
# Noise + yamux set-up, identify (a few KiB each way), DCUtR (4 KiB messages) and perhaps
# a manifest request before the direct connection takes over: 512 KiB leaves room for a
# manifest of a 16 GiB blob at 1 MiB chunks (32 B a chunk) and nothing like a blob.
CIRCUIT_MAX_BYTES = 512 * 1024
# A hole punch takes a few RTTs plus up to three 5 s rounds in py-libp2p; two minutes as
# go-libp2p, then the circuit is reset.
CIRCUIT_MAX_SECONDS = 120
# A reservation lives an hour (the spec's suggestion); clients refresh it before expiry.
RESERVATION_TTL_SECONDS = 3600
# Reservations one relay holds at once: one per NATed worker of a run (hundreds).
MAX_RESERVATIONS = 256
# Circuits open at once to one reserved peer: a handful of fetchers arriving together.
MAX_CIRCUITS_PER_PEER = 8
# Admitted peers remembered at once (bounded: each entry is a peer ID and an expiry).
MAX_ADMITTED_PEERS = 4096
# How long one admission, reservation or CONNECT exchange may take: a few relay RTTs.
EXCHANGE_TIMEOUT = 10.0
# The relay's answer to a certificate: "ok" or a one-line reason (bounded).
MAX_ADMIT_REPLY = 512
# A dial-back request names at most this many ports (a node listens on one or two), and
# the relay dials only the asker's observed IP: it cannot be aimed at a third party.
MAX_REACH_PORTS = 4
MAX_REACH_REQUEST = 64
# A dial-back is TCP + Noise + yamux, about five RTTs: 1 s at 200 ms. A NAT drops the SYN
# silently, so "private" is the dial timing out.
REACH_DIAL_TIMEOUT = 5.0
# Dial-backs running at once: one per peer (each may take 5 s a port, so many streams
# asking at once would have the relay dial without bound), and this many in all.
MAX_DIAL_BACKS = 32


def control_limits(
    *,
    max_bytes: int = CIRCUIT_MAX_BYTES,
    max_seconds: int = CIRCUIT_MAX_SECONDS,
    max_reservations: int = MAX_RESERVATIONS,
    max_circuits_per_peer: int = MAX_CIRCUITS_PER_PEER,
    reservation_ttl: int = RESERVATION_TTL_SECONDS,
) -> RelayLimits:
    """Relay limits for signalling traffic (the defaults), or raised ones for a relay
    that users allow to carry blobs (``max_bytes`` large)."""
    if max_bytes <= 0 or max_seconds <= 0:
        raise ValueError("circuit limits must be positive (0 means unlimited in relay v2)")
    return RelayLimits(
        duration=max_seconds,
        data=max_bytes,
        max_circuit_conns=max_circuits_per_peer,
        max_reservations=max_reservations,
        reservation_ttl=reservation_ttl,
    )


class RelayError(Exception):
    """A relay exchange failed; ``str`` is a one-line reason naming whose fault it is."""

    exit_code = ExitCode.NETWORK


class RelayRefused(RelayError):
    """The relay answered, and said no (not admitted, no reservation, limits)."""


# ------------------------------------------------------------------------ admission
class AdmissionBook:
    """Peers that presented a valid admission certificate, until it expires. Sans-IO:
    time is an argument."""

    def __init__(self, trust: TrustStore, *, capacity: int = MAX_ADMITTED_PEERS) -> None:
        self.trust = trust
        self.capacity = capacity
        self._until: dict[str, float] = {}

    def present(self, peer_id: str, certificate: bytes, now: float) -> str | None:
        """Record ``peer_id`` if ``certificate`` admits it at ``now``; else the reason."""
        try:
            cert = verify_certificate(certificate, trust=self.trust, now=now, peer_id=peer_id)
        except IdentityError as exc:
            return str(exc)
        if peer_id not in self._until and len(self._until) >= self.capacity:
            self._forget_expired(now)
            if len(self._until) >= self.capacity:
                return "the relay admits no more peers (its admission book is full)"
        self._until[peer_id] = float(cert.not_after)
        return None

    def admitted(self, peer_id: str, now: float) -> bool:
        until = self._until.get(peer_id)
        return until is not None and now < until

    def _forget_expired(self, now: float) -> None:
        for peer, until in list(self._until.items()):
            if until <= now:
                del self._until[peer]

    def __len__(self) -> int:
        return len(self._until)


class _CountingReader:
    """A stream proxy that counts the bytes read through it into its owner."""

    def __init__(self, stream: INetStream, owner: AdmittedRelay) -> None:
        self._stream = stream
        self._owner = owner

    async def read(self, n: int | None = None) -> bytes:
        data = await self._stream.read(n)
        self._owner.relayed_bytes += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class AdmittedRelay(CircuitV2Protocol):
    """py-libp2p's relay v2 hop service, serving only peers ``admitted(peer_id)`` says
    yes to, and counting every byte it relays (``relayed_bytes``)."""

    def __init__(
        self,
        host: IHost,
        *,
        admitted: Callable[[ID], bool],
        limits: RelayLimits,
        open_connect: bool = False,
    ) -> None:
        super().__init__(host, limits=limits, allow_hop=True)
        self.admitted = admitted
        self.open_connect = open_connect
        self.relayed_bytes = 0
        self.refused: list[str] = []  # peer IDs refused, newest last (bounded)
        self.dialling: set[str] = set()  # peers whose dial-back runs now
        # Circuits being set up or open, per destination and per source. py-libp2p
        # counts a destination's circuits only once the STOP exchange has finished, so
        # CONNECTs that arrive together all pass its check; and it caps a source only
        # when the source holds a reservation itself. Counting from the moment a
        # CONNECT is accepted bounds both at ``max_circuit_conns``.
        self._circuits_to: Counter[bytes] = Counter()
        self._circuits_from: Counter[bytes] = Counter()
        self._circuit_serial = 0  # names each circuit's own key (``_relay_data``)

    def _refuse(self, peer: ID) -> None:
        self.refused.append(str(peer))
        del self.refused[:-64]

    async def _handle_reserve(self, stream: INetStream, msg: HopMessage) -> None:
        peer = stream.muxed_conn.peer_id
        if not self.admitted(peer):
            log.info("relay: reservation refused for %s (not admitted)", peer)
            self._refuse(peer)
            await write_delimited_msg(
                stream,
                HopMessage(
                    type=HopMessage.STATUS,
                    status=to_proto_status(StatusCode.RESERVATION_REFUSED),
                ),
            )
            return
        msg.ClearField("peer")  # reserve for the authenticated peer, never a named one
        await super()._handle_reserve(stream, msg)

    async def _handle_connect(self, stream: INetStream, msg: HopMessage) -> None:
        peer = stream.muxed_conn.peer_id
        if not self.open_connect and not self.admitted(peer):
            log.info("relay: circuit refused for %s (not admitted)", peer)
            self._refuse(peer)
            await self._send_status(stream, StatusCode.PERMISSION_DENIED, "not admitted")
            return
        source, target = peer.to_bytes(), bytes(msg.peer.id)
        cap = self.limits.max_circuit_conns
        if self._circuits_to[target] >= cap or self._circuits_from[source] >= cap:
            log.info("relay: circuit refused for %s (circuit limit %d)", peer, cap)
            await self._send_status(
                stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, f"at most {cap} circuits per peer"
            )
            return  # as for "not admitted": the hop stream's loop reads on, or it ends
        self._circuits_to[target] += 1
        self._circuits_from[source] += 1
        try:
            await super()._handle_connect(stream, msg)
        finally:
            for counter, key in ((self._circuits_to, target), (self._circuits_from, source)):
                counter[key] -= 1
                if counter[key] <= 0:
                    del counter[key]  # the counters hold only peers with circuits

    def open_circuits(self) -> int:
        """Circuits being set up or relaying now."""
        return sum(self._circuits_to.values())

    async def _relay_data(  # type: ignore[override]
        self, src_stream: INetStream, dst_stream: INetStream, *args: Any
    ) -> None:
        """One direction of a circuit; when it ends, the whole circuit ends.

        py-libp2p's own clean-up (protocol.py, ``_relay_data``'s ``finally``) closes the
        streams it filed under the direction's peer ID, and the source's entry holds no
        destination stream (``_active_relays[source_addr] = (stream, None)``): a fetcher
        closing its side leaves the other direction waiting on the provider, whose
        relayed connection lives on until its DCUtR grace period (60 s) ends. The circuit
        slot stays taken meanwhile, and after ``max_circuit_conns`` such circuits the
        relay answers NO_RESERVATION (its one code for that limit and for no
        reservation). Resetting both streams frees the slot at once.

        That clean-up also files a circuit under one peer ID per side
        (``_active_relays[peer]``), so with two circuits to one provider (two fetchers
        punching to it at once) the first to end closed the other's streams: its
        relayed connection died before DCUtR could run (seen on the NAT testbed). So
        py-libp2p's loop gets a key of this circuit's own (nothing is filed under it),
        and only entries holding this circuit's streams are removed here."""
        counted: Any = _CountingReader(src_stream, self)
        peer, rest = (args[0], args[1:]) if args else (None, ())
        self._circuit_serial += 1
        own_key = ID(b"\x00blobnet-circuit-%d" % self._circuit_serial)
        try:
            await super()._relay_data(counted, dst_stream, own_key, *rest)
        finally:
            with trio.CancelScope(shield=True):
                for stream in (src_stream, dst_stream):
                    await _reset_quietly(stream)
            if isinstance(peer, ID):
                entry = self._active_relays.get(peer)
                if entry is not None and (src_stream in entry or dst_stream in entry):
                    del self._active_relays[peer]


async def _reset_quietly(stream: INetStream) -> None:
    """Reset a stream that may already be closed or reset."""
    try:
        await stream.reset()
    except Exception:  # already gone: nothing left to end
        pass


async def _serve_admission(book: AdmissionBook, stream: INetStream) -> None:
    peer = str(stream.muxed_conn.peer_id)
    try:
        with trio.fail_after(EXCHANGE_TIMEOUT):
            cert = await read_varint_prefixed_bytes_limited(stream, MAX_CERTIFICATE_SIZE)
            reason = book.present(peer, cert, time.time())
            reply = "ok" if reason is None else reason
            await stream.write(encode_varint_prefixed(reply.encode()[:MAX_ADMIT_REPLY]))
        if reason is not None:
            log.info("relay: certificate from %s refused: %s", peer, reason)
        await stream.close()
    except Exception as exc:  # a peer's broken stream ends only its own exchange
        log.info("relay: admission exchange with %s failed: %r", peer, exc)
        await _reset_quietly(stream)


async def _serve_reach(
    host: IHost, admitted: Callable[[ID], bool], stream: INetStream, dialling: set[str]
) -> None:
    """Dial the asker back at its observed IP on the ports it names; answer
    ``public <addr>`` or ``private <reason>``. ``dialling``: the peers whose dial-back
    runs now (one each, ``MAX_DIAL_BACKS`` in all)."""
    peer = stream.muxed_conn.peer_id
    try:
        with trio.fail_after(EXCHANGE_TIMEOUT):
            request = await read_varint_prefixed_bytes_limited(stream, MAX_REACH_REQUEST)
        ports = [int(p) for p in request.decode().split()[:MAX_REACH_PORTS] if p.isdecimal()]
        ip = _observed_ip(stream)
        if not admitted(peer):
            reply = "refused: not admitted"
        elif ip is None or not ports:
            reply = "refused: no observed address or no ports named"
        elif str(peer) in dialling:
            reply = "refused: a dial-back for this peer is already running"
        elif len(dialling) >= MAX_DIAL_BACKS:
            reply = "refused: the relay is busy with other dial-backs; try again shortly"
        else:
            dialling.add(str(peer))
            try:
                reply = await _dial_back(host, peer, ip, ports)
            finally:
                dialling.discard(str(peer))
        with trio.fail_after(EXCHANGE_TIMEOUT):
            await stream.write(encode_varint_prefixed(reply.encode()[:MAX_ADMIT_REPLY]))
        await stream.close()
    except Exception as exc:  # a peer's broken stream ends only its own exchange
        log.info("relay: dial-back for %s failed: %r", peer, exc)
        await _reset_quietly(stream)


def _observed_ip(stream: INetStream) -> str | None:
    try:
        remote = stream.get_remote_address()
    except Exception:  # a relayed or odd connection: no address
        return None
    if not remote:
        return None
    return str(remote[0])


async def _dial_back(host: IHost, peer: ID, ip: str, ports: list[int]) -> str:
    network: Any = host.get_network()
    tried = []
    for port in ports:
        addr = multiaddr.Multiaddr(f"/ip4/{ip}/tcp/{port}")
        tried.append(str(addr))
        conn = None
        with trio.move_on_after(REACH_DIAL_TIMEOUT):
            try:
                conn = await network.dial_addr(addr, peer)
            except Exception as exc:  # refused, reset, wrong peer: not reachable there
                log.debug("dial-back to %s at %s: %r", peer, addr, exc)
        if conn is not None:
            try:
                await conn.close()
            except Exception:  # closing our probe connection is best effort
                pass
            return f"public {addr}"
    return f"private: no answer from {', '.join(tried)} within {REACH_DIAL_TIMEOUT:.0f} s"


@asynccontextmanager
async def relay_service(
    host: IHost,
    *,
    trust: TrustStore | None = None,
    admitted: Callable[[ID], bool] | None = None,
    limits: RelayLimits | None = None,
    open_connect: bool = False,
) -> AsyncIterator[AdmittedRelay]:
    """Offer relay v2 on a running host for the ``async with`` block.

    Peers are admitted by presenting certificates that ``trust`` accepts (the
    ``ADMIT_PROTOCOL``), or by ``admitted`` (a predicate over peer IDs), or both (either
    suffices). ``open_connect``: let peers that are not admitted open circuits to those
    that are (fetchers outside the run); reservations stay admitted-only.
    """
    if trust is None and admitted is None:
        raise ValueError("a relay needs a trust store or an admission predicate")
    book = AdmissionBook(trust) if trust is not None else None

    def is_admitted(peer: ID) -> bool:
        if admitted is not None and admitted(peer):
            return True
        return book is not None and book.admitted(str(peer), time.time())

    relay = AdmittedRelay(
        host, admitted=is_admitted, limits=limits or control_limits(), open_connect=open_connect
    )
    if book is not None:
        admission_book = book

        async def handler(stream: INetStream) -> None:
            await _serve_admission(admission_book, stream)

        host.set_stream_handler(ADMIT_PROTOCOL, handler)

    async def reach_handler(stream: INetStream) -> None:
        await _serve_reach(host, is_admitted, stream, relay.dialling)

    host.set_stream_handler(REACH_PROTOCOL, reach_handler)
    async with background_trio_service(relay):
        await relay.event_started.wait()
        yield relay


# ------------------------------------------------------------------------ client
@dataclass(frozen=True)
class Reservation:
    relay: str  # the relay's peer ID
    expires: int  # Unix time
    circuit_addrs: tuple[str, ...]  # where others reach us through this relay
    max_bytes: int  # the relay's per-circuit limits (0: none stated)
    max_seconds: int


def circuit_addrs(relay_addrs: Sequence[str], relay_id: str, peer_id: str) -> list[str]:
    """``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<peer>`` for each of the relay's
    addresses (wildcard and circuit ones skipped)."""
    out = []
    for addr in relay_addrs:
        base = addr.split("/p2p/")[0]
        if "/p2p-circuit" in addr or "/0.0.0.0/" in base or not base:
            continue
        out.append(f"{base}/p2p/{relay_id}/p2p-circuit/p2p/{peer_id}")
    return list(dict.fromkeys(out))


async def present_certificate(host: IHost, relay: ID, certificate: bytes) -> None:
    """Show the relay our admission certificate (RelayRefused with its reason)."""
    try:
        with trio.fail_after(EXCHANGE_TIMEOUT):
            stream = await host.new_stream(relay, [ADMIT_PROTOCOL])
            await stream.write(encode_varint_prefixed(certificate))
            reply = await read_varint_prefixed_bytes_limited(stream, MAX_ADMIT_REPLY)
            await stream.close()
    except trio.TooSlowError:
        raise RelayError(f"relay {relay} did not answer our certificate in time") from None
    except RelayError:
        raise
    except Exception as exc:  # libp2p raises many types for one failed exchange
        raise RelayError(f"relay {relay} does not take certificates: {exc}") from None
    text = reply.decode(errors="replace")
    if text != "ok":
        raise RelayRefused(f"relay {relay} refused our certificate: {text}")


async def reserve(host: IHost, relay_addr: str, *, certificate: bytes | None = None) -> Reservation:
    """Connect to a relay (``/ip4/.../tcp/.../p2p/<relay>``), present ``certificate`` if
    given, and reserve a slot; the reservation's circuit addresses name us."""
    info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
    try:
        with trio.fail_after(EXCHANGE_TIMEOUT):
            await host.connect(info)
    except Exception as exc:  # libp2p raises many types for one failed dial
        raise RelayError(f"cannot reach relay {relay_addr}: {exc}") from None
    if certificate is not None:
        await present_certificate(host, info.peer_id, certificate)
    try:
        with trio.fail_after(EXCHANGE_TIMEOUT):
            stream = await host.new_stream(info.peer_id, [HOP_PROTOCOL])
            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
            resp = await read_delimited_msg(stream, HopMessage)
            await stream.close()
    except Exception as exc:  # libp2p raises many types for one failed exchange
        raise RelayError(f"relay {info.peer_id} broke off the reservation: {exc!r}") from None
    status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.UNUSED
    if status != StatusCode.OK:
        raise RelayRefused(
            f"relay {info.peer_id} refused a reservation: {status.name}"
            + ("" if certificate is not None else _refusal_hint(StatusCode.PERMISSION_DENIED))
        )
    addrs = [str(multiaddr.Multiaddr(a)) for a in resp.reservation.addrs] or [relay_addr]
    me = str(host.get_id())
    return Reservation(
        relay=str(info.peer_id),
        expires=int(resp.reservation.expire),
        circuit_addrs=tuple(circuit_addrs(addrs, str(info.peer_id), me)),
        max_bytes=int(resp.limit.data) if resp.HasField("limit") else 0,
        max_seconds=int(resp.limit.duration) if resp.HasField("limit") else 0,
    )


def _refusal_hint(status: StatusCode) -> str:
    """What to do about a relay's refusal, where the user can do something: a reservation
    refused to a peer that showed no certificate, or a circuit refused for want of one."""
    if status == StatusCode.PERMISSION_DENIED:
        return (
            " (it serves admitted peers only: give --certificate FILE, an admission "
            "certificate from the relay's authority for this machine's key)"
        )
    return ""


def parse_circuit_addr(addr: str) -> tuple[str, str]:
    """``(relay addr ending /p2p/<relay>, target peer ID)`` of a circuit address."""
    head, sep, tail = addr.partition("/p2p-circuit/p2p/")
    if not sep or "/p2p/" not in head or not tail or "/" in tail:
        raise ValueError(f"not a circuit address (…/p2p/<relay>/p2p-circuit/p2p/<peer>): {addr}")
    return head, tail


@dataclass(frozen=True)
class Circuit:
    """A connection through a relay and the limits the relay stated for it (0: none
    stated; relay v2 sends them with its CONNECT answer)."""

    conn: Any
    max_bytes: int
    max_seconds: int


async def dial_via_relay(host: IHost, addr: str) -> Circuit:
    """A Noise + yamux connection to the peer named by circuit address ``addr``, through
    its relay (RelayRefused when the relay says no: the peer holds no reservation, or we
    are not admitted)."""
    relay_addr, target = parse_circuit_addr(addr)
    relay_info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
    target_id = ID.from_base58(target)
    try:
        with trio.fail_after(EXCHANGE_TIMEOUT):
            await host.connect(relay_info)
            stream = await host.new_stream(relay_info.peer_id, [HOP_PROTOCOL])
            await write_delimited_msg(
                stream,
                HopMessage(type=HopMessage.CONNECT, peer=CircuitPeerId(id=target_id.to_bytes())),
            )
            resp = await read_delimited_msg(stream, HopMessage)
    except Exception as exc:  # libp2p raises many types for one failed exchange
        raise RelayError(f"relay {relay_info.peer_id} unusable: {exc!r}") from None
    status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.UNUSED
    if status != StatusCode.OK:
        await stream.reset()
        raise RelayRefused(
            f"relay {relay_info.peer_id} would not connect us to {target}: {status.name}"
            + _refusal_hint(status)
        )
    circuit = multiaddr.Multiaddr(f"/p2p/{relay_info.peer_id}/p2p-circuit/p2p/{target}")
    raw = RawConnection(
        stream=stream, initiator=True, connection_type=ConnectionType.RELAYED, addresses=[circuit]
    )
    has_limit = resp.HasField("limit")
    try:
        with trio.fail_after(EXCHANGE_TIMEOUT):
            conn = await host.upgrade_outbound_connection(raw, target_id)
        return Circuit(
            conn,
            max_bytes=int(resp.limit.data) if has_limit else 0,
            max_seconds=int(resp.limit.duration) if has_limit else 0,
        )
    except Exception as exc:  # libp2p raises many types for one failed upgrade
        raise RelayError(f"handshake with {target} through the relay failed: {exc!r}") from None


def direct_connection(host: IHost, peer: ID) -> Any | None:
    """A live connection to ``peer`` that does not run through a relay, if any."""
    conns = host.get_network().get_connections(peer)
    for conn in conns:
        if getattr(conn, "is_closed", False):
            continue
        try:
            addrs = conn.get_transport_addresses()
        except Exception:  # a connection that cannot say is not known to be direct
            continue
        if addrs and all("/p2p-circuit" not in str(a) for a in addrs):
            return conn
    return None


@asynccontextmanager
async def nat_services(
    host: IHost, *, limits: RelayLimits | None = None
) -> AsyncIterator[DCUtRProtocol]:
    """What a node needs to be reached through relays and to hole-punch: the relay v2
    stop handler (accepts circuits the relay opens to us) and DCUtR."""
    stop = CircuitV2Protocol(host, limits=limits or control_limits(), allow_hop=False)
    dcutr = DCUtRProtocol(host)
    patches.stop_dcutr_auto_drive(dcutr)  # the dialler starts the one session
    install_punch_dial(host, dcutr)
    try:
        async with background_trio_service(stop), background_trio_service(dcutr):
            await stop.event_started.wait()
            await dcutr.event_started.wait()
            yield dcutr
    finally:
        # DCUtRProtocol registers itself on the host and never leaves; a stopped one must
        # not be found there by the next user (p2p.nat.punch looks for a running one).
        patches.forget_dcutr(host, dcutr)
