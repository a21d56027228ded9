"""The outer loop as a library around a user's own model and loop (training.outer.api).

The model class is defined here (a plain torch module, not a transformers model), with its
own loss, data and AdamW. Three worker processes run it through ``OuterLoop`` over
``BlockingNode`` on 127.0.0.1 with real stores, at the ``scored`` level; one of them trains
on the wrong task, and the proposers leave its updates out by the loss they would cause.
This file is also the worker program (``python test_outer_api.py CONFIG``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

VOCAB = 32
SEQ = 16
H = 5


class TinyLM(nn.Module):
    """A next-token model: embedding, one hidden layer, logits."""

    def __init__(self, dim: int = 32, hidden: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.emb(x))))


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def task_rows(seed: int, n: int, shift: int = 1) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Rows where each token is the previous plus ``shift`` (mod VOCAB)."""
    start = np.random.default_rng(seed).integers(0, VOCAB, size=(n, 1))
    return (start + shift * np.arange(SEQ)[None, :]) % VOCAB


def worker_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """One worker: the user's loop, wrapped (the shape the README shows)."""
    from p2p import BlockingNode
    from tests.training.ranks import bootstrap_addrs, listening
    from training import determinism
    from training.outer.api import OuterLoop

    determinism.enter("cpu", threads=1)  # the kernel class its certificate names
    torch.manual_seed(cfg["index"])
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.from_numpy(task_rows(100 + cfg["index"], 256, shift=cfg["shift"]))
    evaluation = task_rows(7, 64)
    losses: list[float] = []
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
            inner_optimizer=opt,
            certificate=cfg["cert"],
            rounds=2,
            eval_fn=loss_fn,
            eval_data=evaluation,
            bootstrap=bootstrap_addrs(cfg),
        ) as loop,
    ):
        listening(cfg, node.addrs)
        loop.join()
        for _ in range(100 * H):  # bounded: the run has 2 rounds of H steps
            batch = data[torch.randint(0, data.shape[0], (8,))]
            loss = loss_fn(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            loop.step(loss.item())
            if loop.finished:
                break
        else:
            raise AssertionError("the run did not finish within 100 rounds' steps")
        result = loop.result
        assert result is not None
    final = {n: p.detach().numpy().tolist() for n, p in model.named_parameters()}
    return {"losses": losses, "result": result, "level": loop.level, "model": final}


def _init_spec(tmp: Path, plan: Any, level: str, workers: int = 3) -> str:
    """``blob outer init`` for this file's model. A lone worker proposes at once, so its
    proposer timeout only sets how long it waits after the last round (2 * t + 2 s) for a
    better closure nobody can send: 0.1 s there, 1 s among three."""
    from click.testing import CliRunner
    from safetensors.torch import save_file

    from training.outer.cli import outer_group

    torch.manual_seed(0)
    state = tmp / "initial.safetensors"
    save_file({n: p.detach().contiguous() for n, p in TinyLM().named_parameters()}, str(state))
    w0 = plan.workers[0]
    made = CliRunner().invoke(
        outer_group,
        [
            "init",
            "--model",
            str(state),
            "--run",
            "api",
            "--authority",
            plan.authority,
            "--workers",
            str(workers),
            "--inner-steps",
            str(H),
            "--deadline",
            "6",
            "--proposer-timeout",
            "1" if workers > 1 else "0.1",
            "--min-verification",
            level,
            "--chunk",
            "1024",
            "--k",
            "64",
        ],
        obj={"store_root": w0.store, "key_path": w0.key},
    )
    assert made.exit_code == 0, made.output
    return made.output.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.timeout(300)  # worker processes that each import torch: 40-70 s seen at load 7
def test_three_workers_own_model_and_loop_scored_level(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from blobstore import Store
    from tests.training.ranks import run_programs
    from training.outer.cli import outer_group
    from training.outer.launch import prepare_run
    from training.outer.params import RunParams

    plan = prepare_run(tmp_path / "run", RunParams("api", workers=3, rounds=2, inner_steps=H))
    spec = _init_spec(tmp_path, plan, "scored")
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
                "out": str(w.dir / "out.json"),
                "shift": 7 if i == 2 else 1,
            }
        )
    outs = run_programs(__file__, configs, bootstrap=True)
    results = [o["result"] for o in outs]
    assert {r["final_root"] for r in results} == {results[0]["final_root"]}
    assert all(r["final_round"] == 2 for r in results)
    assert all(o["level"] == "scored" for o in outs)
    # Every worker's model holds the final state: the same parameters everywhere.
    assert outs[0]["model"] == outs[1]["model"] == outs[2]["model"]
    # The worker on the wrong task is left out by its score once its update makes the loss
    # worse (from a random init, round 0's learns what both tasks share and lowers it);
    # the honest two are included.
    wrong = results[2]["peer_id"]
    for record in results[0]["rounds"][1:]:
        included = {x["peer"] for x in record["included"]}
        assert wrong not in included
        assert len(included) == 2
    reasons = [u["reason"] for r in results for u in r["refused_updates"] if u["peer"] == wrong]
    assert reasons and all(x.startswith("scored worse") for x in reasons)
    # The loss falls for the honest workers' loops.
    for out in outs[:2]:
        first, last = np.mean(out["losses"][:H]), np.mean(out["losses"][-H:])
        assert last < first - 0.2, (first, last)
    verified = CliRunner().invoke(
        outer_group,
        ["verify", "api", "--authority", plan.authority],
        obj={"store_root": plan.workers[0].store, "key_path": plan.workers[0].key},
    )
    assert verified.exit_code == 0, verified.output
    # Every applied update's commitment says it was scored, and the spec's minimum holds.
    levels = CliRunner().invoke(
        outer_group,
        ["levels", "api", "--json"],
        obj={"store_root": plan.workers[0].store, "key_path": plan.workers[0].key},
    )
    assert levels.exit_code == 0, levels.output
    report = json.loads(levels.output)
    assert {e["level"] for r in report["rounds"].values() for e in r} == {"scored"}
    # Verify holds a spec'd run to the spec's minimum: under a spec asking for replayed
    # updates, the same scored run fails verification, naming the level.
    from dataclasses import replace

    from blobstore import Store
    from identity import MachineKey, SoftwareSigner
    from training.outer.runs import read_spec, spec_tag
    from training.outer.spec import encode_spec

    store = Store.open(plan.workers[0].store)
    _, signed = read_spec(store, "api")
    stricter = replace(signed.spec, level="replayed")
    store.tag(
        spec_tag("api"),
        store.put_bytes(encode_spec(stricter, SoftwareSigner(MachineKey.generate()))),
    )
    refused = CliRunner().invoke(
        outer_group,
        ["verify", "api", "--authority", plan.authority],
        obj={"store_root": plan.workers[0].store, "key_path": plan.workers[0].key},
    )
    assert refused.exit_code != 0
    assert "FAILED level:" in refused.output, refused.output


