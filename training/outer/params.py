"""What every worker of an outer-loop run is given: the run's parameters, one worker's
configuration, the errors that end a run, and the kernel class its workers run under.

:class:`RunParams` is what every worker must be given identically (run ID, K, rounds,
inner steps, deadline, proposer timeout, seed, codec and model size; the outer optimiser is
``MODE_DEFAULTS["sparseloco"]``). S_0 is made once, by the launcher, and named by its state
blob ID (``training.outer.state_blob``): nobody re-derives a random init.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blobstore.durable import write_file_atomic
from blobstore.exitcodes import ExitCode
from p2p.node.gossip import MAX_RUN_WORKERS
from training.errors import TrainingError
from training.outer.agreement import quorum_of
from training.outer.codec import CodecParams
from training.outer.loop import (
    MODE_DEFAULTS,
    OuterConfig,
)
from training.outer.messages import check_run_id
from training.outer.spec import MAX_OVERLAP
from training.outer.verification import Level

OUTER_MODE = "sparseloco"
DEFAULT_START_TIMEOUT = 300.0
# Certificates issued by the launcher start this early (clock skew) and last this long.
CERT_SKEW = 300
CERT_LIFETIME = 7 * 24 * 3600


class OuterNetError(TrainingError):
    """The run cannot go on: a bad setup (key, certificate, initial state) or a peer that
    never answered within its bound."""

    exit_code = ExitCode.REJECTED


class NoQuorum(OuterNetError):
    """Fewer of the run's workers than its quorum were present for the whole start timeout:
    the worker closed no round with them (a partition, or peers that never came)."""

    exit_code = ExitCode.NO_QUORUM


class OuterRunFailed(TrainingError):
    """A local run ended with workers that failed or roots that disagree."""

    exit_code = ExitCode.REJECTED


@dataclass(frozen=True)
class RunParams:
    """What every worker of a run must be given identically."""

    run_id: str
    workers: int
    rounds: int
    inner_steps: int
    deadline: float = 8.0
    proposer_timeout: float = 3.0
    seed: int = 0
    batch: int = 8
    seq_len: int = 64
    inner_lr: float = 2e-3
    chunk: int = 4096
    # 80 of 4096 values kept per chunk: what bench/outer.py tuned (157x fewer bytes than a
    # dense float32 update; bench/figures/outer-issue-18-grid.md).
    k: int = 80
    model_size: str = "tiny"
    shard_sequences: int = 512
    # Share of each round's updates that another worker replays (training.outer.replay):
    # at 0.25 each worker replays about a quarter of an update per round (a quarter of
    # its training compute) and a cheat in 8 rounds is caught with probability 0.9.
    replay_rate: float = 0.25
    # The least time a worker gives one fetch (a closure's blobs, a state blob) on top of
    # three deadlines: dials, stream opens and slow links. It also bounds how long a
    # finished worker lingers for a missing final root and how long one back from a pause
    # with nobody connected waits before it stops (training.outer.worker points 3 and 6).
    fetch_floor: float = 10.0
    # The outer optimiser and the error feedback's decay (None: MODE_DEFAULTS["sparseloco"]);
    # a run spec sets them.
    outer_lr: float | None = None
    outer_momentum: float | None = None
    feedback_decay: float | None = None
    # The distinct operators a closure must name (training.outer.agreement rule 7); 0: a
    # majority of ``workers``, so two groups that cannot hear each other never both close.
    quorum: int = 0
    # Rounds a worker trains ahead of the state its next update is taken against (0
    # blocks; 1: the one-step-delayed outer step, training.outer.trainer rule 5).
    overlap: int = 0

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.workers < 1 or self.rounds < 0 or self.inner_steps < 1 or self.deadline <= 0:
            raise ValueError("workers and inner steps must be >= 1, rounds >= 0, deadline > 0")
        if self.workers > MAX_RUN_WORKERS:
            raise ValueError(
                f"a run has at most {MAX_RUN_WORKERS} workers (p2p.node.gossip's limits)"
            )
        if self.proposer_timeout <= 0:
            raise ValueError("the proposer timeout must be > 0")
        if not 0.0 <= self.replay_rate <= 1.0:
            raise ValueError("the replay rate must be in [0, 1]")
        if not self.fetch_floor > 0:
            raise ValueError("the fetch floor must be > 0")
        if not 0 <= self.quorum <= self.workers:
            raise ValueError(f"the quorum must be 1..{self.workers} (K), or 0 for a majority")
        if not 0 <= self.overlap <= MAX_OVERLAP:
            raise ValueError(f"overlap must be 0..{MAX_OVERLAP} rounds")
        self.codec()

    @property
    def needed(self) -> int:
        """The distinct operators a round's closure must name (its quorum)."""
        return quorum_of(self.workers, self.quorum)

    def codec(self) -> CodecParams:
        return CodecParams(chunk=self.chunk, k=self.k)

    def outer_config(self) -> OuterConfig:
        mode = MODE_DEFAULTS[OUTER_MODE]
        lr = mode["outer_lr"] if self.outer_lr is None else self.outer_lr
        momentum = mode["outer_momentum"] if self.outer_momentum is None else self.outer_momentum
        return OuterConfig(lr=lr, momentum=momentum)

    @property
    def ef_decay(self) -> float:
        if self.feedback_decay is not None:
            return self.feedback_decay
        return MODE_DEFAULTS[OUTER_MODE]["ef_decay"]

    def shard_seed(self, shard: int) -> int:
        return self.seed * 1000 + 1 + shard


