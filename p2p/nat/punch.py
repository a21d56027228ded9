"""Fetching from a provider behind NAT: through its relay, upgraded to a direct
connection by hole punching (DCUtR), the blob itself over the direct connection.

Steps of :func:`punch_through` (and :func:`fetch_with_nat`, which runs it for every NATed
provider of a fetch at once; each step is bounded, and the result says which ended it):

1. Dial the provider's circuit address (``p2p.nat.relay.dial_via_relay``): TCP + Noise to the
   relay, ``CONNECT``, then Noise + yamux end to end through it.
2. Hole-punch (py-libp2p's ``DCUtRProtocol.initiate_hole_punch``): a direct dial first
   (the provider may be reachable after all), then up to three simultaneous-open rounds,
   each from two local ports (``p2p.nat.holepunch`` rule 6; the second is opened before
   step 1, so the identify push that announces it does not cross the circuit).
3. With a direct connection: close the relayed one (so no blob byte can take it) and
   fetch from the provider as a connected peer. Without one: say why in one line; fetch
   through the relay only when the caller allows it (and the relay's limits will cut a
   bulk transfer short unless it was configured with raised ones).

A node dials circuit addresses through ``Node.connect``, which runs :func:`punch_through`
as a :class:`PunchJobs` job: one try per address at a time, shared by every caller, in
the node's own nursery (a caller's cancel does not abandon it), failures remembered for
``PUNCH_FAILURE_MEMORY``. Each try first lifts py-libp2p's negative dial cache for the
peer (:func:`_unblock`): a NATed peer's own addresses always fail, and a DHT walk that
dialled them would otherwise have DCUtR refused.

Reachability (:func:`reachable`, for a serving node): the node asks a relay to dial it
back at the IP the relay sees it at and its listen port, on a fresh connection
(:func:`check_reachability`; py-libp2p 0.8.1's AutoNAT cannot tell, see there). A NAT
drops that SYN: the node is private, reserves on every configured relay (renewing before
expiry), pings each relay every ``RELAY_KEEPALIVE`` so its NAT keeps the relay
connection's mapping (reserving anew over a fresh connection if a relay stops
answering), and advertises the circuit addresses (:func:`advertise`); its tickets name
only those, so they stay short.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.host.ping import perform_ping_roundtrip
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

from blobstore.exitcodes import ExitCode
from p2p.blob.ticket import TICKET_PREFIX, Ticket
from p2p.fetch.download_parts import Progress, ProgressCallback
from p2p.nat.holepunch import open_punch_ports, punch_book
from p2p.nat.relay import (
    EXCHANGE_TIMEOUT,
    MAX_ADMIT_REPLY,
    MAX_REACH_PORTS,
    REACH_DIAL_TIMEOUT,
    REACH_PROTOCOL,
    RelayError,
    Reservation,
    dial_via_relay,
    direct_connection,
    nat_services,
    parse_circuit_addr,
    present_certificate,
    reserve,
)
from p2p.nat.syn import SynTrace
from p2p.transport import patches

log = logging.getLogger(__name__)

# A private node pings each relay it holds a reservation on this often. A NAT forgets a
# mapping left idle: 30 s is common for UDP and some routers and carrier-grade NATs use
# it for TCP too. Once the mapping of the relay connection is gone, the relay's CONNECT
# for a fetcher never reaches us, and we would not know for minutes.
RELAY_KEEPALIVE = 15.0
# Reservations are renewed when this much of their life is left (py-libp2p's client
# renews at 80% of the TTL too), and retried this soon after a failed renewal.
RENEW_AT_FRACTION_LEFT = 0.2
RENEW_RETRY = 30.0

# A relay whose circuits carry less than this is for signalling: a fetch through it (when
# the user allows relayed fetches) would be cut mid-blob and retried for tens of seconds,
# so it is refused at once, saying why. 16 MiB: sixteen default chunks.
MIN_RELAYED_FETCH_BYTES = 16 * 1024 * 1024
# py-libp2p's DCUtR tries a direct dial (10 s cap), then three rounds of at most 5 s with
# 2 s pauses: 25 s is its worst case; a caller's timeout bounds the whole of it.
DEFAULT_PUNCH_TIMEOUT = 30.0
# Circuit addresses punched at once for one fetch: each punch is a relay dial, a Noise
# handshake and DCUtR's rounds, and a DHT answer or a ticket can name any number. A
# fetch needs a few providers, not every one; those given first (ticket, command line)
# come before the DHT's.
MAX_PUNCHES = 16
# A node's punches under way or remembered at once (PunchJobs): sixteen per fetch, a few
# fetches of a collection at once.
MAX_PUNCH_JOBS = 64
# A failed punch is not tried again for this long: a NAT that mapped symmetrically a
# minute ago still does (PunchJobs).
PUNCH_FAILURE_MEMORY = 60.0
# A failed punch's line names what the SYNs to this many of the peer's addresses met
# (the rest, its private addresses from identify, are silence by nature).
MAX_DESCRIBED_ADDRS = 2
# Closing a relayed connection sends a yamux GO_AWAY and a Noise frame through the relay:
# a few RTTs at most; a dead relay must not hold a cancelled punch up.
CLOSE_TIMEOUT = 5.0


class NatUnreachable(Exception):
    """No provider of a fetch could be reached: each NATed one failed to hole-punch
    (and relayed transfer was not allowed) and no other was given. ``str``: one line."""

    exit_code = ExitCode.NETWORK


@dataclass
class Punch:
    """One NATed provider's way in: ``path`` "direct" (hole punched), "relayed" (the
    punch failed; the caller allowed the relay) or "failed" (``reason``, one line)."""

    addr: str
    peer: str = ""
    path: str = "failed"
    reason: str = ""
    relayed_s: float | None = None  # connected through the relay, from the start
    direct_s: float | None = None  # direct connection up, from the start
    relay_max_bytes: int = 0  # what the relay said one circuit may carry (0: unstated)
    # Our SYNs (p2p.nat.syn): sent to the peer in all, the dial windows (DCUtR rounds)
    # that sent them to the address that answered most, and what they met, in words.
    syns: int = 0
    windows: int = 0
    seen: str = ""


@dataclass
class NatFetch:
    """What a fetch with NATed providers came to; times in seconds from its start."""

    blob_id: str
    punches: list[Punch] = field(default_factory=list)
    first_byte_s: float | None = None
    done_s: float | None = None
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def failures(self) -> list[str]:
        """One line per NATed provider that could not be reached directly."""
        return [p.reason for p in self.punches if p.path != "direct" and p.reason]


@asynccontextmanager
async def _dcutr(host: Any) -> AsyncIterator[Any]:
    existing = patches.running_dcutr(host)
    if existing is not None:
        yield existing
        return
    async with nat_services(host) as dcutr:
        yield dcutr


# ------------------------------------------------------------------------ reachability
@dataclass(frozen=True)
class Reachability:
    """Whether peers can dial us: ``public`` True / False, or None when no relay could
    tell; ``detail`` is the relay's one-line answer or why there was none."""

    public: bool | None
    detail: str


