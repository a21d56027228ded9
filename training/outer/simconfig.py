"""What a simulation of the outer loop is given and what it returns.

Kept apart from :mod:`training.outer.loop` (which loads numpy and the codec) so that the
command line can build ``blob outer simulate``'s options from :class:`SimConfig`'s defaults
without those imports on every ``blob`` start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MODES: tuple[str, ...] = ("sparseloco", "diloco", "ddp")


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulation depends on (the benchmark records it next to its figures)."""

    mode: str = "sparseloco"
    workers: int = 4
    rounds: int = 20
    inner_steps: int = 20
    batch: int = 8
    seq_len: int = 64
    inner_lr: float = 2e-3
    weight_decay: float = 0.0
    outer_lr: float | None = None  # None: the mode's default (MODE_DEFAULTS)
    outer_momentum: float | None = None
    chunk: int = 4096
    # 80 of 4096 (1.95%): with Rice-coded positions (training.outer.codec) the tiny Llama's update
    # is 3.16 KB, 157x fewer bytes than dense fp32 (k 48 with 12-bit indices: 130x).
    k: int = 80
    ef_decay: float | None = None
    eval_sequences: int = 64
    shard_sequences: int = 2048
    model_size: str = "tiny"
    seed: int = 0
    threads: int | None = 1
    # Aggregate as the network does (training.outer.aggregate: envelopes, bounds, copies,
    # direction) instead of the plain mean; implied by a byzantine worker.
    robust: bool = False
    # Research only (bench/outer.py --study; no wire format carries these): "exact-values"
    # sends the kept top-k values unquantised (what the 2-bit codes cost), "sender-mean"
    # averages each coordinate over the workers that sent it instead of over all K (what
    # the outer optimiser sees of values only one worker kept). "" is the codec as shipped.
    ablation: str = ""
    # Overlapped rounds (training.outer.simulate point 3): 0 blocks as the network's default
    # does; 1 trains round r+1 from each worker's own state while round r is agreed.
    overlap: int = 0
    # With overlap, the share of a round's inner steps done before the previous round's
    # state arrives (1.0: at its end, a whole round of communication hidden).
    overlap_at: float = 1.0


@dataclass
class SimResult:
    config: SimConfig
    eval_loss: list[float] = field(default_factory=list)  # index 0: before round 1
    train_loss: list[float] = field(default_factory=list)  # mean inner loss per round
    bytes_per_worker: list[int] = field(default_factory=list)  # per round, one worker
    dense_fp32_bytes: int = 0  # 4 bytes x parameters: one dense pseudo-gradient
    round_seconds: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    state_roots: list[str] = field(default_factory=list)
    params: int = 0
    # Robust aggregation only, per round: "peer: reason" of each excluded update, and each
    # admitted update's cosine with the others' sum (training.outer.aggregate rule 4).
    excluded: list[list[str]] = field(default_factory=list)
    agreement: list[list[float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config.__dict__,
            "excluded": self.excluded,
            "agreement": self.agreement,
            "eval_loss": self.eval_loss,
            "train_loss": self.train_loss,
            "bytes_per_worker": self.bytes_per_worker,
            "dense_fp32_bytes": self.dense_fp32_bytes,
            "round_seconds": self.round_seconds,
            "wall_seconds": self.wall_seconds,
            "state_roots": self.state_roots,
            "params": self.params,
        }
