"""DiLoCo outer loop: pseudo-gradients, deterministic averaging, Nesterov outer step.

Theory of operation
-------------------
1. A round starts from a global state: the parameters and the outer optimiser's momentum,
   both float32 numpy arrays by name, the model's floating buffers where it has any
   (``training.outer.module_state``), plus the round number. Every worker holds the same
   bits, so ``state_root`` (BLAKE3 over a canonical tensor encoding) is the same everywhere.
2. Each worker loads the global parameters into its model, runs H inner steps on its shard
   with its own AdamW (whose state stays local across rounds, as in DiLoCo), and sends
   ``make_update``: the pseudo-gradient ``start - end``, encoded densely or through a
   SparseLoCo codec with the worker's own error-feedback residual (``training.outer.codec``).
3. ``apply_round`` averages the decoded updates that arrived, in ascending peer-ID order
   (so the float32 sum is the same whatever order they arrived in), and takes one outer
   step, SGD with Nesterov momentum as in DiLoCo (PyTorch's formulation, dampening 0)::

       m <- mu * m + g;   p <- p - lr * (g + mu * m)

   Every op is an elementwise numpy float32 op (no threads, no fused multiply-add, no
   reductions across elements), so the same inputs give the same bits on any worker.
   The buffers become the coordinate-wise median of the updates' (:func:`median_buffers`).
   A round in which no update arrived leaves the state as it was, apart from the round.
4. The in-process simulation (``training.outer.simulate``) and the real multi-process run
   use ``run_inner_steps``, ``make_update``, ``decode_update`` and ``apply_round`` as they
   are.

torch is imported inside functions; importing this module costs numpy and blake3 only.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np
import numpy.typing as npt

from blobstore.exitcodes import ExitCode
from training.errors import TrainingError
from training.outer.codec import (
    F32,
    ErrorFeedback,
    decode,
    encode_dense,
)

if TYPE_CHECKING:
    import torch

STATE_DOMAIN = b"blobnet/outer-state/v1"
TENSORSET_DOMAIN = b"TENSORSET/v1"


class OuterError(TrainingError):
    """The outer loop was given inconsistent inputs (a local bug, not a peer's fault)."""

    exit_code = ExitCode.USAGE


# outer_step's block: 64 Ki float32 elements (256 KiB) per operand, so a block's five
# operations run in the CPU's cache and each array crosses memory once.
STEP_BLOCK = 1 << 16
# outer_step's threads: the step is elementwise, so its blocks may run on any thread in
# any order with the same bits, and numpy lets go of the GIL for each block's operations.
# At most 8: past that a 124M step is bound by memory bandwidth, not by cores.
STEP_THREADS = max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimiser: SGD with (Nesterov) momentum; DiLoCo uses lr 0.7, mu 0.9."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass(frozen=True)
class OuterState:
    """The global state every worker agrees on at the start of round ``round``;
    ``buffers``: the model's floating buffers (none for most models)."""

    round: int
    params: dict[str, F32]
    momentum: dict[str, F32]
    buffers: dict[str, F32] = field(default_factory=dict)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(int(d) for d in value.shape) for name, value in self.params.items()}


def sorted_names(names: Iterable[str]) -> list[str]:
    """Tensor names in canonical order: by their UTF-8 bytes."""
    return sorted(names, key=lambda n: n.encode())


def initial_state(
    params: Mapping[str, Any], buffers: Mapping[str, Any] | None = None
) -> OuterState:
    """Round 0: copies of ``params`` (float32 arrays or tensors) and zero momentum, and
    copies of the model's floating ``buffers``."""
    copied = {name: _to_numpy(params[name]) for name in sorted_names(params)}
    given = buffers or {}
    held = {name: _to_numpy(given[name]) for name in sorted_names(given)}
    return OuterState(0, copied, {n: np.zeros_like(v) for n, v in copied.items()}, held)


def _to_numpy(value: Any, *, copy: bool = True) -> F32:
    """``value`` as a C-ordered float32 array: a copy of its own, or (``copy=False``, for
    a caller that only reads it) a view where it already is one."""
    if hasattr(value, "detach"):
        value = value.detach().to("cpu").contiguous().numpy()
    array = np.asarray(value)
    if array.dtype != np.float32:
        raise OuterError(f"expected float32, got {array.dtype}")
    if not copy:
        return np.ascontiguousarray(array)
    return np.array(array, dtype=np.float32, order="C", copy=True)


# --- state roots ---------------------------------------------------------------------