def test_a_mismatched_model_is_refused_before_step_0(tmp_path: Path) -> None:
    """A model whose parameters differ from the spec's is refused when the loop is made,
    in one line, before the node does anything for the run."""
    from p2p import BlockingNode
    from training.outer.api import OuterLoop
    from training.outer.launch import prepare_run
    from training.outer.module_state import ModelMismatch
    from training.outer.params import RunParams
    from training.outer.spec import LevelRefused

    plan = prepare_run(tmp_path / "run", RunParams("api", workers=1, rounds=1, inner_steps=H))
    spec = _init_spec(tmp_path, plan, "scored")
    w0 = plan.workers[0]
    with BlockingNode(w0.store, key_path=w0.key, listen=["/ip4/127.0.0.1/tcp/0"], dht=False) as n:
        said = r"parameter 'hidden.bias' has shape \(48,\), the spec says \(32,\)"
        with pytest.raises(ModelMismatch, match=said) as exc:
            OuterLoop(n, spec=spec, model=TinyLM(hidden=48), certificate=w0.cert, rounds=1)
        assert "\n" not in str(exc.value)
        with pytest.raises(LevelRefused, match="requires verification level 'scored'"):
            OuterLoop(n, spec=spec, model=TinyLM(), certificate=w0.cert, rounds=1)


def rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of a worker that is a torch.distributed group (gloo, CPU): DDP replicas,
    rank 0 the run's peer."""
    import os

    import torch.distributed as dist

    from p2p import BlockingNode
    from training import determinism
    from training.outer.api import OuterLoop

    rank = cfg["rank"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    determinism.enter("cpu", threads=1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)  # replicas start apart: join() must make them equal
    model = TinyLM()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.from_numpy(task_rows(200 + rank, 128))
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
            node,
            spec=cfg["spec"],
            model=model,
            certificate=cfg["cert"],
            rounds=2,
            group=dist.group.WORLD,
        )
        loop.join()
        joined = [p.detach().clone() for p in model.parameters()]
        for _ in range(100 * H):  # bounded: 2 rounds of H steps
            loss = loss_fn(ddp, data[torch.randint(0, data.shape[0], (8,))])
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.step(loss.item())
            if loop.finished:
                break
        loop.close()
    finally:
        if node is not None:
            node.close()
    out = {
        "joined": [p.numpy().tolist() for p in joined],
        "model": {n: p.detach().numpy().tolist() for n, p in model.named_parameters()},
        "result": loop.result,
    }
    dist.destroy_process_group()
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.timeout(300)  # worker processes that each import torch: 40-70 s seen at load 7
def test_a_worker_that_is_a_two_rank_gloo_group(tmp_path: Path) -> None:
    """Two CPU ranks over gloo are one worker (one peer identity, rank 0's); they start
    from different random inits and end with the same parameters, the run's final state."""
    from blobstore import Store
    from tests.training.ranks import group_configs, run_programs
    from training.outer.launch import prepare_run
    from training.outer.params import RunParams
    from training.outer.state_blob import decode_state

    plan = prepare_run(tmp_path / "run", RunParams("api", workers=1, rounds=2, inner_steps=H))
    spec = _init_spec(tmp_path, plan, "bounded", workers=1)
    w0 = plan.workers[0]
    outs = run_programs(__file__, group_configs(w0, spec, tmp_path), args=["--rank"])
    assert outs[0]["joined"] == outs[1]["joined"]
    assert outs[0]["model"] == outs[1]["model"]
    result = outs[0]["result"]
    assert result["final_round"] == 2 and outs[1]["result"] is None
    tip = decode_state(Store.open(w0.store).path(result["rounds"][-1]["state_blob"]).read_bytes())
    for name, value in tip.params.items():
        assert np.array_equal(np.asarray(outs[1]["model"][name], dtype=np.float32), value), name


def test_a_bfloat16_model_sends_a_float32_update_and_takes_the_state_in_place() -> None:
    """bfloat16 parameters: the state is read as float32, copied back in place (cast), and
    the pseudo-gradient is float32 against the float32 state."""
    from training.outer.api.handoff import Handoff
    from training.outer.api.model import UserModel, load_state, model_views
    from training.outer.api.user_trainer import LoopTrainer
    from training.outer.loop import OuterState, decode_update
    from training.outer.params import RunParams

    model = TinyLM().to(torch.bfloat16)
    ids = {n: id(p) for n, p in model.named_parameters()}
    state = {n: v.astype(np.float32) + 0.5 for n, v in model_views(model).items()}
    assert all(v.dtype == np.float32 for v in state.values())
    load_state(model, state)
    assert {n: id(p) for n, p in model.named_parameters()} == ids
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    params = RunParams("bf", workers=1, rounds=1, inner_steps=1, chunk=1024, k=64)
    trainer = LoopTrainer(params, UserModel(model), Handoff(), None)
    start = OuterState(0, state, {n: np.zeros_like(v) for n, v in state.items()})
    with torch.no_grad():
        model.out.bias.add_(1.0)
    trained = trainer.make(start, "a" * 64, "peer", [1.0])
    from training.outer.aggregate import unwrap_update

    grad = decode_update(unwrap_update(trained.update).payload, start)
    assert all(g.dtype == np.float32 for g in grad.values())
    assert float(np.abs(grad["out.bias"]).sum()) > 0


def test_a_loop_the_library_does_not_drive_commits_to_no_inner_state() -> None:
    """Its updates are never replayed, so the error-feedback residual (the model's size)
    is neither encoded nor stored: the commitment names one small, empty inner state."""
    from training.outer.api.handoff import Handoff
    from training.outer.api.model import UserModel, model_views
    from training.outer.api.user_trainer import LoopTrainer
    from training.outer.inner import decode_inner
    from training.outer.loop import OuterState
    from training.outer.params import RunParams

    model = TinyLM()
    state = {n: v.copy() for n, v in model_views(model).items()}  # the round's start
    params = RunParams("ni", workers=1, rounds=2, inner_steps=1, chunk=1024, k=64)
    trainer = LoopTrainer(params, UserModel(model), Handoff(), None)
    start = OuterState(0, state, {n: np.zeros_like(v) for n, v in state.items()})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    trained = trainer.make(start, "a" * 64, "peer", [1.0])
    residual = trainer.feedback.residual
    assert sum(int(np.count_nonzero(r)) for r in residual.values()) > 0
    assert trained.inner_before == trained.inner_after
    model_bytes = 4 * sum(v.size for v in state.values())
    assert len(trained.inner_before) < model_bytes // 100
    sizes = [p.numel() for p in model.parameters()]
    optimizer, ef = decode_inner(trained.inner_before, sizes, {})
    assert optimizer == [None] * len(sizes) and ef == {}


