"""DiLoCo outer loop: pseudo-gradients, deterministic averaging, Nesterov outer step.

Theory of operation
-------------------
1. A round starts from a global state: the parameters and the outer optimiser's momentum,
   both float32 numpy arrays by name, plus the round number. Every worker holds the same
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
   A round in which no update arrived leaves the state as it was, apart from the round.
4. ``simulate`` runs K workers in one process (the benchmark and ``blob outer simulate``);
   the real multi-process run reuses ``run_inner_steps``, ``make_update``, ``decode_update``
   and ``apply_round`` unchanged.

torch is imported inside functions; importing this module costs numpy and blake3 only.
"""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np
import numpy.typing as npt

from blobstore.errors import ExitCode
from training.errors import TrainingError
from training.outer.codec import (
    F32,
    CodecParams,
    ErrorFeedback,
    compress_tensor,
    decode,
    encode_dense,
)
from training.outer.simconfig import MODES, SimConfig, SimResult

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
    """The global state every worker agrees on at the start of round ``round``."""

    round: int
    params: dict[str, F32]
    momentum: dict[str, F32]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(int(d) for d in value.shape) for name, value in self.params.items()}


def _sorted(names: Iterable[str]) -> list[str]:
    return sorted(names, key=lambda n: n.encode())


def initial_state(params: Mapping[str, Any]) -> OuterState:
    """Round 0: copies of ``params`` (float32 arrays or tensors) and zero momentum."""
    copied = {name: _to_numpy(params[name]) for name in _sorted(params)}
    return OuterState(0, copied, {n: np.zeros_like(v) for n, v in copied.items()})


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
    for name in _sorted(named):
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
    """64 hex digits naming the global state: round, parameters and momentum."""
    h = blake3.blake3()
    h.update(STATE_DOMAIN)
    h.update(struct.pack("<Q", state.round))
    h.update(tensor_set_digest(state.params))
    h.update(tensor_set_digest(state.momentum))
    return h.hexdigest()


# --- the outer step ------------------------------------------------------------------


