"""The simulator stays wired to the real scheduler: a small simulated fan-out that the
swarming rules make cheap for the seeder, and that fails when the rule is switched off.
Deterministic (simulated time, no randomness in the scenario), a fraction of a second."""

from __future__ import annotations

import pytest

from bench.sim import fanout
from p2p.fetch import sched_picking

# bench.wan.scenarios.fan_out's shape: a 100 Mbit/s seeder, 8 fetchers on 1 Gbit/s, 32 MiB.
WORKERS = 8
SIZE = 32 * fanout.MiB
# With the rule the seeder sends 1.44x the blob here; with `_defers` switched off, 2.21x;
# without swarming at all (every fetcher from the seeder), 8x.
MAX_SEEDER_SHARE = 1.8


def test_fellows_spare_the_seeder_in_a_simulated_fan_out() -> None:
    result = fanout.wan_fan_out(WORKERS, SIZE)
    summary = result.summary()
    assert summary["honest_finished"] == WORKERS
    assert summary["seeder_sent_ratio"] < MAX_SEEDER_SHARE, summary
    assert summary["hold_ratio"] < 3.0, summary


def test_the_scenario_fails_without_the_schedulers_swarming_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guard above can fail: with the seeder no longer leaving a fellow's chunks to the
    fellow (``Picking._defers``), the same run costs the seeder far more."""
    monkeypatch.setattr(sched_picking.Picking, "_defers", lambda self, peer: False)
    summary = fanout.wan_fan_out(WORKERS, SIZE).summary()
    assert summary["seeder_sent_ratio"] >= MAX_SEEDER_SHARE, summary
