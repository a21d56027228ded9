"""Resuming after a crash (point 8 of :mod:`training.outer.api`): what a worker keeps of its
own each round, and how a restarted one takes it back.

1. **What is kept.** The global state (parameters, momentum, buffers) is the run's and comes
   back from the tip, as for any joiner. What only this worker holds is kept in its store
   after each update it makes: its error-feedback residual (what compression has not sent
   yet), the inner optimizer's state when the loop was given ``inner_optimizer``, and the
   round that update was for. One safetensors file, ``<store>/outer/<run>-resume.
   safetensors``, replaced through the store's durable write (temp file, fsync, rename),
   so a crash at any moment leaves one whole checkpoint. A file, not a blob: nobody
   fetches it, and a blob would hash 12 bytes a parameter each round for nothing.
2. **When.** In ``step()``, after the update is handed to the worker and while the round is
   agreed: the residual and the optimizer's state only change in the user's thread, which
   is inside ``step()`` until the next state is in the model, so the checkpoint is of one
   moment without a copy. Its write overlaps the round's communication. An overlapped
   round's end (``training.outer.api.overlap``) writes it on its own thread while the
   user's loop steps the optimizer on: the optimizer's state is copied first
   (:func:`copy_optimizer`, in the user's thread), and the residual is only changed by the
   next round's end, which starts after this one ended.
3. **Taking it back** (``resume=True``): the checkpoint must be of this run and this peer,
   and fit the model and optimizer (names, shapes; the optimizer's parameter groups); else
   one line says what differs. The worker then joins from the run's tip; its next update
   carries on from its own residual. With no checkpoint in the store the loop says so and
   starts as a new worker.
4. **Encoding.** Tensors as safetensors (``residual/<name>``, ``optimizer/<index>/<key>``),
   everything else as JSON in its metadata under :data:`RESUME_METADATA_KEY`: the run, the
   peer, the round, and the optimizer's parameter groups and non-tensor state (numbers,
   booleans, strings, lists; an optimizer holding anything else is refused when the loop
   is made, before any round). No pickle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from blobstore.exitcodes import ExitCode
from training.errors import TrainingError

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

    F32 = npt.NDArray[np.float32]

RESUME_METADATA_KEY = "blobnet.resume"
RESUME_VERSION = 1
# Point 4: the JSON beside the tensors (parameter groups, a few numbers per parameter):
# far under this for any optimizer of a model that fits a machine.
MAX_RESUME_METADATA = 16 << 20


class ResumeRefused(TrainingError):
    """A checkpoint that is not this worker's, or does not fit its model (the user's to
    sort out: another store, another run)."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class Checkpoint:
    """Point 1, read back: the round whose update the worker made last, its residual and
    its optimizer's state (None: the loop had no ``inner_optimizer``)."""

    round: int
    residual: dict[str, F32]
    optimizer: dict[str, Any] | None


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON holds it (tuples become lists), or :class:`ResumeRefused`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, where) for k, v in value.items()}
    raise ResumeRefused(
        f"the inner optimizer's {where} holds a {type(value).__name__}; a checkpoint keeps "
        "tensors, numbers, booleans, strings and lists only"
    )


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Point 4, before any round: refuse an optimizer whose state a checkpoint cannot keep."""
    _split_optimizer(optimizer.state_dict())


def _split_optimizer(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors by ``optimizer/<index>/<key>``, the rest as JSON) of a ``state_dict()``."""
    import torch

    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for index, entry in state["state"].items():
        plain: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{index}/{key}"] = value.detach().to("cpu").contiguous()
            else:
                plain[key] = _plain(value, f"state {key!r}")
        rest[str(index)] = plain
    groups = [_plain(g, "parameter group") for g in state["param_groups"]]
    return tensors, {"state": rest, "param_groups": groups}


@dataclass(frozen=True)
class OptimizerCopy:
    """An inner optimizer's state at one moment (point 2): its tensors copied (by
    ``optimizer/<index>/<key>``), the rest as JSON, and its kind."""

    tensors: dict[str, Any]
    rest: dict[str, Any]
    kind: str


def copy_optimizer(optimizer: torch.optim.Optimizer) -> OptimizerCopy:
    """Point 2: ``optimizer``'s state now, for a checkpoint written while it steps on."""
    held, rest = _split_optimizer(optimizer.state_dict())
    return OptimizerCopy({n: t.clone() for n, t in held.items()}, rest, _kind(optimizer))


