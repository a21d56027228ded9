"""What the blocking and trio faces of :mod:`training.outer.api` share: the checks before
step 0, the hand-off, the user's side of a round, and the worker's task."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.outer.api.driven import DrivenTrainers, InnerStep, check_step, peer_shard
from training.outer.api.handoff import Handoff, OuterLoopError
from training.outer.api.model import load_state, trainable
from training.outer.api.scoring import Scorer
from training.outer.api.user_trainer import LoopTrainer
from training.outer.spec import RunSpec, check_level, check_model

if TYPE_CHECKING:
    import torch

    from identity import Signer
    from training.outer.codec import F32
    from training.outer.loop import OuterState
    from training.outer.params import RunParams

# How long join() waits for the worker to hold a state: its start barrier (all K workers
# present) plus fetching S_0 or the tip.
JOIN_WAIT = 600.0


class Core:
    """What the blocking and trio faces share: checks, the hand-off, the user's side."""

    def __init__(
        self,
        *,
        spec: RunSpec,
        model: torch.nn.Module,
        rounds: int | None,
        eval_fn: Any,
        eval_rows: Any,
        bootstrap: Sequence[str] = (),
        level: str | None = None,
        inner_step: InnerStep | None = None,
        records: tuple[str, Any] | None = None,
        keep_states: int | None = None,
    ) -> None:
        from training.kernel_class import detect
        from training.outer.runs import params_from_spec

        shapes = {n: tuple(p.shape) for n, p in trainable(model).items()}
        check_model(spec, shapes)
        self.level = "scored" if eval_fn is not None else "bounded"
        self.driven: DrivenTrainers | None = None
        if inner_step is not None:
            check_step(spec, inner_step)
            assert records is not None
            data, tokens = records
            if data and data == spec.data:
                self.level = "replayed"
            self.driven = DrivenTrainers(model, inner_step, tokens)
        self.keep_states = keep_states
        if level is None:  # the group's rank 0 offers the level; other ranks follow it
            check_level(spec, self.level)
        self.spec = spec
        self.bootstrap = tuple(bootstrap)
        self.params = params_from_spec(spec, rounds=rounds)
        self.model = model
        first = next(iter(model.parameters()))
        self.device = first.device
        self.kernel_class = detect(self.device.type).id
        self.handoff = Handoff()
        scorer = None
        if eval_fn is not None:
            scorer = Scorer(copy.deepcopy(model), eval_fn, eval_rows, self.params, self.device)
        self.trainer = LoopTrainer(self.params, model, self.handoff, self.kernel_class, scorer)
        self.state: OuterState | None = None
        self.root = ""
        self.author = ""
        self.steps = 0
        self.losses: list[float] = []
        self.finished = False
        self.rounds_applied = 0
        self.result: dict[str, Any] | None = None
        self.join = False
        # Per round: (seconds of the user's H steps, seconds step() waited for the round
        # to close), for utilisation figures.
        self.timings: list[tuple[float, float]] = []
        self.adopted_at = 0.0
        self.steps_done_at = 0.0

    def adopt(self, timeout: float) -> bool:
        """Take the next posted state into the model; False when the run finished."""
        got = self.handoff.wait_state(timeout)
        if got is None:
            self.finished = True
            return False
        self.state, self.root = got
        load_state(self.model, self.state.params)
        self.adopted_at = time.monotonic()
        with self.handoff.cond:
            # The worker's final state, taken: this worker's rounds are over.
            self.finished = self.handoff.finished and self.handoff.taken
        self.steps = 0
        self.losses = []
        return True

    def count(self, loss: float | None) -> bool:
        """One inner step done; True when it was the H-th (the round's update is due)."""
        if self.finished:
            raise OuterLoopError(f"run {self.spec.run}: this worker's rounds are over")
        if self.state is None:
            raise OuterLoopError("call join() before the first step()")
        self.steps += 1
        if loss is not None:
            self.losses.append(float(loss))
        if self.steps < self.params.inner_steps:
            return False
        self.steps_done_at = time.monotonic()
        return True

    def send(self, current: dict[str, F32] | None = None) -> tuple[float, float]:
        """Post the round's update; returns when the round's steps began and when its
        H-th step ended (monotonic)."""
        assert self.state is not None
        trained = self.trainer.make(self.state, self.root, self.author, self.losses, current)
        self.handoff.post_trained(trained, self.root)
        return self.adopted_at, self.steps_done_at

    def timed(self, marks: tuple[float, float]) -> None:
        """Record the round's (compute, communication) seconds: the H steps alone, then
        everything from the H-th step's end until the next state is in the model (making
        the update, the round's closure, the apply, the copy into the model)."""
        began, done = marks
        self.timings.append((done - began, time.monotonic() - done))

    def config(
        self, store_root: Path, key_path: Path, cert_path: Path, result_path: Path | None
    ) -> Any:
        """The worker's configuration: S_0 and the run's peers from ``bootstrap``."""
        from identity import parse_public_key
        from training.outer.params import WorkerConfig

        trainer = self.trainer
        make_trainer: Callable[[RunParams, int], Any] = lambda params, shard: trainer  # noqa: E731
        shard = 0
        if self.driven is not None:
            make_trainer = self.driven
            shard = peer_shard(self.author)
        config = WorkerConfig(
            params=self.params,
            shard=shard,
            store_root=store_root,
            key_path=key_path,
            cert_path=cert_path,
            authorities=tuple(parse_public_key(a) for a in self.spec.authorities),
            result_path=result_path,
            initial=None if self.join else self.spec.initial,
            join=self.join,
            bootstrap=self.bootstrap,
            make_trainer=make_trainer,
            score=trainer.scorer,
            level=self.level,
            min_level=self.spec.level,
            require_hardware=self.spec.require_hardware,
        )
        if self.keep_states is not None:
            config = replace(config, keep_states=self.keep_states)
        return config

    def worker_done(self, result: dict[str, Any] | None, error: str | None) -> None:
        self.result = result
        # The final state: the tip the worker ends on, for the user's model.
        final = None if result is None else result.pop("final_state", None)
        self.handoff.end(error, final)


async def run_worker(
    core: Core, node: Any, signer: Signer, cert_path: Path, result_path: Path | None
) -> dict[str, Any]:
    """The worker's task in the node's loop (point 1)."""
    from identity import AdmissionCertificate, TrustStore
    from training.outer.memory import limit_heap_growth
    from training.outer.worker import Worker

    limit_heap_growth()  # flat RSS over a long run (training.outer.memory)

    store_root = Path(node.store.root)  # only for the config; the node holds the store
    config = core.config(store_root, Path("-"), cert_path, result_path)
    import trio

    raw = await trio.to_thread.run_sync(cert_path.read_bytes)
    certificate = AdmissionCertificate.decode(raw)
    trust = TrustStore(frozenset(config.authorities))
    if certificate.kernel_class != core.kernel_class:
        raise OuterLoopError(
            f"this process's kernel class is {core.kernel_class}, but its certificate admits "
            f"{certificate.kernel_class}; get a certificate for this one"
        )
    worker = Worker(config, node, signer, certificate, trust)
    result = await worker.run()
    if worker.state is not None:
        result["final_state"] = (worker.state, worker.root)
    return result


def load_spec(store: Any, ref: str) -> RunSpec:
    from training.outer.runs import read_spec

    return read_spec(store, ref)[1].spec
