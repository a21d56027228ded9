"""What the blocking and trio faces share (training.outer.api.core), driven without a node:
a round that starts over, a round skipped, and a worker taking its checkpoint back."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from blobstore import Store
from tests.training.stranger import StrangerNet, images, loss_fn
from training.outer.api.core import Core
from training.outer.api.model import model_views
from training.outer.loop import OuterState
from training.outer.module_state import layout_of
from training.outer.spec import RunSpec

H = 2
PEER = "12D3KooWTestPeer"


def _core(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Core:
    layout = layout_of(model)
    spec = RunSpec(
        run="r",
        initial="a" * 64,
        root="b" * 64,
        tensors=tuple(sorted(layout.trainable.items())),
        inner_steps=H,
        workers=1,
        authorities=("c" * 64,),
        rounds=2,
        buffers=tuple(sorted(layout.buffers.items())),
        fixed=tuple((n, d, s) for n, (d, s) in sorted(layout.fixed.items())),
        fixed_blob="d" * 64,
        aliases=tuple(sorted(layout.aliases.items())),
        chunk=1024,
        k=64,
    )
    core = Core(
        spec=spec, model=model, rounds=None, eval_fn=None, eval_data=None, optimizer=optimizer
    )
    core.author = PEER
    return core


def _start(core: Core, model: torch.nn.Module) -> OuterState:
    """S_0 of the model as it is, posted by the worker and adopted by the loop."""
    params = {n: v.copy() for n, v in model_views(model).items()}
    buffers = core.model.buffers()
    state = OuterState(0, params, {n: np.zeros_like(v) for n, v in params.items()}, buffers)
    core.handoff.post_state(state, "0" * 64)
    assert core.adopt(1.0)
    return state


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, core: Core) -> None:
    x, y = images(1, 64)
    for _ in range(H):
        loss_fn(model, (x, y)).backward()
        opt.step()
        opt.zero_grad()
        core.count(None)


def test_restore_copies_the_rounds_start_back_and_counts_its_steps_again() -> None:
    torch.manual_seed(0)
    model = StrangerNet()
    core = _core(model)
    state = _start(core, model)
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), core)
    assert any(not np.array_equal(v, state.params[n]) for n, v in model_views(model).items())
    core.restore()
    assert all(np.array_equal(v, state.params[n]) for n, v in model_views(model).items())
    assert all(np.array_equal(v, state.buffers[n]) for n, v in core.model.buffers().items())
    assert core.steps == 0


def test_a_skipped_round_hands_the_worker_nothing_and_leaves_the_residual() -> None:
    torch.manual_seed(0)
    model = StrangerNet()
    core = _core(model)
    state = _start(core, model)
    got: list[object] = []
    worker = threading.Thread(target=lambda: got.append(core.trainer.train(state, "0" * 64, PEER)))
    worker.start()
    core.skip()
    worker.join(timeout=10)
    assert got == [None]  # the worker passes this round
    assert core.trainer.feedback.residual == {}


def test_a_restarted_worker_takes_back_its_residual_and_optimizer(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "store")
    torch.manual_seed(0)
    model = StrangerNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    core = _core(model, opt)
    _start(core, model)
    _train(model, opt, core)
    core.send()  # the round's update: the error-feedback residual is made
    core.keep(store)
    residual = {n: v.copy() for n, v in core.trainer.feedback.residual.items()}
    assert residual and any(np.any(v) for v in residual.values())

    torch.manual_seed(1)  # the process started again: another init, a fresh optimizer
    again = StrangerNet()
    fresh = torch.optim.AdamW(again.parameters(), lr=1e-2)
    restarted = _core(again, fresh)
    restarted.resume_from(store)
    assert restarted.join  # it joins from the run's tip, not S_0
    kept = restarted.trainer.feedback.residual
    assert set(kept) == set(residual)
    assert all(np.array_equal(kept[n], residual[n]) for n in residual)
    want, have = opt.state_dict()["state"], fresh.state_dict()["state"]
    assert want.keys() == have.keys()
    assert all(torch.equal(want[i][k], have[i][k]) for i in want for k in want[i])