def _kind(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def checkpoint_path(store: Any, run: str) -> Path:
    from training.outer.runs import worker_files

    return worker_files(Path(store.root)) / f"{run}-resume.safetensors"


def write_checkpoint(
    store: Any,
    *,
    run: str,
    peer: str,
    round_: int,
    residual: Mapping[str, F32],
    optimizer: torch.optim.Optimizer | OptimizerCopy | None,
) -> Path:
    """Point 1: the checkpoint, durably replacing the one before; returns its path. Each
    tensor is written from its own memory (``module_state.write_safetensors``).
    ``optimizer``: the inner optimizer, or a copy of its state (:func:`copy_optimizer`)."""
    from blobstore.durable import TempFile
    from training.outer.module_state import write_safetensors

    tensors: dict[str, Any] = {f"residual/{n}": v for n, v in residual.items()}
    meta: dict[str, Any] = {"v": RESUME_VERSION, "run": run, "peer": peer, "round": round_}
    if optimizer is not None:
        if not isinstance(optimizer, OptimizerCopy):
            held, rest = _split_optimizer(optimizer.state_dict())
            optimizer = OptimizerCopy(held, rest, _kind(optimizer))
        tensors.update(optimizer.tensors)
        meta["optimizer"] = {**optimizer.rest, "kind": optimizer.kind}
    target = checkpoint_path(store, run)
    with TempFile(Path(store.tmp_dir)) as tmp:
        write_safetensors(tmp.fd, tensors, {RESUME_METADATA_KEY: json.dumps(meta, sort_keys=True)})
        tmp.publish(target, replace=True, mode=0o600)
    return target


def read_checkpoint(
    store: Any, *, run: str, peer: str, shapes: Mapping[str, tuple[int, ...]]
) -> Checkpoint | None:
    """Point 3: this worker's checkpoint of ``run`` (None: the store holds none)."""
    from safetensors import SafetensorError, safe_open

    path = checkpoint_path(store, run)
    if not path.exists():
        return None
    blob = path.name  # what messages call it
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(RESUME_METADATA_KEY, "")
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise ResumeRefused(f"run {run}'s resume checkpoint {blob} is unreadable: {exc}") from None
    if len(raw) > MAX_RESUME_METADATA:
        raise ResumeRefused(f"run {run}'s resume checkpoint {blob} is malformed")
    try:
        meta = json.loads(raw)
        ok = meta.get("v") == RESUME_VERSION and isinstance(meta.get("round"), int)
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise ResumeRefused(f"run {run}'s resume checkpoint {blob} is malformed")
    if meta.get("run") != run or meta.get("peer") != peer:
        raise ResumeRefused(
            f"the resume checkpoint in this store is {meta.get('peer', '?')[-6:]}'s of run "
            f"{meta.get('run')!r}, not this worker's ({peer[-6:]}) of run {run!r}"
        )
    residual = {
        name[len("residual/") :]: t.numpy().astype(np.float32)
        for name, t in tensors.items()
        if name.startswith("residual/")
    }
    if residual and {n: tuple(v.shape) for n, v in residual.items()} != dict(shapes):
        raise ResumeRefused(f"run {run}'s resume checkpoint does not fit this model's parameters")
    optimizer = None
    if "optimizer" in meta:
        optimizer = _join_optimizer(meta["optimizer"], tensors)
    return Checkpoint(int(meta["round"]), residual, optimizer)


def _join_optimizer(rest: dict[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """A ``state_dict()`` for ``load_state_dict`` from point 4's two halves."""
    state: dict[int, dict[str, Any]] = {}
    for index, plain in rest["state"].items():
        state[int(index)] = dict(plain)
    for name, value in tensors.items():
        if name.startswith("optimizer/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": rest["param_groups"], "kind": rest.get("kind")}


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any], run: str) -> None:
    """Point 3: the checkpoint's optimizer state into ``optimizer``, or one line saying
    why it does not fit."""
    if saved.get("kind") != _kind(optimizer):
        raise ResumeRefused(
            f"run {run}'s resume checkpoint does not fit this inner optimizer: it holds a "
            f"{saved.get('kind')}'s state, this is a {_kind(optimizer)}"
        )
    try:
        optimizer.load_state_dict({k: v for k, v in saved.items() if k != "kind"})
    except (ValueError, KeyError, RuntimeError, TypeError) as exc:
        raise ResumeRefused(
            f"run {run}'s resume checkpoint does not fit this inner optimizer: {exc}"
        ) from None