def _listen_ports(host: Any) -> list[int]:
    ports = []
    for addr in host.get_transport_addrs():
        try:
            port = addr.value_for_protocol("tcp")
        except Exception:  # not a TCP address
            continue
        if port and int(port) not in ports:
            ports.append(int(port))
    return ports[:MAX_REACH_PORTS]


async def check_reachability(host: Any, relay: ID) -> Reachability:
    """Ask a (connected) blobnet relay to dial us back on a fresh connection at the IP it
    sees us at and our listen ports. A NAT or firewall drops that SYN: "private".

    Why not py-libp2p's AutoNAT (v1, 0.8.1): its server dials back with ``host.connect``
    (host/autonat/autonat.py, ``_try_dial``), which returns at once when a connection to
    the peer exists (host/basic_host.py, ``connect``), and the request itself arrived on
    one. Measured on the testbed: a host behind NAT asking to be dialled at its public
    IP, port 9 (nothing listens; the NAT drops it anyway) is answered OK; asking with its
    own (private) listen address it is answered E_DIAL_REFUSED. It never says private."""
    ports = _listen_ports(host)
    if not ports:
        return Reachability(None, "no TCP listen address to be dialled back on")
    try:
        with trio.fail_after(EXCHANGE_TIMEOUT + REACH_DIAL_TIMEOUT * len(ports)):
            stream = await host.new_stream(relay, [REACH_PROTOCOL])
            await stream.write(encode_varint_prefixed(" ".join(map(str, ports)).encode()))
            reply = await read_varint_prefixed_bytes_limited(stream, MAX_ADMIT_REPLY)
            await stream.close()
    except Exception as exc:  # libp2p raises many types for one failed exchange
        return Reachability(None, f"relay {relay} gave no dial-back answer: {exc!r}")
    text = reply.decode(errors="replace")
    if text.startswith("public"):
        return Reachability(True, text)
    if text.startswith("private"):
        return Reachability(False, text)
    return Reachability(None, f"relay {relay}: {text}")


