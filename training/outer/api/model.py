"""The user's model as the run sees it (points 2 and 6 of :mod:`training.outer.api`): its
trainable parameters as float32 host arrays, the whole state (``training.outer.module_state``)
copied back in place, and a model sharded over a group gathered whole."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np

from training.outer.module_state import floating_buffers, layout_of, load_into

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor

    from training.outer.codec import F32
    from training.outer.loop import OuterState


class UserModel:
    """The user's module and the run's fixed tensors it took at join: what the run reads
    from it (trainable parameters, floating buffers) and writes into it (a whole state).

    1. ``load`` writes a state's parameters (not the sharded ones: the group scatters
       those), its buffers, and the run's integer buffers (reset with every state, so
       ``num_batches_tracked`` is the same on every worker).
    2. ``load_fixed`` writes every fixed tensor of the run once, when the worker joins:
       frozen parameters made with another seed are the run's from then on."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.layout = layout_of(module)
        self.reset: dict[str, Any] = {}  # the run's fixed tensors that are buffers

    def views(self) -> dict[str, F32]:
        return model_views(self.module)

    def buffers(self) -> dict[str, F32]:
        return floating_buffers(self.module) if self.layout.buffers else {}

    def load(self, state: OuterState) -> None:
        load_state(self.module, state.params)
        load_into(self.module, state.buffers, self.reset)

    def snapshot(
        self, into: Mapping[str, F32] | None = None
    ) -> tuple[dict[str, F32], dict[str, F32]]:
        """Copies of the trainable parameters (float32; into ``into``'s arrays where given,
        a spare snapshot of this model, so a round allocates nothing) and floating buffers:
        the end of a round a worker trains on from (point 9). One torch call copies every
        parameter, so the user's thread takes the interpreter lock back once, not once a
        tensor (each time, another thread of the process may hold it a switch interval)."""
        import torch

        params = trainable(self.module)
        held = (
            {n: np.empty(tuple(p.shape), dtype=np.float32) for n, p in params.items()}
            if into is None
            else dict(into)
        )
        with torch.no_grad():
            torch._foreach_copy_(
                [torch.from_numpy(held[n]) for n in params], [p.detach() for p in params.values()]
            )
        return held, self.buffers()

    def shift(self, state: OuterState, base: tuple[Mapping[str, F32], Mapping[str, F32]]) -> None:
        """Point 9's correction: the parameters and buffers move by ``state - base``
        (float32, elementwise), so the model holds ``state`` plus its drift since ``base``;
        the run's integer buffers are reset as with every state."""
        import torch

        params, buffers = base
        with torch.no_grad():
            for name, p in trainable(self.module).items():
                if not is_sharded(p):
                    shift = np.subtract(state.params[name], params[name], dtype=np.float32)
                    p.add_(torch.from_numpy(shift).to(p.device, p.dtype))
        moved = {
            n: now + np.subtract(state.buffers[n], buffers[n], dtype=np.float32)
            for n, now in self.buffers().items()
        }
        load_into(self.module, moved, self.reset)

    def add(self, shift: tuple[Mapping[str, F32], Mapping[str, F32]]) -> None:
        """Point 9's correction, computed ahead (``training.outer.api.overlap``): the
        parameters and floating buffers move by ``shift`` (float32 arrays of S_{r+1} - E_r);
        the run's integer buffers are reset as with every state. One torch call adds to
        every parameter (as ``snapshot`` copies them): each parameter's sum is the same
        float32 addition ``p.add_`` makes."""
        import torch

        params, buffers = shift
        held = {n: p for n, p in trainable(self.module).items() if not is_sharded(p)}
        with torch.no_grad():
            torch._foreach_add_(
                list(held.values()),
                [torch.from_numpy(params[n]).to(p.device, p.dtype) for n, p in held.items()],
            )
        moved = {n: now + buffers[n] for n, now in self.buffers().items()}
        load_into(self.module, moved, self.reset)

    def load_fixed(self, fixed: Mapping[str, Any]) -> None:
        load_into(self.module, {}, fixed)
        buffers = {name for name, _ in self.module.named_buffers()}
        self.reset = {n: t for n, t in fixed.items() if n in buffers}


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def model_views(model: torch.nn.Module) -> dict[str, F32]:
    """The model's trainable parameters as float32 host arrays (any dtype, any device):
    views where a parameter already is a contiguous CPU float32 tensor, so for a caller
    that reads them before the model next changes (``LoopTrainer.make``, inside the
    user's ``step()``)."""
    import torch

    out = {}
    for name, p in trainable(model).items():
        t = p.detach().to("cpu", torch.float32)  # a new tensor unless already CPU float32
        out[name] = t.contiguous().numpy()
    return out


def load_state(model: torch.nn.Module, params: dict[str, F32]) -> None:
    """Copy ``params`` into the model's parameters in place (cast to their dtype/device);
    sharded parameters are left to the group's scatter (point 6)."""
    import torch

    with torch.no_grad():
        for name, p in trainable(model).items():
            if not is_sharded(p):
                p.copy_(torch.from_numpy(params[name]))


def is_sharded(p: Any) -> TypeGuard[DTensor]:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def gathered_state(model: torch.nn.Module) -> dict[str, F32]:
    """Point 6: ``model_views`` of a model sharded over a group, whole (copies); every
    rank of the group calls it (one all-gather per sharded parameter, in name order)."""
    import torch

    out = {}
    for name, p in sorted(trainable(model).items()):
        whole = p.full_tensor() if is_sharded(p) else p
        out[name] = whole.detach().to("cpu", torch.float32).numpy().copy()
    return out
