"""A worker whose model is sharded over a torch.distributed group (FSDP2 ``fully_shard``,
two CPU ranks over gloo): the API gathers the shards for each round's update and scatters
the applied state back (training.outer.api point 6). This file is also the rank program
(``python test_outer_api_fsdp.py CONFIG``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

H = 2
ROUNDS = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from p2p import BlockingNode
    from training import determinism
    from training.outer.api import OuterLoop
    from training.outer.api.model import gathered_state

    rank = cfg["rank"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    determinism.enter("cpu", threads=1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(10 + rank)  # ranks start apart: join() must give them S_0
    model = Net()
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    node = None
    if rank == 0:
        node = BlockingNode(
            cfg["store"],
            key_path=cfg["key"],
            listen=["/ip4/127.0.0.1/tcp/0"],
            dht=False,
            pubsub=True,
        ).start()
    try:
        loop = OuterLoop(
            node, spec=cfg["spec"], model=model, certificate=cfg["cert"], group=dist.group.WORLD
        )
        loop.join()
        joined = gathered_state(model)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        for _ in range(10 * ROUNDS * H):  # bounded: ROUNDS rounds of H steps
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            loop.step()
            if loop.finished:
                break
        final = gathered_state(model)
        loop.close()
    finally:
        if node is not None:
            node.close()
    out = {
        "joined": {n: v.tolist() for n, v in joined.items()},
        "final": {n: v.tolist() for n, v in final.items()},
        "result": loop.result,
    }
    dist.destroy_process_group()
    return out


def _spec(tmp: Path, plan: Any) -> str:
    from safetensors.torch import save_file

    from blobstore import Store
    from identity import SoftwareSigner, load_key_file
    from training.outer.runs import init_run

    torch.manual_seed(0)
    source = tmp / "initial.safetensors"
    save_file({n: p.detach().contiguous() for n, p in Net().named_parameters()}, str(source))
    w0 = plan.workers[0]
    spec_id, _ = init_run(
        Store.open(w0.store),
        SoftwareSigner(load_key_file(w0.key)),
        source,
        run_id="fsdp",
        authorities=[plan.authority],
        options={
            "workers": 1,
            "rounds": ROUNDS,
            "inner_steps": H,
            "chunk": 64,
            "k": 16,
            "deadline": 2.0,
            "proposer_timeout": 0.1,  # one worker: it only stretches the wait after the last round
        },
    )
    return spec_id


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.timeout(300)
def test_a_worker_whose_model_is_sharded_over_two_gloo_ranks(tmp_path: Path) -> None:
    """Guards against a sharded model's shards being taken for the whole model: the ranks
    start from different inits, join on S_0, and end holding (together) the run's tip."""
    from blobstore import Store
    from tests.training.ranks import group_configs, run_programs
    from training.outer.launch import prepare_run
    from training.outer.params import RunParams
    from training.outer.state_blob import decode_state

    plan = prepare_run(tmp_path / "run", RunParams("fsdp", workers=1, rounds=1, inner_steps=H))
    spec = _spec(tmp_path, plan)
    w0 = plan.workers[0]
    outs = run_programs(__file__, group_configs(w0, spec, tmp_path))
    store = Store.open(w0.store)
    from training.outer.runs import read_spec

    start = decode_state(store.path(read_spec(store, spec)[1].spec.initial).read_bytes())
    result = outs[0]["result"]
    assert result["final_round"] == ROUNDS
    tip = decode_state(store.path(result["rounds"][-1]["state_blob"]).read_bytes())
    for name in tip.params:
        for out in outs:
            joined = np.asarray(out["joined"][name], dtype=np.float32)
            final = np.asarray(out["final"][name], dtype=np.float32)
            assert np.array_equal(joined, start.params[name]), name
            assert np.array_equal(final, tip.params[name]), name
    # The rounds moved the model: the update was made from the whole model.
    assert any(not np.array_equal(start.params[n], tip.params[n]) for n in tip.params)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.training.ranks import program

    program(rank_main)