def advertise(host: Any, extra: list[str]) -> None:
    """Make ``host.get_addrs()`` (identify, DHT provider records, ``Node.addrs`` and so
    tickets) name ``extra`` addresses too, after its own.

    (p2p.transport.patches.advertise_addrs says why not through ``addrs_factory``.)"""
    patches.advertise_addrs(host, [multiaddr.Multiaddr(a) for a in extra])


@dataclass
class Reachable:
    """How a node can be reached: ``addrs`` to hand out (tickets: circuit addresses only
    when the node is private, so they stay short), its reservations and the one-line
    reasons of relays that failed."""

    reachability: Reachability
    addrs: list[str] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


async def _reserve_all(
    host: Any, relays: Sequence[str], certificate: bytes | None, out: Reachable
) -> None:
    out.reservations, out.problems = [], []
    for relay_addr in relays:
        try:
            out.reservations.append(await reserve(host, relay_addr, certificate=certificate))
        except RelayError as exc:
            out.problems.append(str(exc))
            log.warning("%s", exc)


async def _renew(
    host: Any, relays: Sequence[str], certificate: bytes | None, out: Reachable
) -> None:
    while True:
        if out.reservations:
            soonest = min(r.expires for r in out.reservations)
            life = soonest - time.time()
            await trio.sleep(max(RENEW_RETRY, life * (1 - RENEW_AT_FRACTION_LEFT)))
        else:
            await trio.sleep(RENEW_RETRY)
        await _reserve_all(host, relays, certificate, out)


async def _keep_alive(
    host: Any, relays: Sequence[str], certificate: bytes | None, out: Reachable
) -> None:
    """Ping every relay we hold a reservation on each ``RELAY_KEEPALIVE`` (a stream per
    ping: py-libp2p's ping handler ends an idle stream), so our NAT keeps the relay
    connection's mapping; when a relay does not answer, drop its connection and reserve
    anew over a fresh one."""
    while True:
        await trio.sleep(RELAY_KEEPALIVE)
        lost = []
        for reservation in list(out.reservations):
            relay = ID.from_base58(reservation.relay)
            try:
                with trio.fail_after(EXCHANGE_TIMEOUT):
                    stream = await host.new_stream(relay, [PING_PROTOCOL])
                    await perform_ping_roundtrip(stream)
                    await stream.close()
            except Exception as exc:  # a dead connection fails in many ways
                log.warning("relay %s did not answer a keepalive ping: %r", relay, exc)
                lost.append(relay)
        if lost:
            for relay in lost:
                with trio.move_on_after(CLOSE_TIMEOUT):
                    for conn in list(host.get_network().get_connections(relay)):
                        await conn.close()
            await _reserve_all(host, relays, certificate, out)


