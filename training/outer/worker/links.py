"""A worker's links to its run: the topic in and out, dials, pauses, and never going on
alone (points 1 and 6 of :mod:`training.outer.worker`).

1. An announcement is published when it is new or changed, then re-sent with back-off
   (``training.outer.announce.Announcer``) until dropped; a failed publish is only logged
   (the re-sends make up for it).
2. What the topic delivers goes to the ledger; the hello (while announced) is re-sent at
   once whenever a worker is heard of for the first time, since one that subscribed after
   it went out would otherwise wait at its start barrier for the first update.
3. Every admitted peer heard of and not connected is dialled, with back-off
   (``PeerDialer``), at most ``MAX_CONCURRENT_DIALS`` at a time.
4. A pause (the event loop did not run for ``PAUSE_GAP``) makes every missing peer due
   at once and keeps live connections: the closures the others published meanwhile
   arrive over them. Only :meth:`Links.redial` (after a state fetch that failed, which
   shows a connection that only looks alive) drops them all.
5. Alone (trained with others, connected to none): the worker waits for a peer before it
   proposes or fetches a closure's blobs, and stops with an error after ``alone_bound`` (a
   fetch bound) if it was paused since it last had a peer (the run most likely went on or
   ended without it), else after ``peer_bound`` (its start timeout: its peers vanished
   while it ran, and one restarting with ``--resume`` takes that long to come back).
6. Traffic: the sockets' bytes (``WireMeter``) and the announcement payloads published and
   delivered, counted since the last :meth:`Links.traffic`.
7. The rendezvous: workers bootstrapped only to a peer they share (a ``blob serve`` node
   that holds the run's spec, say) are not on each other's topic until they connect. So a
   worker asks each bootstrap peer, with the blob protocol's ``peers`` request
   (``p2p/blob/PROTOCOL.md`` section 5.3), who else asked it about a blob every worker of
   the run holds (the spec's, else the initial state: asking is registering), and dials
   whom it names; once connected, gossipsub puts them on one topic, and the worker
   re-sends its hello a heartbeat later. It asks every ``RENDEZVOUS_FIRST`` seconds while
   fewer than K workers are present, then every ``RENDEZVOUS_IDLE`` for the whole run (a
   healed partition, a joiner). What the serving node holds for it is its swarm book,
   bounded there (``p2p.blob.swarm``: 64 peers a blob, 256 blobs, 300 s), and gated to
   admitted peers where the node has authorities; at most ``MAX_PEERS_LISTED`` peers an
   answer, dialled ``MAX_CONCURRENT_DIALS`` at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from p2p.errors import P2PError
from p2p.transport.meter import SAMPLE_INTERVAL, WireMeter
from training.outer.announce import Announcer, PeerDialer
from training.outer.messages import Event, Ledger
from training.outer.params import OuterNetError
from training.outer.worker.signals import Changes, say

if TYPE_CHECKING:
    from p2p.node.node import Node

# The dial loop looks for peers to dial this often (PeerDialer decides whom).
DIAL_TICK = 0.5
# Dials of one tick run at once, at most this many (a dead host's dial waits its timeout).
MAX_CONCURRENT_DIALS = 8
# An event loop that did not run for this long was stopped (SIGSTOP, a suspended laptop).
# A loaded 2-vCPU machine can stall a worker's loop for 5-6 s while torch is imported in
# a thread (the GIL); a false alarm only costs a redial. Stops shorter than this are caught
# by a fetch that fails (a catch-up then redials).
PAUSE_GAP = 7.0
# The rendezvous (rule 7): while workers of the run are missing a worker asks once a
# second (a peer that starts a second later is found a second later); then seldom, for a
# partition that heals or a joiner, at a cost of one small request a peer.
RENDEZVOUS_FIRST = 1.0
RENDEZVOUS_IDLE = 15.0
# After dialling a peer the rendezvous named, the hello is re-sent this long after: one
# gossipsub heartbeat (p2p.node.gossip.HEARTBEAT_S) grafts the new peer into the mesh.
HELLO_AFTER_DIAL = 1.5
# Peers the rendezvous connected to that the log names, once each, at most this many.
MAX_SAID = 256


class Links:
    """The topic, dials and pauses of one worker (see the module's rules)."""

    def __init__(
        self,
        node: Node,
        topic: str,
        announcer: Announcer,
        dialer: PeerDialer,
        meter: WireMeter,
        changes: Changes,
        *,
        alone_bound: float,
        peer_bound: float | None = None,
        label: str,
    ) -> None:
        self.node = node
        self.peer = node.peer_id
        self.topic = topic
        self.announcer = announcer
        self.dialer = dialer
        self.meter = meter
        self.changes = changes
        self.alone_bound = alone_bound
        self.peer_bound = alone_bound if peer_bound is None else peer_bound
        self.woke = False  # paused since it last had a peer (rule 5)
        self.label = label
        # Peers whose updates this worker applied (rule 5: whom it trained with).
        self.ever_admitted: set[str] = set()
        # Announcement payloads published / delivered (each once; gossipsub relays and
        # control messages are not in these, only in the wire counts), and at the mark.
        self.pubsub_bytes = [0, 0]
        self._pubsub_mark = (0, 0)
        self._wire_mark = (0, 0)

    # --- the topic (rules 1 and 2) ----------------------------------------------------
    async def publish(self, data: bytes) -> None:
        self.pubsub_bytes[0] += len(data)
        try:
            await self.node.publish(self.topic, data)
        except Exception as exc:  # libp2p raises many types; announcements are re-sent
            say(self.label, f"publish failed (will re-send): {exc!r}")

    async def announce(self, name: str, data: bytes) -> None:
        """Announce ``data`` as ``name`` (replacing what was announced as it)."""
        if self.announcer.set(name, data, trio.current_time()):
            await self.publish(data)
            self.changes.set()

    async def announce_loop(self) -> None:
        while True:
            with trio.move_on_at(self.announcer.next_due()):
                await trio.sleep_forever()
            for data in self.announcer.due(trio.current_time()):
                await self.publish(data)

    async def receive_loop(
        self, sub: Any, ledger: Ledger, handle: Callable[[list[Event]], None]
    ) -> None:
        """Hear the topic into ``ledger``, its events to ``handle``."""
        from libp2p.peer.id import ID

        while True:
            msg = await sub.get()
            try:
                sender = ID(msg.from_id).to_base58()
            except Exception:  # a malformed source field: not a message we can judge
                continue
            self.pubsub_bytes[1] += len(msg.data)
            present = len(ledger.present)
            handle(ledger.hear(msg.data, sender, time.time()))
            if len(ledger.present) > present:
                operator = ledger.operators.get(sender, "worker")
                say(
                    self.label,
                    f"heard {operator} {sender[-6:]} of the run "
                    f"({len(ledger.present)} other worker(s) heard)",
                )
            hello = self.announcer.entries.get("hello")
            if hello is not None and len(ledger.present) > present:
                # A worker new to us: our hello may have gone out before it subscribed,
                # and its start barrier waits for it (re-sent at once, not after back-off).
                await self.publish(hello.data)

    # --- dials and pauses (rules 3 and 4) ---------------------------------------------
    async def meter_loop(self) -> None:
        """Sample the sockets' byte counts; after a pause, dial every peer not connected
        at once (rule 4)."""
        last = trio.current_time()
        while True:
            self.meter.sample()
            await trio.sleep(SAMPLE_INTERVAL)
            now = trio.current_time()
            if now - last > PAUSE_GAP:
                say(self.label, f"woke after {now - last:.0f}s without running")
                self.woke = True
                self.dialer.all_due(now)
            last = now

    async def dial_loop(self) -> None:
        """Dial every admitted peer heard of and not connected (PeerDialer's back-off)."""
        limit = trio.Semaphore(MAX_CONCURRENT_DIALS)

        async def dial(peer: str, addrs: tuple[str, ...]) -> None:
            async with limit:
                ok = await self._dial(addrs)
            if ok:
                self.dialer.succeeded(peer, trio.current_time())
            else:
                self.dialer.failed(peer, trio.current_time())

        while True:
            due = self.dialer.due(trio.current_time(), self.node.connected_peers())
            async with trio.open_nursery() as nursery:
                for peer, addrs in due:
                    if peer != self.peer:
                        nursery.start_soon(dial, peer, addrs)
            await trio.sleep(DIAL_TICK)

    async def rendezvous_loop(
        self, key: str, points: Sequence[str], settled: Callable[[], bool]
    ) -> None:
        """Rule 7: ask each peer of ``points`` who else holds blob ``key``, and dial whom
        it names; often until ``settled()`` (every worker of the run present), then seldom."""
        if not points:
            return
        limit = trio.Semaphore(MAX_CONCURRENT_DIALS)
        dialling: set[str] = set()  # at most MAX_PEERS_LISTED per point asked
        said: set[str] = set()

        async def dial(point: str, peer: str, addrs: tuple[str, ...]) -> None:
            try:
                async with limit:
                    if not await self.node.dial_listed(peer, addrs):
                        return  # a fetcher of the blob that has gone, say
            finally:
                dialling.discard(peer)
            if peer not in said and len(said) < MAX_SAID:
                said.add(peer)
                say(self.label, f"rendezvous: {point[-6:]} named {peer[-6:]}; connected")
            hello = self.announcer.entries.get("hello")
            if hello is not None:
                await trio.sleep(HELLO_AFTER_DIAL)
                await self.publish(hello.data)

        async with trio.open_nursery() as nursery:
            while True:
                connected = set(self.node.connected_peers())
                for point in points:
                    for peer, addrs in await self.node.ask_peers(point, key):
                        if peer == self.peer or peer in connected or peer in dialling:
                            continue
                        dialling.add(peer)
                        nursery.start_soon(dial, point, peer, addrs)
                await trio.sleep(RENDEZVOUS_IDLE if settled() else RENDEZVOUS_FIRST)

    async def _dial(self, addrs: Sequence[str]) -> bool:
        # Node.connect lifts py-libp2p's 60 s negative dial cache; PeerDialer's back-off
        # governs these dials instead.
        for addr in addrs:
            try:
                await self.node.connect(addr)
                return True
            except P2PError:
                continue
        return False

    async def redial(self) -> None:
        """Drop every connection; the dial loop makes new ones within a second. After this
        worker was paused (SIGSTOP, a laptop lid), connections its peers have long closed
        can linger here looking alive, so nobody answers its fetches and new dials to the
        same peers are refused; fresh connections fix that."""
        from libp2p.peer.id import ID

        for peer in self.node.connected_peers():
            with trio.move_on_after(5):
                try:
                    await self.node.host.disconnect(ID.from_base58(peer))
                except Exception as exc:  # libp2p raises many types; the dial loop retries
                    say(self.label, f"disconnect {peer[-6:]} failed: {exc!r}")
        self.dialer.all_due(trio.current_time())
        say(self.label, "dropped all connections to dial again")

    # --- never alone (rule 5) ---------------------------------------------------------
    def admitted(self, peers: Iterable[str]) -> None:
        """Peers whose updates this worker applied."""
        self.ever_admitted.update(peers)

    def alone(self) -> bool:
        """Trained with others (applied an update of theirs) and connected to no admitted
        peer: a closure made now would agree with nobody."""
        if not self.ever_admitted - {self.peer}:
            return False  # round 0, or nobody else's update applied: nobody to fork from
        peers = set(self.dialer.peers) - {self.peer}
        return not peers & set(self.node.connected_peers())

    async def waited_for_peers(self, r: int, what: str = "not proposing alone") -> bool:
        """Before proposing for round ``r`` (or fetching a closure's blobs), wait while
        alone; False if there was no need. With nobody back within ``alone_bound`` it
        stops: every closure it made alone would be a fork of whatever the others agreed
        on, and a closure's blobs cannot come from nobody. The bound is rule 5's."""
        if not self.alone():
            self.woke = False
            return False
        bound = self.alone_bound if self.woke else self.peer_bound
        say(self.label, f"round {r}: no worker of the run connected; {what} (at most {bound:.0f}s)")
        self.dialer.all_due(trio.current_time())  # the wait is for them: dial all now
        with trio.move_on_after(bound):
            # The dial loop connects; the node has no event for a new connection.
            while self.alone():  # noqa: ASYNC110
                await trio.sleep(DIAL_TICK)
            self.woke = False
            return True
        raise OuterNetError(
            f"round {r}: no worker of the run is reachable, so the run went on or ended "
            "without this worker (paused or cut off past the others' end); not closing "
            "rounds alone"
        )

    # --- traffic (rule 6) -------------------------------------------------------------
    def mark(self) -> tuple[int, int]:
        """Count traffic from now; the sockets' totals (sent, received) now."""
        self._wire_mark = self.meter.sample()
        self._pubsub_mark = (self.pubsub_bytes[0], self.pubsub_bytes[1])
        return self._wire_mark

    def traffic(self) -> tuple[int, int, int, int]:
        """Bytes since the last call (or :meth:`mark`): wire sent and received,
        announcement payloads published and delivered."""
        sent, received = self.meter.sample()
        wire = (sent - self._wire_mark[0], received - self._wire_mark[1])
        pubsub = (
            self.pubsub_bytes[0] - self._pubsub_mark[0],
            self.pubsub_bytes[1] - self._pubsub_mark[1],
        )
        self._wire_mark = (sent, received)
        self._pubsub_mark = (self.pubsub_bytes[0], self.pubsub_bytes[1])
        return (*wire, *pubsub)
