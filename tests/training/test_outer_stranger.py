"""A stranger's model through the outer loop, as a new user would run it: a model class the
project never saw (tests.training.stranger: BatchNorm buffers, a frozen projection drawn
from each process's own seed, tied weights), its spec made from the module's whole state
(``save_state``, ``blob outer init --state``), its own AdamW loop in three worker
processes over TCP on 127.0.0.1 with real stores. Every worker ends with the same full
``state_dict()``, the export loads with ``load_state_dict(strict=True)``, the held-out
loss falls, and at the ``scored`` level a worker whose updates make the loss worse is left
out while the run goes on. The ``bounded`` run overlaps its rounds (``--overlap 1``): each
worker trains round r+1 while round r is agreed, and still ends on the run's one state
(the README's own example, tests/training/test_readme_example.py, is a blocking bounded
run of a model of the same kind).

This file is also the worker program (``python test_outer_stranger.py CONFIG``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

H = 20
ROUNDS = 3


def worker_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """One worker: the user's loop, wrapped as the README shows, nothing else set up."""
    import torch

    from p2p import BlockingNode
    from tests.training.ranks import bootstrap_addrs, listening
    from tests.training.stranger import StrangerNet, eval_loss, images, loss_fn, state_lists
    from training.outer.api import OuterLoop

    torch.set_num_threads(1)
    torch.manual_seed(100 + cfg["index"])  # each process its own init and frozen projection
    model = StrangerNet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = images(10 + cfg["index"], 2048)
    if cfg.get("harmful"):
        y = (y + 1) % 4  # trains on the wrong labels: in bounds, and harmful
    held_out = images(99, 512)
    scored = cfg["level"] == "scored"
    overlapped = cfg["level"] == "overlapped"
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
            eval_fn=loss_fn if scored else None,
            eval_data=images(7, 256) if scored else None,
            bootstrap=bootstrap_addrs(cfg),
        ) as loop,
    ):
        listening(cfg, node.addrs)
        loop.join()
        start = eval_loss(model, held_out)
        model.train()
        for _ in range(100 * H):  # bounded: the run has ROUNDS rounds of H steps
            pick = torch.randint(0, x.shape[0], (32,))
            loss = loss_fn(model, (x[pick], y[pick]))
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.step(loss.item())
            if loop.finished:
                break
        else:
            raise AssertionError("the run did not finish within 100 rounds' steps")
        result = loop.result
        timings = [tuple(t) for t in loop.timings]
    if overlapped:  # each round trained on while the one before was agreed
        assert all(overlap > 0 for _, _, overlap in timings[1:]), timings
    return {
        "result": result,
        "state": state_lists(model),
        "start_loss": start,
        "end_loss": eval_loss(model, held_out),
    }


def _init(tmp: Path, plan: Any, level: str) -> str:
    """The spec from the module's whole state, as the README's flow makes it."""
    import torch
    from click.testing import CliRunner

    from tests.training.stranger import StrangerNet
    from training.outer.cli import outer_group
    from training.outer.module_state import save_state

    torch.manual_seed(0)
    save_state(StrangerNet(), tmp / "state.safetensors")
    w0 = plan.workers[0]
    made = CliRunner().invoke(
        outer_group,
        [
            "init",
            "--state",
            str(tmp / "state.safetensors"),
            "--run",
            "stranger",
            "--authority",
            plan.authority,
            "--workers",
            "3",
            "--rounds",
            str(ROUNDS),
            "--inner-steps",
            str(H),
            "--deadline",
            "6",
            "--proposer-timeout",
            "1",
            "--min-verification",
            "scored" if level == "scored" else "bounded",
            "--overlap",
            "1" if level == "overlapped" else "0",
            "--chunk",
            "1024",
            "--k",
            "64",
        ],
        obj={"store_root": w0.store, "key_path": w0.key},
    )
    assert made.exit_code == 0, made.output
    return made.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.timeout(300)  # three worker processes that each import torch
@pytest.mark.parametrize("level", ["overlapped", "scored"])
def test_three_workers_of_a_strangers_model_end_on_one_whole_state(
    tmp_path: Path, level: str
) -> None:
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from blobstore import Store
    from tests.training.ranks import run_programs
    from tests.training.stranger import StrangerNet
    from training.outer.cli import outer_group
    from training.outer.launch import prepare_run
    from training.outer.params import RunParams

    plan = prepare_run(
        tmp_path / "run", RunParams("stranger", workers=3, rounds=ROUNDS, inner_steps=H)
    )
    spec = _init(tmp_path, plan, level)
    spec_bytes = Store.open(plan.workers[0].store).path(spec).read_bytes()
    configs = []
    for i, w in enumerate(plan.workers):
        Store.open(w.store).put_bytes(spec_bytes)  # the user fetched the spec by its ID
        configs.append(
            {
                "index": i,
                "store": str(w.store),
                "key": str(w.key),
                "cert": str(w.cert),
                "spec": spec,
                "level": level,
                "out": str(w.dir / "out.json"),
                "harmful": level == "scored" and i == 2,
            }
        )
    outs = run_programs(__file__, configs, bootstrap=True)
    results = [o["result"] for o in outs]
    assert {r["final_root"] for r in results} == {results[0]["final_root"]}
    assert all(r["final_round"] == ROUNDS for r in results)
    # The whole state_dict, buffers, counters, frozen projection and tied names included,
    # is the same on every worker, though each process drew its own init.
    assert outs[0]["state"] == outs[1]["state"] == outs[2]["state"]
    # The held-out loss falls for the honest workers.
    for out in outs[:2]:
        assert out["end_loss"] < out["start_loss"] - 0.05, (out["start_loss"], out["end_loss"])
    if level == "scored":
        harmful = results[2]["peer_id"]
        for record in results[0]["rounds"]:
            included = {x["peer"] for x in record["included"]}
            assert harmful not in included and len(included) == 2, record
        reasons = [u["reason"] for r in results for u in r["refused_updates"]]
        assert reasons and all(r.startswith("scored worse") for r in reasons), reasons
    obj = {"store_root": plan.workers[0].store, "key_path": plan.workers[0].key}
    # By the spec's ID (the export below too), as by the run's.
    argv = ["verify", spec, "--authority", plan.authority]
    verified = CliRunner().invoke(outer_group, argv, obj=obj)
    assert verified.exit_code == 0, verified.output
    exported = CliRunner().invoke(
        outer_group, ["export", spec, "-o", str(tmp_path / "out")], obj=obj
    )
    assert exported.exit_code == 0, exported.output
    model = StrangerNet()
    model.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")), strict=True)
    final = {n: t.numpy().tolist() for n, t in model.state_dict().items()}
    assert final == outs[0]["state"]
    assert model.down.weight is model.up.weight  # the tie survives a strict load


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.training.ranks import program

    program(worker_main)