@asynccontextmanager
async def reachable(
    host: Any,
    relays: Sequence[str],
    *,
    certificate: bytes | None = None,
    assume_private: bool = False,
) -> AsyncIterator[Reachable]:
    """Run what a node needs behind NAT for the ``async with`` block: relay v2's stop
    side and DCUtR; a dial-back check through the first relay that answers; if the node
    is private (or ``assume_private``), reservations on every relay, renewed before they
    expire, with their circuit addresses advertised (``advertise``)."""
    async with nat_services(host), trio.open_nursery() as nursery:
        reach = Reachability(None, "no relays configured")
        for relay_addr in relays:
            relay_id = ID.from_base58(relay_addr.rsplit("/p2p/", 1)[1])
            try:
                with trio.fail_after(EXCHANGE_TIMEOUT):
                    await host.connect(_peer_info(relay_addr))
                if certificate is not None:
                    await present_certificate(host, relay_id, certificate)
            except Exception as exc:  # RelayError or a failed dial: try the next relay
                reach = Reachability(None, f"relay {relay_addr}: {exc}")
                continue
            reach = await check_reachability(host, relay_id)
            if reach.public is not None:
                break
        out = Reachable(reach)
        own = [str(a) for a in host.get_addrs()]
        if reach.public is True and not assume_private:
            out.addrs = own
        elif relays:
            await _reserve_all(host, relays, certificate, out)
            circuits = [a for r in out.reservations for a in r.circuit_addrs]
            advertise(host, circuits)
            out.addrs = circuits or own
            nursery.start_soon(_renew, host, relays, certificate, out)
            nursery.start_soon(_keep_alive, host, relays, certificate, out)
        else:
            out.addrs = own
        yield out
        nursery.cancel_scope.cancel()


def _peer_info(addr: str) -> Any:
    return info_from_p2p_addr(multiaddr.Multiaddr(addr))


async def close_relayed(host: Any, peer: ID) -> int:
    """Close every relayed connection to ``peer``; the number closed."""
    closed = 0
    for conn in list(host.get_network().get_connections(peer)):
        try:
            addrs = conn.get_transport_addresses()
        except Exception:  # cannot tell: leave it
            continue
        if addrs and all("/p2p-circuit" in str(a) for a in addrs):
            await conn.close()
            closed += 1
    return closed


async def upgrade_to_direct(
    host: Any, peer: ID, *, punch_timeout: float
) -> tuple[str | None, list[SynTrace]]:
    """Hole-punch to ``peer`` (connected through a relay). None when a direct connection
    is up, else the one-line reason it is not (what its SYNs met and how long it took);
    and the traces of our SYNs, the address that answered most first."""
    async with _dcutr(host) as dcutr:
        book = punch_book(host)
        await open_punch_ports(host)  # before the exchange: its CONNECT names them
        book.begin(peer)
        started = trio.current_time()
        with trio.move_on_after(punch_timeout) as scope:
            await dcutr.initiate_hole_punch(peer)
        waited = trio.current_time() - started
    traces = book.traces(peer)
    if direct_connection(host, peer) is not None:
        return None, traces
    reason = punch_failure(
        str(peer),
        waited,
        timed_out=scope.cancelled_caught,
        traces=traces,
        retried=book.schedule.max_syns > 1,
    )
    return reason, traces


def punch_failure(
    peer: str, waited: float, *, timed_out: bool, traces: list[SynTrace], retried: bool = True
) -> str:
    """The one line a failed punch says: how long it waited, why it stopped, what its
    SYNs met (p2p.nat.syn rule 5) and what that leaves as causes. ``retried``: refused
    SYNs were sent again (p2p.nat.syn rule 3), so refusals to the end mean their SYN
    never opened a way in."""
    ended = "the time allowed ran out" if timed_out else "DCUtR gave up after its rounds"
    head = f"hole punching to {peer} failed after {waited:.1f} s ({ended})"
    if not traces or not any(t.syns for t in traces):
        return (
            f"{head}: no SYN was sent (the DCUtR exchange through the relay did not "
            "complete, or the peer gave no address to dial)"
        )
    seen = "; ".join(t.describe() for t in traces[:MAX_DESCRIBED_ADDRS])
    if not retried:
        meaning = "refused SYNs were not sent again: retries are off"
    elif any(t.handshakes_failed for t in traces):
        meaning = (
            "a TCP connection came up but its handshake never finished: a router on the "
            "way passed the SYNs but not what followed"
        )
    elif any(t.refusals_from_dest() for t in traces):
        meaning = (
            "their side refused our SYNs to the end, so no SYN of theirs opened its NAT to "
            "us: a NAT that maps each connection to a new port, on either side, or a firewall"
        )
    else:
        meaning = (
            "no answer, and no SYN of theirs came through: a NAT that maps each connection "
            "to a new port, on either side, or a firewall that drops them"
        )
    return f"{head}: {seen} ({meaning})"


