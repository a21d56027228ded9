"""What the blocking and trio faces of :mod:`training.outer.api` share: the checks before
step 0, the hand-off, the user's side of a round, and the worker's task."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.outer.api.clock import LoopClock, RoundTiming
from training.outer.api.driven import DrivenTrainers, InnerStep, check_step, peer_shard
from training.outer.api.handoff import HANDOFF_WAIT, Handoff, OuterLoopError
from training.outer.api.model import UserModel
from training.outer.api.overlap import RoundEnd
from training.outer.api.resume import (
    check_optimizer,
    copy_optimizer,
    load_optimizer,
    read_checkpoint,
    write_checkpoint,
)
from training.outer.api.scoring import EvalBatches, Scorer
from training.outer.api.user_trainer import LoopTrainer
from training.outer.spec import RunSpec, check_level, check_model
from training.outer.verification import Level

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
        eval_data: Any,
        spec_blob: str = "",
        bootstrap: Sequence[str] = (),
        level: str | None = None,
        inner_step: InnerStep | None = None,
        records: tuple[str, Any] | None = None,
        keep_states: int | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        from training.outer.module_state import layout_of
        from training.outer.runs import params_from_spec

        if optimizer is not None:
            check_optimizer(optimizer)  # point 8: refused now, not at round 0's end
        self.optimizer = optimizer

        check_model(spec, layout_of(model))
        self.level = Level.SCORED if eval_fn is not None else Level.BOUNDED
        self.driven: DrivenTrainers | None = None
        if inner_step is not None:
            check_step(spec, inner_step)
            assert records is not None
            data, tokens = records
            if data and data == spec.data:
                self.level = Level.REPLAYED
            self.driven = DrivenTrainers(model, inner_step, tokens)
        self.keep_states = keep_states
        if level is None:  # the group's rank 0 offers the level; other ranks follow it
            check_level(spec, self.level)
        self.spec = spec
        self.spec_blob = spec_blob
        self.bootstrap = tuple(bootstrap)
        self.params = params_from_spec(spec, rounds=rounds)
        self.model = UserModel(model)
        first = next(iter(model.parameters()))
        self.device = first.device
        self.handoff = Handoff()
        scorer = None
        if eval_fn is not None:
            batches = EvalBatches(eval_data, self.params.batch, self.device)
            scorer = Scorer(model, eval_fn, batches, self.params)
        # Bounded and scored updates are never replayed, so this process's kernel class
        # binds nothing: the worker attests the one its certificate names (point 3).
        self.trainer = LoopTrainer(self.params, self.model, self.handoff, scorer)
        self.state: OuterState | None = None
        self.root = ""
        self.author = ""
        self.steps = 0
        self.losses: list[float] = []
        self.finished = False
        self.rounds_applied = 0
        self.result: dict[str, Any] | None = None
        self.join = False
        # Per round this loop took part in (point 9, training.outer.api.clock): its
        # compute, the seconds the user's loop spent in the loop's calls, and the seconds
        # of communication that overlapped compute; whether the call running ended a round.
        self.clock = LoopClock()
        self.ended = False
        self.adopted_at = 0.0
        self.steps_done_at = 0.0
        # Point 9, overlapped rounds: the round's end in flight (training.outer.api.overlap),
        # what the model's drift is taken against once a state was moved to, when the
        # round's end was started and its state taken, the overlap the round that ends
        # next reports, and the arrays the last round's end is done with (the next
        # round's copy goes into them).
        self.overlap = spec.overlap
        self.ending: RoundEnd | None = None
        self.base: tuple[dict[str, F32], dict[str, F32]] | None = None
        self.sent_at = 0.0
        self.arrived_at = 0.0
        self.overlapped = 0.0
        self.spare: dict[str, F32] | None = None

    @property
    def timings(self) -> list[RoundTiming]:
        return self.clock.rounds

    def enter(self) -> None:
        """Point 9: one of the loop's calls that may wait began (``LoopClock``)."""
        self.clock.enter(time.monotonic())

    def leave(self) -> None:
        """Point 9: the call entered last returned or raised; the round it ended, timed."""
        ended, self.ended = self.ended, False
        overlapped, self.overlapped = self.overlapped, 0.0
        self.clock.leave(time.monotonic(), ended, overlapped)

    @property
    def round(self) -> int:
        """The round the model's current state starts (-1 before join)."""
        return -1 if self.state is None else self.state.round

    def adopt(self, timeout: float) -> bool:
        """Take the next posted state into the model; False when the run finished."""
        got = self.handoff.wait_state(timeout)
        if got is None:
            self.finished = True
            return False
        self.state, self.root = got
        self.model.load(self.state)
        self.adopted_at = time.monotonic()
        if not self.clock.started:  # join: the first round's span begins
            self.clock.start(self.adopted_at)
        with self.handoff.cond:
            # The worker's final state, taken: this worker's rounds are over.
            self.finished = self.handoff.finished and self.handoff.taken
        self.steps = 0
        self.losses = []
        return True

    @property
    def in_flight(self) -> bool:
        """Point 9: a round's end runs behind the user's steps."""
        return self.ending is not None

    def poll(self) -> None:
        """Point 9, at a step boundary: take a state that has come, never waiting."""
        if not self.overlap:
            return
        if self.ending is not None:
            if self.ending.done.is_set():
                self.take_end(0.0)
        elif self.base is not None:  # a state posted after the one moved to
            got = self.handoff.poll_state()
            if got is not None:
                self.move_to(got)
            elif self.handoff.finished:
                self.finished = True

    def take_end(self, timeout: float) -> None:
        """Point 9: once the round's end has ended (waiting at most ``timeout``), its state
        into the model (its shift added, or the run's final state whole)."""
        assert self.ending is not None
        got = self.ending.result(timeout)
        ending, self.ending = self.ending, None
        self.arrived_at = ending.arrived_at
        if got is None:
            self.finished = True
            return
        state, root = got
        if ending.final:  # the run's end holds no drift
            self.model.load(state)
            self.finished = True
        else:
            self.model.add(ending.snapshot)  # S_{r+1} - E_r (overlap point 2)
        self.spare = ending.snapshot[0]  # the thread is done with it
        self.state, self.root = state, root
        self.base = (state.params, state.buffers)

    def move_to(self, got: tuple[OuterState, str]) -> None:
        """Point 9: a state posted after the one the model moved to (that one's closure
        was beaten): the model holds ``got``'s state plus its drift since the base; the
        run's final state replaces it whole (the run's end holds no drift)."""
        state, root = got
        with self.handoff.cond:
            final = self.handoff.finished and self.handoff.taken
        assert self.base is not None
        if final:
            self.model.load(state)
            self.finished = True
        else:
            self.model.shift(state, self.base)
        self.state, self.root = state, root
        self.base = (state.params, state.buffers)

    def wait_base(self) -> None:
        """Point 9: this round's update is due and the state it is taken against has not
        come (the overlap allowed is used up): wait for the round's end."""
        self.take_end(HANDOFF_WAIT)

    def launch(self, store: Any) -> None:
        """Point 9: the round's H steps are done: copy the model (and the inner optimizer's
        state), start the round's end behind the user's steps and train on at once."""
        state, root, losses, author = self.state, self.root, self.losses, self.author
        assert state is not None
        snapshot = self.model.snapshot(into=self.spare)
        self.spare = None
        saved = None if self.optimizer is None else copy_optimizer(self.optimizer)
        params, buffers = snapshot
        trainer, run = self.trainer, self.spec.run
        self.ending = RoundEnd(
            self.handoff,
            root,
            make=lambda: trainer.make(state, root, author, losses, params, buffers),
            keep=lambda: write_checkpoint(
                store,
                run=run,
                peer=author,
                round_=state.round,
                residual=trainer.feedback.residual,
                optimizer=saved,
            ),
            snapshot=snapshot,
        )
        self.ending.start()
        if self.sent_at:
            self.overlapped = max(0.0, min(self.arrived_at, self.steps_done_at) - self.sent_at)
        self.ended = True
        self.sent_at = self.adopted_at = time.monotonic()
        self.arrived_at = 0.0
        self.steps = 0
        self.losses = []

    def close(self) -> None:
        """The round's end in flight, if any, ends (the hand-off is closed first)."""
        if self.ending is not None:
            self.ending.join(60)

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

    def send(self, current: dict[str, F32] | None = None) -> None:
        """Post the round's update."""
        assert self.state is not None
        trained = self.trainer.make(self.state, self.root, self.author, self.losses, current)
        self.handoff.post_trained(trained, self.root)
        self.ended = True

    def skip(self) -> None:
        """Point 8: this round sends nothing (the worker takes the round's result)."""
        if self.state is None:
            raise OuterLoopError("call join() before skip()")
        if self.finished:
            raise OuterLoopError(f"run {self.spec.run}: this worker's rounds are over")
        self.steps_done_at = time.monotonic()
        self.handoff.post_trained(None, self.root)
        self.ended = True

    def restore(self) -> None:
        """Point 8: the round's start state back into the model, its steps from 0."""
        if self.state is None:
            raise OuterLoopError("call join() before restore()")
        self.model.load(self.state)
        self.steps = 0
        self.losses = []

    def keep(self, store: Any) -> None:
        """Point 8: this worker's checkpoint of the update just sent (its residual, the
        inner optimizer's state, the round), while the round is agreed."""
        assert self.state is not None
        write_checkpoint(
            store,
            run=self.spec.run,
            peer=self.author,
            round_=self.state.round,
            residual=self.trainer.feedback.residual,
            optimizer=self.optimizer,
        )

    def resume_from(self, store: Any) -> None:
        """Point 8: take this worker's checkpoint back, and join from the run's tip; with
        none in the store, start as a new worker (saying so)."""
        import sys

        saved = read_checkpoint(
            store, run=self.spec.run, peer=self.author, shapes=self.model.layout.trainable
        )
        if saved is None:
            print(
                f"outer: no resume checkpoint of run {self.spec.run} in this store; "
                "starting as a new worker",
                file=sys.stderr,
            )
            return
        if saved.optimizer is not None:
            if self.optimizer is None:
                raise OuterLoopError(
                    "the resume checkpoint holds an inner optimizer's state: give the loop "
                    "inner_optimizer= to take it back"
                )
            load_optimizer(self.optimizer, saved.optimizer, self.spec.run)
        self.trainer.feedback.residual = saved.residual
        self.join = True
        print(
            f"outer: resuming run {self.spec.run} after round {saved.round}'s update "
            f"(residual{', inner optimizer' if saved.optimizer is not None else ''}); "
            "joining from the run's tip",
            file=sys.stderr,
        )

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
            # Workers meet through who holds the spec (a joiner holds no initial state).
            rendezvous=self.spec_blob or None,
            make_trainer=make_trainer,
            score=trainer.scorer,
            level=self.level,
            min_level=self.spec.level,
            require_hardware=self.spec.require_hardware,
        )
        if self.keep_states is not None:
            config = replace(config, keep_states=self.keep_states)
        return config

    def load_fixed(self, fixed: dict[str, Any]) -> None:
        """The run's fixed tensors (``training.outer.module_state`` point 1), into the
        user's model and every copy the library scores or replays on."""
        self.model.load_fixed(fixed)
        scorer = self.trainer.scorer
        if scorer is not None:
            scorer.model.load_fixed(fixed)
        if self.driven is not None:
            self.driven.load_fixed(fixed)

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
    from training.outer.worker.driver import Worker

    limit_heap_growth()  # flat RSS over a long run (training.outer.memory)

    store_root = Path(node.store.root)  # only for the config; the node holds the store
    config = core.config(store_root, Path("-"), cert_path, result_path)
    import trio

    raw = await trio.to_thread.run_sync(cert_path.read_bytes)
    certificate = AdmissionCertificate.decode(raw)
    trust = TrustStore(frozenset(config.authorities))
    core.trainer.kernel_class = certificate.kernel_class  # point 3: bounded and scored
    await keep_spec(core, node)
    if core.spec.fixed_blob:
        core.load_fixed(await fetch_fixed(core, node))
    worker = Worker(config, node, signer, certificate, trust)
    result = await worker.run()
    if worker.state is not None:
        result["final_state"] = (worker.state, worker.root)
    return result