def test_a_state_posted_ahead_is_taken_once_and_an_update_from_a_dropped_one_is_not_sent() -> None:
    """The worker posts S_{r+1} ahead of adopting it, then again for its round: the user's
    loop takes it once. Had the worker adopted another state instead, the update made
    from the one posted ahead is for nobody: the round waits for one from its own."""
    import threading

    from training.outer.api.handoff import Handoff, OuterLoopError
    from training.outer.loop import OuterState

    handoff = Handoff()
    ahead = OuterState(1, {}, {})
    handoff.post_state(ahead, "r1")
    assert handoff.wait_state(1.0) == (ahead, "r1")
    handoff.post_state(ahead, "r1")  # the same state, now for its round
    handoff.post_state(OuterState(1, {}, {}), "r1")  # or its equal (same root), adopted
    with pytest.raises(OuterLoopError, match="no outer state"):
        handoff.wait_state(0.2)
    adopted = OuterState(1, {}, {})  # another closure's result won
    handoff.post_state(adopted, "r1b")
    assert handoff.wait_state(1.0) == (adopted, "r1b")
    stale, fresh = object(), object()
    handoff.post_trained(stale, "r1")  # type: ignore[arg-type]
    later = threading.Timer(0.2, handoff.post_trained, (fresh, "r1b"))
    later.start()
    try:
        assert handoff.wait_trained(5.0, "r1b") is fresh
    finally:
        later.cancel()


def test_the_trio_face_runs_a_one_worker_run_holding_one_state(tmp_path: Path) -> None:
    """open_outer_loop on a trio Node: join, H steps per round, the final state in the
    model and the worker's result, all in one trio program. The worker holds the state of
    its current round (parameters and momentum, 8 bytes a parameter: 1 GB at 124M), and
    the next one only while it adopts it: once round 1's state is adopted, S_0 is held
    nowhere in the process, not even by a frame that lives the whole run."""
    import trio

    from identity import load_key_file
    from p2p import open_node
    from training.outer.api import open_outer_loop
    from training.outer.launch import prepare_run
    from training.outer.params import RunParams

    plan = prepare_run(tmp_path / "run", RunParams("api", workers=1, rounds=2, inner_steps=H))
    spec = _init_spec(tmp_path, plan, "bounded", workers=1)
    w0 = plan.workers[0]
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.from_numpy(task_rows(3, 64))
    held: dict[str, int] = {}

    async def main() -> dict[str, Any] | None:
        key = load_key_file(w0.key)
        async with (
            open_node(
                w0.store, key=key, listen=["/ip4/127.0.0.1/tcp/0"], dht=False, pubsub=True
            ) as node,
            open_outer_loop(
                node, key=key, spec=spec, model=model, certificate=w0.cert, rounds=2
            ) as loop,
        ):
            await loop.join()
            held["S_0 in round 0"] = _states_alive(0)
            for _ in range(20 * H):  # bounded: two rounds of H steps
                loss = loss_fn(model, data[:8])
                loss.backward()
                opt.step()
                opt.zero_grad()
                if await loop.step(loss.item()) and "S_0 in round 1" not in held:
                    # The worker may still be keeping round 1 (its blob, tags): it lets
                    # go of S_0 when it enters round 1, within this bound.
                    for _ in range(100):
                        if _states_alive(0) == 0 and _states_alive(1) > 0:
                            break
                        await trio.sleep(0.05)
                    held["S_1 in round 1"] = _states_alive(1)
                    held["S_0 in round 1"] = _states_alive(0)
                if loop.finished:
                    break
            # The trio face says what the blocking one says.
            held.update(level=loop.level == "bounded", round=loop.round, timed=len(loop.timings))
            return loop.result

    result = trio.run(main)
    assert result is not None and result["final_round"] == 2
    assert held["level"] and held["round"] == 2 and held["timed"] == 2, held
    assert held["S_0 in round 0"] >= 1 and held["S_1 in round 1"] >= 1  # the census sees them
    assert held["S_0 in round 1"] == 0, held


