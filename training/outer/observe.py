"""What an outer worker shows an operator: its ``blob status`` section and the outer loop's
metrics (p2p.metrics rule 4), read from the worker's own records.

Rules
1. Metric labels come from the closed sets of :mod:`p2p.metrics` (rule 2 there): the
   free-text reasons the aggregator, the proposer and the replayer give are sorted into
   ``EXCLUSION_REASONS`` and ``REPLAY_VERDICTS`` here, and the full text stays in the
   worker's result file, its milestones and ``blob status``.
2. The status names peers and blobs (they are not labels); it is built when asked, from
   what the worker already holds, so it costs nothing between requests.
"""

from __future__ import annotations

# What the worker is doing, as ``blob status`` says it (a closed set, like the labels).
PHASES = ("joining", "training", "waiting for updates", "finishing", "done")

# Words in an exclusion's reason and the label each sorts into, first match wins.
_REASON_WORDS = (
    ("mismatch", "replay"),  # an operator this worker saw cheat in a replay
    ("norm", "bounds"),
    ("disagrees", "bounds"),
    ("late", "late"),
    ("score", "score"),
    ("worse", "score"),
)


def exclusion_label(reason: str) -> str:
    """The ``EXCLUSION_REASONS`` label of a free-text exclusion reason (rule 1): copies,
    undecodable payloads, too low a verification level and the like are ``invalid``."""
    text = reason.lower()
    for word, label in _REASON_WORDS:
        if word in text:
            return label
    return "invalid"


def verdict_label(outcome: str, *, mismatched: bool, unavailable: str) -> str:
    """The ``REPLAY_VERDICTS`` label of a replay's outcome: its update matched, did not, or
    could not be replayed (``unavailable``: the replay's inputs could not be had)."""
    if mismatched:
        return "disagree"
    return "error" if outcome == unavailable else "agree"
