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
   (``p2p.fetch.download_probes.HaveProbes``; ``have`` does not wait for the manifest): 1.
6. ``get`` on the ``have`` stream: 1, plus the first chunk's own transfer time.

So 6 round trips; py-libp2p's own path takes 13 (two stream opens of 2 each, ``have``
after the manifest, and 2 each for the Noise and yamux negotiations). Without the fast
path (``fast=False``) the two negotiations take their 2 each. Named providers are
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
the first one, the control lane (``Connections._control_connection``; p2p.fetch.downloader rule 9).

Where the code is: :class:`Node` (this module, with ``open_node``, which starts and stops
everything, and the names and pubsub glue) owns one part per job, each an object with its
own state, built by the node from what it needs and tested alone:
:class:`~p2p.node.connections.Connections` (dials, punches, blob streams, lanes),
:class:`~p2p.node.providing.ProviderRecords` (DHT provider records),
:class:`~p2p.node.fetching.Fetches` (where providers come from, peer exchange, one fetch)
and :class:`~p2p.node.fetching.FetchRecords` (what fetches leave for the operator: transfers
in flight, bad chunks, refusals).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from blobstore import Store
from identity import MachineKey, TrustStore, load_or_create_key
from p2p.blob.pacing import Pacer
from p2p.blob.server import BlobServer, ServerLimits
from p2p.blob.ticket import MAX_TICKET_ADDRS, Ticket
from p2p.errors import BadAddress, ListenFailed, PeerUnreachable
from p2p.fetch import peer_memory
from p2p.fetch.sched_records import SchedulerConfig
from p2p.fetch.scores import PeerScores
from p2p.fetch.striping import StripeConfig
from p2p.logs import no_handler_of_our_own, quiet_unless_chosen
from p2p.metrics import Metrics
from p2p.names import service as names
from p2p.node.admission import install_gate, open_answer
from p2p.node.connections import MAX_CONNECTIONS_PER_PROVIDER, Connections
from p2p.node.dht_hygiene import forget_clients_on_disconnect
from p2p.node.fetching import Fetches, FetchRecords, FetchSettings
from p2p.node.gossip import make_pubsub
from p2p.node.providing import ProviderRecords
from p2p.transport import patches
from p2p.transport.addresses import dialable_addrs
from p2p.transport.host import build_host
from p2p.transport.providers import ProviderLimits, install_provider_guard

if TYPE_CHECKING:
    from p2p.names.record import NameRecord

log = logging.getLogger(__name__)


no_handler_of_our_own()

DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)
# Provider records expire on DHT peers; refresh well inside go-libp2p's 22 h lifetime.
DEFAULT_REPROVIDE_INTERVAL = 3600.0
# The swarm's own per-peer cap (py-libp2p trims connections beyond it, default 3) must
# leave room for the lanes a fetch stripes over (MAX_CONNECTIONS_PER_PROVIDER) and the
# first connection (the control lane once a fetch stripes), plus one the peer dialled to
# us (a DHT query, its own fetch).
SWARM_CONNECTIONS_PER_PEER = MAX_CONNECTIONS_PER_PROVIDER + 2

