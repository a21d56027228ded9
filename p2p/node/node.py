"""The blobnet node: a libp2p host, the store, the blob protocol server, a downloader and
the Kademlia DHT, usable embedded in trio programs::

    async with open_node(store_root) as node:
        blob_id = await node.add(path)
        await node.fetch(other_id, providers=["/ip4/.../tcp/.../p2p/12D3KooW..."])

Providers of a fetch come from (a) peers named by the caller (multiaddrs or a ticket),
(b) peers already connected, which are asked ``have``, and (c) the DHT, searched in the
background while the transfer runs; providers found late join it. No step waits on a
fixed delay. Every complete blob this node holds is provided on the DHT at start, when it
arrives, and again every ``reprovide_interval``.

Round trips from ``blob get`` to the first verified chunk, from a named provider
(counted on the wire; each is one path RTT, 200 ms between continents):

1. TCP connect: 1.
2. multistream-select of Noise: 1 (``p2p.transport.fast.upgrade.FastSecurityMultistream`` sends the
   header and the proposal together; py-libp2p's dialler waits for the header's answer
   first, 2).
3. Noise XX: 1 (the dialler's third message leaves with what follows).
4. multistream-select of yamux: 1 (``p2p.transport.fast.upgrade.select_pipelined`` sends the header
   and the proposal together; py-libp2p alone takes 2). Identify runs in the background.
5. A blob stream needs no round trip of its own: the protocol proposal and the first
   request leave together (``p2p.blob.shell.OptimisticStream``; py-libp2p's ``new_stream``
   takes 2). ``manifest`` and ``have`` go out at the same time on two streams
   (``p2p.fetch.downloader.HaveProbes``; ``have`` does not wait for the manifest): 1.
6. ``get`` on the ``have`` stream: 1, plus the first chunk's own transfer time.

So 6 round trips where there were 13 (two stream opens of 2 each, ``have`` after the
manifest, and one round trip each of the Noise and yamux negotiations cut); without the
fast path (``fast=False``) the two negotiations take their 2 each. Named providers are
dialled at once and each joins the fetch as soon as it is connected, so one that accepts
TCP and never completes the handshake costs nothing (``HANDSHAKE_TIMEOUT`` ends its dial).

Behind NAT (``p2p.nat.punch``): ``connect`` reaches a circuit address
(``.../p2p/<relay>/p2p-circuit/p2p/<peer>``) through its relay and hole-punches; the fetch
then uses the direct connection (``NodeConfig.relayed_fetch`` lets it use the relayed one
when the punch fails). DHT providers known only by circuit addresses are punched to before
they join a fetch. A node that holds reservations hands out its circuit addresses
(``set_advertised``, ``reachable_addrs``) and provides its blobs again so DHT records name
them.

Swarming (``p2p.blob.swarm``): while a fetch runs, its providers are asked ``peers``
(``/blobnet/blob/1.2.0``, on a stream of its own) about once a second; fellow fetchers they
name are dialled (bounded) and join the fetch as partial providers. The node serves the
blob protocol while it fetches (``NodeConfig.upload``, paced by ``upload_limit``), so
fellows fetch from it in turn. Striped providers: a stream that names no connection goes on
the first one, the control lane (``_control_connection``; p2p.fetch.downloader rule 9).
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from blobstore import BlobNotFound, Store
from identity import MachineKey, TrustStore, load_or_create_key
from p2p.blob import protocol as proto
from p2p.blob.pacing import Pacer
from p2p.blob.server import BlobServer, ServerLimits
from p2p.blob.shell import (
    MULTISTREAM,
    BlobClient,
    OptimisticStream,
    StreamLost,
    close_quietly,
    multistream_message,
    reset_quietly,
)
from p2p.blob.swarm import PEX_DIAL_PARALLELISM, Listed, PexBook
from p2p.blob.ticket import MAX_TICKET_ADDRS, Ticket, validate_peer_addr
from p2p.errors import (
    BadAddress,
    FetchFailed,
    ListenFailed,
    NoProviders,
    PeerUnreachable,
    unwrap_single,
)
from p2p.fetch.downloader import Progress, ProgressCallback, download_blob
from p2p.fetch.scheduler import SchedulerConfig
from p2p.fetch.scores import PeerScores
from p2p.fetch.striping import StripeConfig
from p2p.logs import no_handler_of_our_own, quiet_unless_chosen
from p2p.metrics import Metrics
from p2p.node.admission import UNADMITTED, install_gate, open_answer, present
from p2p.node.dht_hygiene import forget_clients_on_disconnect
from p2p.transport import patches
from p2p.transport.fast import connection_rtt
from p2p.transport.host import build_host
from p2p.transport.providers import ProviderLimits, install_provider_guard

if TYPE_CHECKING:
    from p2p.names.record import NameRecord

log = logging.getLogger(__name__)


no_handler_of_our_own()

DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)
# Provider records expire on DHT peers; refresh well inside go-libp2p's 22 h lifetime.
DEFAULT_REPROVIDE_INTERVAL = 3600.0
DIAL_TIMEOUT = 15.0
# Pauses after failed stream opens before the next try (three tries in all).
STREAM_OPEN_RETRY_PAUSES = (0.2, 0.5, 0.0)
# How soon a blob put into the store by another process gets provided on the DHT.
NEW_BLOB_POLL = 10.0
# Connected peers asked "have" for each fetch; beyond this, rely on the DHT.
MAX_CONNECTED_CANDIDATES = 32
# Children of a collection fetched at once.
COLLECTION_PARALLELISM = 4
# Admission refusals remembered (p2p.node.admission): one line per provider that said no.
MAX_REFUSALS = 256
# Senders of bad chunks named in status (the total is counted beyond them).
MAX_BAD_PEERS = 1024
# The multihash code of BLAKE3-256 (0x1e, length 0x20) prefixes blob IDs as DHT keys.
DHT_KEY_PREFIX = "1e20"
# Connections a fetch may stripe one provider's streams over (p2p.fetch.scheduler.StripeConfig).
MAX_CONNECTIONS_PER_PROVIDER = StripeConfig().max_connections
# The swarm's own per-peer cap (py-libp2p trims connections beyond it, default 3) must
# leave room for those and the first connection (the control lane once a fetch stripes),
# plus one the peer dialled to us (a DHT query, its own fetch).
SWARM_CONNECTIONS_PER_PEER = MAX_CONNECTIONS_PER_PROVIDER + 2

# What a blob stream's first write proposes, and what a blobnet server answers: the
# multistream header and the version's protocol, echoed (p2p.blob.shell.OptimisticStream).
PROPOSALS = {
    v: multistream_message(MULTISTREAM) + multistream_message(v.protocol_id.encode())
    for v in proto.Version
}
BLOB_PROPOSAL = PROPOSALS[proto.Version.V1_0]
# A `peers` question (open, ask, answer) takes two round trips: 5 s covers a slow path.
PEX_TIMEOUT = 5.0
# A listed fellow is dialled for at most this long per address: it is a bonus, not a need.
SWARM_DIAL_TIMEOUT = 5.0
# With peer exchange on, requests to a peer hold at most ~1 s of its rate and 4 MiB before
# it is measured (SchedulerConfig.max_request_seconds): a 100 Mbit/s seeder shared by four
# fetchers is then asked for ~3 MiB at a time by each, not 16 MiB twice over, and the rest
# comes from whichever fellow has it by then.
SWARM_REQUEST_SECONDS = 0.25
SWARM_UNMEASURED_BATCH_BYTES = 2 * 1024 * 1024
# Peer exchange stops looking once, this long into a fetch, no manifest has been found, no
# dial or question is in flight and nobody named a fellow: otherwise its open channel keeps
# the provider search waiting out --discovery-timeout when every named peer said not_found.
PEX_QUIET_GRACE = 3.0
# NATed providers found on the DHT that one fetch punches to (each costs a relay dial and
# DCUtR's rounds; p2p.nat.punch.MAX_PUNCHES is the same cap for named ones), and relays tried
# per provider (its circuit addresses name one per relay).
MAX_DHT_PUNCHES = 16
MAX_RELAYS_PER_PROVIDER = 4
# How long a dialled peer may take to finish the Noise and yamux handshakes once TCP is
# up: they take about five round trips, 1 s at 200 ms, so 5 s is generous; a peer that
# accepts TCP and never answers then costs 5 s per try, not py-libp2p's 10.
HANDSHAKE_TIMEOUT = 5.0

# The connection the next stream to a peer should use; read by the swarm's connection
# choice that `_choose_connections` installs (a context variable: per trio task).
_PREFERRED_CONNECTION: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "blobnet_preferred_connection", default=None
)


def _choose_connections(swarm: Any, control: Callable[[Any, list[Any]], Any] | None = None) -> bool:
    """Let `Node.open_blob_stream` pick which of a peer's connections a new stream uses.

    py-libp2p 0.8.1's ``Swarm.new_stream`` picks one with ``_select_connection`` (by
    default the one with the most streams, which would pile every stream onto one TCP
    connection). Wrapping it keeps the rest of ``new_stream`` (resource accounting,
    retries, protocol negotiation) as py-libp2p does it. A stream with no preferred
    connection goes where ``control(peer_id, connections)`` says, when it names one:
    the control lane, which carries no bulk data (`Node._control_connection`). False if
    this py-libp2p has no such hook: streams then go where it puts them, and fetches do
    not stripe."""

    def make(original: Callable[[list[Any], Any], Any]) -> Callable[[list[Any], Any], Any]:
        def select(connections: list[Any], peer_id: Any) -> Any:
            wanted = _PREFERRED_CONNECTION.get()
            if wanted is not None and wanted in connections:
                return wanted
            if control is not None:
                chosen = control(peer_id, connections)
                if chosen is not None:
                    return chosen
            return original(connections, peer_id)

        return select

    return patches.wrap_select_connection(swarm, make)


def dht_key(blob_id: str) -> str:
    return DHT_KEY_PREFIX + blob_id


@dataclass(frozen=True)
class NodeConfig:
    listen: tuple[str, ...] = DEFAULT_LISTEN
    bootstrap: tuple[str, ...] = ()
    dht: bool = True
    fast: bool = True
    reprovide_interval: float = DEFAULT_REPROVIDE_INTERVAL
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # When a fetch opens more connections to one provider (max_connections=1: never).
    stripe: StripeConfig = field(default_factory=StripeConfig)
    discovery_timeout: float = 10.0
    # Floodsub for small runs' announcements (tens of workers): every subscriber relays
    # a topic's messages to its connected subscribers, so a star around one worker works.
    pubsub: bool = False
    # Hash chunks again when serving them (see p2p.blob.server.BlobServer.verify_reads).
    verify_reads: bool = False
    # Hash a blob already in the store before a fetch takes it as done (a fetch must not
    # trust a rotten local copy). Costs a read of the blob, ~1 s per GiB.
    verify_local: bool = True
    # Serve the blob protocol (complete blobs and partial downloads alike) to other peers.
    # False: this node only fetches (fellows that are told of it fail one stream to it).
    upload: bool = True
    # Bytes per second this node's server sends at most, to all peers together (p2p.blob.pacing;
    # at least p2p.blob.pacing.MIN_UPLOAD_LIMIT). None: as fast as the link goes.
    upload_limit: float | None = None
    # Bytes per second this node's fetches receive at most, all together (a token bucket
    # that each arriving chunk draws on before the next is read). None: no limit.
    download_limit: float | None = None
    # Ask a fetch's providers which other peers fetch the same blob and fetch from them
    # too (p2p.blob.swarm).
    peer_exchange: bool = True
    # Behind NAT (p2p.nat.punch): when hole punching to a provider reached through a
    # relay fails, fetch through the relay (only a relay with raised circuit limits lets
    # a blob through); by default such a provider is left out, with its one-line reason.
    relayed_fetch: bool = False
    # The admission certificate shown to relays before a CONNECT (relays serve admitted
    # peers only unless run with --open-circuits).
    certificate: bytes | None = None
    punch_timeout: float = 30.0  # p2p.nat.punch.DEFAULT_PUNCH_TIMEOUT
    # The blob server's budgets and deadlines (p2p.blob.server.ServerLimits).
    server_limits: ServerLimits = field(default_factory=ServerLimits)
    # What other peers may store in this node's DHT provider records (p2p.transport.providers).
    provider_limits: ProviderLimits = field(default_factory=ProviderLimits)
    # Serve blobs, names and status only to peers admitted by one of these authorities
    # (p2p.node.admission); None: serve everyone.
    admission: TrustStore | None = None
    # Answer DHT queries and ask to be in others' routing tables (Kademlia server mode).
    # A short-lived node (one `blob get`) runs in client mode: it queries the DHT but no
    # server keeps it in its table after it is gone (p2p.node.dht_hygiene).
    dht_server: bool = True


class Node:
    """A running blobnet node. Create it with :func:`open_node`."""

    def __init__(
        self,
        store: Store,
        host: Any,
        server: BlobServer,
        dht: KadDHT | None,
        config: NodeConfig,
        pubsub: Any = None,
    ) -> None:
        self.store = store
        self.host = host
        self.server = server
        self.dht = dht
        self.config = config
        self.pubsub = pubsub
        # Peers that sent bad data, remembered across this node's downloads.
        self.scores = PeerScores()
        # Extra connections per peer that fetches stripe streams over (lane 1, 2, ...);
        # lane 0 is whichever connection the swarm had first.
        self._lanes: dict[str, list[Any]] = {}
        self._striping = _choose_connections(host.get_network(), self._control_connection)
        self._dialled: dict[str, Multiaddr] = {}
        # Providers being dialled to fetch from (`connect(..., lanes=True)`): once the TCP
        # connect of the first connection is up, its RTT says how many bulk lanes to dial
        # (StripeConfig.early_lanes), beside its Noise handshake rather than after it.
        self._lanes_wanted: set[str] = set()
        self._early_lanes: dict[str, trio.Event] = {}  # peer -> those lanes are dialled
        from p2p.transport.fast.upgrade import on_tcp_dialled

        on_tcp_dialled(host, self._on_tcp_dialled)
        # Behind NAT: the circuit addresses this node hands out once it holds
        # reservations (``set_advertised``; None: its own listen addresses).
        self.advertised: list[str] | None = None
        from p2p.nat.punch import PunchJobs

        self.punches = PunchJobs()
        # Peers reached by hole punching or through a relay: no second connection can be
        # dialled to them (their NAT drops unasked SYNs), so fetches do not stripe them.
        self._unstripeable: set[str] = set()
        # The node's own nursery (open_node), for punches and NAT services that outlive
        # the call that started them; None for a Node built by hand.
        self._background: trio.Nursery | None = None
        self._nat_up: trio.Event | None = None
        self._reprovide_now = trio.Event()
        # What an operator sees (p2p.metrics, ``blob status``): counters owned by this node,
        # and the latest progress of each fetch in flight, by blob ID.
        self.metrics = Metrics()
        self.transfers: dict[str, Progress] = {}
        # Providers that serve admitted peers only and refused us, with their one line
        # (p2p.node.admission rule 3), and an event set when one more did.
        self.refusals: dict[str, str] = {}
        # Chunks received that failed their hash, in all and by the latest senders
        # (p2p.fetch.downloader.BadDataAware; at most MAX_BAD_PEERS named).
        self.bad_chunks_total = 0
        self.bad_chunks: dict[str, int] = {}
        # p2p.fetch.downloader.PacedNetwork: what NodeConfig.download_limit allows.
        self.download_pacer = (
            None
            if config.download_limit is None
            else Pacer(config.download_limit, trio.current_time())
        )
        self._refusal = trio.Event()

    # --- pubsub ----------------------------------------------------------------------
    async def subscribe(self, topic: str) -> Any:
        """Subscribe to ``topic``; ``await sub.get()`` yields messages (``.data``,
        ``.from_id``). The node must have been opened with ``pubsub=True``."""
        if self.pubsub is None:
            raise RuntimeError("this node runs without pubsub (open_node(..., pubsub=True))")
        return await self.pubsub.subscribe(topic)

    async def publish(self, topic: str, data: bytes) -> None:
        if self.pubsub is None:
            raise RuntimeError("this node runs without pubsub (open_node(..., pubsub=True))")
        await self.pubsub.publish(topic, data)

    # --- identity and addresses ----------------------------------------------------
    @property
    def peer_id(self) -> str:
        return str(self.host.get_id())

    @property
    def addrs(self) -> list[str]:
        """Addresses other nodes can dial, each ending in ``/p2p/<peer id>`` (a wildcard
        listen address appears as each interface's address)."""
        from p2p.transport.addresses import dialable_addrs

        out = []
        for addr in self.host.get_addrs():
            text = str(addr)
            out.append(text if "/p2p/" in text else f"{text}/p2p/{self.peer_id}")
        return dialable_addrs(out)

    @property
    def reachable_addrs(self) -> list[str]:
        """The addresses to hand out (tickets, ready lines, announcements): the circuit
        addresses of a node behind NAT (``set_advertised``; nothing else can be dialled
        from outside, and a list of them stays short), else ``addrs``."""
        return list(self.advertised) if self.advertised else self.addrs

    def ticket(self, blob_id: str) -> str:
        """A ticket naming this node (``reachable_addrs``)."""
        return Ticket(blob_id, tuple(self.reachable_addrs[:MAX_TICKET_ADDRS])).encode()

    def set_advertised(self, addrs: Sequence[str] | None) -> None:
        """Hand out ``addrs`` (circuit addresses learned from reservations) in tickets,
        and provide every blob on the DHT again now, so provider records name them
        (``p2p.nat.punch.advertise`` already put them in ``host.get_addrs()``)."""
        self.advertised = list(addrs) if addrs else None
        self._reprovide_now.set()

    # --- connections -----------------------------------------------------------------
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
        if self.config.certificate is not None:
            # Once per connection, to nodes that serve admitted peers only (admission rule 2).
            await present(self.host, peer, self.config.certificate)
        if self.dht is not None:
            try:
                # Bounded: a full routing-table bucket makes py-libp2p ping its oldest peer.
                with trio.move_on_after(DIAL_TIMEOUT):
                    await self.dht.add_peer(info.peer_id)
            except Exception as exc:  # a DHT-less peer is still a blob peer
                log.debug("DHT add_peer %s failed: %r", info.peer_id, exc)
        return str(info.peer_id)

    async def _connect_circuit(self, addr: str) -> str:
        from p2p.nat.relay import parse_circuit_addr

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
            certificate=self.config.certificate,
            allow_relayed=self.config.relayed_fetch,
            punch_timeout=self.config.punch_timeout,
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
        from p2p.nat.relay import nat_services

        try:
            async with nat_services(self.host):
                up.set()
                await trio.sleep_forever()
        finally:
            up.set()

    def connected_peers(self) -> list[str]:
        return [str(p) for p in self.host.get_connected_peers()]

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
            proto.Version.V1_5
            if tentative
            else proto.Version.V1_1
            if pipelined
            else proto.Version.V1_0
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
        self, peer_id: ID, version: proto.Version = proto.Version.V1_0
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
                version = proto.Version.V1_2
                stream = await self._open_optimistic(ID.from_base58(peer), version)
                answer = await BlobClient(stream, version=version).peers(blob_id)
            await close_quietly(stream)
        except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
            log.debug("peers of %s from %s: %r", blob_id[:12], peer, exc)
        except (StreamLost, proto.ProtocolError, ValueError) as exc:
            log.debug("peers of %s from %s: %r", blob_id[:12], peer, exc)
        else:
            if isinstance(answer, proto.PeersResponse):
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
        token = _PREFERRED_CONNECTION.set(conn)
        try:
            return await self.open_blob_stream(peer, pipelined=pipelined, tentative=tentative)
        finally:
            _PREFERRED_CONNECTION.reset(token)

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
        addr = self._dialled.get(peer) or _first_tcp_addr(self.host, peer_id)
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
        count = self.config.stripe.early_lanes(rtt) - len(self._live_lanes(peer))
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

    # --- DHT -------------------------------------------------------------------------
    async def provide(self, blob_id: str) -> bool:
        if self.dht is None:
            return False
        try:
            with trio.move_on_after(30):
                return bool(await self.dht.provide(dht_key(blob_id)))
        except Exception as exc:  # provider records are best effort
            log.info("provide %s failed: %r", blob_id[:12], exc)
        return False

    async def find_providers(self, blob_id: str, limit: int = 20) -> list[str]:
        """Peer IDs that advertise ``blob_id`` on the DHT (their addresses go to the
        peerstore, so they can be dialled)."""
        if self.dht is None:
            return []
        try:
            infos = await self.dht.find_providers(dht_key(blob_id), limit)
        except Exception as exc:  # a failed lookup just finds nobody
            log.info("find_providers %s failed: %r", blob_id[:12], exc)
            return []
        found: list[str] = []
        for info in infos:
            if info.peer_id == self.host.get_id():
                continue
            if info.addrs:
                self.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 3600)
            if str(info.peer_id) not in found:
                found.append(str(info.peer_id))
        return found

    async def _reprovide_loop(self) -> None:
        """Provide every complete blob at start and each ``reprovide_interval``; blobs that
        appear meanwhile (a ``blob put`` beside a running ``blob serve``) are provided
        within ``NEW_BLOB_POLL`` seconds."""
        provided: dict[str, float] = {}
        while True:
            if self._reprovide_now.is_set():  # our addresses changed (set_advertised)
                self._reprovide_now = trio.Event()
                provided.clear()
            now = trio.current_time()
            ids = await trio.to_thread.run_sync(self._complete_ids)
            for blob_id in ids:
                last = provided.get(blob_id)
                if last is None or now - last >= self.config.reprovide_interval:
                    provided[blob_id] = now
                    await self.provide(blob_id)
            with trio.move_on_after(NEW_BLOB_POLL):
                await self._reprovide_now.wait()

    def _complete_ids(self) -> list[str]:
        return [blob_id for blob_id in self.store.blob_ids() if self.store.has(blob_id)]

    # --- blobs -----------------------------------------------------------------------
    async def add(self, path: str | os.PathLike[str], *, tag: str | None = None) -> str:
        """Put a file or directory into the store and announce it."""
        source = Path(path)
        if await trio.to_thread.run_sync(source.is_dir):
            blob_id = await trio.to_thread.run_sync(self.store.put_dir, source)
        else:
            blob_id = await trio.to_thread.run_sync(self.store.put_path, source)
        if tag is not None:
            await trio.to_thread.run_sync(self.store.tag, tag, blob_id)
        await self._announce(blob_id)
        return blob_id

    async def add_bytes(self, data: bytes) -> str:
        blob_id = await trio.to_thread.run_sync(self.store.put_bytes, data)
        await self._announce(blob_id)
        return blob_id

    async def _announce(self, blob_id: str) -> None:
        if self.dht is not None:
            with trio.move_on_after(30):
                await self.provide(blob_id)

    async def fetch(
        self,
        ref: str,
        *,
        providers: Sequence[str] = (),
        progress: ProgressCallback | None = None,
        recursive: bool = True,
        announce: bool = True,
    ) -> str:
        """Fetch a blob (by ID or ticket) and, for a collection, its children.

        ``providers`` are multiaddrs ending in ``/p2p/<id>``; connected peers and the DHT
        are asked as well. With ``announce`` the blob is then provided on the DHT.
        Returns the blob ID.
        """
        started = trio.current_time()
        outcome = "failed"
        tally = _Tally()
        try:
            blob_id = await self._fetch_unwrapped(ref, providers, progress, tally, recursive)
            outcome = "ok"
        except (NoProviders, FetchFailed) as exc:
            outcome = "not_found" if isinstance(exc, NoProviders) else "failed"
            reasons = self._refusals(providers)
            if reasons:
                raise type(exc)(f"{exc}; " + "; ".join(reasons)) from None
            raise
        except trio.Cancelled:
            outcome = "cancelled"
            raise
        finally:
            seconds = trio.current_time() - started
            self.metrics.fetch_ended(outcome, seconds)
            for seen in tally.last:
                self.transfers.pop(seen, None)
            for line in tally.lines(outcome, seconds):
                log.info("%s", line)
        if announce:
            await self._announce(blob_id)
        return blob_id

    async def _fetch_unwrapped(
        self,
        ref: str,
        providers: Sequence[str],
        progress: ProgressCallback | None,
        tally: _Tally,
        recursive: bool,
    ) -> str:
        try:
            return await self._fetch(ref, providers, self._counted(progress, tally), recursive)
        except BaseExceptionGroup as group:
            raise unwrap_single(group) from None

    def bad_chunk(self, peer: str) -> None:
        """``peer`` sent a chunk that failed its hash (the download bans it)."""
        self.bad_chunks_total += 1
        self.bad_chunks[peer] = self.bad_chunks.pop(peer, 0) + 1
        if len(self.bad_chunks) > MAX_BAD_PEERS:
            del self.bad_chunks[next(iter(self.bad_chunks))]

    def refused(self, peer: str, message: str) -> None:
        """A provider answered an error (p2p.fetch.downloader.RefusalAware): remember an
        admission refusal (bounded: one line per peer, MAX_REFUSALS peers)."""
        if not message.startswith(UNADMITTED):
            return
        if peer not in self.refusals and len(self.refusals) >= MAX_REFUSALS:
            del self.refusals[next(iter(self.refusals))]
        self.refusals[peer] = message
        self._refusal.set()
        self._refusal = trio.Event()

    def _refusals(self, providers: Sequence[str]) -> list[str]:
        """Why named providers refused us, if they did (admission rule 3): the one thing
        a user who forgot --certificate needs to read."""
        named = [a.rsplit("/p2p/", 1)[-1] for a in providers if "/p2p/" in a]
        return [f"{p} refused us: {self.refusals[p]}" for p in named if p in self.refusals]

    async def _end_when_all_refuse(self, dials: _Dials, blob_id: str) -> None:
        """Without a DHT to find others, a fetch whose every provider refused us for want
        of admission is over: say so now rather than after the discovery timeout."""
        if self.dht is not None:
            return
        while True:
            await self._refusal.wait()
            peers = set(self.connected_peers()) | set(dials.peers)
            if dials.pending == 0 and peers and peers <= set(self.refusals):
                raise NoProviders(f"no provider of {blob_id} would serve us")

    def _counted(self, progress: ProgressCallback | None, tally: _Tally) -> ProgressCallback:
        """``progress``, and the received-bytes counter, ``transfers`` and ``tally`` kept
        up to date."""

        def on_progress(update: Progress) -> None:
            fetched = sum(update.new_bytes.values())
            previous = tally.last.get(update.blob_id)
            grown = fetched - (sum(previous.new_bytes.values()) if previous else 0)
            tally.last[update.blob_id] = update
            if grown > 0:
                self.metrics.bytes_received.labels(protocol="blob").inc(grown)
            if update.finished:
                self.transfers.pop(update.blob_id, None)
            else:
                self.transfers[update.blob_id] = update
            if progress is not None:
                progress(update)

        return on_progress

    async def _fetch(
        self,
        ref: str,
        providers: Sequence[str],
        progress: ProgressCallback | None,
        recursive: bool,
    ) -> str:
        addrs = list(providers)
        from p2p.names import service as names

        if names.is_name_ref(ref):
            ref = (await names.resolve(self, ref)).blob_id
        if ref.startswith("blob1"):
            ticket = Ticket.decode(ref)
            blob_id = ticket.blob_id
            addrs.extend(ticket.addrs)
        else:
            from blobstore import parse_blob_id

            blob_id = parse_blob_id(ref)
        dials = _Dials()
        # The lease keeps gc off the parent and, once it is here, its children, however long
        # the fetch runs (gc's grace period alone would not).
        lease = await trio.to_thread.run_sync(self.store.lease, [blob_id])
        try:
            await self._fetch_leased(blob_id, addrs, dials, progress, recursive)
        finally:
            await trio.to_thread.run_sync(lease.release)
        return blob_id

    async def _fetch_leased(
        self,
        blob_id: str,
        addrs: list[str],
        dials: _Dials,
        progress: ProgressCallback | None,
        recursive: bool,
    ) -> None:
        async with trio.open_nursery() as nursery:
            # Named providers are dialled at once and each joins the fetch as soon as it
            # is connected: one that accepts TCP and never handshakes delays nobody.
            for addr in dict.fromkeys(addrs):
                dials.pending += 1
                nursery.start_soon(self._dial_into, addr, dials)
            nursery.start_soon(self._end_when_all_refuse, dials, blob_id)
            await self._fetch_one(blob_id, dials, progress)
            entries = (
                await trio.to_thread.run_sync(self.store.collection_entries, blob_id)
                if recursive
                else None
            )
            if entries is not None:
                limiter = trio.CapacityLimiter(COLLECTION_PARALLELISM)

                async def child(child_id: str) -> None:
                    async with limiter:
                        await self._fetch_one(child_id, dials, progress)

                async with trio.open_nursery() as children:
                    # Identical files (two empty ones, say) share one blob: fetch it once.
                    for child_id in dict.fromkeys(entry.blob_id for entry in entries):
                        children.start_soon(child, child_id)
            nursery.cancel_scope.cancel()

    async def _dial_into(self, addr: str, dials: _Dials) -> None:
        try:
            dials.add(await self.connect(addr, lanes=True))
        except PeerUnreachable as exc:
            log.info("%s", exc)
            dials.errors.append(str(exc))
        finally:
            dials.pending -= 1
            dials.wake()

    async def _fetch_one(
        self, blob_id: str, dials: _Dials, progress: ProgressCallback | None
    ) -> None:
        if await trio.to_thread.run_sync(self._intact, blob_id):
            return
        send, receive = trio.open_memory_channel[str](256)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._feed_dialled, dials, send.clone())
            if self.config.peer_exchange:
                nursery.start_soon(self._exchange, blob_id, dials, send.clone())
            nursery.start_soon(self._discover, blob_id, set(dials.peers), send)
            await download_blob(
                self,
                self.store,
                blob_id,
                providers=list(dials.peers),
                more_providers=receive,
                progress=progress,
                config=self._scheduler_config(),
                discovery_timeout=self.config.discovery_timeout,
                stripe_config=self.config.stripe,
                scores=self.scores,
                own_peer=self.peer_id,
                board=self.server.board,
            )
            nursery.cancel_scope.cancel()

    def _scheduler_config(self) -> SchedulerConfig:
        config = self.config.scheduler
        if not self.config.peer_exchange:
            return config
        return replace(
            config,
            max_request_seconds=config.max_request_seconds or SWARM_REQUEST_SECONDS,
            unmeasured_batch_bytes=config.unmeasured_batch_bytes or SWARM_UNMEASURED_BATCH_BYTES,
            defer_to_partial_holders=True,
        )

    async def _exchange(
        self, blob_id: str, dials: _Dials, send: trio.MemorySendChannel[str]
    ) -> None:
        """Peer exchange for one fetch (p2p.blob.swarm): ask its providers ``peers`` (each at
        most once per PEX_INTERVAL, backing off: `PexBook`), dial the new fellows they name
        (bounded), and hand each one reached to the download."""
        book = PexBook(self.peer_id)
        dialling = trio.Semaphore(PEX_DIAL_PARALLELISM)

        async def dial(peer: str, addrs: tuple[str, ...]) -> None:
            async with dialling:
                if not await self.dial_listed(peer, addrs):
                    return
            book.add_source(peer)
            try:
                await send.send(peer)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the download is over

        async def ask(source: str) -> None:
            fresh = book.to_dial(await self.ask_peers(source, blob_id))
            for peer, addrs in fresh:
                nursery.start_soon(dial, peer, addrs)
            book.answered(source, len(fresh))

        started = trio.current_time()
        async with send, trio.open_nursery() as nursery:
            while True:
                for peer in dials.peers:
                    book.add_source(peer)
                now = trio.current_time()
                if (
                    now - started >= PEX_QUIET_GRACE
                    and dials.pending == 0
                    and not nursery.child_tasks
                    and not await trio.to_thread.run_sync(self._manifest_known, blob_id)
                ):
                    return  # nothing anywhere: let the search end now
                for source in book.due(now):
                    nursery.start_soon(ask, source)
                # A named provider that connects is asked at once.
                with trio.move_on_after(max(book.next_wake(now) - now, 0.05)):
                    await dials.changed.wait()

    def _manifest_known(self, blob_id: str) -> bool:
        try:
            self.store.manifest(blob_id)
        except BlobNotFound:
            return False
        return True

    def _intact(self, blob_id: str) -> bool:
        """Whether the store holds ``blob_id`` whole and sound. With ``verify_local`` a
        local copy is hashed first: a rotten one is quarantined (``Store.verify``) and the
        fetch goes on, from its good chunks, rather than trusting it."""
        if not self.store.has(blob_id):
            return False
        if not self.config.verify_local:
            return True
        bad = self.store.verify(blob_id)
        if bad:
            log.warning(
                "local copy of %s is damaged (%d chunk(s)): quarantined, fetching it again",
                blob_id[:12],
                len(bad),
            )
        return not bad

    async def _feed_dialled(self, dials: _Dials, send: trio.MemorySendChannel[str]) -> None:
        """Hand the download each named provider as its dial succeeds, until all ended."""
        async with send:
            sent = len(dials.peers)  # those already connected went in as providers
            while True:
                for peer in dials.peers[sent:]:
                    await send.send(peer)
                sent = len(dials.peers)
                if dials.pending == 0:
                    return
                await dials.changed.wait()

    async def _discover(
        self, blob_id: str, seen: set[str], send: trio.MemorySendChannel[str]
    ) -> None:
        """Feed candidate providers: connected peers at once, then the DHT's answers,
        asked again with growing pauses (a provider may announce itself late) until the
        discovery timeout."""
        async with send:
            for peer in self.connected_peers()[:MAX_CONNECTED_CANDIDATES]:
                if peer not in seen and self._may_fetch_from(peer):
                    seen.add(peer)
                    await send.send(peer)
            if self.dht is None:
                return
            pause = 0.25
            # A NATed provider may first be found by a record from before its reservation
            # (its own addresses only), then by one naming its circuit: punch it then.
            punched: set[str] = set()
            async with trio.open_nursery() as punching:
                with trio.move_on_after(self.config.discovery_timeout):
                    while True:
                        for peer in await self.find_providers(blob_id):
                            circuits = [] if peer in punched else self._circuit_addrs(peer)
                            if circuits and len(punched) < MAX_DHT_PUNCHES:
                                punched.add(peer)
                                seen.add(peer)
                                punching.start_soon(self._punch_into, circuits, send.clone())
                            elif peer not in seen and self._may_fetch_from(peer):
                                seen.add(peer)
                                await send.send(peer)
                        await trio.sleep(pause)
                        pause = min(pause * 2, 4.0)

    def _may_fetch_from(self, peer: str) -> bool:
        """Whether a provider candidate may be asked for blobs now: not while the only
        connection to it runs through a relay (a punch still in flight keeps it open),
        unless ``relayed_fetch``; else the blob would cross the relay. Once the punch
        lands, a later discovery pass (or a retry) offers the peer again."""
        if self.config.relayed_fetch or peer not in self.connected_peers():
            return True
        from p2p.nat.relay import direct_connection

        return direct_connection(self.host, ID.from_base58(peer)) is not None

    def _circuit_addrs(self, peer: str) -> list[str]:
        """Circuit addresses a provider (found on the DHT) is known by, if we are not
        connected to it: a NATed provider is reachable only through them."""
        if peer in self.connected_peers():
            return []
        try:
            addrs = [str(a) for a in self.host.get_peerstore().addrs(ID.from_base58(peer))]
        except Exception:  # no addresses known
            return []
        return [a for a in addrs if "/p2p-circuit" in a and a.endswith(f"/p2p/{peer}")]

    async def _punch_into(self, circuits: list[str], send: trio.MemorySendChannel[str]) -> None:
        """Reach a NATed provider through the first of its relays that works and hand it
        to the download; a failure is in ``self.punches.failures``."""
        async with send:
            for addr in circuits[:MAX_RELAYS_PER_PROVIDER]:
                try:
                    peer = await self.connect(addr)
                except (PeerUnreachable, BadAddress) as exc:
                    log.info("%s", exc)
                    continue
                try:
                    await send.send(peer)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the download is over
                return

    # --- names (p2p/names/service.py, p2p/names/NAMES.md) -------------------------------
    async def publish_name(self, name: str, blob_id: str, **options: Any) -> NameRecord:
        """Sign ``<this peer ID>/name -> blob_id`` and spread it (see
        :func:`p2p.names.service.publish_name` for ``signer``, ``seq``, ``expiry_s``...)."""
        from p2p.names import service as names

        return await names.publish_name(self, name, blob_id, **options)

    async def resolve(self, ref: str, **options: Any) -> NameRecord:
        """The newest valid record for ``PUBLISHER/NAME`` (:func:`p2p.names.service.resolve`)."""
        from p2p.names import service as names

        return await names.resolve(self, ref, **options)

    async def export(self, blob_id: str, dest: str | os.PathLike[str]) -> None:
        await trio.to_thread.run_sync(self.store.export, blob_id, Path(dest))


