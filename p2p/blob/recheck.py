"""Which chunks a server hashes again after a fetcher drops the stream they came on, sans-IO
(time is the ``now`` argument; the server does the reading and hashing).

A server hashes each chunk the first time it reads it from disk, and later serves it from
the page cache unhashed (p2p.blob.server, theory rule 6); a chunk that rots after that (or
whose cached pages readahead refilled from a rotten disk) is sent as it is. Its fetcher
hashes it, bans the server and resets the stream, and nothing in the protocol tells the
server why. So a stream reset by its peer soon after a chunk went out is a hint: the
server hashes that stream's last few chunks again, and quarantines the blob if one fails.

Rules:
1. Only chunks sent within ``window`` seconds of the reset are candidates, at most
   ``per_stream`` of them, newest first: a fetcher that rejects a chunk resets at once,
   while other resets (a fetch ending, endgame duplicates cancelled) are not about a chunk.
2. All re-checks share one byte bucket: ``rate`` bytes a second, up to ``burst`` saved. A
   chunk larger than the credit left is skipped (the next fetcher it fails will reset
   too). A peer that resets every stream it gets so costs the server at most ``rate``
   bytes of hashing a second, and a good chunk hashed again is only that: the server's
   own hash decides, never a peer.
3. A chunk that checked out is not exempt from the next check: every fetch that ends
   checks its last chunks, and rot found a second after one of them must still count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MiB = 1024 * 1024

# A fetcher hashes a chunk as it lands (or in a writer thread right behind it) and resets
# the stream on a mismatch: well under a second on any machine this serves.
RECHECK_WINDOW = 5.0
# Chunks a pipelined stream may have sent after the bad one before the reset arrives
# (p2p.fetch's PIPELINE_DEPTH is 2, each `get` a few chunks at 1 MiB).
RECHECK_PER_STREAM = 4
# Hashing budget for re-checks: BLAKE3 of 1 MiB chunks runs at 0.6 to 2.6 GiB/s on one
# core of the 2-vCPU machine this is developed on (the low end when other work shares it),
# so 64 MiB a second costs 2.5% to 10% of a core whatever peers do; the burst lets one
# fetcher's whole stripe (8 lanes x 4 chunks of 1 MiB, or four 16 MiB chunks) be checked
# at once.
RECHECK_RATE = 64 * MiB
RECHECK_BURST = 64 * MiB


@dataclass(frozen=True)
class Sent:
    """A chunk that went out on a stream: its blob, index, length and when."""

    blob_id: str
    index: int
    length: int
    at: float


class Rechecks:
    """The decisions of the module docstring's rules, for one server."""

    def __init__(
        self,
        *,
        window: float = RECHECK_WINDOW,
        per_stream: int = RECHECK_PER_STREAM,
        rate: float = RECHECK_RATE,
        burst: float = RECHECK_BURST,
        now: float = 0.0,
    ) -> None:
        self.window = window
        self.per_stream = per_stream
        self.rate = rate
        self.burst = burst
        self._credit = burst
        self._at = now
        self.skipped = 0  # candidates left unchecked for want of credit

    def due(self, sent: Iterable[Sent], now: float) -> list[Sent]:
        """Of the chunks a stream sent (oldest first), those to hash again now that its
        peer ended it; each one returned is charged to the bucket."""
        if now > self._at:
            self._credit = min(self.burst, self._credit + (now - self._at) * self.rate)
            self._at = now
        recent = [s for s in sent if now - s.at <= self.window][-self.per_stream :]
        out = []
        for s in reversed(recent):
            if s.length > self._credit:
                self.skipped += 1
                continue
            self._credit -= s.length
            out.append(s)
        return out
