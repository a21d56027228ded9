"""Remembering peers across downloads (sans-IO): :class:`PeerScores` keeps a decaying score
of the bad data each peer sent, and says which peers are distrusted, with time as an
argument; ``p2p.fetch.peer_memory`` saves it in the store.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScoreConfig:
    # A peer that sent one bad chunk is distrusted for about a day (score 1 decays below
    # the threshold 0.25 after two half-lives): long enough to outlast a training round's
    # many fetches, short enough that a provider whose disk was repaired is used again.
    half_life_s: float = 12 * 3600.0
    distrust_threshold: float = 0.25
    # Scores kept at most; the least-penalised entries are forgotten first. Identities are
    # free, so this bounds memory, not the number of liars one can meet.
    max_peers: int = 4096


class PeerScores:
    """Sans-IO: penalties for peers that sent bad data, decaying with ``half_life_s``.

    A download that bans a peer (bad chunk, protocol breach) reports it here; later
    downloads of the same node start distrusted peers last (``distrusted``)."""

    def __init__(self, config: ScoreConfig = ScoreConfig()) -> None:
        self._cfg = config
        self._scores: dict[str, tuple[float, float]] = {}  # peer -> (score, at time)

    def penalize(self, peer: str, now: float, amount: float = 1.0) -> None:
        self._scores[peer] = (self.score(peer, now) + amount, now)
        if len(self._scores) > self._cfg.max_peers:
            weakest = min(self._scores, key=lambda name: self.score(name, now))
            del self._scores[weakest]

    def score(self, peer: str, now: float) -> float:
        entry = self._scores.get(peer)
        if entry is None:
            return 0.0
        value, at = entry
        return float(value * 0.5 ** (max(0.0, now - at) / self._cfg.half_life_s))

    def distrusted(self, peer: str, now: float) -> bool:
        return self.score(peer, now) >= self._cfg.distrust_threshold

    def snapshot(self, now: float) -> dict[str, float]:
        """Every score as of ``now`` that still matters (above a tenth of the threshold),
        for keeping across processes (p2p.fetch.peer_memory)."""
        floor = self._cfg.distrust_threshold / 10
        return {p: v for p in self._scores if (v := self.score(p, now)) >= floor}

    def restore(self, scores: dict[str, float], now: float, elapsed_s: float) -> None:
        """Merge scores saved ``elapsed_s`` seconds ago (decayed by that much) into this
        table as of ``now``, keeping the larger of two scores for one peer."""
        decay = 0.5 ** (max(0.0, elapsed_s) / self._cfg.half_life_s)
        for peer, value in list(scores.items())[: self._cfg.max_peers]:
            carried = value * decay
            if carried > self.score(peer, now):
                self._scores[peer] = (carried, now)

    def __len__(self) -> int:
        return len(self._scores)
