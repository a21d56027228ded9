"""The replayed level from the Python API (point 7 of :mod:`training.outer.api`): the
user's named inner step, and the trainers the library drives with it."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3

if TYPE_CHECKING:
    import torch

    from training.outer.params import RunParams
    from training.outer.spec import RunSpec


@dataclass(frozen=True)
class InnerStep:
    """Point 7: the user's inner step, named as the run spec's ``step`` names it.
    ``fn(model, batch) -> loss`` (a scalar tensor), ``batch`` an int64 tensor of rows
    (batch x sequence length) of the run's records on the model's device; the library
    calls ``backward()`` and the optimizer."""

    name: str
    fn: Callable[[Any, Any], Any]


def check_step(spec: RunSpec, step: InnerStep) -> None:
    """Point 7: refuse a step the spec does not name, before step 0."""
    from training.outer.spec import LevelRefused

    if not spec.step:
        raise LevelRefused(
            f"run {spec.run} names no inner step (its replays run the built-in causal-LM "
            f"step): make the run with step={step.name!r} to drive it with InnerStep"
        )
    if step.name != spec.step:
        raise LevelRefused(
            f"run {spec.run} replays the inner step {spec.step!r}; this worker's InnerStep "
            f"is {step.name!r}"
        )


def peer_shard(peer: str) -> int:
    """A worker's shard (its sampler's stream) from its peer ID, as the CLI worker's."""
    return int.from_bytes(blake3.blake3(peer.encode()).digest()[:4], "little") % (1 << 20)


class DrivenTrainers:
    """Point 7: the worker's trainer trains the user's model; each replay's trains a
    fresh copy of it as it was when the loop was made."""

    def __init__(self, model: torch.nn.Module, step: InnerStep, tokens: Any) -> None:
        import torch

        self.model = model
        self.template = copy.deepcopy(model)
        self.step = step
        self.tokens = tokens
        self.device = next(iter(model.parameters())).device.type
        self.threads = torch.get_num_threads()
        self.lock = threading.Lock()
        self.given = False
        self.reset: dict[str, Any] = {}  # the run's fixed tensors that are buffers

    def load_fixed(self, fixed: dict[str, Any]) -> None:
        """The run's fixed tensors into the copy replays start from (the user's model
        takes them through :class:`~training.outer.api.model.UserModel`)."""
        from training.outer.module_state import load_into

        load_into(self.template, {}, fixed)
        buffers = {name for name, _ in self.template.named_buffers()}
        self.reset = {n: t for n, t in fixed.items() if n in buffers}

    def __call__(self, params: RunParams, shard: int) -> Any:
        from training.outer.trainer import Trainer

        with self.lock:
            model, self.given = (copy.deepcopy(self.template) if self.given else self.model), True
        return Trainer(
            params,
            shard,
            model=model,
            tokens=self.tokens,
            device=self.device,
            threads=self.threads,
            step_fn=self.step.fn,
            reset=self.reset,
        )