def pseudo_gradient(start: Mapping[str, F32], end: Mapping[str, Any]) -> dict[str, F32]:
    """``start - end`` per parameter (what a worker's inner steps moved, sign as a grad)."""
    if set(start) != set(end):
        raise OuterError("start and end states name different parameters")
    out: dict[str, F32] = {}
    for name in _sorted(start):
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
    for name in _sorted(shapes):
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
) -> OuterState:
    """One SGD step with (Nesterov) momentum on the averaged pseudo-gradient.

    In float32, per element: ``buf = mu * m + g``, ``step = g + mu * buf`` (Nesterov; else
    ``buf``), ``p' = p - lr * step``. Two new arrays per tensor (the new momentum and the
    new parameters), written block by block (:data:`STEP_BLOCK` elements, through two
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
    for name in _sorted(state.params):
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
        for lo in range(0, p.size, STEP_BLOCK):
            blocks.append((p, m, g, pn, mn, lo, min(lo + STEP_BLOCK, p.size)))
        params[name] = p_out
        momentum[name] = m_out

    def run(part: list[tuple[F32, F32, F32, F32, F32, int, int]]) -> None:
        scratch = np.empty(STEP_BLOCK, dtype=np.float32)
        spare = np.empty(STEP_BLOCK, dtype=np.float32) if grad_is_spare else None
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
    return OuterState(state.round + 1, params, momentum)


def apply_round(
    state: OuterState,
    updates: Mapping[str, Mapping[str, F32]],
    config: OuterConfig | None = None,
) -> OuterState:
    """The next global state from the decoded updates (peer ID -> name -> array)."""
    if not updates:
        return OuterState(state.round + 1, state.params, state.momentum)
    averaged = average_updates(updates, state.shapes())
    return outer_step(state, averaged, config or OuterConfig())


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


# --- in-process simulation -----------------------------------------------------------


# Outer hyper-parameters per mode. Dense DiLoCo uses the paper's Nesterov SGD (lr 0.7,
# momentum 0.9). SparseLoCo, as in its paper, drops the outer momentum: the workers'
# error-feedback residuals carry what momentum would, and plain SGD applies the sparse mean.
# Its decay is what decides the gap to dense (bench/outer.py --study, tiny Llama, 4 workers,
# k 80 of 4096, median of 3 seeds; bench/figures/outer-study.md): at 20 inner steps x 30
# rounds, lr 3 / decay 0.9 is +0.9% (median per-seed gap) against dense DiLoCo tuned on lr
# {0.7, 1} x momentum {0, 0.9}; decay 1 (classic error feedback, the old default) +6.9%,
# decay 0.95 +2.7%, decay 0.8 +1.6%, lr 2 / 0.9 +2.2%, lr 4 / 0.9 +1.1%. At 50 inner steps
# lr 3 / decay 0.9 is -0.3% (decay 1: +22.8%).
MODE_DEFAULTS: dict[str, dict[str, float]] = {
    "diloco": {"outer_lr": 0.7, "outer_momentum": 0.9, "ef_decay": 1.0},
    "sparseloco": {"outer_lr": 3.0, "outer_momentum": 0.0, "ef_decay": 0.9},
    "ddp": {"outer_lr": 0.0, "outer_momentum": 0.0, "ef_decay": 1.0},
}


def _batches(
    shard: npt.NDArray[np.int64], rng: np.random.Generator, batch: int, steps: int
) -> Iterator[torch.Tensor]:
    import torch

    for _ in range(steps):
        rows = rng.integers(0, shard.shape[0], size=batch)
        yield torch.from_numpy(shard[rows])


def eval_loss(model: torch.nn.Module, tokens: npt.NDArray[np.int64], batch: int = 32) -> float:
    """Mean causal-LM loss over ``tokens`` rows (every row has the same length)."""
    import torch

    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, tokens.shape[0], batch):
            rows = torch.from_numpy(tokens[i : i + batch])
            total += float(model(input_ids=rows, labels=rows).loss.item()) * rows.shape[0]
    return total / int(tokens.shape[0])


def _adamw(model: torch.nn.Module, config: SimConfig) -> torch.optim.Optimizer:
    import torch

    return torch.optim.AdamW(
        model.parameters(),
        lr=config.inner_lr,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
        foreach=False,
        fused=False,
    )


# A byzantine worker in the simulation: given the round's start state, the honest
# workers' codec payloads and their decoded updates (by peer), the payload it sends.
Adversary = Callable[[OuterState, Mapping[str, bytes], Mapping[str, Mapping[str, F32]]], bytes]
BYZANTINE_PEER = "sim-byzantine"


def simulate(
    config: SimConfig | None = None,
    *,
    progress: Callable[[int, SimResult], None] | None = None,
    adversary: Adversary | None = None,
    **overrides: Any,
) -> SimResult:
    """Run ``config.workers`` simulated workers for ``config.rounds`` rounds in-process.

    ``mode`` "sparseloco" sends top-k 2-bit updates with error feedback, "diloco" dense
    float32 updates, "ddp" is synchronous data parallel (one AdamW step per batch of every
    worker, gradients averaged), with ``rounds * inner_steps`` steps and the same data.
    ``progress(round, result)`` is called after each round. ``adversary``, if given, is one
    more worker (``BYZANTINE_PEER``) whose payload each round it makes; the round is then
    aggregated by ``training.outer.aggregate`` (as with ``robust``).
    """
    import torch

    from training.model import make_tiny_llama

    cfg = SimConfig(**{**(config or SimConfig()).__dict__, **overrides})
    if cfg.mode not in MODES:
        raise OuterError(f"unknown mode {cfg.mode!r}; choose one of {', '.join(MODES)}")
    cfg = SimConfig(
        **{
            **cfg.__dict__,
            **{k: v for k, v in MODE_DEFAULTS[cfg.mode].items() if cfg.__dict__[k] is None},
        }
    )
    assert cfg.outer_lr is not None
    assert cfg.outer_momentum is not None
    assert cfg.ef_decay is not None
    if cfg.workers < 1 or cfg.rounds < 0 or cfg.inner_steps < 1:
        raise OuterError("workers and inner steps must be >= 1, rounds >= 0")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    result = SimResult(cfg)
    shards = [
        synthetic_tokens(cfg.seed * 1000 + 1 + w, cfg.shard_sequences, cfg.seq_len)
        for w in range(cfg.workers)
    ]
    held_out = synthetic_tokens(cfg.seed * 1000, cfg.eval_sequences, cfg.seq_len)
    rngs = [np.random.default_rng([cfg.seed, w]) for w in range(cfg.workers)]
    reference = make_tiny_llama(cfg.model_size, seed=cfg.seed)
    state = initial_state(model_params(reference))
    result.params = sum(v.size for v in state.params.values())
    result.dense_fp32_bytes = 4 * result.params
    result.eval_loss.append(eval_loss(reference, held_out))
    result.state_roots.append(state_root(state))

    if cfg.mode == "ddp":
        _simulate_ddp(cfg, result, reference, shards, held_out, rngs, progress)
        result.wall_seconds = time.perf_counter() - started
        return result

    outer = OuterConfig(lr=cfg.outer_lr, momentum=cfg.outer_momentum)
    models = [make_tiny_llama(cfg.model_size, seed=cfg.seed) for _ in range(cfg.workers)]
    optimizers = [_adamw(m, cfg) for m in models]
    codec = CodecParams(chunk=cfg.chunk, k=cfg.k)
    if cfg.ablation not in ABLATIONS:
        raise OuterError(f"unknown ablation {cfg.ablation!r}; choose one of {ABLATIONS}")
    feedback_class = _ExactValues if cfg.ablation == "exact-values" else ErrorFeedback
    feedbacks = [
        # Names and shapes by schema digest, as on the wire (training.outer.launch.Trainer).
        feedback_class(codec, decay=cfg.ef_decay, schema_ref=True)
        if cfg.mode == "sparseloco"
        else None
        for _ in range(cfg.workers)
    ]
    for r in range(cfg.rounds):
        t0 = time.perf_counter()
        updates: dict[str, dict[str, F32]] = {}
        payloads: dict[str, bytes] = {}
        sizes: list[int] = []
        losses: list[float] = []
        for w in range(cfg.workers):
            load_params(models[w], state.params)
            batches = _batches(shards[w], rngs[w], cfg.batch, cfg.inner_steps)
            losses.extend(run_inner_steps(models[w], optimizers[w], batches))
            blob = make_update(state.params, model_params(models[w]), feedbacks[w])
            sizes.append(len(blob))
            payloads[f"sim-worker-{w:03d}"] = blob
            updates[f"sim-worker-{w:03d}"] = decode_update(blob, state)
        if cfg.robust or adversary is not None:
            state = _robust_round(state, payloads, updates, outer, adversary, result)
        elif cfg.ablation == "sender-mean":
            state = outer_step(state, _sender_mean(updates), outer)
        else:
            state = apply_round(state, updates, outer)
        load_params(reference, state.params)
        result.eval_loss.append(eval_loss(reference, held_out))
        result.train_loss.append(float(np.mean(losses)))
        result.bytes_per_worker.append(max(sizes))
        result.state_roots.append(state_root(state))
        result.round_seconds.append(time.perf_counter() - t0)
        if progress is not None:
            progress(r + 1, result)
    result.wall_seconds = time.perf_counter() - started
    return result


ABLATIONS = ("", "exact-values", "sender-mean")


class _ExactValues(ErrorFeedback):
    """Error feedback that sends the kept values themselves, not their 2-bit codes (a
    dense encoding of the sparse tensor: the bytes it reports are not the codec's)."""

    def step(self, grads: Mapping[str, Any]) -> bytes:
        sent: dict[str, F32] = {}
        for name in _sorted(grads):
            grad = np.asarray(grads[name], dtype=np.float32)
            previous = self.residual.get(name)
            accumulated = grad.copy() if previous is None else previous * self.decay + grad
            kept = compress_tensor(accumulated, self.params).positions
            out = np.zeros(accumulated.size, dtype=np.float32)
            out[kept] = accumulated.reshape(-1)[kept]
            accumulated.reshape(-1)[kept] = 0.0
            self.residual[name] = accumulated
            sent[name] = out.reshape(accumulated.shape)
        return encode_dense(sent)


def _sender_mean(updates: Mapping[str, Mapping[str, F32]]) -> dict[str, F32]:
    """Each coordinate's mean over the updates that are non-zero there (0 where none is)."""
    peers = sorted(updates)
    out: dict[str, F32] = {}
    for name in _sorted(updates[peers[0]]):
        total = np.zeros_like(updates[peers[0]][name])
        count = np.zeros_like(total)
        for peer in peers:
            total += updates[peer][name]
            count += updates[peer][name] != 0
        out[name] = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    return out


def _robust_round(
    state: OuterState,
    payloads: Mapping[str, bytes],
    updates: Mapping[str, Mapping[str, F32]],
    outer: OuterConfig,
    adversary: Adversary | None,
    result: SimResult,
) -> OuterState:
    """One round aggregated as the network does: each payload in its envelope, plus the
    adversary's, through ``training.outer.aggregate.aggregate``."""
    from training.outer.aggregate import aggregate, wrap_update

    root = state_root(state)
    blobs = dict(payloads)
    if adversary is not None:
        blobs[BYZANTINE_PEER] = adversary(state, payloads, updates)
    wrapped = {
        peer: wrap_update(data, round_=state.round, start_root=root, author=peer)
        for peer, data in blobs.items()
    }
    agg = aggregate(state, [(p, p) for p in wrapped], wrapped.__getitem__, outer, start_root=root)
    result.excluded.append([f"{e.peer}: {e.reason}" for e in agg.excluded])
    result.agreement.append([c for _, c in agg.agreement])
    return agg.state


def _simulate_ddp(
    cfg: SimConfig,
    result: SimResult,
    model: torch.nn.Module,
    shards: list[npt.NDArray[np.int64]],
    held_out: npt.NDArray[np.int64],
    rngs: list[np.random.Generator],
    progress: Callable[[int, SimResult], None] | None,
) -> None:
    """Synchronous data parallel: each step averages the workers' gradients (all-reduce)."""
    import torch

    optimizer = _adamw(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    # What one worker puts on the wire per step: its dense float32 gradient.
    per_step = len(
        encode_dense({n: np.zeros(p.shape, np.float32) for n, p in model.named_parameters()})
    )
    for r in range(cfg.rounds):
        t0 = time.perf_counter()
        losses: list[float] = []
        iters = [
            _batches(shards[w], rngs[w], cfg.batch, cfg.inner_steps) for w in range(cfg.workers)
        ]
        model.train()
        for _ in range(cfg.inner_steps):
            optimizer.zero_grad(set_to_none=True)
            grads = [torch.zeros_like(p) for p in params]
            for w in range(cfg.workers):
                batch = next(iters[w])
                loss = model(input_ids=batch, labels=batch).loss
                local = torch.autograd.grad(loss, params)
                for acc, g in zip(grads, local, strict=True):
                    acc.add_(g)
                losses.append(float(loss.item()))
            for p, acc in zip(params, grads, strict=True):
                p.grad = acc / cfg.workers
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
            optimizer.step()
        result.eval_loss.append(eval_loss(model, held_out))
        result.train_loss.append(float(np.mean(losses)))
        result.bytes_per_worker.append(per_step * cfg.inner_steps)
        result.state_roots.append(state_root(initial_state(model_params(model))))
        result.round_seconds.append(time.perf_counter() - t0)
        if progress is not None:
            progress(r + 1, result)
