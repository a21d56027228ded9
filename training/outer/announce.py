"""When a worker re-publishes its announcements, and when it dials its peers again (sans-IO).

Gossipsub keeps no history, so a peer that subscribed late, or was paused, hears an
announcement only if it is sent again. Sending every announcement every second would
make announcements 7x the update bytes. Instead each
announcement is sent when it is set or changes, then again after ``FIRST_RETRY``,
doubling up to ``MAX_RETRY`` seconds, until it is dropped (the round it belongs to closed).
Sans-IO: ``now`` is an argument; :meth:`Announcer.next_due` says when to wake.

:class:`PeerDialer` is the same idea for connections (a worker resumed after a pause
must rejoin): it remembers every admitted peer heard of, with the addresses its
signed announcements gave, and says whom to dial when. A peer that is not connected is
dialled at once, then after ``DIAL_FIRST`` seconds, doubling up to ``DIAL_MAX``, for the
whole run: a dead bootstrap peer costs one failed dial every ``DIAL_MAX`` seconds, and a
resumed or restarted worker finds the living ones whoever it first bootstrapped to. A
successful dial resets the back-off, so a connection that drops is dialled again at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Within its first GOSSIP_WINDOW heartbeats (3 s, p2p.node.gossip) a message that a mesh peer
# missed is recovered by gossipsub itself (IHAVE / IWANT), so the first re-send waits that
# long; later ones back off to about one per round at the default deadline. (Re-sending
# after 1 s made announcements half of a worker's bytes per round on 3 workers.)
FIRST_RETRY = 4.0
MAX_RETRY = 8.0


@dataclass
class _Entry:
    data: bytes
    due: float
    interval: float


class Announcer:
    """Named announcements and when each is next re-sent."""

    def __init__(self, first: float = FIRST_RETRY, cap: float = MAX_RETRY) -> None:
        self.first = first
        self.cap = cap
        self.entries: dict[str, _Entry] = {}

    def set(self, name: str, data: bytes, now: float) -> bool:
        """Set ``name``; True if it changed (the caller publishes it now)."""
        old = self.entries.get(name)
        if old is not None and old.data == data:
            return False
        self.entries[name] = _Entry(data, now + self.first, self.first)
        return True

    def drop(self, name: str) -> None:
        self.entries.pop(name, None)

    def due(self, now: float) -> list[bytes]:
        """The announcements to re-send at ``now``; each backs off (doubling, capped)."""
        out = []
        for entry in self.entries.values():
            if entry.due <= now:
                out.append(entry.data)
                entry.interval = min(entry.interval * 2, self.cap)
                entry.due = now + entry.interval
        return out

    def next_due(self) -> float:
        return min((e.due for e in self.entries.values()), default=float("inf"))


# A failed dial is tried again after this long, doubling up to DIAL_MAX: long enough that
# a dead peer costs little, short enough that a peer back from a pause is found within a
# round at the default deadline.
DIAL_FIRST = 1.0
DIAL_MAX = 8.0
# Peers remembered: every admitted worker of the largest run (p2p.node.gossip.MAX_RUN_WORKERS)
# with room for as many that left; the oldest-heard are forgotten first.
MAX_PEERS = 128
# Addresses kept per peer (newest first): a node listens on a handful.
MAX_ADDRS_PER_PEER = 4


@dataclass
class _Peer:
    addrs: tuple[str, ...]
    due: float
    interval: float
    heard: float


class PeerDialer:
    """Admitted peers heard of, their addresses, and when each is next dialled."""

    def __init__(self, first: float = DIAL_FIRST, cap: float = DIAL_MAX) -> None:
        self.first = first
        self.cap = cap
        self.peers: dict[str, _Peer] = {}

    def learn(self, peer: str, addrs: Sequence[str], now: float) -> None:
        """Remember ``addrs`` (from a valid announcement of ``peer``), newest first."""
        if not addrs:
            return
        old = self.peers.get(peer)
        if old is None:
            if len(self.peers) >= MAX_PEERS:
                del self.peers[min(self.peers, key=lambda p: self.peers[p].heard)]
            old = self.peers[peer] = _Peer((), now, self.first, now)
        old.addrs = tuple(dict.fromkeys([*addrs, *old.addrs]))[:MAX_ADDRS_PER_PEER]
        old.heard = now

    def addrs(self, peer: str) -> tuple[str, ...]:
        entry = self.peers.get(peer)
        return () if entry is None else entry.addrs

    def due(self, now: float, connected: Iterable[str]) -> list[tuple[str, tuple[str, ...]]]:
        """Peers to dial at ``now``: not connected, and their retry time has come."""
        live = set(connected)
        out = []
        for peer, entry in self.peers.items():
            if peer in live:
                entry.due = min(entry.due, now)  # if it drops, dial again at once
                entry.interval = self.first
            elif entry.due <= now:
                out.append((peer, entry.addrs))
        return out

    def failed(self, peer: str, now: float) -> None:
        entry = self.peers.get(peer)
        if entry is not None:
            entry.due = now + entry.interval
            entry.interval = min(entry.interval * 2, self.cap)

    def succeeded(self, peer: str, now: float) -> None:
        entry = self.peers.get(peer)
        if entry is not None:
            entry.due = now
            entry.interval = self.first

    def all_due(self, now: float) -> None:
        """Dial everyone again now (after a pause: connections may be dead)."""
        for entry in self.peers.values():
            entry.due = now
            entry.interval = self.first