def tensor_set_digest(named: Mapping[str, Any]) -> bytes:
    """BLAKE3 over a canonical encoding of named tensors (research/train.md section 4).

    Sorted names; for each: name, dtype name, rank, dims and the raw little-endian bytes,
    every field length-prefixed with a u64 so no two tensor sets share an encoding.
    """
    # Large updates hash on several threads (BLAKE3's tree: the same digest on any number).
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(TENSORSET_DOMAIN)
    h.update(struct.pack("<Q", len(named)))
    for name in sorted_names(named):
        array = np.asarray(named[name])
        little = array.astype(array.dtype.newbyteorder("<"), copy=False)
        raw_name = name.encode()
        dtype = little.dtype.name.encode()
        h.update(struct.pack("<Q", len(raw_name)) + raw_name)
        h.update(struct.pack("<Q", len(dtype)) + dtype)
        h.update(struct.pack(f"<Q{little.ndim}Q", little.ndim, *little.shape))
        raw = np.ascontiguousarray(little).reshape(-1).view(np.uint8)  # a view, not a copy
        h.update(struct.pack("<Q", raw.nbytes))
        h.update(raw.data)
    return h.digest()


def state_root(state: OuterState) -> str:
    """64 hex digits naming the global state: round, parameters and momentum, and the
    buffers' digest after them where the state has buffers (a state without keeps the
    root it always had; with, the input is 32 bytes longer, so the two never meet)."""
    h = blake3.blake3()
    h.update(STATE_DOMAIN)
    h.update(struct.pack("<Q", state.round))
    h.update(tensor_set_digest(state.params))
    h.update(tensor_set_digest(state.momentum))
    if state.buffers:
        h.update(tensor_set_digest(state.buffers))
    return h.hexdigest()


# --- the outer step ------------------------------------------------------------------


def pseudo_gradient(start: Mapping[str, F32], end: Mapping[str, Any]) -> dict[str, F32]:
    """``start - end`` per parameter (what a worker's inner steps moved, sign as a grad)."""
    if set(start) != set(end):
        raise OuterError("start and end states name different parameters")
    out: dict[str, F32] = {}
    for name in sorted_names(start):
        finish = _to_numpy(end[name], copy=False)  # read once, into the difference
        if finish.shape != start[name].shape:
            raise OuterError(f"parameter {name!r} changed shape during the round")
        out[name] = start[name] - finish
    return out


def average_updates(
    updates: Mapping[str, Mapping[str, F32]], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, F32]:
    """Mean of the updates, summed in ascending peer-ID order (order of arrival is moot)."""
    if not updates:
        raise OuterError("no updates to average")
    peers = sorted(updates)
    count = np.float32(len(peers))
    out: dict[str, F32] = {}
    for name in sorted_names(shapes):
        total = np.zeros(shapes[name], dtype=np.float32)
        for peer in peers:
            value = updates[peer].get(name)
            if value is None or value.shape != total.shape or value.dtype != np.float32:
                raise OuterError(f"update from {peer} lacks float32 {name!r} {shapes[name]}")
            total += value
        out[name] = total / count
    if any(set(u) != set(shapes) for u in updates.values()):
        raise OuterError("an update names parameters the model does not have")
    return out


