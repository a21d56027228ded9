"""One log line per blob a peer fetched from this server: sans-IO bookkeeping.

Rules
1. A peer's visit lasts while it holds blob streams open: it begins with its first stream
   and ends when its last one closes (a fetch opens several streams per provider, so a line
   per stream or per request would be many lines per blob).
2. During a visit, the bytes of each blob sent to the peer are summed, with the time from
   the first chunk to the last; when the visit ends, ``end`` returns one line per blob.
3. Bounded: peers with streams open are bounded by the server's stream budget; per peer at
   most ``MAX_BLOBS_PER_VISIT`` blobs are kept (a peer fetching a huge collection's files
   one by one gets the first ones named and the rest counted).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

# Blobs named per visit (rule 3): a collection's files fetched in one go, and then some.
MAX_BLOBS_PER_VISIT = 64


@dataclass
class _Sent:
    nbytes: int
    first: float
    last: float


class ServedLog:
    def __init__(self) -> None:
        self._open: Counter[str] = Counter()
        self._visits: dict[str, dict[str, _Sent]] = {}
        self._more: Counter[str] = Counter()  # blobs past MAX_BLOBS_PER_VISIT, by peer

    def begin(self, peer: str) -> None:
        self._open[peer] += 1

    def sent(self, peer: str, blob_id: str, nbytes: int, now: float) -> None:
        visit = self._visits.setdefault(peer, {})
        entry = visit.get(blob_id)
        if entry is None:
            if len(visit) >= MAX_BLOBS_PER_VISIT:
                self._more[peer] += nbytes
                return
            visit[blob_id] = _Sent(nbytes, now, now)
        else:
            entry.nbytes += nbytes
            entry.last = now

    def end(self, peer: str) -> list[str]:
        """A stream of ``peer`` closed; the visit's lines if it was its last (rule 2)."""
        self._open[peer] -= 1
        if self._open[peer] > 0:
            return []
        del self._open[peer]
        lines = [
            f"served {blob_id[:12]} to {peer}: {sent.nbytes} bytes in "
            f"{sent.last - sent.first:.2f} s"
            for blob_id, sent in self._visits.pop(peer, {}).items()
        ]
        more = self._more.pop(peer, 0)
        if more:
            lines.append(f"served {more} more bytes of other blobs to {peer}")
        return lines
