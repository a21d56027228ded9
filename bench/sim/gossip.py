"""A gossipsub mesh for one topic, in simulated time (``p2p.node.gossip``'s settings).

Rules, as the router runs them (py-libp2p 0.8.1 with ``router_settings()``):
1. Every subscriber keeps ``DEGREE`` mesh peers (at least ``DEGREE_LOW``, at most
   ``DEGREE_HIGH``): a newcomer grafts ``DEGREE`` random subscribers, and each heartbeat
   (``HEARTBEAT_S``) grafts peers to a mesh below ``DEGREE_LOW`` and prunes one above
   ``DEGREE_HIGH`` back to ``DEGREE``; a peer that left is gone from every mesh at once.
2. A published message goes to the publisher's mesh peers; a peer that receives a message
   for the first time delivers it and forwards it to its mesh peers but the sender. Every
   copy costs its bytes (the message and the pubsub envelope, ``ENVELOPE``) on the
   connection between the two peers, and a message to a peer already holding it is a
   duplicate, counted.
3. Each heartbeat a peer that saw messages within ``GOSSIP_WINDOW`` heartbeats sends IHAVE
   (their IDs) to ``DEGREE`` subscribers outside its mesh; one that lacks a message asks
   IWANT and gets it. Messages are told apart by (sender, sequence number): a message
   published again is a new message (the outer loop's announcements are re-sent so, with
   back-off: ``training.outer.announce``).

Not simulated: peer scoring, opportunistic grafting, flood publishing and spam limits
(``MAX_MESSAGES_PER_TOPIC_PER_SECOND`` is sized for 64 workers; the counts here say what
a larger run would ask of it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from bench.sim.fluid import Host
from bench.sim.world import World
from p2p.node.gossip import DEGREE, DEGREE_HIGH, DEGREE_LOW, GOSSIP_WINDOW, HEARTBEAT_S

# A pubsub message's bytes beyond its data: sender, sequence number, topic, signature and key.
ENVELOPE = 160
# How long a peer remembers a message it saw (duplicates within it are dropped).
SEEN_TTL = 60.0
# An IHAVE or IWANT frame's bytes beyond its message IDs, and per ID.
CONTROL_FRAME = 40
MESSAGE_ID = 40


@dataclass
class PeerStats:
    sent: int = 0
    received: int = 0
    duplicates: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    control: int = 0


@dataclass
class _Member:
    name: str
    host: Host
    deliver: Callable[[bytes, str], None]
    mesh: set[str] = field(default_factory=set)
    seen: dict[int, float] = field(default_factory=dict)  # message id -> when first seen
    stats: PeerStats = field(default_factory=PeerStats)


class Gossip:
    """One topic's mesh (see the module docstring)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.members: dict[str, _Member] = {}
        self.messages: dict[int, tuple[bytes, str]] = {}  # id -> (data, origin)
        self._next = 0
        self.stats_of: dict[str, PeerStats] = {}
        world.env.process(self._heartbeat())

    def join(self, name: str, host: Host, deliver: Callable[[bytes, str], None]) -> None:
        m = self.members[name] = _Member(name, host, deliver)
        self.stats_of[name] = m.stats
        others = [n for n in self.members if n != name]
        for peer in self.world.rng.sample(others, min(DEGREE, len(others))):
            self._graft(name, peer)

    def leave(self, name: str) -> None:
        m = self.members.pop(name, None)
        if m is None:
            return
        for peer in m.mesh:
            other = self.members.get(peer)
            if other is not None:
                other.mesh.discard(name)

    def _graft(self, a: str, b: str) -> None:
        self.members[a].mesh.add(b)
        self.members[b].mesh.add(a)

    def publish(self, name: str, data: bytes) -> int:
        m = self.members.get(name)
        if m is None:
            return -1
        mid = self._next
        self._next += 1
        self.messages[mid] = (data, name)
        m.seen[mid] = self.world.now
        for peer in list(m.mesh):
            self._send(m, peer, mid)
        return mid

    def _send(self, m: _Member, peer: str, mid: int) -> None:
        other = self.members.get(peer)
        if other is None:
            return
        size = len(self.messages[mid][0]) + ENVELOPE
        m.stats.sent += 1
        m.stats.bytes_out += size
        self.world.net.message(m.host, other.host, self._receive, peer, m.name, mid)

    def _receive(self, name: str, sender: str, mid: int) -> None:
        m = self.members.get(name)
        if m is None:
            return
        data, origin = self.messages[mid]
        m.stats.received += 1
        m.stats.bytes_in += len(data) + ENVELOPE
        if mid in m.seen:
            m.stats.duplicates += 1
            return
        m.seen[mid] = self.world.now
        for peer in list(m.mesh):
            if peer != sender and peer != origin:
                self._send(m, peer, mid)
        m.deliver(data, origin)

    def _heartbeat(self):  # type: ignore[no-untyped-def]
        env = self.world.env
        rng = self.world.rng
        while True:
            yield env.timeout(HEARTBEAT_S)
            now = self.world.now
            window = GOSSIP_WINDOW * HEARTBEAT_S
            names = list(self.members)
            for name, m in list(self.members.items()):
                if name not in self.members:
                    continue
                # Mesh upkeep (rule 1).
                if len(m.mesh) < DEGREE_LOW and len(names) > 1:
                    pool = [n for n in names if n != name and n not in m.mesh]
                    for peer in rng.sample(pool, min(DEGREE - len(m.mesh), len(pool))):
                        self._graft(name, peer)
                elif len(m.mesh) > DEGREE_HIGH:
                    for peer in rng.sample(sorted(m.mesh), len(m.mesh) - DEGREE):
                        m.mesh.discard(peer)
                        self.members[peer].mesh.discard(name)
                # IHAVE gossip (rule 3).
                for mid in [i for i, t in m.seen.items() if now - t > SEEN_TTL]:
                    del m.seen[mid]
                recent = [i for i, t in m.seen.items() if now - t <= window]
                if not recent:
                    continue
                pool = [n for n in names if n != name and n not in m.mesh and n in self.members]
                for peer in rng.sample(pool, min(DEGREE, len(pool))):
                    m.stats.control += 1
                    m.stats.bytes_out += CONTROL_FRAME + MESSAGE_ID * len(recent)
                    self.world.net.message(
                        m.host, self.members[peer].host, self._ihave, peer, name, recent
                    )

    def _ihave(self, name: str, sender: str, ids: list[int]) -> None:
        m = self.members.get(name)
        if m is None:
            return
        m.stats.control += 1
        m.stats.bytes_in += CONTROL_FRAME + MESSAGE_ID * len(ids)
        want = [i for i in ids if i not in m.seen]
        src = self.members.get(sender)
        if not want or src is None:
            return
        m.stats.control += 1
        m.stats.bytes_out += CONTROL_FRAME + MESSAGE_ID * len(want)
        self.world.net.message(m.host, src.host, self._iwant, sender, name, want)

    def _iwant(self, sender: str, name: str, want: list[int]) -> None:
        src = self.members.get(sender)
        if src is None:
            return
        src.stats.control += 1
        src.stats.bytes_in += CONTROL_FRAME + MESSAGE_ID * len(want)
        for mid in want:
            if mid in self.messages:
                self._send(src, name, mid)
