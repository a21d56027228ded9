"""A worker stopped until the others have finished and left (point 6 of
training.outer.worker) must stop with an error, not close the remaining rounds alone.
Before the fix it proposed every remaining round alone (1 update included each): at once
when it had heard none of the others' closures, else once their blobs were dropped as
unavailable; having heard no final root to compare, it could exit 0 "agreed" on a rival
root, a silent fork (seen with a 45 s pause in the setting of bench/outer.py --churn)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from training.outer.churn import ChurnPlan, churn_run
from training.outer.launch import prepare_run
from training.outer.params import RunParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


# About 35 s on an idle 2-vCPU box (59-78 s loaded, with a 10 s floor): torch's imports,
# 2 short rounds, the others' linger for the stopped worker's final root (a fetch bound:
# 3 x deadline + fetch_floor = 5 s), their exit, then its wait for a peer (a fetch bound).
# Whether it heard round 1's closure or not, it stops a fetch bound after waking (not after
# retrying a closure it heard for UNAVAILABLE_TRIES x 2 fetch bounds: 128 s at a 2 s
# deadline).
@pytest.mark.timeout(300)
def test_a_worker_left_behind_stops_instead_of_closing_rounds_alone(tmp_path: Path) -> None:
    params = RunParams(
        run_id="behind",
        workers=3,
        rounds=2,
        inner_steps=2,
        deadline=1.0,
        proposer_timeout=0.5,
        replay_rate=0.0,
        # The others' linger and the stopped one's wait for a peer are each a fetch bound
        # (3 x deadline + this floor): a short one keeps the test short, and the rule
        # under test does not depend on it.
        fetch_floor=2.0,
    )
    plan = prepare_run(tmp_path / "run", params)
    churn = ChurnPlan(pause=1, pause_after=0, resume_after_others=True)
    res = churn_run(plan, churn, timeout=240)
    logs = {i: res.logs[i].read_text(errors="replace") for i in res.returncodes}
    tails = {i: text[-3000:] for i, text in logs.items()}
    # The two that stayed finish together (they waited for the stopped one, then left).
    assert res.returncodes[0] == 0 and res.returncodes[2] == 0, (res.returncodes, tails)
    r0, r2 = res.results[0], res.results[2]
    assert r0 is not None and r2 is not None
    assert r0["final_root"] == r2["final_root"] and r0["agreed"] and r2["agreed"]
    # The one left behind closed nothing after waking and says why it stopped.
    woke = logs[1].split("without running", 1)
    assert len(woke) == 2, tails[1]
    assert not re.search(r"round \d+ closed \(proposed\)", woke[1]), tails[1]
    assert res.returncodes[1] != 0, tails[1]
    assert "not closing rounds alone" in logs[1], tails[1]
