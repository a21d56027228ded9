"""Building the libp2p host: Noise and yamux only, a resource manager that is really there,
and an inbound gate that a flood of sockets cannot fill.

py-libp2p's defaults also offer TLS with 4 KiB reads, secio, ``/plaintext/2.0.0`` and
mplex (unbounded varint frames). A blobnet node offers exactly one security transport
(Noise) and one muxer (yamux), so a peer that asks for anything else fails negotiation.
When blobnet's fast data path (``p2p.transport.fast``) is importable it replaces py-libp2p's Noise
data path and yamux under the same protocol IDs; ``fast=False`` keeps py-libp2p's own.

Theory of operation: inbound connections
py-libp2p 0.8.1 admits inbound sockets through one counter of ``max_connections -
min_connections`` slots (250 by default) that counts sockets still handshaking, lets a
handshake take 10 s, and never gives a slot back: the handler that holds it waits for the
whole swarm to stop. So 250 silent sockets lock every peer out, and so do 250 connections
made and closed over a node's life. blobnet replaces that handler with ``InboundGate``:

1. A socket is *pending* from accept until its Noise + yamux handshake ends; it must end
   within ``HANDSHAKE_TIMEOUT``. At most ``MAX_PENDING_PER_IP`` pending sockets per source
   address (a further one is closed at once) and ``MAX_PENDING_HANDSHAKES`` in all; when
   the global cap is reached the oldest pending socket of the address that opened the most
   sockets lately (``OPENED_HALF_LIFE``; then, of the one with the most pending) is dropped
   to make room. A real handshake takes milliseconds (a few round trips), so the sockets
   dropped are the silent ones; and a flood from more addresses than the cap, each
   holding one pending socket as a real peer does, is told apart by its reconnecting.
2. An *established* inbound connection is counted against its source address until it
   closes (then its slot is free again). At ``MAX_CONNECTIONS_PER_IP`` from one address,
   or ``CONN_HIGH_WATERMARK`` in all, a new socket first evicts an idle connection (no
   open streams, older than ``IDLE_EVICT_AGE``) of that address (or of the address with the
   most connections); if none is idle the new socket is refused. Peers with open streams
   are never evicted: a flood of idle connections degrades to refusal for the flooder while
   a peer that is fetching keeps its connection.
3. Past the gate, py-libp2p's own limits still hold: ``MAX_CONNECTIONS`` in all (checked
   when a connection registers), ``max_connections_per_peer`` per identity, and its pruner
   trims idle connections past ``CONN_GRACE_PERIOD`` above ``CONN_HIGH_WATERMARK``.
4. The gate never cancels py-libp2p's upgrade while an ordinary error can end it: a
   dropped handshake has its socket closed under it (its reads see end of file), and the
   deadline is py-libp2p's own ``inbound_upgrade_timeout`` (``HANDSHAKE_TIMEOUT``), whose
   clean-up runs outside the expired scope. A cancelled upgrade skips py-libp2p's release
   of the resource manager's connection slot (``p2p.transport.patches`` says where and
   releases it anyway), so cancelling is only the backstop, ``HANDSHAKE_ABORT_GRACE``
   later. After any handshake ends, done or not, the manager's connection count is what
   it was before, plus one for each connection that was established.
5. A socket whose peer has already closed it (its end of file is waiting: a non-blocking
   peek reads nothing) is closed at once, before the gate or a handshake. After a flood
   stops, the kernel keeps handing over the flooders' closed connections for seconds
   (the full accept queue, and closes retransmitted into it); each took a handshake
   attempt, and while the queue stays full a new peer's SYN is dropped and retried a
   second later, then three.
6. Before the gate, each source address takes a turn to start its handshake
   (``p2p.transport.handshake_turns``): past a burst of 16, one a second. A handshake that
   connects gives its turn back, as does a socket refused by rule 2 (its address at its
   connection cap, nothing idle to evict: refused before any handshake, for want of room,
   not for being silent; kept, the turn would hold the address's further dials a second
   apart instead of refusing them at once). A socket over its address's rate is held
   unread until a turn comes (woken as soon as one is given back), at most
   ``MAX_TURN_WAIT``, and the held sockets are capped in number. Closed at once instead, a
   flooder's silent socket would reconnect at once, and the server spend its CPU
   accepting, starting handshakes and closing.
Identities are free, so the gate counts by source address (an IPv6 source by its /64,
since one host gets a whole /64), never by peer ID.
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p import new_host
from libp2p.abc import IHost, IMuxedConn
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.rcmgr import ResourceLimits, new_resource_manager
from libp2p.rcmgr.connection_limits import new_connection_limits_with_defaults
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from p2p.transport import patches
from p2p.transport.handshake_turns import MAX_TURN_WAIT, HandshakePacer, HandshakeTurns

# Connection and stream ceilings for the whole host. A blob node talks to tens of peers,
# each with a handful of streams (DESIGN section 4); these leave room for a DHT as well.
MAX_CONNECTIONS = 512
MAX_STREAMS = 4096
MAX_MEMORY_MB = 1024
# Connections one peer may hold to us, and we to it. One TCP connection cannot carry a
# long fat link (stock kernels cap its buffers at a few MiB: ~13 MB/s at 200 ms RTT, 75 MB/s
# with 8 connections), so a fetch stripes its streams over several connections
# to one provider. py-libp2p's default is 3.
MAX_CONNECTIONS_PER_PEER = 8

# --- Inbound gate (see the theory of operation above) ---
# A Noise XX handshake plus two multistream negotiations is about five round trips: 1 s at
# 200 ms RTT, milliseconds on a LAN. 5 s leaves room for a slow satellite path while a
# silent socket holds its slot for 5 s, not py-libp2p's 10 s.
HANDSHAKE_TIMEOUT = 5.0
# Sockets still handshaking, in all: at 5 s each, 64 slots admit ~13 handshakes a second
# from silent flooders before the oldest is dropped, far more than real peers arrive.
MAX_PENDING_HANDSHAKES = 64
# ... and from one source address: one host dialling with several connections at once
# (MAX_CONNECTIONS_PER_PEER of them, a few local processes) fits; a flooder does not.
MAX_PENDING_PER_IP = 16
# Established inbound connections from one source address: several local nodes or a NAT
# with many peers behind it, each striping over a few connections (identities are free,
# so this, not the per-peer cap, is what bounds one machine).
MAX_CONNECTIONS_PER_IP = 128
# Above this many connections in all, a new socket first evicts an idle one, and
# py-libp2p's pruner trims idle connections; MAX_CONNECTIONS stays the hard cap.
CONN_HIGH_WATERMARK = 384
# A new connection is never idle-evicted or pruned this young: a real peer opens its first
# stream within a round trip of its handshake.
IDLE_EVICT_AGE = 2.0
# A handshake the gate ended by closing its socket, or that passed py-libp2p's own
# deadline, normally unwinds within milliseconds; after this long it is cancelled (rule 4).
HANDSHAKE_ABORT_GRACE = 1.0
CONN_GRACE_PERIOD = 10.0
# Sockets each address opened are counted with this half-life (the count halves every so
# often): a flooder whose dropped sockets reconnect at once opens hundreds in that time, a
# peer a few (one connection, and one per stripe of a fetch).
OPENED_HALF_LIFE = 10.0
# Addresses counted at most; past it the least active half is forgotten.
MAX_OPENED_TRACKED = 4096


log = logging.getLogger(__name__)


class HostConfigError(RuntimeError):
    """The host could not be built as blobnet requires (a local bug, not a user error)."""


@dataclass
class _Pending:
    ip: str
    started: float
    drop: Callable[[], None]


@dataclass
class _Established:
    ip: str
    since: float


@dataclass(frozen=True)
class Admission:
    """What the gate decided for one new socket: ``token`` (None: refuse it, for
    ``reason``), and the pending handshake it dropped to make room, if any."""

    token: int | None
    reason: str = ""
    dropped_pending: int | None = None


class InboundGate:
    """Counts inbound sockets by source address, pending and established (sans-IO: the
    caller passes the time and does the closing; see the module's theory of operation)."""

    def __init__(
        self,
        *,
        max_pending: int = MAX_PENDING_HANDSHAKES,
        max_pending_per_ip: int = MAX_PENDING_PER_IP,
        max_per_ip: int = MAX_CONNECTIONS_PER_IP,
        high_watermark: int = CONN_HIGH_WATERMARK,
        idle_evict_age: float = IDLE_EVICT_AGE,
        pacer: HandshakePacer | None = None,
    ) -> None:
        # Turns to start a handshake, per source address (rule 6).
        self.pacer = pacer if pacer is not None else HandshakePacer()
        self.max_pending = max_pending
        self.max_pending_per_ip = max_pending_per_ip
        self.max_per_ip = max_per_ip
        self.high_watermark = high_watermark
        self.idle_evict_age = idle_evict_age
        self._next = 0
        self.pending: dict[int, _Pending] = {}
        self.pending_per_ip: Counter[str] = Counter()
        self.established: dict[int, _Established] = {}
        self.established_per_ip: Counter[str] = Counter()
        # Sockets each address opened lately (rule 1), halved every OPENED_HALF_LIFE.
        self.opened: Counter[str] = Counter()
        self._halved_at: float | None = None
        self.admitted = 0
        self.refused = 0
        self.dropped = 0
        self.evicted = 0
        self.gone = 0  # sockets closed by their peer before they reached the gate (rule 5)

    def admit(self, ip: str, now: float, drop: Callable[[], None]) -> Admission:
        """Admit a new socket from ``ip`` into the handshake phase, or refuse it. ``drop``
        aborts its handshake if the gate later needs the slot."""
        self._count_opened(ip, now)
        if self.pending_per_ip[ip] >= self.max_pending_per_ip:
            self.refused += 1
            return Admission(None, f"{self.pending_per_ip[ip]} handshakes pending from {ip}")
        dropped = None
        if len(self.pending) >= self.max_pending:
            dropped = self._drop_oldest_pending()
        self._next += 1
        self.admitted += 1
        token = self._next
        self.pending[token] = _Pending(ip, now, drop)
        self.pending_per_ip[ip] += 1
        return Admission(token, dropped_pending=dropped)

    def _count_opened(self, ip: str, now: float) -> None:
        if self._halved_at is None:
            self._halved_at = now
        while now - self._halved_at >= OPENED_HALF_LIFE:
            self._halved_at += OPENED_HALF_LIFE
            self.opened = Counter({a: n // 2 for a, n in self.opened.items() if n > 1})
            if not self.opened:
                self._halved_at = now
        self.opened[ip] += 1
        if len(self.opened) > MAX_OPENED_TRACKED:
            self.opened = Counter(dict(self.opened.most_common(MAX_OPENED_TRACKED // 2)))

    def _drop_oldest_pending(self) -> int:
        top_ip = max(self.pending_per_ip, key=lambda a: (self.opened[a], self.pending_per_ip[a]))
        token = min(
            (t for t, p in self.pending.items() if p.ip == top_ip),
            key=lambda t: self.pending[t].started,
        )
        victim = self.pending[token]
        self.handshake_over(token)
        self.dropped += 1
        victim.drop()
        return token

    def handshake_over(self, token: int) -> None:
        """The socket's handshake ended (done, failed, timed out or dropped)."""
        pending = self.pending.pop(token, None)
        if pending is not None:
            self.pending_per_ip[pending.ip] -= 1
            if self.pending_per_ip[pending.ip] <= 0:
                del self.pending_per_ip[pending.ip]

    def connected(self, key: int, ip: str, now: float) -> None:
        self.established[key] = _Established(ip, now)
        self.established_per_ip[ip] += 1

    def disconnected(self, key: int) -> None:
        conn = self.established.pop(key, None)
        if conn is not None:
            self.established_per_ip[conn.ip] -= 1
            if self.established_per_ip[conn.ip] <= 0:
                del self.established_per_ip[conn.ip]

    def room_needed(self, ip: str) -> str | None:
        """The address whose idle connection a new socket from ``ip`` must evict before
        it may handshake, or None when there is room."""
        if self.established_per_ip[ip] >= self.max_per_ip:
            return ip
        if len(self.established) >= self.high_watermark:
            return max(self.established_per_ip, key=lambda a: self.established_per_ip[a])
        return None

    def idle_victim(self, ip: str, now: float, streams: Callable[[int], int]) -> int | None:
        """The oldest connection from ``ip`` with no open streams (``streams(key)``) and
        older than ``idle_evict_age``, or None."""
        candidates = [
            (conn.since, key)
            for key, conn in self.established.items()
            if conn.ip == ip and now - conn.since >= self.idle_evict_age and not streams(key)
        ]
        return min(candidates)[1] if candidates else None


# IPv6 sources are counted by their /64: one host or LAN gets a whole /64, so counting
# single addresses would give a flooder 2**64 separate budgets.
IPV6_PREFIX = 64


def address_key(ip: str) -> str:
    """The source a per-address limit counts: an IPv4 address, or an IPv6 /64."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{address}/{IPV6_PREFIX}", strict=False))
    return str(address)


def remote_address_key(conn: Any) -> str:
    """``address_key`` of a socket's, connection's or stream's remote end ("?" if none)."""
    try:
        address = conn.get_remote_address()
    except Exception:
        address = None
    return address_key(str(address[0])) if address else "?"


def install_inbound_gate(
    host: IHost,
    gate: InboundGate | None = None,
    *,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    max_turn_wait: float = MAX_TURN_WAIT,
) -> InboundGate:
    """Route the host's inbound sockets through ``gate`` instead of py-libp2p's leaking
    slot counter (module docstring, rules 1-6). ``handshake_timeout`` must be the host's
    ``inbound_upgrade_timeout`` (``build_host`` sets both); a socket waits at most
    ``max_turn_wait`` for its turn to handshake. Returns the gate (for tests and stats)."""
    network: Any = host.get_network()
    gate = gate if gate is not None else InboundGate()
    turns = HandshakeTurns(gate.pacer, max_wait=max_turn_wait)
    original: Callable[[Any, Any], Awaitable[None]] | None = None

    def streams_of(key: int) -> int:
        for conn in network.get_connections():
            if id(conn.muxed_conn) == key:
                return len(conn.get_streams())
        return 0

    async def close_connection(key: int) -> None:
        for conn in network.get_connections():
            if id(conn.muxed_conn) == key:
                await conn.close()
                return

    async def handle(read_write_closer: Any, maddr: Any) -> None:
        if isinstance(read_write_closer, IMuxedConn):  # QUIC and the like: not ours to gate
            assert original is not None
            await original(read_write_closer, maddr)
            return
        if peer_gone(read_write_closer):
            gate.gone += 1
            await _close_quietly(read_write_closer)
            return
        ip = remote_address_key(read_write_closer)
        arrived = trio.current_time()
        if not await turns.wait_turn(ip, lambda: peer_gone(read_write_closer)):
            log.debug("inbound from %s closed: over its rate of handshakes", ip)
            await _close_quietly(read_write_closer)
            return
        now = trio.current_time()
        if now > arrived and peer_gone(read_write_closer):  # it gave up while held
            gate.gone += 1
            await _close_quietly(read_write_closer)
            return
        # The backstop only (rule 4): py-libp2p's own timeout ends a silent handshake first.
        scope = trio.CancelScope(deadline=now + handshake_timeout + HANDSHAKE_ABORT_GRACE)

        def drop() -> None:
            _abort_socket(read_write_closer)
            scope.deadline = min(scope.deadline, trio.current_time() + HANDSHAKE_ABORT_GRACE)

        admission = gate.admit(ip, now, drop)
        if admission.token is None:
            log.debug("inbound from %s refused: %s", ip, admission.reason)
            await _close_quietly(read_write_closer)
            return
        crowded = gate.room_needed(ip)
        if crowded is not None:
            victim = gate.idle_victim(crowded, now, streams_of)
            if victim is None:
                gate.handshake_over(admission.token)
                gate.refused += 1
                log.debug("inbound from %s refused: %s has no idle connection", ip, crowded)
                turns.give_back(ip)  # refused for want of room, not for silence (rule 6)
                await _close_quietly(read_write_closer)
                return
            gate.evicted += 1
            gate.disconnected(victim)
            await close_connection(victim)
        muxed: Any = None
        try:
            with scope:
                if network.connection_gate is not None:
                    remote = patches.remote_multiaddr(network, read_write_closer)
                    if remote is not None and not await network.connection_gate.is_allowed(remote):
                        return
                raw = RawConnection(read_write_closer, False)
                muxed = await network.upgrade_inbound_raw_conn(raw, maddr)
        except Exception as exc:
            log.debug("inbound handshake from %s failed: %r", ip, exc)
        finally:
            gate.handshake_over(admission.token)
        if muxed is None or scope.cancelled_caught:
            await _close_quietly(read_write_closer)
            return
        key = id(muxed)
        gate.connected(key, ip, trio.current_time())
        turns.give_back(ip)  # a socket of its address held for a turn may go
        try:
            # The listener closes the socket when this handler returns: stay until the
            # connection is over, then give the slot back.
            # (py-libp2p's Yamux and p2p.transport.fast's both set event_closed when they end.)
            await muxed.event_closed.wait()
        finally:
            gate.disconnected(key)

    original = patches.route_inbound(network, handle)
    return gate


def peer_gone(read_write_closer: Any) -> bool:
    """Whether an inbound socket's peer has closed it already (rule 5): a non-blocking
    peek reads end of file, or the connection was reset. False when there is nothing to
    read yet, or no socket to ask."""
    stream = getattr(read_write_closer, "stream", None)
    sock = getattr(stream, "socket", None)
    if sock is None:
        return False
    try:
        fd = sock.fileno()
    except OSError:
        return False
    if fd < 0:
        return False
    # A stdlib socket over the same descriptor, detached after the peek (not a dup:
    # one syscall is the point).
    probe = socket.socket(fileno=fd)
    try:
        return probe.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # reset by its peer: as gone
    finally:
        probe.detach()


def _abort_socket(read_write_closer: Any) -> None:
    """Close an inbound socket now, from synchronous code: a task reading it sees end of
    file, so py-libp2p's upgrade fails by an ordinary error and runs its own clean-up
    (rule 4). py-libp2p's TCP stream keeps the trio stream as ``.stream``."""
    stream = getattr(read_write_closer, "stream", None)
    sock = getattr(stream, "socket", None)
    if sock is not None:
        sock.close()


async def _close_quietly(read_write_closer: Any) -> None:
    try:
        await read_write_closer.close()
    except Exception:
        pass


def _fast_path() -> Any | None:
    """``p2p.transport.fast`` when it is importable and ready, else None (py-libp2p's own stack)."""
    try:
        module = importlib.import_module("p2p.transport.fast")
    except ImportError:
        return None
    return module if getattr(module, "FAST_PATH_AVAILABLE", False) else None


def fast_path_available() -> bool:
    return _fast_path() is not None


def security_options(key_pair: KeyPair, *, fast: bool) -> dict[TProtocol, Any]:
    fast_path = _fast_path() if fast else None
    if fast_path is not None:
        return dict(fast_path.security_options(key_pair))
    noise_key = create_new_x25519_key_pair().private_key
    return {TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(key_pair, noise_privkey=noise_key)}


def muxer_options(*, fast: bool) -> dict[TProtocol, Any]:
    fast_path = _fast_path() if fast else None
    if fast_path is not None:
        return dict(fast_path.muxer_options())
    return {TProtocol(YAMUX_PROTOCOL_ID): Yamux}


def build_host(
    key_pair: KeyPair,
    *,
    fast: bool = True,
    max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER,
    gate: InboundGate | None = None,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
) -> IHost:
    """A host offering Noise + yamux only, with an explicit resource manager.

    ``max_connections_per_peer`` bounds the connections to (and from) one peer; a fetcher
    opens several to one provider to stripe a long fat link. ``gate`` (a default
    ``InboundGate`` if None) admits inbound sockets, each with ``handshake_timeout`` to
    finish its handshake.
    """
    connection_config = ConnectionConfig(
        max_connections=MAX_CONNECTIONS,
        # No floor of connections to keep: a blob node dials the peers it needs. (py-libp2p's
        # auto-connector still dials known peers up to the watermarks' midpoint.)
        min_connections=0,
        low_watermark=0,
        high_watermark=CONN_HIGH_WATERMARK,
        grace_period=CONN_GRACE_PERIOD,
        max_connections_per_peer=max_connections_per_peer,
        inbound_upgrade_timeout=handshake_timeout,
    )
    resource_manager = new_resource_manager(
        limits=ResourceLimits(
            max_connections=MAX_CONNECTIONS,
            max_memory_mb=MAX_MEMORY_MB,
            max_streams=MAX_STREAMS,
        ),
        # py-libp2p's default connection limits hold 8 established connections per peer
        # whatever ConnectionConfig says: a fetch striping 8 lanes beside its control
        # lane (p2p.fetch.downloader rule 9) was refused its ninth.
        connection_limits=new_connection_limits_with_defaults().with_max_established_per_peer(
            max_connections_per_peer
        ),
    )
    sec_opt = security_options(key_pair, fast=fast)
    muxer_opt = muxer_options(fast=fast)
    host = new_host(
        key_pair=key_pair,
        sec_opt=sec_opt,
        muxer_opt=muxer_opt,
        resource_manager=resource_manager,
        connection_config=connection_config,
    )
    fast_path = _fast_path() if fast else None
    if fast_path is not None:
        # py-libp2p 0.8.1 builds its own Yamux for /yamux/1.0.0 whatever muxer_opt says;
        # install() makes the upgrader build ours.
        fast_path.install(host)
    network: Any = host.get_network()
    upgrader = network.upgrader
    offered = set(upgrader.security_multistream.transports)
    if offered != set(sec_opt):
        raise HostConfigError(f"host offers security {sorted(offered)}, expected {sorted(sec_opt)}")
    muxers = set(upgrader.muxer_multistream.transports)
    if muxers != set(muxer_opt):
        raise HostConfigError(f"host offers muxers {sorted(muxers)}, expected {sorted(muxer_opt)}")
    if getattr(network, "_resource_manager", resource_manager) is None:
        raise HostConfigError("libp2p silently dropped the resource manager")
    patches.release_scopes_of_failed_upgrades(network)
    install_inbound_gate(host, gate, handshake_timeout=handshake_timeout)
    return host


def resource_connections(host: IHost) -> int:
    """Connection slots the host's resource manager counts as held now (each established
    connection holds one; a handshake in progress holds one until it ends)."""
    manager = patches.resource_manager(host.get_network())
    return int(manager.get_stats()["connections"]) if manager is not None else 0