class _Tally:
    """What one fetch received, by blob: the latest progress of each (its log lines)."""

    def __init__(self) -> None:
        self.last: dict[str, Progress] = {}

    def lines(self, outcome: str, seconds: float) -> list[str]:
        """One line per blob fetched (at INFO, ``-v``): peers, bytes, time, outcome."""
        out = []
        for blob_id, progress in self.last.items():
            peers = ", ".join(
                f"{peer} ({count} B)" for peer, count in progress.new_bytes.items() if count
            )
            out.append(
                f"fetched {blob_id[:12]}: {sum(progress.new_bytes.values())} bytes "
                f"from {peers or 'nobody'} in {progress.elapsed:.2f} s "
                f"({outcome if not progress.finished else 'ok'})"
            )
        if not out and outcome != "ok":
            out.append(f"fetch ended {outcome} after {seconds:.2f} s, nothing received")
        return out


class _Dials:
    """The named providers of one fetch, dialled at once (``Node._dial_into``)."""

    def __init__(self) -> None:
        self.peers: list[str] = []  # connected, in the order they answered
        self.errors: list[str] = []
        self.pending = 0
        self.changed = trio.Event()

    def add(self, peer: str) -> None:
        if peer not in self.peers:
            self.peers.append(peer)

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


def _key_pair(key: MachineKey | KeyPair | None, key_path: Path | None) -> KeyPair:
    if isinstance(key, KeyPair):
        return key
    if key is None:
        key = MachineKey.generate() if key_path is None else load_or_create_key(key_path)
    return key.libp2p_keypair()


