"""A node's connections: dialling peers (directly, or through a relay and a hole punch),
opening blob streams on them, and the extra connections (lanes) a fetch stripes over.

1. A blob stream needs no round trip of its own: its protocol proposal and the first
   request leave together (``p2p.blob.shell.OptimisticStream``), and a failed open is
   retried a few times (``STREAM_OPEN_RETRY_PAUSES``).
2. Striping: a fetch may open up to ``MAX_CONNECTIONS_PER_PROVIDER`` extra connections
   (lanes) to a provider; a stream that names none goes on the first connection that is
   no lane, the control lane (p2p.fetch.downloader rule 9). A provider `connect` is told
   to dial lanes to gets as many as its TCP RTT calls for, dialled beside its handshake.
3. A peer reached by hole punching or through a relay is never striped: its NAT drops
   unasked SYNs.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Sequence
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from p2p.blob import messages
from p2p.blob.shell import (
    MULTISTREAM,
    BlobClient,
    OptimisticStream,
    StreamLost,
    close_quietly,
    multistream_message,
    reset_quietly,
)
from p2p.blob.swarm import Listed
from p2p.blob.ticket import validate_peer_addr
from p2p.errors import BadAddress, PeerUnreachable
from p2p.fetch.striping import StripeConfig
from p2p.nat.punch import DEFAULT_PUNCH_TIMEOUT, PunchJobs
from p2p.nat.relay import direct_connection, nat_services, parse_circuit_addr
from p2p.node.admission import present
from p2p.transport import patches
from p2p.transport.fast import connection_rtt
from p2p.transport.fast.upgrade import on_tcp_dialled

log = logging.getLogger(__name__)

DIAL_TIMEOUT = 15.0
# Pauses after failed stream opens before the next try (three tries in all).
STREAM_OPEN_RETRY_PAUSES = (0.2, 0.5, 0.0)
# Connections a fetch may stripe one provider's streams over (p2p.fetch.scheduler.StripeConfig).
MAX_CONNECTIONS_PER_PROVIDER = StripeConfig().max_connections

# What a blob stream's first write proposes, and what a blobnet server answers: the
# multistream header and the version's protocol, echoed (p2p.blob.shell.OptimisticStream).
PROPOSALS = {
    v: multistream_message(MULTISTREAM) + multistream_message(v.protocol_id.encode())
    for v in messages.Version
}
BLOB_PROPOSAL = PROPOSALS[messages.Version.V1_0]
# A `peers` question (open, ask, answer) takes two round trips: 5 s covers a slow path.
PEX_TIMEOUT = 5.0
# A listed fellow is dialled for at most this long per address: it is a bonus, not a need.
SWARM_DIAL_TIMEOUT = 5.0

# The connection the next stream to a peer should use; read by the swarm's connection
# choice that `choose_connections` installs (a context variable: per trio task).
PREFERRED_CONNECTION: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "blobnet_preferred_connection", default=None
)


def choose_connections(swarm: Any, control: Callable[[Any, list[Any]], Any] | None = None) -> bool:
    """Let `Connections.open_blob_stream` pick which of a peer's connections a new stream uses.

    py-libp2p 0.8.1's ``Swarm.new_stream`` picks one with ``_select_connection`` (by
    default the one with the most streams, which would pile every stream onto one TCP
    connection). Wrapping it keeps the rest of ``new_stream`` (resource accounting,
    retries, protocol negotiation) as py-libp2p does it. A stream with no preferred
    connection goes where ``control(peer_id, connections)`` says, when it names one:
    the control lane, which carries no bulk data (`Connections._control_connection`). False if
    this py-libp2p has no such hook: streams then go where it puts them, and fetches do
    not stripe."""

    def make(original: Callable[[list[Any], Any], Any]) -> Callable[[list[Any], Any], Any]:
        def select(connections: list[Any], peer_id: Any) -> Any:
            wanted = PREFERRED_CONNECTION.get()
            if wanted is not None and wanted in connections:
                return wanted
            if control is not None:
                chosen = control(peer_id, connections)
                if chosen is not None:
                    return chosen
            return original(connections, peer_id)

        return select

    return patches.wrap_select_connection(swarm, make)


class Connections:
    """A node's dials, blob streams and lanes (see :mod:`p2p.node.connections`): it owns
    the lanes each provider has, the addresses they are dialled at, and the hole punches
    (``punches``). ``background``: the node's nursery, for lanes dialled beside a handshake
    and the NAT services (None: neither outlives the call that needs it)."""

    def __init__(
        self,
        host: Any,
        dht: KadDHT | None,
        *,
        stripe: StripeConfig,
        certificate: bytes | None = None,
        relayed_fetch: bool = False,
        punch_timeout: float = DEFAULT_PUNCH_TIMEOUT,
        background: trio.Nursery | None = None,
    ) -> None:
        self.host = host
        self.dht = dht
        self.stripe = stripe
        self.certificate = certificate
        self.relayed_fetch = relayed_fetch
        self.punch_timeout = punch_timeout
        self.punches = PunchJobs()
        self._background = background
        self._nat_up: trio.Event | None = None
        # Extra connections per peer that fetches stripe streams over (lane 1, 2, ...);
        # lane 0 is whichever connection the swarm had first.
        self._lanes: dict[str, list[Any]] = {}
        self._striping = choose_connections(host.get_network(), self._control_connection)
        self._dialled: dict[str, Multiaddr] = {}
        # Providers being dialled to fetch from (`connect(..., lanes=True)`): once the TCP
        # connect of the first connection is up, its RTT says how many bulk lanes to dial
        # (StripeConfig.early_lanes), beside its Noise handshake rather than after it.
        self._lanes_wanted: set[str] = set()
        self._early_lanes: dict[str, trio.Event] = {}  # peer -> those lanes are dialled
        # Peers reached by hole punching or through a relay: no second connection can be
        # dialled to them (their NAT drops unasked SYNs), so fetches do not stripe them.
        self._unstripeable: set[str] = set()
        on_tcp_dialled(host, self._on_tcp_dialled)

    @property
    def peer_id(self) -> str:
        return str(self.host.get_id())

    async def connect(self, addr: str, *, lanes: bool = False) -> str:
        """Dial a peer by ``/ip4/.../tcp/.../p2p/<id>``; return its peer ID. A circuit
        address (``.../p2p/<relay>/p2p-circuit/p2p/<id>``) is reached through its relay
        and hole-punched (``p2p.nat.punch.punch_through``); PeerUnreachable with the one-line
        reason when no direct connection came of it (unless ``relayed_fetch``).

        ``lanes``: the peer is a provider about to be fetched from. If the TCP connect
        shows a long path (``StripeConfig.early_lanes`` of its RTT), that many bulk lanes
        are dialled at once, beside the first connection's Noise handshake: they are up a
        round trip sooner than if the fetch dialled them once it starts (`wait_lanes`)."""
        maddr = validate_peer_addr(addr, error=BadAddress)
        if "/p2p-circuit" in addr:
            return await self._connect_circuit(addr)
        info = info_from_p2p_addr(maddr)
        peer = str(info.peer_id)
        # An explicit dial is a deliberate retry: py-libp2p would refuse every dial to a
        # peer for 60 s after one failed (its negative cache), so a peer back from a pause
        # or a restart stayed unreachable that long. Callers bound their own retries.
        unblock = getattr(self.host.get_network(), "unblock_peer", None)
        if unblock is not None:
            unblock(info.peer_id)
        known = self._dialled.get(peer)
        if lanes and info.addrs and peer not in self._early_lanes:
            self._dialled[peer] = info.addrs[0]  # where the lanes go (add_connection)
            self._lanes_wanted.add(peer)
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                await self.host.connect(info)
        except Exception as exc:  # libp2p raises many types for one failed dial
            if known is not None:
                self._dialled[peer] = known
            else:
                self._dialled.pop(peer, None)
            raise PeerUnreachable(f"cannot reach {addr}: {exc}") from None
        finally:
            self._lanes_wanted.discard(peer)
        if info.addrs:
            self._dialled[peer] = info.addrs[0]
        if self.certificate is not None:
            # Once per connection, to nodes that serve admitted peers only (admission rule 2).
            await present(self.host, peer, self.certificate)
        if self.dht is not None:
            try:
                # Bounded: a full routing-table bucket makes py-libp2p ping its oldest peer.
                with trio.move_on_after(DIAL_TIMEOUT):
                    await self.dht.add_peer(info.peer_id)
            except Exception as exc:  # a DHT-less peer is still a blob peer
                log.debug("DHT add_peer %s failed: %r", info.peer_id, exc)
        return str(info.peer_id)

    async def _connect_circuit(self, addr: str) -> str:
        try:
            parse_circuit_addr(addr)
        except ValueError as exc:
            raise BadAddress(str(exc)) from None
        await self._nat_services_up()
        punch = await self.punches.punch(
            self,
            addr,
            self._background,
            now=trio.current_time(),
            certificate=self.certificate,
            allow_relayed=self.relayed_fetch,
            punch_timeout=self.punch_timeout,
        )
        if punch.path == "failed":
            raise PeerUnreachable(punch.reason)
        self._unstripeable.add(punch.peer)
        return punch.peer

    async def _nat_services_up(self) -> None:
        """DCUtR (and relay v2's stop side) running on the host for as long as the node
        runs, started on first need; ``p2p.nat.punch.reachable`` may have started them."""
        if patches.running_dcutr(self.host) is not None or self._background is None:
            return  # running, or no nursery to hold them: punch_through brings its own
        if self._nat_up is None:
            self._nat_up = trio.Event()
            self._background.start_soon(self._hold_nat_services, self._nat_up)
        await self._nat_up.wait()

    async def _hold_nat_services(self, up: trio.Event) -> None:
        try:
            async with nat_services(self.host):
                up.set()
                await trio.sleep_forever()
        finally:
            up.set()

    def connected_peers(self) -> list[str]:
        return [str(p) for p in self.host.get_connected_peers()]

    def may_fetch_from(self, peer: str) -> bool:
        """Whether a provider candidate may be asked for blobs now: not while the only
        connection to it runs through a relay (a punch still in flight keeps it open),
        unless ``relayed_fetch``; else the blob would cross the relay. Once the punch
        lands, a later discovery pass (or a retry) offers the peer again."""
        if self.relayed_fetch or peer not in self.connected_peers():
            return True
        return direct_connection(self.host, ID.from_base58(peer)) is not None

    def circuit_addrs(self, peer: str) -> list[str]:
        """Circuit addresses a provider (found on the DHT) is known by, if we are not
        connected to it: a NATed provider is reachable only through them."""
        if peer in self.connected_peers():
            return []
        try:
            addrs = [str(a) for a in self.host.get_peerstore().addrs(ID.from_base58(peer))]
        except Exception:  # no addresses known
            return []
        return [a for a in addrs if "/p2p-circuit" in a and a.endswith(f"/p2p/{peer}")]

    async def open_blob_stream(
        self, peer: str, *, pipelined: bool = False, tentative: bool = False
    ) -> Any:
        """A new ``/blobnet/blob/1.0.0`` stream to ``peer`` (StreamLost if impossible);
        ``pipelined``: a ``/blobnet/blob/1.1.0`` one, where `get` requests may be sent ahead;
        ``tentative``: a ``/blobnet/blob/1.5.0`` one, where a `get` may be a `try_get`.

        py-libp2p 0.8.1 sometimes loses a connection when another protocol's negotiation
        fails on it (a DHT query to a peer without the DHT, say); the swarm then redials
        from the peerstore, so a failed open is retried a few times before giving up."""
        version = (
            messages.Version.V1_5
            if tentative
            else messages.Version.V1_1
            if pipelined
            else messages.Version.V1_0
        )
        last: Exception | None = None
        for pause in STREAM_OPEN_RETRY_PAUSES:
            try:
                return await self._open_optimistic(ID.from_base58(peer), version)
            except (BaseLibp2pError, OSError, trio.BrokenResourceError) as exc:
                last = exc
                await trio.sleep(pause)
        raise StreamLost(f"cannot open a stream to {peer}: {last}") from last

    async def _open_optimistic(
        self, peer_id: ID, version: messages.Version = messages.Version.V1_0
    ) -> OptimisticStream:
        """A muxed stream with the blob protocol proposed but not yet confirmed: the first
        request goes out in the same round trip (the client checks the answer)."""
        proposal = PROPOSALS[version]
        stream = await self.host.get_network().new_stream(peer_id)
        try:
            await stream.write(proposal)
        except BaseException:
            with trio.CancelScope(shield=True):
                try:
                    await stream.reset()
                except Exception:  # the stream is being abandoned either way
                    pass
            raise
        stream.set_protocol(TProtocol(version.protocol_id))
        return OptimisticStream(stream, proposal)

    async def ask_peers(self, peer: str, blob_id: str) -> tuple[Listed, ...]:
        """Who else fetches or holds ``blob_id``, according to ``peer`` (1.2.0 ``peers``);
        empty if ``peer`` does not say (an older server, not_found, a failure)."""
        stream: Any = None
        try:
            with trio.fail_after(PEX_TIMEOUT):
                version = messages.Version.V1_2
                stream = await self._open_optimistic(ID.from_base58(peer), version)
                answer = await BlobClient(stream, version=version).peers(blob_id)
            await close_quietly(stream)
        except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
            log.debug("peers of %s from %s: %r", blob_id[:12], peer, exc)
        except (StreamLost, messages.ProtocolError, ValueError) as exc:
            log.debug("peers of %s from %s: %r", blob_id[:12], peer, exc)
        else:
            if isinstance(answer, messages.PeersResponse):
                return answer.peers
            return ()
        if stream is not None:
            await reset_quietly(stream)
        return ()

    async def dial_listed(self, peer: str, addrs: Sequence[str]) -> bool:
        """Connect to a peer that a `peers` answer listed, trying its addresses in turn."""
        for addr in addrs:
            try:
                with trio.fail_after(SWARM_DIAL_TIMEOUT):
                    await self.connect(f"{addr}/p2p/{peer}")
                return True
            except (PeerUnreachable, BadAddress, trio.TooSlowError) as exc:
                log.debug("listed peer %s at %s: %s", peer, addr, exc)
        return False

    async def open_blob_stream_on(
        self, peer: str, lane: int, *, pipelined: bool = False, tentative: bool = False
    ) -> Any:
        """A blob stream to ``peer`` on its connection number ``lane`` (0: the first one;
        1, 2, ...: those `add_connection` opened, counted modulo the live ones)."""
        conn = self._lane_connection(peer, lane)
        token = PREFERRED_CONNECTION.set(conn)
        try:
            return await self.open_blob_stream(peer, pipelined=pipelined, tentative=tentative)
        finally:
            PREFERRED_CONNECTION.reset(token)

    def connection_rtt(self, peer: str) -> float | None:
        """The kernel's RTT of the first live connection to ``peer`` (the control lane
        once a fetch stripes it), or None: not connected, or not on the fast path."""
        conn = self._lane_connection(peer, 0)
        return None if conn is None else connection_rtt(getattr(conn, "muxed_conn", None))

    def connection_count(self, peer: str) -> int:
        """Connections to ``peer`` that `open_blob_stream_on` spreads streams over."""
        return 1 + len(self._live_lanes(peer))

    def _control_connection(self, peer_id: Any, connections: list[Any]) -> Any:
        """Where a stream with no preferred connection goes: once a fetch stripes
        ``peer_id`` over lanes of its own, the first connection that is no lane, which
        then carries no bulk data (p2p.fetch.downloader's control lane). A ``status`` or
        ``peers`` answer from a busy seeder so waits behind no chunks in that
        connection's send buffer (seconds, at 100 Mbit/s shared by eight fetchers'
        streams). None: no lanes, py-libp2p chooses."""
        lanes = self._lanes.get(str(peer_id))
        if not lanes:
            return None
        taken = {id(c) for c in lanes}
        for conn in connections:
            if id(conn) not in taken and not getattr(conn, "is_closed", False):
                return conn
        return None

    async def add_connection(self, peer: str) -> bool:
        """Open one more TCP connection (Noise + yamux) to ``peer`` for striping; False
        if none could be opened or the peer already has its share (the first connection,
        which becomes the control lane, and MAX_CONNECTIONS_PER_PROVIDER lanes)."""
        if not self._striping or self.connection_count(peer) > MAX_CONNECTIONS_PER_PROVIDER:
            return False
        if peer in self._unstripeable:
            return False
        peer_id = ID.from_base58(peer)
        addr = self._dialled.get(peer) or first_tcp_addr(self.host, peer_id)
        if addr is None:
            return False
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                conn = await self.host.get_network().dial_addr(addr, peer_id)
        except Exception as exc:  # libp2p raises many types for one failed dial
            log.info("extra connection to %s failed: %r", peer, exc)
            return False
        self._lanes.setdefault(peer, []).append(conn)
        return True

    def _on_tcp_dialled(self, peer_id: ID, rtt: float | None) -> None:
        """A dial's TCP connect is up (p2p.transport.fast.upgrade.on_tcp_dialled): for a provider
        `connect` was asked to dial lanes to, dial as many as its RTT calls for."""
        peer = str(peer_id)
        if peer not in self._lanes_wanted or self._background is None:
            return
        self._lanes_wanted.discard(peer)
        count = self.stripe.early_lanes(rtt) - len(self._live_lanes(peer))
        if count <= 0 or not self._striping or peer in self._unstripeable:
            return
        ms = (rtt or 0.0) * 1e3
        log.info("provider %s: %d connections at once (%.0f ms away)", peer, count, ms)
        done = self._early_lanes[peer] = trio.Event()
        self._background.start_soon(self._dial_early_lanes, peer, count, done)

    async def _dial_early_lanes(self, peer: str, count: int, done: trio.Event) -> None:
        try:
            async with trio.open_nursery() as dials:
                for _ in range(count):
                    dials.start_soon(self.add_connection, peer)
        finally:
            done.set()
            if self._early_lanes.get(peer) is done:
                del self._early_lanes[peer]

    async def wait_lanes(self, peer: str) -> None:
        """Until the lanes `connect` began to dial to ``peer`` are up or failed (at once
        if it dialled none)."""
        done = self._early_lanes.get(peer)
        if done is not None:
            await done.wait()

    def _live_lanes(self, peer: str) -> list[Any]:
        lanes = [c for c in self._lanes.get(peer, []) if not getattr(c, "is_closed", False)]
        if lanes:
            self._lanes[peer] = lanes
        else:
            self._lanes.pop(peer, None)
        return lanes

    def _lane_connection(self, peer: str, lane: int) -> Any:
        lanes = self._live_lanes(peer)
        if lane > 0 and lanes:
            return lanes[(lane - 1) % len(lanes)]
        extra = {id(c) for c in lanes}
        try:
            conns = self.host.get_network().get_connections(ID.from_base58(peer))
        except Exception:  # an unknown peer: let the swarm dial as usual
            return None
        for conn in conns:
            if id(conn) not in extra and not getattr(conn, "is_closed", False):
                return conn
        return None


def first_tcp_addr(host: Any, peer_id: ID) -> Multiaddr | None:
    try:
        addrs = host.get_peerstore().addrs(peer_id)
    except Exception:  # no addresses known
        return None
    for addr in addrs:
        if "/tcp/" in str(addr) and "/ws" not in str(addr):
            return addr  # type: ignore[no-any-return]
    return None
