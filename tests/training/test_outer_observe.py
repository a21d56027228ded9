"""An outer worker's metrics use only the closed label sets of p2p.metrics: every reason the
aggregator, the proposer or a replay gives sorts into one of them, never into a new series."""

from __future__ import annotations

import pytest

from p2p.metrics import EXCLUSION_REASONS, REPLAY_VERDICTS
from training.outer.observe import exclusion_label, verdict_label
from training.outer.replay import UNAVAILABLE


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("norm out of bounds (larger than the model)", "bounds"),
        ("norm far above the round's median", "bounds"),
        ("disagrees with the round's updates", "bounds"),
        ("mismatch: rows differ at step 3", "replay"),
        ("a copy (blob already named)", "invalid"),
        ("undecodable", "invalid"),
        ("offers verification level 'bounded'; the run requires 'replayed'", "invalid"),
        ("scored worse than the round's start", "score"),
        ("late: announced after the round closed", "late"),
    ],
)
def test_each_exclusion_reason_sorts_into_a_closed_label(reason: str, label: str) -> None:
    assert exclusion_label(reason) == label
    assert label in EXCLUSION_REASONS


def test_a_replay_outcome_is_agree_disagree_or_error() -> None:
    assert verdict_label("match", mismatched=False, unavailable=UNAVAILABLE) == "agree"
    assert verdict_label("mismatch: x", mismatched=True, unavailable=UNAVAILABLE) == "disagree"
    assert verdict_label(UNAVAILABLE, mismatched=False, unavailable=UNAVAILABLE) == "error"
    assert {"agree", "disagree", "error"} == set(REPLAY_VERDICTS)