def outer_step(
    state: OuterState,
    grad: Mapping[str, F32],
    config: OuterConfig,
    *,
    threads: int | None = None,
    grad_is_spare: bool = False,
    block: int = STEP_BLOCK,
) -> OuterState:
    """One SGD step with (Nesterov) momentum on the averaged pseudo-gradient.

    In float32, per element: ``buf = mu * m + g``, ``step = g + mu * buf`` (Nesterov; else
    ``buf``), ``p' = p - lr * step``. Two new arrays per tensor (the new momentum and the
    new parameters), written block by block (``block`` elements, default :data:`STEP_BLOCK`,
    through two
    block-sized scratch arrays a thread): at 124M parameters the step is memory-bound, and
    a full-size temporary per operation would cost a pass over memory each. Each product
    and sum is the same float32 operation as written above (IEEE addition and
    multiplication commute exactly), so the bits are those of the formula, on any number
    of ``threads`` (default :data:`STEP_THREADS`).

    ``grad_is_spare``: ``grad``'s arrays are the caller's own (C-ordered float32, used for
    nothing after): the new momentum is written over them, each block of ``g`` copied to a
    third scratch array first, so the step's peak holds one model-sized array fewer."""
    lr = np.float32(config.lr)
    mu = np.float32(config.momentum)
    params: dict[str, F32] = {}
    momentum: dict[str, F32] = {}
    blocks: list[tuple[F32, F32, F32, F32, F32, int, int]] = []
    for name in sorted_names(state.params):
        p_in, m_in, g_in = state.params[name], state.momentum[name], grad[name]
        p_out = np.empty(p_in.shape, dtype=np.float32)
        if grad_is_spare:
            if not (g_in.dtype == np.float32 and g_in.flags.c_contiguous and g_in.flags.writeable):
                raise OuterError(f"gradient {name!r} cannot be written over")
            m_out = g_in
        else:
            m_out = np.empty(p_in.shape, dtype=np.float32)
        p, m, g = p_in.reshape(-1), m_in.reshape(-1), np.asarray(g_in).reshape(-1)
        pn, mn = p_out.reshape(-1), m_out.reshape(-1)
        for lo in range(0, p.size, block):
            blocks.append((p, m, g, pn, mn, lo, min(lo + block, p.size)))
        params[name] = p_out
        momentum[name] = m_out

    def run(part: list[tuple[F32, F32, F32, F32, F32, int, int]]) -> None:
        scratch = np.empty(block, dtype=np.float32)
        spare = np.empty(block, dtype=np.float32) if grad_is_spare else None
        for p, m, g, pn, mn, lo, hi in part:
            gb = g[lo:hi]
            if spare is not None:  # mn is g: keep the block before buf overwrites it
                gb = spare[: hi - lo]
                gb[...] = g[lo:hi]
            buf, step = mn[lo:hi], scratch[: hi - lo]
            np.multiply(m[lo:hi], mu, out=buf)
            buf += gb
            if config.nesterov:
                np.multiply(buf, mu, out=step)
                step += gb
            else:
                step[:] = buf
            step *= lr
            np.subtract(p[lo:hi], step, out=pn[lo:hi])

    n = min(threads or STEP_THREADS, len(blocks))
    if n <= 1:
        run(blocks)
    else:  # strided, so each thread gets a share of every tensor
        with ThreadPoolExecutor(n) as pool:
            for done in [pool.submit(run, blocks[i::n]) for i in range(n)]:
                done.result()
    return OuterState(state.round + 1, params, momentum, state.buffers)