async def punch_through(
    node: Any,
    circuit_addr: str,
    *,
    certificate: bytes | None = None,
    allow_relayed: bool = False,
    punch_timeout: float = DEFAULT_PUNCH_TIMEOUT,
    started: float | None = None,
) -> Punch:
    """Reach the peer at ``circuit_addr`` through its relay and hole-punch to it. A
    failed punch closes the relayed connection unless ``allow_relayed`` (so no fetch can
    drift onto the relay). Never raises for a network failure: the result says why."""
    host = node.host
    t0 = time.monotonic() if started is None else started
    out = Punch(addr=circuit_addr)
    try:
        relay_addr, target = parse_circuit_addr(circuit_addr)
        peer = ID.from_base58(target)
    except ValueError as exc:
        out.reason = str(exc)
        return out
    out.peer = target
    if direct_connection(host, peer) is not None:
        out.path, out.direct_s = "direct", 0.0  # already connected directly: nothing to do
        return out
    try:
        try:
            if certificate is not None:
                relay_id = ID.from_base58(relay_addr.rsplit("/p2p/", 1)[1])
                await node.connect(relay_addr)
                await present_certificate(host, relay_id, certificate)
            _unblock(host, peer)
            # Before the circuit: a new listen address is pushed to connected peers
            # (identify), and through the circuit that would be relay bytes.
            await open_punch_ports(host)
            circuit = await dial_via_relay(host, circuit_addr)
        except Exception as exc:  # RelayError, PeerUnreachable, ...: one line either way
            out.reason = str(exc)
            return out
        out.relay_max_bytes = circuit.max_bytes
        out.relayed_s = time.monotonic() - t0
        _unblock(host, peer)
        reason, traces = await upgrade_to_direct(host, peer, punch_timeout=punch_timeout)
        out.syns = sum(t.syns for t in traces)
        if traces:
            out.windows, out.seen = traces[0].windows, traces[0].describe()
        if reason is None:
            out.direct_s = time.monotonic() - t0
            out.path = "direct"
        else:
            out.reason = reason
            if allow_relayed and 0 < circuit.max_bytes < MIN_RELAYED_FETCH_BYTES:
                out.reason += (
                    f"; its relay cuts circuits at {circuit.max_bytes} bytes (signalling "
                    "only), so it cannot carry the blob: the relay must run with a raised "
                    "--max-circuit-bytes"
                )
            elif allow_relayed:
                out.path = "relayed"
    finally:
        # Also when cancelled half-way: a relayed connection left open would carry the
        # next stream to the peer, and with it the blob.
        if out.path != "relayed":
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                await close_relayed(host, peer)
    return out


def _unblock(host: Any, peer: ID) -> None:
    """Lift py-libp2p's negative dial cache for ``peer`` (0.8.1, ``Swarm.unblock_peer``).

    A NATed peer's own addresses always fail, and anything that dials it (a DHT query
    that walks to it, a stream to a provider not yet reached) puts it in that cache; while
    there, DCUtR's stream and its direct dials to the peer are refused at once (seen on
    the testbed: a public fetcher that found the provider on the DHT never punched)."""
    unblock = getattr(host.get_network(), "unblock_peer", None)
    if unblock is not None:
        unblock(peer)


@dataclass
class _Job:
    done: trio.Event = field(default_factory=trio.Event)
    punch: Punch | None = None
    ended_at: float = 0.0