async def keep_spec(core: Core, node: Any) -> None:
    """Tag the run's spec in this store, as ``blob outer init`` did in the maker's: the
    commands that take a run ID find it, and ``blob gc`` keeps it."""
    import trio

    from training.outer.runs import keep_spec_blob

    await trio.to_thread.run_sync(keep_spec_blob, node.store, core.spec, core.spec_blob)


async def fetch_fixed(core: Core, node: Any) -> dict[str, Any]:
    """The run's fixed tensors (the spec's ``fixed_blob``), fetched from the run's peers
    where this store lacks them, checked against the spec, and tagged with the run."""
    import trio

    from training.outer.milestones import tag
    from training.outer.module_state import decode_fixed

    blob = core.spec.fixed_blob
    if not await trio.to_thread.run_sync(node.store.has, blob):
        with trio.move_on_after(JOIN_WAIT):
            await node.fetch(blob, providers=list(core.bootstrap), announce=False)
        if not await trio.to_thread.run_sync(node.store.has, blob):
            raise OuterLoopError(f"could not fetch run {core.spec.run}'s fixed tensors {blob}")
    await trio.to_thread.run_sync(node.store.tag, tag(core.spec.run, "fixed"), blob)
    data = await trio.to_thread.run_sync(lambda: node.store.path(blob).read_bytes())
    return decode_fixed(data, core.spec.layout().fixed)


def wants_fetch(store: Any, ref: str, bootstrap: Sequence[str]) -> bool:
    """A spec named by its blob ID that the store lacks, with peers to fetch it from."""
    from blobstore import StoreError

    if not bootstrap or len(ref) != 64 or ref in store.tags():
        return False
    try:
        return not store.has(ref)
    except (StoreError, ValueError):  # not a blob ID after all
        return False


def load_spec(store: Any, ref: str) -> tuple[str, RunSpec]:
    """(spec blob ID, spec) of a spec this store holds, by blob ID, tag or run ID."""
    from training.outer.runs import read_spec

    blob, signed = read_spec(store, ref)
    return blob, signed.spec
