"""An overlapped round's end (training.outer.api.overlap) seen from the user's thread: the
update is made from the copy taken at the H-th step while the user's loop trains on, the
checkpoint holds the optimizer as it was then, the state comes back as S_{r+1} plus the
drift, and ``timings`` count what the loop spent inside ``step()`` as waited. The test's
own thread plays the worker through the real hand-off."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from blobstore import Store
from training.outer.api.core import Core
from training.outer.api.handoff import Handoff, OuterLoopError
from training.outer.api.model import model_views
from training.outer.api.overlap import RoundEnd
from training.outer.api.resume import read_checkpoint
from training.outer.loop import OuterState
from training.outer.spec import RunSpec

H = 2
STEP = 0.01  # seconds of one of the user's steps
HOLD = 0.3  # seconds the worker holds S_1 after the user's round-1 steps are done
WAIT = 10.0  # a bound on each hand-off wait: only a failing test waits it out
R0, R1 = "a0" * 32, "a1" * 32  # the roots of S_0 and S_1


def _core(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Core:
    spec = RunSpec(
        run="ov",
        initial="a" * 64,
        root="b" * 64,
        tensors=(("bias", (2,)), ("weight", (2, 3))),
        inner_steps=H,
        workers=1,
        rounds=3,
        authorities=("c" * 64,),
        chunk=16,
        k=8,
        overlap=1,
    )
    core = Core(spec=spec, model=model, rounds=None, eval_fn=None, eval_data=None, optimizer=opt)
    core.author = "peer"
    return core


def _state(round_: int, model: torch.nn.Module, offset: float) -> OuterState:
    params = {n: v + np.float32(offset) for n, v in model_views(model).items()}
    return OuterState(round_, params, {n: np.zeros_like(v) for n, v in params.items()})


def _steps(core: Core, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One round of the user's steps: each moves the model, and step() polls and counts;
    the H-th step() is left open (entered, not left): the caller ends the round in it."""
    for _ in range(H):
        threading.Event().wait(STEP)  # the user's step (time the loop is not waiting)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        core.enter()
        core.poll()
        if core.count(None):
            return
        core.leave()
    raise AssertionError("H steps did not end the round")


@pytest.mark.timeout(60)
def test_an_overlapped_round_ends_behind_the_steps_and_counts_what_the_loop_waited(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    core = _core(model, opt)
    store = Store.open(tmp_path / "store")
    handoff = core.handoff
    s0 = _state(0, model, 0.0)
    handoff.post_state(s0, R0)
    core.adopt(WAIT)
    received: list[object] = []
    steps_done = threading.Event()
    s1 = _state(1, model, 0.5)

    def worker() -> None:
        received.append(handoff.wait_trained(WAIT, R0))
        assert steps_done.wait(WAIT)
        threading.Event().wait(HOLD)
        handoff.post_state(s1, R1)

    side = threading.Thread(target=worker, daemon=True)
    side.start()
    _steps(core, model, opt)
    core.launch(store)  # round 0's end, behind the steps from here
    core.leave()
    e0 = {n: v.copy() for n, v in model_views(model).items()}
    moments = {k: v.clone() for k, v in opt.state[model.weight].items()}
    with torch.no_grad():  # the user's loop trains on at once
        model.weight.add_(1.0)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    _steps(core, model, opt)
    live = {n: v.copy() for n, v in model_views(model).items()}
    steps_done.set()
    core.wait_base()  # round 1's update is due before S_1 came
    side.join(WAIT)
    # The update is S_0 - E_0 (what was sent plus the residual kept), not the model trained on.
    from training.outer.aggregate import unwrap_update
    from training.outer.loop import decode_update

    assert len(received) == 1
    sent = decode_update(unwrap_update(received[0].update).payload, s0)  # type: ignore[attr-defined]
    residual = core.trainer.feedback.residual
    for name, start in s0.params.items():
        assert np.allclose(sent[name] + residual[name], start - e0[name], atol=1e-6), name
    # The model holds S_1 plus its drift since E_0, with the float32 roundings of a shift.
    after = model_views(model)
    for name, value in after.items():
        shift = np.subtract(s1.params[name], e0[name], dtype=np.float32)
        assert np.array_equal(value, live[name] + shift), name
    # The checkpoint holds the optimizer as it was at the H-th step, not stepped since.
    saved = read_checkpoint(store, run="ov", peer="peer", shapes=dict(core.model.layout.trainable))
    assert saved is not None and saved.round == 0 and saved.optimizer is not None
    index = [id(p) for p in model.parameters()].index(id(model.weight))
    for key, value in moments.items():
        assert torch.equal(saved.optimizer["state"][index][key], value), key
    spare = core.spare  # round 0's copy, the thread done with it
    assert spare is not None
    core.launch(store)  # round 1's end: its timing is complete
    core.leave()
    # Round 1's copy went into round 0's arrays (no new model-sized arrays a round).
    assert core.ending is not None
    copied = core.ending.snapshot[0]
    assert all(copied[n] is spare[n] for n in spare)
    for name, value in model_views(model).items():
        assert np.array_equal(copied[name], value), name
    compute, waited, overlapped = core.timings[1]
    assert compute >= H * STEP  # the user's own steps, none of the wait
    assert waited >= HOLD  # what step() waited for S_1 after the steps were done
    assert 0 < overlapped <= compute + 0.05  # round 0's communication ran during round 1
    handoff.close()
    core.close()  # the round's end waiting for S_2 ends with the loop
    assert core.ending is not None and not core.ending.thread.is_alive()


def test_an_error_on_the_round_ends_thread_is_raised_in_the_users_thread() -> None:
    def refused() -> object:
        raise ValueError("error feedback: tensor names changed between rounds")

    handoff = Handoff()
    handoff.wanted = R0  # the worker waits for this round's update
    ending = RoundEnd(handoff, R0, make=refused, keep=lambda: None, snapshot=({}, {}))  # type: ignore[arg-type]
    ending.start()
    with pytest.raises(ValueError, match="tensor names changed"):
        ending.result(WAIT)


def test_a_loop_closed_while_the_round_ends_thread_waits_ends_it() -> None:
    handoff = Handoff()
    ending = RoundEnd(handoff, R0, make=object, keep=lambda: None, snapshot=({}, {}))  # type: ignore[arg-type]
    ending.start()
    handoff.close()
    with pytest.raises(OuterLoopError, match="closed mid-round"):
        ending.result(WAIT)


def test_a_rounds_update_is_made_once_the_worker_asks_for_it() -> None:
    """Point 2: not while the worker still keeps the state just taken (the two would take
    the interpreter lock from each other at every array operation)."""
    handoff = Handoff()
    asked: list[str | None] = []

    def make() -> str:
        asked.append(handoff.wanted)
        return "update"

    ending = RoundEnd(handoff, R0, make=make, keep=lambda: None, snapshot=({}, {}))  # type: ignore[arg-type]
    ending.start()
    with handoff.cond:  # the worker is keeping the state: no update is made meanwhile
        assert not handoff.cond.wait_for(lambda: handoff.trained is not None, timeout=0.5)
    assert handoff.wait_trained(WAIT, R0) == "update"  # the worker asks
    assert asked == [R0]
    handoff.close()
    ending.join(WAIT)
