"""The user's model as the run sees it (points 2 and 6 of :mod:`training.outer.api`): its
trainable parameters as float32 host arrays, the state copied back in place, and a model
sharded over a group gathered whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor

    from training.outer.codec import F32


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