# How long a dialled peer may take to finish the Noise and yamux handshakes once TCP is
# up: they take about five round trips, 1 s at 200 ms, so 5 s is generous; a peer that
# accepts TCP and never answers then costs 5 s per try, not py-libp2p's 10.
HANDSHAKE_TIMEOUT = 5.0


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
    """A running blobnet node. Create it with :func:`open_node`.

    It owns its parts, each built here from what it needs: ``connections``
    (:class:`~p2p.node.connections.Connections`), ``provider_records``
    (:class:`~p2p.node.providing.ProviderRecords`), ``fetch_records``
    (:class:`~p2p.node.fetching.FetchRecords`) and ``fetches``
    (:class:`~p2p.node.fetching.Fetches`). Their public methods are named on the node
    as attributes, so each has one body and one signature. ``background``: the node's
    own nursery (``open_node``), for punches, lanes and NAT services that outlive the call
    that started them."""

    def __init__(
        self,
        store: Store,
        host: Any,
        server: BlobServer,
        dht: KadDHT | None,
        config: NodeConfig,
        pubsub: Any = None,
        *,
        background: trio.Nursery | None = None,
    ) -> None:
        self.store = store
        self.host = host
        self.server = server
        self.dht = dht
        self.config = config
        self.pubsub = pubsub
        # Behind NAT: the circuit addresses this node hands out once it holds
        # reservations (``set_advertised``; None: its own listen addresses).
        self.advertised: list[str] | None = None
        # Peers that sent bad data, remembered across this node's downloads.
        self.scores = PeerScores()
        # What an operator sees (p2p.metrics, ``blob status``): counters owned by this node.
        self.metrics = Metrics()
        # The catalog's side of this node (p2p.names.service.install builds it).
        self.name_service: names.NameService | None = None
        self.connections = Connections(
            host,
            dht,
            stripe=config.stripe,
            certificate=config.certificate,
            relayed_fetch=config.relayed_fetch,
            punch_timeout=config.punch_timeout,
            background=background,
        )
        self.provider_records = ProviderRecords(
            store, host, dht, reprovide_interval=config.reprovide_interval
        )
        self.fetch_records = FetchRecords(self.metrics)
        self.fetches = Fetches(
            store,
            self.connections,
            self.provider_records,
            self.fetch_records,
            settings=FetchSettings(
                scheduler=config.scheduler,
                stripe=config.stripe,
                discovery_timeout=config.discovery_timeout,
                verify_local=config.verify_local,
                peer_exchange=config.peer_exchange,
            ),
            scores=self.scores,
            board=server.board,
            resolve_name=self._resolve_blob_id,
            # NodeConfig.download_limit: what all this node's fetches receive together.
            pacer=None
            if config.download_limit is None
            else Pacer(config.download_limit, trio.current_time()),
        )
        # The public surface: each method is its part's own.
        self.punches = self.connections.punches
        self.connect = self.connections.connect
        self.connected_peers = self.connections.connected_peers
        self.open_blob_stream = self.connections.open_blob_stream
        self.open_blob_stream_on = self.connections.open_blob_stream_on
        self.ask_peers = self.connections.ask_peers
        self.dial_listed = self.connections.dial_listed
        self.add_connection = self.connections.add_connection
        self.connection_count = self.connections.connection_count
        self.connection_rtt = self.connections.connection_rtt
        self.wait_lanes = self.connections.wait_lanes
        self.provide = self.provider_records.provide
        self.find_providers = self.provider_records.find_providers
        self.fetch = self.fetches.fetch
        self.transfers = self.fetch_records.transfers
        self.refusals = self.fetch_records.refusals
        self.bad_chunks = self.fetch_records.bad_chunks
        self.download_pacer = self.fetches.network.download_pacer

    @property
    def peer_id(self) -> str:
        return self.connections.peer_id

    @property
    def bad_chunks_total(self) -> int:
        """Chunks received that failed their hash, from every sender."""
        return self.fetch_records.bad_chunks_total

    async def _resolve_blob_id(self, ref: str) -> str:
        return (await names.resolve(self, ref)).blob_id

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
    def addrs(self) -> list[str]:
        """Addresses other nodes can dial, each ending in ``/p2p/<peer id>`` (a wildcard
        listen address appears as each interface's address)."""
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
        self.provider_records.provide_again()

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
        await self.provider_records.announce(blob_id)
        return blob_id

    async def add_bytes(self, data: bytes) -> str:
        return await self.add_blocks([data])

    async def add_blocks(self, blocks: Iterable[bytes | memoryview]) -> str:
        """Store and announce the concatenation of ``blocks``, never joined in memory."""
        blob_id = await trio.to_thread.run_sync(lambda: self.store.put_blocks(blocks))
        await self.provider_records.announce(blob_id)
        return blob_id

    # --- names (p2p/names/service.py, p2p/names/NAMES.md) -------------------------------
    async def publish_name(self, name: str, blob_id: str, **options: Any) -> NameRecord:
        """Sign ``<this peer ID>/name -> blob_id`` and spread it (see
        :func:`p2p.names.service.publish_name` for ``signer``, ``seq``, ``expiry_s``...)."""
        return await names.publish_name(self, name, blob_id, **options)

    async def resolve(self, ref: str, **options: Any) -> NameRecord:
        """The newest valid record for ``PUBLISHER/NAME`` (:func:`p2p.names.service.resolve`)."""
        return await names.resolve(self, ref, **options)

    async def export(self, blob_id: str, dest: str | os.PathLike[str]) -> None:
        await trio.to_thread.run_sync(self.store.export, blob_id, Path(dest))


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
            node = Node(store, host, server, kad, config, floodsub, background=nursery)
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
                nursery.start_soon(node.provider_records.run)
            try:
                yield node
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(
                        peer_memory.save, store, node.scores, trio.current_time()
                    )


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
    return make_pubsub(host)


@asynccontextmanager
async def _maybe_service(service: Any) -> AsyncIterator[None]:
    if service is None:
        yield
        return
    async with background_trio_service(service):
        yield


__all__ = ["DEFAULT_LISTEN", "Node", "NodeConfig", "open_node"]
