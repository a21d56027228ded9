"""Sampled replay over real worker processes on 127.0.0.1: a
worker whose updates do not match their commitments is caught when a sampled update is
replayed, and left out of the closures that follow, with its reason, while the honest
workers agree on one root and every honest update replays bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from blobstore import Store
from identity import TrustStore, parse_public_key
from training.outer.churn import ChurnPlan, churn_run
from training.outer.launch import prepare_run
from training.outer.milestones import list_milestones, verify_run
from training.outer.params import RunParams

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(300)
def test_an_update_that_does_not_match_its_commitment_is_caught_and_excluded(
    tmp_path: Path,
) -> None:
    """K=3, every update sampled (rate 1). Worker 2 trains on other batch rows than its
    commitment names from round 0 on (and never proposes, so every closure here is an
    honest worker's). Its round-0 update is included (nobody can know yet); its replay
    gives a mismatch, the other honest worker confirms it by its own replay, and the last
    closure leaves worker 2 out with the reason. The honest updates all replay to a match:
    a replay that cannot reproduce honest work would fail this test."""
    params = RunParams(
        run_id="replay",
        workers=3,
        rounds=3,
        inner_steps=1,
        deadline=4.0,
        proposer_timeout=1.0,
        replay_rate=1.0,
    )
    plan = prepare_run(tmp_path / "run", params)
    churn = ChurnPlan(extra={2: ["--test-cheat-from-round", "0"]})
    res = churn_run(plan, churn, timeout=240)
    logs = {i: res.logs[i].read_text(errors="replace")[-3000:] for i in res.returncodes}
    assert res.all_exit_zero(churn), (res.returncodes, logs)
    assert not res.forked(churn), logs
    p = [w.peer_id for w in plan.workers]
    honest = [res.results[0], res.results[1]]
    for result in honest:
        assert result is not None
        assert set(result["banned"]) == {"operator-2"}, logs
        assert result["banned"]["operator-2"].startswith("failed replay of round ")
        outcomes = {(v["author"], v["outcome"].split(":")[0]) for v in result["verdicts"]}
        assert {o for a, o in outcomes if a != p[2]} == {"match"}, result["verdicts"]
        assert {o for a, o in outcomes if a == p[2]} == {"mismatch"}, result["verdicts"]
        last = result["rounds"][-1]
        assert last["round"] == params.rounds - 1
        assert p[2] not in {x["peer"] for x in last["included"]}
        assert {x["peer"] for x in last["included"]} == {p[0], p[1]}
    # Whoever proposed after the ban left worker 2's update out, saying why (a worker
    # that never proposed refused nothing).
    refused = [
        x for r in honest if r is not None for x in r["refused_updates"] if x["peer"] == p[2]
    ]
    assert refused and all(x["reason"].startswith("failed replay of round") for x in refused)
    # Worker 2's round-0 update was included: the cheat is caught after the fact.
    assert p[2] in {x["peer"] for x in honest[0]["rounds"][0]["included"]}

    # The verdicts are signed records beside the milestones (included vs verified), and
    # the run re-verifies from worker 0's store alone, verdicts included.
    store = Store.open(plan.workers[0].store)
    trust = TrustStore(frozenset({parse_public_key(plan.authority)}))
    milestones = list_milestones(store, params.run_id, trust)
    verified = [v for m in milestones for v in m["verified"]]
    assert any(v["author"] == p[2] and v["outcome"].startswith("mismatch") for v in verified)
    assert all(v["outcome"] == "match" for v in verified if v["author"] != p[2]), verified
    report = verify_run(store, params.run_id, trust)
    assert report.ok, report.failures
    assert report.checked_rounds == list(range(params.rounds))