class PunchJobs:
    """The punches one node runs, at most one per circuit address at a time.

    Callers of the same address share one try (the CLI dials its named peers, and the
    fetch dials those that did not answer first again), and each try runs in the node's
    own nursery, so a caller that gives up (``p2p.node.dial.dial_named`` returns at the first
    peer that answers) neither abandons it half-way nor starts it over. A failed try is
    remembered for ``PUNCH_FAILURE_MEMORY`` seconds: the DHT names the same NATed
    provider on each lookup of a fetch, and every try costs DCUtR's rounds. Times are
    ``now`` arguments (trio's clock in the node)."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self.failures: list[str] = []  # one line per failed punch, oldest first
        self.relayed: list[str] = []  # the same for punches that fell back to the relay
        # For the operator's metrics: tries started, and those that ended direct.
        self.attempts = 0
        self.successes = 0

    def _forget_old(self, now: float) -> None:
        for addr, job in list(self._jobs.items()):
            if job.done.is_set() and now - job.ended_at >= PUNCH_FAILURE_MEMORY:
                del self._jobs[addr]
        while len(self._jobs) > MAX_PUNCH_JOBS:
            oldest = min(
                (a for a, j in self._jobs.items() if j.done.is_set()),
                key=lambda a: self._jobs[a].ended_at,
                default=None,
            )
            if oldest is None:
                break
            del self._jobs[oldest]

    async def punch(
        self,
        node: Any,
        addr: str,
        nursery: trio.Nursery | None,
        *,
        now: float,
        certificate: bytes | None = None,
        allow_relayed: bool = False,
        punch_timeout: float = DEFAULT_PUNCH_TIMEOUT,
    ) -> Punch:
        """The outcome of punching to ``addr``: a running or remembered failed try, or a
        new one (in ``nursery``; in the caller's task when None)."""
        self._forget_old(now)
        job = self._jobs.get(addr)
        if job is not None and job.done.is_set() and job.punch is not None:
            if job.punch.path == "failed":
                return job.punch  # remembered
            del self._jobs[addr]  # it worked: a new call means the connection went
            job = None
        if job is None:
            if len(self._jobs) >= MAX_PUNCH_JOBS:
                return Punch(addr=addr, reason=f"{MAX_PUNCH_JOBS} hole punches already running")
            job = self._jobs[addr] = _Job()
            self.attempts += 1

            async def run(job: _Job = job) -> None:
                try:
                    job.punch = await punch_through(
                        node,
                        addr,
                        certificate=certificate,
                        allow_relayed=allow_relayed,
                        punch_timeout=punch_timeout,
                    )
                finally:
                    if job.punch is None:  # cancelled: the node is closing
                        job.punch = Punch(addr=addr, reason="hole punch cancelled")
                    else:
                        self.successes += job.punch.path == "direct"
                        seen = {"failed": self.failures, "relayed": self.relayed}
                        lines = seen.get(job.punch.path)
                        if lines is not None and job.punch.reason not in lines:
                            lines.append(job.punch.reason)
                            del lines[:-MAX_PUNCH_JOBS]
                    job.ended_at = trio.current_time()
                    job.done.set()

            if nursery is None:
                await run()
            else:
                nursery.start_soon(run)
        await job.done.wait()
        assert job.punch is not None
        return job.punch


async def natted_providers(node: Any, blob_id: str) -> list[str]:
    """Circuit addresses of the DHT's providers of ``blob_id`` that we are not connected
    to and know no other way to (a NATed provider advertises only those that work)."""
    out: list[str] = []
    connected = set(node.connected_peers())
    for peer in await node.find_providers(blob_id):
        if peer in connected:
            continue
        try:
            addrs = [str(a) for a in node.host.get_peerstore().addrs(ID.from_base58(peer))]
        except Exception:  # no addresses known after all
            continue
        out.extend(a for a in addrs if "/p2p-circuit" in a and a.endswith(f"/p2p/{peer}"))
    return out


async def _punch_all(
    node: Any,
    circuits: list[str],
    out: NatFetch,
    t0: float,
    certificate: bytes | None,
    allow_relayed: bool,
    punch_timeout: float,
) -> None:
    punches: list[Punch] = []
    if len(circuits) > MAX_PUNCHES:
        log.info("punching %d of %d circuit addresses", MAX_PUNCHES, len(circuits))
        circuits = circuits[:MAX_PUNCHES]

    async def one(addr: str) -> None:
        punch = await punch_through(
            node,
            addr,
            certificate=certificate,
            allow_relayed=allow_relayed,
            punch_timeout=punch_timeout,
            started=t0,
        )
        punches.append(punch)

    async with trio.open_nursery() as nursery:
        for addr in circuits:
            nursery.start_soon(one, addr)
    out.punches = sorted(punches, key=lambda p: circuits.index(p.addr))
    for line in out.failures():
        log.warning("%s", line)


async def punch_circuits(
    node: Any,
    addrs: Sequence[str],
    *,
    certificate: bytes | None = None,
    allow_relayed: bool = False,
    punch_timeout: float = DEFAULT_PUNCH_TIMEOUT,
) -> list[Punch]:
    """Reach every circuit address in ``addrs`` at once (:func:`punch_through`), for a
    caller that then fetches as usual: the punched providers are connected peers, which
    a fetch asks first. Each failure is logged and carried in its ``Punch.reason``."""
    out = NatFetch(blob_id="")
    circuits = list(dict.fromkeys(a for a in addrs if "/p2p-circuit" in a))
    async with _dcutr(node.host):
        await _punch_all(
            node, circuits, out, time.monotonic(), certificate, allow_relayed, punch_timeout
        )
    return out.punches


async def fetch_with_nat(
    node: Any,
    ref: str,
    providers: Sequence[str] = (),
    *,
    certificate: bytes | None = None,
    allow_relayed: bool = False,
    punch_timeout: float = DEFAULT_PUNCH_TIMEOUT,
    progress: ProgressCallback | None = None,
    discover: bool = False,
) -> NatFetch:
    """Fetch ``ref`` (a blob ID or a ticket, whose addresses join ``providers``):
    circuit addresses are reached through their relays and hole-punched (in parallel,
    each bounded by ``punch_timeout``), the others dialled as usual. NATed providers
    that could not be punched are left out (each with a one-line reason in the result)
    unless ``allow_relayed``; NatUnreachable when no provider is left. With
    ``discover`` the DHT is asked first, and providers it names that are known only by
    circuit addresses join the punches (the fetch asks the DHT again as usual). Errors of
    the fetch itself propagate (``Node.fetch``'s)."""
    t0 = time.monotonic()
    providers = list(providers)
    blob_id = ref
    if ref.startswith(TICKET_PREFIX):
        ticket = Ticket.decode(ref)
        blob_id = ticket.blob_id
        providers.extend(ticket.addrs)
    out = NatFetch(blob_id=blob_id)
    if discover:
        providers.extend(await natted_providers(node, blob_id))
    circuits = [a for a in dict.fromkeys(providers) if "/p2p-circuit" in a]
    direct = [a for a in dict.fromkeys(providers) if "/p2p-circuit" not in a]
    failed: Exception | None = None
    # Errors leave the services' block as themselves, not wrapped in an exception group.
    async with _dcutr(node.host):
        try:
            await _punch_all(node, circuits, out, t0, certificate, allow_relayed, punch_timeout)
            reached = [p for p in out.punches if p.path in ("direct", "relayed")]
            if not reached and not direct:
                raise NatUnreachable("; ".join(out.failures()) or "no providers given")

            def on_progress(p: Progress) -> None:
                if out.first_byte_s is None and p.done_bytes > 0:
                    out.first_byte_s = time.monotonic() - t0
                out.bytes = p.done_bytes
                if progress is not None:
                    progress(p)

            await node.fetch(blob_id, providers=direct, progress=on_progress)
            out.done_s = time.monotonic() - t0
        except Exception as exc:  # re-raised below, outside the services
            failed = exc
    if failed is not None:
        raise failed
    return out