@asynccontextmanager
async def open_node(
    store: Store | str | os.PathLike[str],
    *,
    key: MachineKey | KeyPair | None = None,
    key_path: str | os.PathLike[str] | None = None,
    listen: Sequence[str] = DEFAULT_LISTEN,
    bootstrap: Sequence[str] = (),
    dht: bool = True,
    fast: bool = True,
    pubsub: bool = False,
    dht_server: bool = True,
    config: NodeConfig | None = None,
) -> AsyncIterator[Node]:
    """Run a node for the duration of the ``async with`` block.

    ``key``/``key_path``: the machine identity (a fresh ephemeral key if neither is given).
    ``bootstrap``: DHT bootstrap peers, dialled at start (a failed one is logged).
    ``dht_server``: False for a short-lived node (NodeConfig.dht_server).
    """
    if config is None:
        config = NodeConfig(
            listen=tuple(listen),
            bootstrap=tuple(bootstrap),
            dht=dht,
            fast=fast,
            pubsub=pubsub,
            dht_server=dht_server,
        )
    quiet_unless_chosen()  # py-libp2p's routine churn is not the embedding program's
    if not isinstance(store, Store):
        store = await trio.to_thread.run_sync(_open_store, store)
    key_pair = _key_pair(key, Path(key_path) if key_path is not None else None)
    # Room for the connections a fetcher stripes over (py-libp2p trims the rest).
    host = build_host(
        key_pair, fast=config.fast, max_connections_per_peer=SWARM_CONNECTIONS_PER_PEER
    )
    connection_config = getattr(host.get_network(), "connection_config", None)
    if connection_config is not None:
        connection_config.outbound_upgrade_timeout = HANDSHAKE_TIMEOUT
    server = BlobServer(
        store,
        limits=config.server_limits,
        verify_reads=config.verify_reads,
        upload_limit=config.upload_limit,
    )
    listen_addrs = [_listen_addr(a) for a in config.listen]
    for addr in listen_addrs:
        _check_port_free(addr)
    async with host.run(listen_addrs=listen_addrs):
        if not host.get_addrs():
            raise ListenFailed(
                f"could not listen on {', '.join(config.listen)} (address in use or not local?)"
            )
        if config.admission is not None:
            server.gate = install_gate(host, config.admission)  # before anything is served
        else:
            open_answer(host)
        patches.advertise_interfaces(host)
        if config.upload:
            server.install(host)  # every protocol version the server speaks
        mode = DHTMode.SERVER if config.dht_server else DHTMode.CLIENT
        kad = KadDHT(host, mode) if config.dht else None
        if kad is not None:
            install_provider_guard(kad, config.provider_limits, local=str(host.get_id()))
            if config.dht_server:
                forget_clients_on_disconnect(host, kad)
        floodsub: Any = _make_pubsub(host) if config.pubsub else None
        async with _maybe_service(kad), _maybe_service(floodsub), trio.open_nursery() as nursery:
            if floodsub is not None:
                await floodsub.wait_until_ready()
            node = Node(store, host, server, kad, config, floodsub)
            node._background = nursery
            from p2p.fetch import peer_memory
            from p2p.names import service as names

            # Liars banned by earlier processes on this store start distrusted here too.
            await trio.to_thread.run_sync(peer_memory.load, store, node.scores, trio.current_time())
            names.install(node).admitted = None if server.gate is None else server.gate.admitted
            nursery.start_soon(names.run_names, node)
            for addr in config.bootstrap:
                try:
                    await node.connect(addr)
                except (PeerUnreachable, BadAddress) as exc:
                    log.warning("bootstrap peer unusable: %s", exc)
            if kad is not None:
                nursery.start_soon(node._reprovide_loop)
            try:
                yield node
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(
                        peer_memory.save, store, node.scores, trio.current_time()
                    )


