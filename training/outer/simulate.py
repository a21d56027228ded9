"""The in-process simulation of an outer-loop run: K workers in one process, for the
benchmark and ``blob outer simulate``.

1. ``simulate`` runs the real round's parts unchanged (``training.outer.loop``'s
   ``run_inner_steps``, ``make_update``, ``decode_update`` and ``apply_round``), or, with
   ``robust`` or an adversary, aggregates each round as the network does
   (``training.outer.aggregate``).
2. ``mode`` "ddp" is synchronous data parallel with the same data and steps, the baseline;
   the ablations swap one part of SparseLoCo's aggregation (``ABLATIONS``).
3. ``overlap`` 1 is the one-step-delayed outer step (DESIGN section 8, "Overlap"): a
   worker does not wait for round r's result; it trains round r+1 on from its own end of
   round r, E_r, and when S_{r+1} arrives (after ``overlap_at`` of the round's steps) it
   moves its parameters by ``S_{r+1} - E_r``, keeping its local drift since the round
   began: theta <- S_{r+1} + (theta - E_r). Its round-(r+1) update is then taken against
   S_{r+1}, as a blocking worker's is, so the network's rounds, closures and aggregate are
   unchanged.

torch is imported inside functions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from training.outer.aggregate import aggregate, wrap_update
from training.outer.codec import F32, CodecParams, ErrorFeedback, compress_tensor, encode_dense
from training.outer.loop import (
    MODE_DEFAULTS,
    OuterConfig,
    OuterError,
    OuterState,
    apply_round,
    decode_update,
    initial_state,
    load_params,
    make_update,
    model_params,
    outer_step,
    run_inner_steps,
    shift_params,
    sorted_names,
    state_root,
    synthetic_tokens,
)
from training.outer.simconfig import MODES, SimConfig, SimResult

if TYPE_CHECKING:
    import torch


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
    ends: list[dict[str, F32] | None] = [None] * cfg.workers  # point 3: each worker's E_r
    for r in range(cfg.rounds):
        t0 = time.perf_counter()
        updates: dict[str, dict[str, F32]] = {}
        payloads: dict[str, bytes] = {}
        sizes: list[int] = []
        losses: list[float] = []
        for w in range(cfg.workers):
            batches = _batches(shards[w], rngs[w], cfg.batch, cfg.inner_steps)
            previous = ends[w]
            if previous is not None:  # point 3: on from E_{r-1}
                ahead = min(cfg.inner_steps, round(cfg.overlap_at * cfg.inner_steps))
                losses.extend(run_inner_steps(models[w], optimizers[w], islice(batches, ahead)))
                shift_params(models[w], state.params, previous)
                losses.extend(run_inner_steps(models[w], optimizers[w], batches))
            else:
                load_params(models[w], state.params)
                losses.extend(run_inner_steps(models[w], optimizers[w], batches))
            end = model_params(models[w])
            blob = make_update(state.params, end, feedbacks[w])
            sizes.append(len(blob))
            payloads[f"sim-worker-{w:03d}"] = blob
            updates[f"sim-worker-{w:03d}"] = decode_update(blob, state)
            if cfg.overlap:
                ends[w] = end
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
        for name in sorted_names(grads):
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
    for name in sorted_names(updates[peers[0]]):
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