def median_buffers(
    buffers: Sequence[Mapping[str, F32]], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, F32]:
    """Point 3: the coordinate-wise median of the updates' buffers (float32; of an even
    count, half of each of the two middle values, added, which neither overflows nor
    depends on the order). ``buffers`` must each name exactly ``shapes``."""
    out: dict[str, F32] = {}
    for name in sorted_names(shapes):
        stack = np.stack([b[name] for b in buffers])
        if stack.shape[1:] != tuple(shapes[name]) or stack.dtype != np.float32:
            raise OuterError(f"buffer {name!r} is not float32 {shapes[name]} in every update")
        stack.sort(axis=0)  # exact: sorting moves values, it computes none
        n = stack.shape[0]
        if n % 2:
            out[name] = stack[n // 2].copy()
        else:
            half = np.float32(0.5)
            out[name] = stack[n // 2 - 1] * half + stack[n // 2] * half
    return out


def apply_round(
    state: OuterState,
    updates: Mapping[str, Mapping[str, F32]],
    config: OuterConfig | None = None,
    buffers: Mapping[str, Mapping[str, F32]] | None = None,
) -> OuterState:
    """The next global state from the decoded updates (peer ID -> name -> array) and, for
    a state with buffers, each update's buffers (peer ID -> name -> array)."""
    if not updates:
        return OuterState(state.round + 1, state.params, state.momentum, state.buffers)
    averaged = average_updates(updates, state.shapes())
    stepped = outer_step(state, averaged, config or OuterConfig())
    if not state.buffers:
        return stepped
    shapes = {n: tuple(v.shape) for n, v in state.buffers.items()}
    held = [(buffers or {})[peer] for peer in sorted(updates)]
    return replace(stepped, buffers=median_buffers(held, shapes))


# --- a worker's side of a round ------------------------------------------------------


def model_params(model: torch.nn.Module) -> dict[str, F32]:
    """Copies of the model's trainable parameters as float32 numpy arrays."""
    return {
        name: p.detach().to("cpu").numpy().copy()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def load_params(model: torch.nn.Module, params: Mapping[str, F32]) -> None:
    """Overwrite the model's trainable parameters with ``params`` (same names and shapes)."""
    import torch

    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(named) != set(params):
        raise OuterError("global state and model name different parameters")
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(torch.from_numpy(params[name]))


def shift_params(model: torch.nn.Module, state: Mapping[str, F32], end: Mapping[str, F32]) -> None:
    """Overlap's correction: move the model's trainable parameters by ``state - end``
    (float32, elementwise), keeping the local drift since ``end``: theta <- state + (theta -
    end), written as theta += (state - end) so each element is one float32 subtraction and
    one addition."""
    import torch

    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, p in named.items():
            shift = np.subtract(state[name], end[name], dtype=np.float32)
            p.add_(torch.from_numpy(shift).to(p.device, p.dtype))


def run_inner_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[torch.Tensor],
    *,
    clip: float | None = 1.0,
) -> list[float]:
    """One AdamW step per batch of token ids (causal LM loss); returns the losses."""
    import torch

    losses: list[float] = []
    model.train()
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=False)
        optimizer.step()
        losses.append(float(loss.item()))
    model.eval()
    return losses


def make_update(
    start: Mapping[str, F32],
    end: Mapping[str, Any],
    feedback: ErrorFeedback | None = None,
) -> bytes:
    """The update blob for a round: dense float32, or SparseLoCo through ``feedback``."""
    grad = pseudo_gradient(start, end)
    return encode_dense(grad) if feedback is None else feedback.step(grad)


def decode_update(data: bytes, state: OuterState) -> dict[str, F32]:
    """Decode a peer's update, checking its tensors against the global state's shapes."""
    shapes = state.shapes()
    limit = sum(math.prod(s) for s in shapes.values())
    return decode(data, max_elements=limit, expected=shapes).tensors


# --- synthetic corpus ----------------------------------------------------------------

_NOUNS = ["cat", "dog", "bird", "fox", "child", "robot", "farmer", "horse", "teacher", "fish"]
_PLURAL = {"child": "children", "fox": "foxes", "fish": "fish"}
_VERBS = ["see", "like", "chase", "find", "help", "follow", "watch", "call"]
_ADJS = ["small", "red", "happy", "old", "quick", "quiet", "green", "brave"]
_PLACES = ["in the park", "near the river", "at home", "on the hill", "by the old barn"]


def _noun_phrase(rng: np.random.Generator) -> tuple[str, bool]:
    noun = _NOUNS[int(rng.integers(len(_NOUNS)))]
    plural = bool(rng.random() < 0.4)
    word = _PLURAL.get(noun, noun + "s") if plural else noun
    dets = ("the", "some", "two") if plural else ("the", "a", "one")
    det = dets[int(rng.integers(3))]
    if rng.random() < 0.5:
        word = f"{_ADJS[int(rng.integers(len(_ADJS)))]} {word}"
    return f"{det} {word}", plural


def _sentence(rng: np.random.Generator) -> str:
    subject, plural = _noun_phrase(rng)
    verb = _VERBS[int(rng.integers(len(_VERBS)))]
    if not plural:
        verb = verb + ("es" if verb.endswith(("ch", "sh")) else "s")
    obj, _ = _noun_phrase(rng)
    text = f"{subject} {verb} {obj}"
    if rng.random() < 0.3:
        text += " " + _PLACES[int(rng.integers(len(_PLACES)))]
    return text[0].upper() + text[1:] + "."


def synthetic_tokens(seed: int, sequences: int, seq_len: int) -> npt.NDArray[np.int64]:
    """``sequences`` x ``seq_len`` byte-level tokens of a small English-like grammar.

    Documents of a few sentences (subject-verb agreement, determiners that agree with
    number, optional adjectives and places) are tokenised by ``training.records``'s byte
    tokenizer and cut into rows. Deterministic in ``seed``.
    """
    from training.records import encode_bytes

    rng = np.random.default_rng(seed)
    stream: list[int] = []
    need = sequences * seq_len
    while len(stream) < need:
        doc = " ".join(_sentence(rng) for _ in range(int(rng.integers(2, 7))))
        stream.extend(encode_bytes(doc.encode()))
    return np.asarray(stream[:need], dtype=np.int64).reshape(sequences, seq_len)


# Outer hyper-parameters per mode. Dense DiLoCo uses the paper's Nesterov SGD (lr 0.7,
# momentum 0.9). SparseLoCo, as in its paper, drops the outer momentum: the workers'
# error-feedback residuals carry what momentum would, and plain SGD applies the sparse mean.
# Its decay decides the gap to dense; lr 3 / decay 0.9 is the setting the study chose
# (bench/outer.py --study): its gap, and those of the settings it was chosen over, are in
# bench/figures/outer-study.md.
MODE_DEFAULTS: dict[str, dict[str, float]] = {
    "diloco": {"outer_lr": 0.7, "outer_momentum": 0.9, "ef_decay": 1.0},
    "sparseloco": {"outer_lr": 3.0, "outer_momentum": 0.0, "ef_decay": 0.9},
    "ddp": {"outer_lr": 0.0, "outer_momentum": 0.0, "ef_decay": 1.0},
}