@dataclass(frozen=True)
class WorkerConfig:
    params: RunParams
    shard: int
    store_root: Path
    key_path: Path
    cert_path: Path
    authorities: tuple[bytes, ...]
    result_path: Path | None
    initial: str | None = None
    join: bool = False
    bootstrap: tuple[str, ...] = ()
    listen: str = "/ip4/127.0.0.1/tcp/0"
    addr_file: Path | None = None
    start_timeout: float = DEFAULT_START_TIMEOUT
    # Name the final state blob <this peer ID>/NAME at the end (p2p/names/NAMES.md).
    publish: str | None = None
    # Behind NAT: relays to reserve on when no relay can dial this worker back
    # (its own admission certificate is what the relays check), and whether a fetch may
    # cross a relay when hole punching to a NATed worker fails.
    relays: tuple[str, ...] = ()
    assume_private: bool = False
    relayed_fetch: bool = False
    # Builds the worker's trainer (and replay's, per replayed update) from the params and
    # the shard; None: the built-in tiny model on synthetic data (training.outer.trainer).
    make_trainer: Callable[[RunParams, int], Any] | None = None
    # Scores a candidate update before this worker proposes a closure naming it:
    # (S_r, root, author, update blob bytes) -> "" or the reason to leave it out
    # (training.outer.api point 4, the scored level).
    score: Callable[[Any, str, str, bytes], str] | None = None
    # The verification level this worker offers, named in each update's commitment
    # (training.outer.spec point 3): the built-in trainer's updates replay.
    level: Level = Level.REPLAYED
    # The least level an update may offer to be named in a closure this worker proposes
    # (the run spec's minimum; bounded: every update).
    min_level: Level = Level.BOUNDED
    # Accept only hardware-signed updates, closures, verdicts and final roots (the run
    # spec's require_hardware; training.outer.messages rule 7). This worker's own key must
    # then be TPM-bound and admitted on its TPM.
    require_hardware: bool = False
    # Rounds whose state blobs (and own inner-state blobs) the store keeps; older ones are
    # deleted (training.outer.runs point 4). 3: the tip, and two rounds for a replay of
    # the previous round's sample and a peer catching up from a slightly older state.
    keep_states: int = 3
    # Serve the node's metrics (p2p.metrics) at http://ADDR/metrics, as `serve --metrics`.
    metrics: str | None = None
    # A blob every worker of the run holds (the spec's): the worker asks its bootstrap
    # peers who else holds it (the rendezvous, training.outer.worker point 1). None: the
    # initial state's (a joiner without it has no rendezvous, its bootstrap peers only).
    rendezvous: str | None = None
    # Keep a resume point each round (training.outer.trainer), and start from the kept one:
    # its inner state, then a catch-up from the run's tip (--resume).
    keep_resume: bool = False
    resume: bool = False


def outer_kernel_class(device: str = "cpu", threads: int = 1) -> str:
    """The kernel class ID this process's workers run under: deterministic mode on
    ``device`` with ``threads`` torch threads (refused, never a fallback, where the device
    is missing)."""
    from training import determinism
    from training.kernel_class import detect

    determinism.enter(device, threads=threads)
    return detect(device).id


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON durably, replacing what was there (readers never see half)."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    write_file_atomic(path, data, replace=True, mode=0o644)