def _first_tcp_addr(host: Any, peer_id: ID) -> Multiaddr | None:
    try:
        addrs = host.get_peerstore().addrs(peer_id)
    except Exception:  # no addresses known
        return None
    for addr in addrs:
        if "/tcp/" in str(addr) and "/ws" not in str(addr):
            return addr  # type: ignore[no-any-return]
    return None


def _listen_addr(text: str) -> Multiaddr:
    try:
        return Multiaddr(text)
    except Exception as exc:  # multiaddr raises many unrelated types for bad text
        raise BadAddress(f"bad listen address {text!r}: {exc}") from None


def _check_port_free(addr: Multiaddr) -> None:
    """Refuse a fixed TCP port that another process already listens on.

    py-libp2p listens with SO_REUSEPORT (for hole punching), so on Linux a second node on
    the same port would bind without error and silently take half of the first one's
    connections. A plain bind (SO_REUSEADDR only) still fails against a live listener."""
    try:
        port = int(addr.value_for_protocol("tcp") or 0)
        host = addr.value_for_protocol("ip4")
    except Exception:  # not an ip4/tcp address: nothing to check
        return
    if not port or not host:
        return
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        raise ListenFailed(f"could not listen on {addr}: {exc.strerror}") from None
    finally:
        probe.close()


def _open_store(root: str | os.PathLike[str]) -> Store:
    return Store.open(Path(root).expanduser())


def _make_pubsub(host: Any) -> Any:
    from p2p.node.gossip import make_pubsub

    return make_pubsub(host)


@asynccontextmanager
async def _maybe_service(service: Any) -> AsyncIterator[None]:
    if service is None:
        yield
        return
    async with background_trio_service(service):
        yield
