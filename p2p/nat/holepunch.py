"""Hole-punch dials for py-libp2p's DCUtR: SYNs that outlive refusals, and a listener
that completes the punch either way.

Theory of operation
===================

1. py-libp2p 0.8.1's DCUtR runs the exchange (CONNECT, SYNC) and up to three dial
   rounds, each a window of at most 5 s in which it dials every address the peer gave
   from our TCP listen port and polls for a direct connection. Its dial connects once:
   a router that refuses an early SYN (a reset, an ICMP error) ends that dial for the
   window, and the peer's SYN, arriving just after, is turned away too (``p2p.nat.syn``
   says why). Its dial is replaced (``install``): the SYNs are ``p2p.nat.syn.send_syns``
   on the host's ``PunchBook.schedule``, the rest is as py-libp2p does it: the DCUtR
   initiator upgrades its dial as the Noise responder and the other peer as the
   initiator, so a simultaneous open, one TCP connection from two dials, agrees on roles.
2. One DCUtR session per punch: the dialler's (``p2p.nat.punch``). py-libp2p's own
   auto-drive, which opens a session to every relayed peer every 2 s, is stopped
   (``p2p.transport.patches.stop_dcutr_auto_drive`` says what two crossing sessions did).
   And one dial per address at a time: a second one from the same port would find the
   port pair taken by the first's SYN.
3. While a dial runs, the book expects the peer's address (its public IP and port) at
   our listener. A socket accepted from there is the punched connection (the peer's SYN
   reached our port between two SYNs of ours; ``p2p.nat.syn`` rule 4): it is upgraded in
   the role of our dial. As the DCUtR initiator that is the responder role, which any
   inbound socket gets; as the other peer it is the Noise initiator, which py-libp2p's
   listener would never take, so the book claims the socket from the inbound handler.
4. A punched connection whose handshake fails within ``UPGRADE_TIMEOUT`` is closed with
   a reset (``_abort``), so the next window finds its port pair free.
5. Each punch's SYNs are traced per address (``p2p.nat.syn.SynTrace``) in the book,
   which ``p2p.nat.punch`` reads to say what a failed punch saw. The book is owned by
   its host (one per host, made by the first ``nat_services``), bounded by
   ``MAX_TRACED_PEERS`` peers and ``MAX_TRACED_ADDRS`` addresses each.
6. The DCUtR initiator punches from ``PUNCH_PORTS`` local ports at once: before its
   first exchange it listens on more TCP ports beside its own (``open_punch_ports``,
   once per host), py-libp2p's CONNECT advertises every listen port at our public IP,
   the peer dials each from its one port, and we dial the peer from each: independent
   port pairs, any one of which makes the connection. Why: one pair can be lost for
   minutes by a race no process always wins. When the peer's SYN reaches us after our
   router delivered the refusal of our early SYN (an ICMP error, which crossed their SYN
   on the way) but before our next SYN leaves (tens of microseconds on an idle host,
   milliseconds when the SYN thread waits for the GIL), our listener answers it. A
   Linux router tracked our refused SYN's sequence number; the listener's SYN-ACK
   carries one a round trip of the ISN clock later (64 ns a step; more than a 64 KiB
   window past it once the round trip exceeds 4 ms), so the router marks it and every
   later packet of ours on that pair invalid and forwards them unmasqueraded: the
   pair's entry stays in SYN_SENT2 for two minutes (seen on the testbed: the TCP
   connection may even come up when their SYN is resent, and then its handshake never
   finishes, as our side's packets never arrive). No packet of ours repairs it within a
   window, so only another port pair avoids it, and a second pair from the start costs
   one more listener and SYN thread, not a second exchange's round trips and windows.
   The pairs to one peer IP start
   ``PAIR_STAGGER_S`` apart on each side: started together, their refusals arrive in
   the same instant and their SYN threads wait on each other for the GIL, so they lose
   the race together. The first pair whose connection is upgraded stops the others'
   SYNs; one already upgrading finishes (cut short, the peer may have counted it up).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.nat.syn import DEFAULT_SCHEDULE, SynSchedule, SynsRefused, SynTrace, send_syns
from p2p.transport import patches

log = logging.getLogger(__name__)

# Peers whose punch traces a host keeps: a fetch punches at most 16 providers at once
# (p2p.nat.punch.MAX_PUNCHES) and a node runs a few fetches.
MAX_TRACED_PEERS = 64
# Addresses traced per peer: DCUtR dials each address a peer gives (its predicted
# public address, its private ones from identify); a peer that gives more is capped.
MAX_TRACED_ADDRS = 8
# SYN threads a host runs at once (p2p.nat.syn.send_syns): one per address per punch,
# p2p.nat.punch.MAX_PUNCHES (16) punches of a fetch, two addresses each. The book's own
# limiter, so a punch neither waits on trio's default one (the store's file work shares
# it) nor holds it.
MAX_SYN_THREADS = 32
# A punched connection's Noise + yamux handshake: a few RTTs on a path DCUtR just timed
# (about 1.5 s at 300 ms). A failed one is aborted (``_abort``) within a punch window
# (py-libp2p's DCUtR waits 5 s a window, 2 s between), so the next window can try again.
UPGRADE_TIMEOUT = 4.0
# Local ports the DCUtR initiator punches from at once (rule 6): two pairs lose the
# first window only when the race is lost on both (measured on the testbed: about one
# pair in twelve through routers that answer an early SYN with ICMP).
PUNCH_PORTS = 2
# The k-th port pair of a punch to one peer IP waits k times this before its first SYN
# (rule 6): pairs started together lose the race together (their refusals arrive in the
# same instant and their SYN threads queue for the GIL; measured: both pairs lost in 2
# punches of 36, as often as one pair alone). A few milliseconds part them; 20 ms is
# well inside a punch window and leaves the first pair unhurried.
PAIR_STAGGER_S = 0.02
# Port pairs one host punches to one peer IP at once (each dial, each of our ports).
MAX_PAIRS_PER_IP = 8
BOOK_ATTRIBUTE = "_blobnet_punch_book"


@dataclass
class _Expected:
    peer: ID
    initiator: bool  # our dial would upgrade as the Noise initiator
    dials: int = 0  # dials to this address running now


class PunchBook:
    """One host's punches under way and what their SYNs met (rules 3, 5). Sans-IO but for
    ``threads``, the limiter of its SYN threads."""

    def __init__(self, schedule: SynSchedule = DEFAULT_SCHEDULE) -> None:
        self.schedule = schedule
        self._expected: dict[tuple[str, int], _Expected] = {}
        self._traces: dict[str, dict[str, SynTrace]] = {}
        self.claimed = 0  # punched connections our listener took (rule 3)
        self.threads = trio.CapacityLimiter(MAX_SYN_THREADS)
        self.extra_ports: list[int] = []  # listen ports opened for punching (rule 6)
        self._opening = trio.Lock()
        self._pairs: dict[tuple[str, str], int] = {}  # (peer, its IP) -> pairs running

    def pair_started(self, peer: ID, ip: str) -> int:
        """A port pair to ``peer`` at ``ip`` begins; how many were running (its place in
        the stagger, rule 6)."""
        key = (str(peer), ip)
        running = self._pairs.get(key, 0)
        self._pairs[key] = running + 1
        return min(running, MAX_PAIRS_PER_IP)

    def pair_ended(self, peer: ID, ip: str) -> None:
        key = (str(peer), ip)
        left = self._pairs.get(key, 0) - 1
        if left > 0:
            self._pairs[key] = left
        else:
            self._pairs.pop(key, None)

    def sources(self, source: tuple[str, int]) -> list[tuple[str, int]]:
        """The local addresses a dial from ``source`` (our first listen address) leaves
        from: it and the extra punch ports on the same IP (rule 6)."""
        return [source, *((source[0], port) for port in self.extra_ports if port != source[1])]

    def begin(self, peer: ID) -> None:
        """A new punch to ``peer``: forget what the last one saw."""
        self._traces.pop(str(peer), None)

    def start(self, peer: ID, dest: tuple[str, int], *, initiator: bool) -> SynTrace:
        """A dial to ``dest`` begins a window: expect the peer there; its trace."""
        expected = self._expected.get(dest)
        if expected is None or expected.peer != peer:
            expected = self._expected[dest] = _Expected(peer, initiator)
        expected.initiator = initiator
        expected.dials += 1
        traces = self._traces.pop(str(peer), {})
        self._traces[str(peer)] = traces  # the newest last: the oldest goes first
        while len(self._traces) > MAX_TRACED_PEERS:
            del self._traces[next(iter(self._traces))]
        key = f"{dest[0]}:{dest[1]}"
        trace = traces.get(key)
        if trace is None:
            trace = SynTrace(key)
            if len(traces) < MAX_TRACED_ADDRS:
                traces[key] = trace
        trace.windows += 1
        return trace

    def dialling(self, dest: tuple[str, int]) -> bool:
        """Whether a dial to ``dest`` runs now: a second one from the same port (two DCUtR
        sessions at once, ours and the peer's) would find the port pair taken by the
        first's SYN, again and again."""
        expected = self._expected.get(dest)
        return expected is not None and expected.dials > 0

    def stop(self, dest: tuple[str, int]) -> None:
        """A dial to ``dest`` ended (connected, refused for good or cancelled)."""
        expected = self._expected.get(dest)
        if expected is not None:
            expected.dials -= 1
            if expected.dials <= 0:
                del self._expected[dest]

    def claim(self, remote: tuple[str, int]) -> _Expected | None:
        """The punch an inbound socket from ``remote`` belongs to, if any."""
        return self._expected.get(remote)

    def trace(self, peer: ID, dest: tuple[str, int]) -> SynTrace | None:
        """The trace of the punch to ``peer`` at ``dest``, if one is kept."""
        return self._traces.get(str(peer), {}).get(f"{dest[0]}:{dest[1]}")

    def traces(self, peer: ID) -> list[SynTrace]:
        """What the SYNs of the latest punch to ``peer`` met: addresses that connected,
        then those whose side answered, then the silent ones, and last those a router
        on the way called unreachable (a private address from identify), then by SYNs
        sent."""
        found = self._traces.get(str(peer), {}).values()
        return sorted(
            found,
            key=lambda t: (
                t.connected_at is None,
                t.refusals_from_dest() == 0,
                t.refusals_on_the_way() > 0,
                -t.syns,
            ),
        )


def punch_book(host: Any) -> PunchBook:
    """The host's book, made (and its listener's claim installed, rule 3) on first use."""
    book: PunchBook | None = getattr(host, BOOK_ATTRIBUTE, None)
    if book is None:
        book = PunchBook()
        setattr(host, BOOK_ATTRIBUTE, book)
        _claim_inbound(host, book)
    return book


def _free_port(ip: str) -> int:
    """A TCP port free on ``ip`` now. Probed rather than listened on at port 0:
    py-libp2p's ``Swarm.listen`` answers only whether it listened, and keys its listeners
    by the address asked for. Another process may take the port before our listen does;
    ``open_punch_ports`` then goes without it (an ``OSError``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((ip, 0))
        port: int = probe.getsockname()[1]
        return port


async def open_punch_ports(host: Any) -> list[int]:
    """Listen on ``PUNCH_PORTS - 1`` more TCP ports, on the IP of the host's first TCP
    listen address, once per host (rule 6); the extra ports. A port that cannot be had
    is left out: the punch then has fewer pairs, nothing else changes."""
    book = punch_book(host)
    async with book._opening:
        if book.extra_ports:
            return book.extra_ports
        first = next((d for d in map(_tcp_dest, host.get_transport_addrs()) if d is not None), None)
        if first is None:
            return []
        network = host.get_network()
        for _ in range(PUNCH_PORTS - 1):
            try:
                port = _free_port(first[0])
                listening = await network.listen(Multiaddr(f"/ip4/{first[0]}/tcp/{port}"))
            except OSError as exc:
                log.debug("no extra punch port on %s: %r", first[0], exc)
                continue
            if listening:
                book.extra_ports.append(port)
        return book.extra_ports


def _tcp_dest(addr: Any) -> tuple[str, int] | None:
    try:
        ip = addr.value_for_protocol("ip4")
        port = addr.value_for_protocol("tcp")
    except Exception:  # not /ip4/.../tcp/...: QUIC, IPv6, DNS: py-libp2p's own dial
        return None
    if not ip or not port:
        return None
    return str(ip), int(port)


def _abort(sock: Any) -> None:
    """Close a punched socket whose handshake failed with a reset, not a FIN: a FIN would
    leave the port pair in TIME_WAIT for a minute, and every later SYN of the punch would
    find it taken. The reset also closes the routers' entries for the pair, so the next
    window starts afresh."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


async def _upgrade(
    network: Any, stream: trio.SocketStream, peer: ID, addr: Any, *, initiator: bool
) -> None:
    raw = RawConnection(TrioTCPStream(stream), initiator)
    try:
        with trio.fail_after(UPGRADE_TIMEOUT):
            if initiator:
                await network.upgrade_outbound_raw_conn(raw, peer)
                return
            muxed = await network.upgrade_inbound_raw_conn(raw, addr)
    except BaseException:
        _abort(stream.socket)
        raise
    if getattr(muxed, "peer_id", None) != peer:
        await muxed.close()
        raise RuntimeError(f"the punched connection is not to {peer}")


def install(host: Any, dcutr: Any) -> PunchBook:
    """Give ``dcutr``'s hole-punch dials ``send_syns`` on the host's book (rules 1, 2, 4, 6)."""
    book = punch_book(host)
    network = host.get_network()

    def make(original: Any) -> Any:
        async def dial_peer(
            peer_id: ID, addr: Any, source: tuple[str, int] | None = None,
            as_responder: bool = False,
        ) -> None:  # fmt: skip
            dest = _tcp_dest(addr)
            if source is None or dest is None:
                await original(peer_id, addr, source, as_responder)
                return
            if book.dialling(dest):
                log.debug("hole punch to %s at %s: already dialling it", peer_id, addr)
                return
            trace = book.start(peer_id, dest, initiator=not as_responder)
            initiator = not as_responder

            syns: list[trio.CancelScope] = []  # each pair's SYN phase

            async def one_pair(local: tuple[str, int]) -> None:
                """One port pair (rule 6): SYNs, then the upgrade. The first pair whose
                connection is upgraded stops the others' SYNs; one already upgrading
                goes on (cut short, its peer may have counted it up)."""
                place = book.pair_started(peer_id, dest[0])
                try:
                    with trio.CancelScope() as scope:
                        syns.append(scope)
                        await trio.sleep(place * PAIR_STAGGER_S)
                        stream = await send_syns(
                            local, dest, trace, schedule=book.schedule, threads=book.threads
                        )
                    if scope.cancelled_caught:
                        return
                except SynsRefused as exc:
                    log.debug("hole punch from %s to %s stopped: %s", local, dest, exc)
                    return
                finally:
                    book.pair_ended(peer_id, dest[0])
                try:
                    await _upgrade(network, stream, peer_id, addr, initiator=initiator)
                except Exception as exc:  # py-libp2p raises many types for one upgrade
                    trace.handshake_failed()
                    log.debug("hole punch from %s to %s: upgrade failed: %r", local, dest, exc)
                    return
                for scope in syns:
                    scope.cancel()

            try:
                async with trio.open_nursery() as nursery:
                    for local in book.sources(source):
                        nursery.start_soon(one_pair, local)
            finally:
                book.stop(dest)
                log.debug("hole punch to %s: %s", peer_id, trace.describe())

        return dial_peer

    patches.replace_dcutr_dial(dcutr, make)
    return book


def _claim_inbound(host: Any, book: PunchBook) -> None:
    network = host.get_network()
    previous: Any = None

    async def handle(read_write_closer: Any, maddr: Any) -> None:
        remote: tuple[str, int] | None = None
        try:
            address = read_write_closer.get_remote_address()
            remote = (str(address[0]), int(address[1])) if address else None
        except Exception:  # not a socket that can say: not a punch
            pass
        expected = book.claim(remote) if remote is not None else None
        if remote is None or expected is None or not expected.initiator:
            await previous(read_write_closer, maddr)
            return
        book.claimed += 1
        trace = book.trace(expected.peer, remote)
        if trace is not None:
            trace.connected(trio.current_time())
        try:
            with trio.fail_after(UPGRADE_TIMEOUT):
                conn = await network.upgrade_outbound_raw_conn(
                    RawConnection(read_write_closer, True), expected.peer
                )
        except Exception as exc:  # py-libp2p raises many types for one failed upgrade
            log.debug("punched connection from %s: upgrade failed: %r", remote, exc)
            if trace is not None:
                trace.handshake_failed()
            sock = getattr(getattr(read_write_closer, "stream", None), "socket", None)
            if sock is not None:
                _abort(sock)
            return
        # The listener closes the socket when this handler returns: stay until it ends.
        await conn.muxed_conn.event_closed.wait()

    previous = patches.route_inbound(network, handle)
