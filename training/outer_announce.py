"""When a worker re-publishes its announcements: on change, then with exponential back-off.

Gossipsub keeps no history, so a peer that subscribed late, or was paused, hears an
announcement only if it is sent again. Sending every announcement every second (the
first version) made announcements 7x the update bytes (issue 17). Instead each
announcement is sent when it is set or changes, then again after ``FIRST_RETRY``,
doubling up to ``MAX_RETRY`` seconds, until it is dropped (the round it belongs to closed).
Sans-IO: ``now`` is an argument; :meth:`Announcer.next_due` says when to wake.
"""

from __future__ import annotations

from dataclasses import dataclass

# Within its first GOSSIP_WINDOW heartbeats (3 s, p2p.gossip) a message that a mesh peer
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