def test_a_joiner_says_hello_once_it_has_joined(tmp_path: Path) -> None:
    """A worker joining a run under way (``late=True``) catches up from the tip, then says
    hello. A joiner starts each round later than the others (it aggregates no round ahead),
    so its first update may come after that round's closure: the others count such a late
    update toward their next round's wait only from a worker they have heard as present.
    Here a third node on the run's topic hears the joiner's hello while the run goes on."""
    import trio

    from blobstore import Store
    from identity import load_key_file
    from p2p import open_node
    from training.outer.api import open_outer_loop
    from training.outer.api.core import load_spec
    from training.outer.launch import prepare_run
    from training.outer.messages import Hello, decode_message, topic
    from training.outer.params import RunParams

    plan = prepare_run(
        tmp_path / "run", RunParams("api", workers=1, rounds=3, inner_steps=H), slots=2
    )
    spec = _init_spec(tmp_path, plan, "bounded", workers=1)
    w0, w1 = plan.workers
    Store.open(w1.store).put_bytes(Store.open(w0.store).path(spec).read_bytes())
    run_topic = topic(load_spec(Store.open(w0.store), spec)[1].run)
    joiner_peer = load_key_file(w1.key).peer_id
    data = torch.from_numpy(task_rows(3, 64))
    joined = trio.Event()
    said: list[float] = []
    listening = trio.CancelScope()

    async def train(loop: Any, model: nn.Module, wait_for: trio.Event | None) -> None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(40 * H):  # bounded: at most three rounds of H steps
            loss = loss_fn(model, data[:8])
            loss.backward()
            opt.step()
            opt.zero_grad()
            applied = await loop.step(loss.item())
            if loop.finished:
                return
            if applied and wait_for is not None and not wait_for.is_set():
                with trio.fail_after(60):  # round 0 closed: the joiner has a tip to join
                    await wait_for.wait()

    async def listen(sub: Any) -> None:
        from libp2p.peer.id import ID

        with listening:  # until the joiner's rounds are over
            while True:
                msg = await sub.get()
                hello = isinstance(decode_message(msg.data), Hello)
                if hello and ID(msg.from_id).to_base58() == joiner_peer:
                    said.append(trio.current_time())
                    return

    async def main() -> None:
        local = ["/ip4/127.0.0.1/tcp/0"]
        k0, k1 = load_key_file(w0.key), load_key_file(w1.key)
        m0, m1 = TinyLM(), TinyLM()
        async with (
            open_node(w0.store, key=k0, listen=local, dht=False, pubsub=True) as n0,
            open_outer_loop(n0, key=k0, spec=spec, model=m0, certificate=w0.cert, rounds=3) as l0,
            open_node(
                tmp_path / "listener", listen=local, dht=False, pubsub=True, bootstrap=n0.addrs
            ) as n2,
            trio.open_nursery() as nursery,
        ):
            await l0.join()
            nursery.start_soon(listen, await n2.subscribe(run_topic))
            nursery.start_soon(train, l0, m0, joined)
            async with (
                open_node(
                    w1.store, key=k1, listen=local, dht=False, pubsub=True, bootstrap=n0.addrs
                ) as n1,
                open_outer_loop(
                    n1,
                    key=k1,
                    spec=spec,
                    model=m1,
                    certificate=w1.cert,
                    rounds=3,
                    late=True,
                    bootstrap=n0.addrs,
                ) as l1,
            ):
                with trio.fail_after(60):
                    await l1.join()
                joined.set()
                await train(l1, m1, None)  # to the run's end, beside worker 0
                listening.cancel()

    trio.run(main)
    assert said, "the listener never heard the joiner say hello"


def _states_alive(round_: int) -> int:
    """How many ``OuterState`` objects of round ``round_`` this process still holds."""
    import gc

    from training.outer.loop import OuterState

    gc.collect()
    # type(), not isinstance(): isinstance reads each object's __class__, and some of the
    # process's objects (torch.distributed's deprecated aliases) warn when touched.
    return sum(1 for o in gc.get_objects() if type(o) is OuterState and o.round == round_)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.training.ranks import program

    program(rank_main if sys.argv[1] == "--rank" else worker_main)


def test_making_an_update_reads_the_model_in_place() -> None:
    """At the H-th step the update is made from the model's own parameters while the
    user's loop waits: after the first round (which makes the error-feedback residual)
    a round's update costs the pseudo-gradient and the encoding's blocks, not a copy of
    the model besides (at 124M parameters each copy is 0.5 GB)."""
    import tracemalloc

    from training.outer.api.handoff import Handoff
    from training.outer.api.model import UserModel
    from training.outer.api.user_trainer import LoopTrainer
    from training.outer.loop import OuterState
    from training.outer.params import RunParams

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 256))
    state = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    model_bytes = 4 * sum(v.size for v in state.values())
    trainer = LoopTrainer(
        RunParams("m", workers=1, rounds=3, inner_steps=1), UserModel(model), Handoff(), None
    )
    start = OuterState(0, state, {n: np.zeros_like(v) for n, v in state.items()})
    peaks = []
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        tracemalloc.start()
        try:
            trainer.make(start, "a" * 64, "peer", [1.0])
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[0] > 2 * model_bytes  # the residual, made in the first round
    assert peaks[1] < 1.6 * model_bytes, peaks[1] / model_bytes
