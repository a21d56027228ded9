"""The outer loop in simulated time through the real agreement code (bench.sim.outer): a
small run closes every round on one root with every worker's update named, and a run
with workers leaving and joining still never forks, its newcomers catching up."""

from __future__ import annotations

import pytest

from bench.sim.outer import OuterParams, OuterSim


def test_a_small_run_closes_every_round_on_one_root_with_every_update() -> None:
    params = OuterParams(workers=6, rounds=3, compute_s=30.0, fetch="direct", deadline=15.0)
    report = OuterSim(params).run()
    assert report["forks"] == 0
    assert [r["round"] for r in report["rounds"]] == [0, 1, 2]
    assert all(r["included"] == 6 and r["closures"] >= 1 for r in report["rounds"])
    # Each worker fetched the five others' updates once: the all-to-all floor.
    assert all(abs(r["bytes_in_over_floor"] - 1.0) < 0.05 for r in report["rounds"])


def test_workers_leaving_and_joining_never_fork_and_newcomers_catch_up() -> None:
    params = OuterParams(
        workers=8,
        rounds=4,
        compute_s=30.0,
        fetch="direct",
        deadline=15.0,
        churn=0.125,
        state_bytes=50_000_000,
    )
    sim = OuterSim(params)
    report = sim.run()
    assert report["forks"] == 0
    assert report["joins"] >= 2 and report["leaves"] >= 2
    caught_up = [log for log in sim.logs if log.how == "caught up"]
    assert caught_up, "no newcomer caught up from a state blob"


def test_rival_proposers_at_once_still_leave_one_root_per_round() -> None:
    """With no take-over delay and a deadline shorter than the fetches, every worker
    proposes at once with the updates it happens to hold: rival closures naming different
    sets, and rule 3 (the lowest rank, then digest) must still bring every worker to the
    same chain, those on a losing sibling catching up from the winner's state blob."""
    params = OuterParams(
        workers=8,
        rounds=3,
        compute_s=30.0,
        fetch="direct",
        deadline=0.5,
        proposer_timeout=1e-3,
        state_bytes=10_000_000,
    )
    sim = OuterSim(params)
    report = sim.run()
    assert max(r["closures"] for r in report["rounds"]) > 1  # rivals did happen
    assert any(log.how == "caught up" for log in sim.logs)  # some were on a losing one
    assert report["forks"] == 0
    assert len({w.root for w in sim.workers.values()}) == 1


def test_a_run_whose_majority_no_closure_can_name_is_refused() -> None:
    """Rule 7 with MAX_INCLUDED: a closure names at most 64 workers, so a majority of 256
    (129) can never be named; the simulator says so instead of running rounds that cannot
    close, and runs with a quorum the closures can hold."""
    with pytest.raises(ValueError, match="exceeds the 64 workers a closure can name"):
        OuterSim(OuterParams(workers=256))
    assert OuterSim(OuterParams(workers=256, quorum=64)).quorum == 64
