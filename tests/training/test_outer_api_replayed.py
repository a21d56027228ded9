"""The replayed level from the Python API (training.outer.api point 7): a model class and
a loss defined here, three worker processes through ``OuterLoop(inner_step=, data=).run()``
over ``BlockingNode`` on 127.0.0.1 with real stores. The run overlaps its rounds (spec
``overlap`` 1): after round 0 each worker trains every round ahead from its own end of the
round before and moves by the delayed outer step (training.outer.trainer rules 4 to 7).
The library drives the inner steps on rows it commits to; every update is sampled (rate 1)
and replayed by another worker with its own step of the spec's name, from the state the
commitment names. Worker 2's step function, registered under the same name, adds a term to
its loss from its second round on (its overlapped updates are not what the step computes):
replay catches it and the honest workers ban its operator. This file is also the worker
program (``python test_outer_api_replayed.py CONFIG``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

VOCAB = 264  # the byte records' vocabulary (training.records) rounded up
DIM = 16
H = 3
ROUNDS = 2  # round 0 plain, round 1 trained ahead (and the cheat in it caught)
STEP_NAME = "tiny-next-token/v1"


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x)))


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def cheating_step(own: nn.Module) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """Not the run's step on ``own`` (the worker's model) from its second round on: what it
    trains then is not what a replay of the step computes. Replays, on copies of the model,
    run the step as it is."""
    calls = 0

    def step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        loss = next_token_loss(model, batch)
        if model is not own:
            return loss
        calls += 1
        return loss if calls <= H else loss + 0.01 * model.out.bias.square().sum()

    return step


def worker_main(cfg: dict[str, Any]) -> dict[str, Any]:
    from p2p import BlockingNode
    from tests.training.ranks import RUN_TIMEOUT, bootstrap_addrs, listening
    from training import determinism
    from training.outer.api import InnerStep, OuterLoop

    determinism.enter("cpu", threads=1)  # the kernel class its certificate names
    model = TinyLM()
    fn = cheating_step(model) if cfg["cheat"] else next_token_loss
    with (
        BlockingNode(
            cfg["store"],
            key_path=cfg["key"],
            listen=["/ip4/127.0.0.1/tcp/0"],
            dht=False,
            pubsub=True,
        ) as node,
        OuterLoop(
            node,
            spec=cfg["spec"],
            model=model,
            certificate=cfg["cert"],
            inner_step=InnerStep(STEP_NAME, fn),
            data=cfg["data"],
            bootstrap=bootstrap_addrs(cfg),
        ) as loop,
    ):
        listening(cfg, node.addrs)
        result = loop.run(timeout=RUN_TIMEOUT)
    final = {n: p.detach().numpy().tolist() for n, p in model.named_parameters()}
    return {"result": result, "level": loop.level, "model": final}


def _records() -> bytes:
    from training.records import make_records

    text = b"".join(
        b"worker %d trains row %d of the shared records. " % (i % 3, i) for i in range(80)
    )
    return make_records([text], 16)


def _make_spec(tmp: Path, plan: Any, records: str) -> str:
    from safetensors.torch import save_file

    from blobstore import Store
    from identity import SoftwareSigner, load_key_file
    from training.outer.runs import init_run

    torch.manual_seed(0)
    source = tmp / "initial.safetensors"
    save_file({n: p.detach().contiguous() for n, p in TinyLM().named_parameters()}, str(source))
    w0 = plan.workers[0]
    spec_id, _ = init_run(
        Store.open(w0.store),
        SoftwareSigner(load_key_file(w0.key)),
        source,
        run_id="replayed",
        authorities=[plan.authority],
        options={
            "workers": 3,
            "rounds": ROUNDS,
            "inner_steps": H,
            "batch": 4,
            "deadline": 3.0,
            "proposer_timeout": 1.0,
            "chunk": 1024,
            "k": 64,
            "level": "replayed",
            "replay_rate": 1.0,
            "data": records,
            "step": STEP_NAME,
            "overlap": 1,
        },
    )
    return spec_id


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.timeout(300)  # worker processes that each import torch: 40-70 s seen at load 7
def test_three_api_workers_overlapped_and_replayed_catch_a_step_that_is_not_the_runs(
    tmp_path: Path,
) -> None:
    from blobstore import Store
    from identity import TrustStore, parse_public_key
    from tests.training.ranks import run_programs
    from training.outer.launch import prepare_run
    from training.outer.levels import check_levels
    from training.outer.milestones import verify_run
    from training.outer.params import RunParams
    from training.outer.replay import decode_commitment
    from training.outer.state_blob import decode_state

    plan = prepare_run(tmp_path / "run", RunParams("replayed", workers=3, rounds=1, inner_steps=H))
    data = _records()
    records = Store.open(plan.workers[0].store).put_bytes(data)
    spec = _make_spec(tmp_path, plan, records)
    spec_bytes = Store.open(plan.workers[0].store).path(spec).read_bytes()
    configs = []
    for i, w in enumerate(plan.workers):
        store = Store.open(w.store)  # the user fetched the spec and records by ID
        store.put_bytes(spec_bytes)
        store.put_bytes(data)
        configs.append(
            {
                "store": str(w.store),
                "key": str(w.key),
                "cert": str(w.cert),
                "spec": spec,
                "data": records,
                "out": str(w.dir / "out.json"),
                "cheat": i == 2,
            }
        )
    outs = run_programs(__file__, configs, bootstrap=True)
    results = [o["result"] for o in outs]
    p = [r["peer_id"] for r in results]
    assert all(o["level"] == "replayed" for o in outs)
    honest = results[:2]
    assert honest[0]["final_root"] == honest[1]["final_root"]
    assert all(r["final_round"] == ROUNDS for r in honest)
    # Round 0 trained from S_0; every later round ahead, from the worker's own end of the
    # round before, moved by the delayed outer step at a step boundary (0..H).
    for r in honest:
        moved = {x["round"]: x["moved_at"] for x in r["rounds"]}
        assert moved[0] is None and all(0 <= moved[i] <= H for i in range(1, ROUNDS)), moved
    # Its round-0 update was honest and included (nothing shows a cheat before a replay);
    # its round-1 update, trained ahead, is caught by its first step's loss: the assigned
    # replayer's mismatch (and a confirmation by the other honest worker's own replay
    # where it heard that verdict after applying the round); no honest operator is banned,
    # whatever the cheater said of them.
    assert all(p[2] in {x["peer"] for x in r["rounds"][0]["included"]} for r in honest)
    caught = "mismatch: loss of step 0 differs"
    banned = [r["banned"] for r in honest]
    assert all(set(b) <= {"operator-2"} for b in banned), banned
    assert any(set(b) == {"operator-2"} for b in banned), [r["verdicts"] for r in honest]
    assert all(why == f"failed replay of round 1 ({caught})" for b in banned for why in b.values())
    verdicts = [v for r in honest for v in r["verdicts"]]
    on_cheat = {v["round"]: v["outcome"] for v in verdicts if v["author"] == p[2]}
    assert on_cheat.get(0) == "match" and on_cheat.get(1) == caught, on_cheat
    assert all(outcome == caught for r, outcome in on_cheat.items() if r >= 1), on_cheat
    # Each honest update of every round, plain (round 0) and overlapped alike, replays bit
    # for bit in its replayer's process (the cheater's replays, on copies of its model, run
    # the step as it is): nobody is accused.
    assert not [a for r in honest for a in r["false_accusations"]]
    for author in p[:2]:
        replays = [v for v in verdicts if v["author"] == author]
        assert all(v["outcome"] == "match" for v in replays), (author, verdicts)
        assert {v["round"] for v in replays} == set(range(ROUNDS)), (author, verdicts)
    # The worker's model holds the final state.
    store = Store.open(plan.workers[0].store)
    tip = decode_state(store.path(honest[0]["rounds"][-1]["state_blob"]).read_bytes())
    for name, value in tip.params.items():
        assert np.array_equal(np.asarray(outs[0]["model"][name], dtype=np.float32), value)
    # The commitments name what a replay needs: an overlapped one, the state its steps
    # began from (kept in its author's store) and the boundary it moved at.
    verdict = next(v for v in verdicts if v["author"] == p[0] and v["round"] == 1)
    c = decode_commitment(store.path(verdict["commitment"]).read_bytes())
    assert c.overlapped and c.moved == honest[0]["rounds"][1]["moved_at"]
    assert store.has(c.origin) and store.has(c.inner)
    levels = check_levels(store, "replayed", "replayed")
    assert levels.ok, levels.failures
    assert {e["level"] for r in levels.rounds.values() for e in r} == {"replayed"}
    trust = TrustStore(frozenset({parse_public_key(plan.authority)}))
    report = verify_run(store, "replayed", trust)
    assert report.ok, report.failures
    assert report.checked_rounds == list(range(ROUNDS))


def test_a_step_the_spec_does_not_name_is_refused_before_step_0() -> None:
    from training.outer.api import InnerStep, check_step
    from training.outer.spec import LevelRefused, RunSpec

    spec = RunSpec(
        run="r",
        initial="a" * 64,
        root="b" * 64,
        tensors=(("w", (2,)),),
        inner_steps=1,
        workers=1,
        authorities=("c" * 64,),
        step=STEP_NAME,
    )
    check_step(spec, InnerStep(STEP_NAME, next_token_loss))
    with pytest.raises(LevelRefused, match="replays the inner step 'tiny-next-token/v1'"):
        check_step(spec, InnerStep("other/v1", next_token_loss))
    from dataclasses import replace

    with pytest.raises(LevelRefused, match="names no inner step"):
        check_step(replace(spec, step=""), InnerStep(STEP_NAME, next_token_loss))


def test_the_step_field_is_optional_in_the_spec_bytes() -> None:
    """A spec without a step keeps its bytes (and ID); one with a step round-trips; a step
    written empty is not canonical."""
    import msgpack

    from identity import MachineKey, SoftwareSigner
    from training.outer.spec import BadSpec, RunSpec, decode_body, decode_spec, encode_spec

    fields: dict[str, Any] = {
        "run": "r",
        "initial": "a" * 64,
        "root": "b" * 64,
        "tensors": (("w", (2,)),),
        "inner_steps": 1,
        "workers": 1,
        "authorities": ("c" * 64,),
    }
    plain = RunSpec(**fields)
    assert "step" not in plain.body()
    named = RunSpec(**fields, step=STEP_NAME)
    signer = SoftwareSigner(MachineKey.generate())
    assert decode_spec(encode_spec(named, signer)).spec.step == STEP_NAME
    assert decode_spec(encode_spec(plain, signer)).spec.step == ""
    body = dict(sorted({**plain.body(), "step": ""}.items()))
    with pytest.raises(BadSpec, match="canonical"):
        decode_body(msgpack.packb(body))


def test_the_cli_worker_refuses_a_spec_that_names_a_step(tmp_path: Path) -> None:
    """Its model code is the user's: only the API, given the step, can train and replay it."""
    from blobstore import Store
    from training.outer.launch import prepare_run
    from training.outer.params import RunParams
    from training.outer.runs import RunNotFound, prepare_spec_worker

    plan = prepare_run(tmp_path / "run", RunParams("replayed", workers=1, rounds=1, inner_steps=H))
    records = Store.open(plan.workers[0].store).put_bytes(_records())
    spec = _make_spec(tmp_path, plan, records)
    w0 = plan.workers[0]
    with pytest.raises(RunNotFound, match="take part through the Python API"):
        prepare_spec_worker(w0.store, w0.key, spec, None, device="cpu", threads=1, rounds=1)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.training.ranks import program

    program(worker_main)
