"""The outer loop as a library around the user's own model and training loop.

::

    model = MyModel(); opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    with (
        BlockingNode(store, key_path=KEY, bootstrap=[...], pubsub=True, dht=False) as node,
        OuterLoop(node, spec=SPEC_ID, model=model, certificate=CERT, rounds=10) as loop,
    ):
        loop.join()                  # adopt the run's state (S_0, or the tip when joining)
        for batch in loader:
            loss_fn(model(batch)).backward(); opt.step(); opt.zero_grad()
            loop.step()              # every H steps: update out, closure agreed, applied
            if loop.finished:
                break

From trio, ``async with open_outer_loop(node, key=KEY, spec=..., ...) as loop`` with
``await loop.join()`` and ``await loop.step()``.

At the ``replayed`` level the library drives the inner steps itself (point 7)::

    STEP = InnerStep("tinylm-next-token/v1", lambda model, batch: loss_of(model, batch))
    with OuterLoop(node, spec=SPEC_ID, model=model, certificate=CERT, rounds=10,
                   inner_step=STEP, data=RECORDS) as loop:
        result = loop.run()          # every round: H steps on committed rows, replayable

Theory of operation
-------------------
1. **Two threads, one hand-off.** The worker (``training.outer.worker``: gossip, agreement,
   aggregation, replay verdicts) runs as a task in the node's trio loop; the user's loop
   runs in the user's thread. They meet in a :class:`_Handoff`: for each round the worker
   posts the state S_r it starts from and waits for an update; the user's ``step()``
   counts inner steps and at the H-th builds the update from S_r (pseudo-gradient
   S_r - model in float32, SparseLoCo with error feedback), posts it, and waits for the
   next state, which it copies into the model's parameters in place. The worker posts
   S_{r+1} as soon as it has computed it and checked its root against the closure, ahead
   of keeping its state blob and signing its milestone, which then overlap the user's
   next steps; should that state not be adopted after all (its closure bad or beaten),
   the update made from it is dropped and the adopted state posted. When the worker
   leaves (its rounds are done) it posts the final state and ``finished`` turns true.
2. **The user's things stay the user's.** Parameters stay on their device and dtype
   (float32 or bfloat16; CPU or CUDA: the CUDA path is this same code, tested on CPU);
   the inner optimizer is never touched (DiLoCo keeps it across rounds); torch threads are
   as the user set them. The outer state (parameters, momentum, residual) stays in host
   memory as float32. A bfloat16 model's pseudo-gradient includes the rounding of S_r to
   bfloat16; error feedback carries it to the next round.
3. **Refused before step 0**, in one line: a model whose trainable parameters differ from
   the spec's names and shapes; a worker offering less verification than the spec's
   minimum; a certificate for another kernel class than this process's.
4. **Verification levels** (``training.outer.spec`` point 3). ``bounded``: the library
   does not drive the loop, so nothing is replayed; every update is held to the norm and
   direction rules of ``training.outer.aggregate``. ``scored``: with ``eval_fn(model,
   batch) -> loss`` and evaluation rows (an int64 array or a records blob), the proposer
   of each closure scores every candidate update by the loss change it makes alone on
   :data:`SCORE_ROWS` rows drawn from the round's root (Templar's Gauntlet), on a copy of
   the model, and leaves out an update that makes the loss worse, with that reason.
   ``replayed`` is offered by workers the library drives (``blob outer worker --spec
   --data``): a sample of their updates is recomputed from the rows they commit to.
5. **Bounds.** Every wait of the hand-off is bounded (:data:`HANDOFF_WAIT`); the worker's
   own waits are its own (``training.outer.worker``). A loop closed while the worker waits
   ends the worker with an error, not a hang.
6. **A worker that is a torch.distributed group** of replicas (DDP within a node): rank 0
   holds the node and is the run's one peer; every rank counts its steps, and at each
   round's end (and at join) rank 0's parameters, which hold the applied state, are
   broadcast over the group, with whether the run finished. Every rank is left with the
   same state. A model sharded over the group (FSDP2, ``torch.distributed.fsdp.fully_shard``,
   whose parameters are DTensors on a mesh of the group's ranks) is gathered instead: at a
   round's end every rank takes part in ``full_tensor()`` per parameter (in name order) so
   rank 0 holds the whole model for the update, and the applied state is scattered back
   from rank 0 (``distribute_tensor``), each rank keeping its shard. Memory on rank 0 is
   then the whole model in float32 at the round's end, as for an unsharded worker.
7. **The replayed level** (``inner_step`` and ``data``). Replay needs the rows, the inner
   optimizer's state and the step itself, so the library runs the round: an
   :class:`InnerStep` (a name and ``fn(model, batch) -> loss``) on batches of rows of the
   records blob ``data``, drawn by the worker's sampler and written into its update's
   commitment, with the library's own inner AdamW (the spec's ``inner_lr``, kept across
   rounds; ``inner_optimizer`` is not used) and the causal-LM recipe's clipping
   (``training.outer.trainer``). ``run()`` takes part in the worker's rounds and leaves the
   final state in the model. The spec names the step (``RunSpec.step``); a worker whose
   step has another name is refused before step 0. Other workers replay a sampled update
   with *their own* function of that name on a fresh copy of *their own* model (made when
   the loop is, before any training), so every worker of the run must run the same model
   class and step function under that name, with the same buffers and frozen parameters;
   an author whose function differs (a cheat or a bug) fails replay like any mismatch.
   Records other than the spec's ``data`` offer ``bounded``. Not with a ``group``; the
   blocking face only (``open_outer_loop`` takes no ``inner_step``). The store must hold
   the records blob (fetch it by ID first, as the spec).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import blake3
import numpy as np

from blobstore.canonical import encode as encode_canonical
from blobstore.errors import ExitCode
from training.errors import TrainingError
from training.outer.spec import RunSpec, check_level, check_model

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor

    from identity import MachineKey, Signer
    from training.outer.codec import F32
    from training.outer.loop import OuterState
    from training.outer.params import RunParams
    from training.outer.trainer import Trained

# The longest the worker waits for the user's H inner steps, and the user's step() for
# the round to close: a day covers a 70B model's round on slow links; past it the
# other side is taken for dead.
HANDOFF_WAIT = 24 * 3600.0
# Rows an update is scored on (point 4): enough that one row's noise does not decide, few
# enough that scoring K updates costs a proposer about K small forward passes.
SCORE_ROWS = 8
# How long join() waits for the worker to hold a state: its start barrier (all K workers
# present) plus fetching S_0 or the tip.
JOIN_WAIT = 600.0


@dataclass(frozen=True)
class InnerStep:
    """Point 7: the user's inner step, named as the run spec's ``step`` names it.
    ``fn(model, batch) -> loss`` (a scalar tensor), ``batch`` an int64 tensor of rows
    (batch x sequence length) of the run's records on the model's device; the library
    calls ``backward()`` and the optimizer."""

    name: str
    fn: Callable[[Any, Any], Any]


class OuterLoopError(TrainingError):
    """The outer loop cannot go on (the worker failed, the run ended, a bound passed)."""

    exit_code = ExitCode.REJECTED


def _describe(exc: BaseException) -> str:
    """One line for the user's thread: the one exception inside nested trio groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


class _Closed(Exception):
    pass


class _Handoff:
    """Point 1: the state the worker posts and the update the user posts, under one lock."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.state: tuple[OuterState, str] | None = None
        self.taken = True  # the posted state was taken by the user
        self.trained: tuple[Trained, str] | None = None
        self.finished = False
        self.error: str | None = None
        self.closed = False

    def post_state(self, state: OuterState, root: str) -> None:
        """Offer ``state`` to the user's loop, once: a state of the root posted last (ahead
        of its adoption, then for its round) is not taken twice."""
        with self.cond:
            if self.state is not None and self.state[1] == root:
                return
            self.state, self.taken = (state, root), False
            self.cond.notify_all()

    def wait_state(self, timeout: float) -> tuple[OuterState, str] | None:
        """The next state not yet taken (None: the run finished)."""
        give_up = time.monotonic() + timeout
        with self.cond:
            while self.taken and not self.finished and self.error is None:
                left = give_up - time.monotonic()
                if left <= 0:
                    raise OuterLoopError(f"no outer state within {timeout:.0f}s")
                self.cond.wait(left)
            if self.error is not None:
                raise OuterLoopError(f"the outer-loop worker stopped: {self.error}")
            if self.taken:
                return None
            assert self.state is not None
            self.taken = True
            return self.state

    def post_trained(self, trained: Trained, root: str) -> None:
        """The user's update, made from the state of root ``root``."""
        with self.cond:
            self.trained = (trained, root)
            self.cond.notify_all()

    def wait_trained(self, timeout: float, root: str) -> Trained:
        """The user's update from the state of root ``root``; one from another state (one
        posted ahead that the worker did not adopt) is for nobody, and dropped."""
        give_up = time.monotonic() + timeout
        with self.cond:
            while True:
                if self.trained is not None:
                    (trained, made_from), self.trained = self.trained, None
                    if made_from == root:
                        return trained
                    continue
                if self.closed:
                    raise _Closed
                left = give_up - time.monotonic()
                if left <= 0:
                    raise OuterLoopError(f"the user's loop sent no update within {timeout:.0f}s")
                self.cond.wait(left)

    def end(self, error: str | None, final: tuple[OuterState, str] | None = None) -> None:
        """The worker left: its final state (if any) is the last one posted."""
        with self.cond:
            if final is not None:
                self.state, self.taken = final, False
            self.finished = True
            self.error = error
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def model_views(model: torch.nn.Module) -> dict[str, F32]:
    """The model's trainable parameters as float32 host arrays (any dtype, any device):
    views where a parameter already is a contiguous CPU float32 tensor, so for a caller
    that reads them before the model next changes (``LoopTrainer.make``, inside the
    user's ``step()``)."""
    import torch

    out = {}
    for name, p in _trainable(model).items():
        t = p.detach().to("cpu", torch.float32)  # a new tensor unless already CPU float32
        out[name] = t.contiguous().numpy()
    return out


def load_state(model: torch.nn.Module, params: dict[str, F32]) -> None:
    """Copy ``params`` into the model's parameters in place (cast to their dtype/device);
    sharded parameters are left to the group's scatter (point 6)."""
    import torch

    with torch.no_grad():
        for name, p in _trainable(model).items():
            if not _is_sharded(p):
                p.copy_(torch.from_numpy(params[name]))


def _is_sharded(p: Any) -> TypeGuard[DTensor]:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def gathered_state(model: torch.nn.Module) -> dict[str, F32]:
    """Point 6: ``model_views`` of a model sharded over a group, whole (copies); every
    rank of the group calls it (one all-gather per sharded parameter, in name order)."""
    import torch

    out = {}
    for name, p in sorted(_trainable(model).items()):
        whole = p.full_tensor() if _is_sharded(p) else p
        out[name] = whole.detach().to("cpu", torch.float32).numpy().copy()
    return out


class LoopTrainer:
    """The worker's trainer for a loop the library does not drive (point 1): ``train``
    runs in a worker thread of the node's loop and waits for the user's update."""

    def __init__(
        self,
        params: RunParams,
        model: torch.nn.Module,
        handoff: _Handoff,
        kernel_class: str,
        scorer: _Scorer | None,
    ) -> None:
        from training.outer.codec import ErrorFeedback
        from training.outer.inner import encode_inner

        self.params = params
        self.model = model
        self.handoff = handoff
        self.kernel_class = kernel_class
        self.scorer = scorer
        self.feedback = ErrorFeedback(params.codec(), decay=params.ef_decay, schema_ref=True)
        self.names = list(_trainable(model))
        self.no_inner = encode_inner([None] * len(self.names), {})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in _trainable(self.model).items()}

    def ready(self, state: OuterState, root: str) -> None:
        """The worker's next state, ahead of its adoption (``WorkerState._offer``): the
        user's loop may take it and start the round now."""
        self.handoff.post_state(state, root)

    def train(self, state: OuterState, root: str, author: str, *, cheat: bool = False) -> Trained:
        self.handoff.post_state(state, root)
        try:
            return self.handoff.wait_trained(HANDOFF_WAIT, root)
        except _Closed:
            raise OuterLoopError("the training loop was closed mid-round") from None

    def make(
        self,
        state: OuterState,
        root: str,
        author: str,
        losses: list[float],
        current: dict[str, F32] | None = None,
    ) -> Trained:
        """The user's side of a round's end: the update from S_r to the model now
        (``current``: its parameters, where the caller gathered them)."""
        from training.outer.aggregate import wrap_update
        from training.outer.loop import make_update
        from training.outer.trainer import Trained

        # Read in place: the user's loop waits in step() until the update is made.
        now = model_views(self.model) if current is None else current
        payload = make_update(state.params, now, self.feedback)
        update = wrap_update(payload, round_=state.round, start_root=root, author=author)
        # A loop the library does not drive commits to no rows (zeros) and no inner state:
        # its updates are never sampled for replay (the run's replay rate is 0 below the
        # replayed level), and the residual is the model's size: encoding it twice,
        # hashing it and storing it would be a round's largest cost after the apply.
        rows = np.zeros((self.params.inner_steps, self.params.batch), dtype=np.int64)
        padded = (losses + [float("nan")] * self.params.inner_steps)[: self.params.inner_steps]
        return Trained(update, padded, rows, self.no_inner, self.no_inner)


@dataclass
class _Scorer:
    """Point 4: the loss change one update makes alone on rows drawn from the round's root."""

    model: torch.nn.Module
    eval_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    rows: np.ndarray[Any, np.dtype[np.int64]]
    params: RunParams
    device: Any

    def batch(self, root: str) -> torch.Tensor:
        import torch

        seed = int.from_bytes(blake3.blake3(bytes.fromhex(root)).digest()[:8], "little")
        pick = np.random.default_rng(seed).integers(0, self.rows.shape[0], size=SCORE_ROWS)
        return torch.from_numpy(self.rows[pick]).to(self.device)

    def loss(self, params: dict[str, F32], batch: torch.Tensor) -> float:
        import torch

        load_state(self.model, params)
        self.model.eval()  # no dropout: a score must not draw from the user's generator
        with torch.no_grad():
            return float(self.eval_fn(self.model, batch))

    def __call__(self, state: OuterState, root: str, peer: str, update: bytes) -> str:
        """'' if the update alone does not make the loss worse, else the reason."""
        from training.outer.aggregate import unwrap_update
        from training.outer.codec import CodecError
        from training.outer.loop import apply_round, decode_update

        try:
            grad = decode_update(unwrap_update(update).payload, state)
        except CodecError as exc:
            return f"unscorable: {exc}"
        batch = self.batch(root)
        before = self.loss(state.params, batch)
        after = self.loss(
            apply_round(state, {peer: grad}, self.params.outer_config()).params, batch
        )
        if not after <= before:
            return f"scored worse: eval loss {before:.4f} -> {after:.4f} on the round's rows"
        return ""


def _eval_rows(node_store: Any, eval_data: Any) -> np.ndarray[Any, np.dtype[np.int64]]:
    if isinstance(eval_data, np.ndarray):
        return eval_data.astype(np.int64)
    from training.records import decode_records

    return decode_records(node_store.path(eval_data).read_bytes()).tokens


class _Core:
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

        shapes = {n: tuple(p.shape) for n, p in _trainable(model).items()}
        check_model(spec, shapes)
        self.level = "scored" if eval_fn is not None else "bounded"
        self.driven: _DrivenTrainers | None = None
        if inner_step is not None:
            check_step(spec, inner_step)
            assert records is not None
            data, tokens = records
            if data and data == spec.data:
                self.level = "replayed"
            self.driven = _DrivenTrainers(model, inner_step, tokens)
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
        self.handoff = _Handoff()
        scorer = None
        if eval_fn is not None:
            scorer = _Scorer(copy.deepcopy(model), eval_fn, eval_rows, self.params, self.device)
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


def check_step(spec: RunSpec, step: InnerStep) -> None:
    """Point 7: refuse a step the spec does not name, before step 0."""
    from training.outer.spec import LevelRefused

    if not spec.step:
        raise LevelRefused(
            f"run {spec.run} names no inner step (its replays run the built-in causal-LM "
            f"step): make the run with step={step.name!r} to drive it with InnerStep"
        )
    if step.name != spec.step:
        raise LevelRefused(
            f"run {spec.run} replays the inner step {spec.step!r}; this worker's InnerStep "
            f"is {step.name!r}"
        )


def peer_shard(peer: str) -> int:
    """A worker's shard (its sampler's stream) from its peer ID, as the CLI worker's."""
    return int.from_bytes(blake3.blake3(peer.encode()).digest()[:4], "little") % (1 << 20)


class _DrivenTrainers:
    """Point 7: the worker's trainer trains the user's model; each replay's trains a
    fresh copy of it as it was when the loop was made."""

    def __init__(self, model: torch.nn.Module, step: InnerStep, tokens: Any) -> None:
        import torch

        self.model = model
        self.template = copy.deepcopy(model)
        self.step = step
        self.tokens = tokens
        self.device = next(iter(model.parameters())).device.type
        self.threads = torch.get_num_threads()
        self.lock = threading.Lock()
        self.given = False

    def __call__(self, params: RunParams, shard: int) -> Any:
        from training.outer.trainer import Trainer

        with self.lock:
            model, self.given = (copy.deepcopy(self.template) if self.given else self.model), True
        return Trainer(
            params,
            shard,
            model=model,
            tokens=self.tokens,
            device=self.device,
            threads=self.threads,
            step_fn=self.step.fn,
        )


async def _run_worker(
    core: _Core, node: Any, signer: Signer, cert_path: Path, result_path: Path | None
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


def _share_spec(spec: RunSpec | None, group: Any) -> RunSpec:
    """Point 6: rank 0's spec, to every rank of the group (checked there like any spec)."""
    import torch.distributed as dist

    from training.outer.spec import decode_body

    box = [None if spec is None else msgpack_body(spec)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    assert isinstance(box[0], bytes)
    return decode_body(box[0])


def msgpack_body(spec: RunSpec) -> bytes:
    """The spec's canonical body, as ranks exchange it."""
    return encode_canonical(spec.body())


def _records(store: Any, spec: RunSpec, data: str | None) -> tuple[str, Any]:
    """Point 7: (records blob ID, its int64 rows) of ``data`` (default: the spec's)."""
    from training.outer.runs import RunNotFound
    from training.records import decode_records

    ref = data or spec.data
    if not ref:
        raise RunNotFound(f"run {spec.run} names no records: give data=RECORDS")
    from blobstore import StoreError

    blob = store.tags().get(ref, ref)
    try:
        held = store.has(blob)
    except (StoreError, ValueError):  # not a blob ID
        held = False
    if not held:
        raise RunNotFound(f"this store lacks the records blob {ref}: fetch it first")
    return blob, decode_records(store.path(blob).read_bytes()).tokens


def _load_spec(store: Any, ref: str) -> RunSpec:
    from training.outer.runs import read_spec

    return read_spec(store, ref)[1].spec


class OuterLoop:
    """The blocking face (module doc): a worker of the run ``spec`` around ``model``.

    ``node``: a started ``p2p.BlockingNode`` made with ``pubsub=True`` and the machine key
    ``key_path`` its certificate admits; ``spec``: the run spec's ID (or tag) in the node's
    store (fetch it first to join by ID from peers); ``certificate``: the admission
    certificate file; ``rounds``: rounds to take part in (an open-ended run needs it);
    ``eval_fn`` and ``eval_data`` (an int64 row array or a records blob ID) offer the
    ``scored`` level; ``bootstrap``: peers of the run (multiaddrs) to fetch S_0 from and
    dial; ``result_path``: where the worker writes its result JSON.
    ``inner_optimizer`` is accepted for symmetry with other wrappers and never touched.
    ``late``: join a run already under way (catch up from its tip, not S_0).
    ``group``: the ``torch.distributed`` group this worker's replicas form (point 6); its
    ranks other than 0 pass ``node=None``.
    ``inner_step`` (an :class:`InnerStep`) and ``data`` (a records blob ID or tag; default
    the spec's): the library drives the inner steps and the worker offers ``replayed``
    (point 7); call :meth:`run` instead of ``join()`` and ``step()``.
    ``keep_states``: how many rounds' state blobs the worker's store keeps (older ones
    are deleted; ``training.outer.worker`` point 5).
    """

    def __init__(
        self,
        node: Any,
        *,
        spec: str,
        model: torch.nn.Module,
        certificate: str | Path,
        inner_optimizer: Any = None,
        rounds: int | None = None,
        eval_fn: Callable[[Any, Any], Any] | None = None,
        eval_data: Any = None,
        bootstrap: Sequence[str] = (),
        result_path: str | Path | None = None,
        group: Any = None,
        late: bool = False,
        inner_step: InnerStep | None = None,
        data: str | None = None,
        keep_states: int | None = None,
    ) -> None:
        self._group = group
        self._rank = 0
        if group is not None:
            import torch.distributed as dist

            self._rank = dist.get_rank(group)
        if self._rank == 0 and (node is None or node.key_path is None):
            raise OuterLoopError("the node needs a machine key file (BlockingNode key_path)")
        store = node.store if self._rank == 0 else None
        run_spec = _load_spec(store, spec) if self._rank == 0 else None
        if group is not None:
            run_spec = _share_spec(run_spec, group)
        assert run_spec is not None
        rows = _eval_rows(store, eval_data) if eval_fn is not None and self._rank == 0 else None
        records = None
        if inner_step is not None:
            if group is not None:
                raise OuterLoopError("a loop the library drives (inner_step) is one process")
            records = _records(store, run_spec, data)
        self._core = _Core(
            spec=run_spec,
            model=model,
            rounds=rounds,
            eval_fn=eval_fn if self._rank == 0 else None,
            eval_rows=rows,
            bootstrap=bootstrap,
            level=None if self._rank == 0 else "group",
            inner_step=inner_step,
            records=records,
            keep_states=keep_states,
        )
        self._core.join = late
        self._sharded = any(_is_sharded(p) for p in _trainable(model).values())
        if self._sharded and (group is None or eval_fn is not None):
            raise OuterLoopError(
                "a sharded (FSDP) model needs group= (its ranks gather it) and is not scored"
            )
        self._node = node
        self._cert = Path(certificate)
        self._result_path = Path(result_path) if result_path is not None else None
        self._thread: threading.Thread | None = None
        self.inner_optimizer = inner_optimizer

    @property
    def level(self) -> str:
        return self._core.level

    @property
    def round(self) -> int:
        """The round the model's current state starts (its number of applied rounds)."""
        state = self._core.state
        return -1 if state is None else state.round

    @property
    def finished(self) -> bool:
        return self._core.finished

    @property
    def result(self) -> dict[str, Any] | None:
        """The worker's result (rounds, roots, verdicts) once it finished."""
        return self._core.result

    @property
    def timings(self) -> list[tuple[float, float]]:
        """Per round this loop took part in: (seconds of its H steps, seconds from the
        H-th step's end until the next state was in the model: the update made, the round
        closed and applied)."""
        return self._core.timings

    def __enter__(self) -> OuterLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, timeout: float = HANDOFF_WAIT) -> dict[str, Any]:
        """Point 7: take part in the run's rounds, the library driving the inner steps;
        returns the worker's result, with the final state in the model."""
        core = self._core
        if core.driven is None:
            raise OuterLoopError("this loop's inner steps are the user's: join() and step()")
        self._spawn()
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise OuterLoopError(f"run {core.spec.run} did not end within {timeout:.0f}s")
        with core.handoff.cond:
            error, final = core.handoff.error, core.handoff.state
        if error is not None:
            raise OuterLoopError(f"the outer-loop worker stopped: {error}")
        if final is not None:
            core.state, core.root = final
            load_state(core.model, final[0].params)
        core.finished = True
        assert core.result is not None
        return core.result

    def join(self, timeout: float = JOIN_WAIT) -> None:
        """Start the worker and copy the run's state into the model (S_0, or the tip)."""
        if self._core.driven is not None:
            raise OuterLoopError("the library drives this loop's inner steps: call run()")
        if self._rank != 0:
            self._sync()  # point 6: rank 0's adopted state, to every rank
            return
        self._start(timeout)
        if self._group is not None:
            self._sync()

    def _start(self, timeout: float) -> None:
        self._spawn()
        if not self._core.adopt(timeout):
            raise OuterLoopError(f"run {self._core.spec.run} ended before this worker joined")

    def _spawn(self) -> None:
        from identity import load_key_file, machine_signer

        key = load_key_file(self._node.key_path)
        signer = machine_signer(key, self._node.key_path)  # TPM-backed where bound
        self._core.author = key.peer_id
        core, node, cert, out = self._core, self._node, self._cert, self._result_path

        def main() -> None:
            try:
                result = node.call(_run_worker, core, node.node, signer, cert, out)
            except BaseException as exc:  # reported to the user's thread by the hand-off
                core.worker_done(None, _describe(exc))
            else:
                core.worker_done(result, None)

        self._thread = threading.Thread(target=main, name="blobnet-outer", daemon=True)
        self._thread.start()

    def step(self, loss: float | None = None) -> bool:
        """After each inner step (``loss``: optional, recorded as the round's mean loss).
        At the H-th: send the update, wait for the round's closure and copy the new state
        into the model; True then. ``finished`` turns true after the worker's last round."""
        core = self._core
        if core.driven is not None:
            raise OuterLoopError("the library drives this loop's inner steps: call run()")
        if self._rank != 0:
            core.steps += 1
            if core.steps < core.params.inner_steps:
                return False
            core.steps = 0
            if self._sharded:
                gathered_state(core.model)  # point 6: rank 0 gathers the whole model
            self._sync()
            return True
        if not core.count(loss):
            return False
        sent = core.send(gathered_state(core.model) if self._sharded else None)
        core.adopt(HANDOFF_WAIT)
        core.timed(sent)
        core.rounds_applied += 1
        if core.finished and self._thread is not None:
            self._thread.join(timeout=60)
        if self._group is not None:
            self._sync()
        return True

    def _sync(self) -> None:
        """Point 6: rank 0's parameters (the applied state) and ``finished`` to every rank."""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import distribute_tensor

        src = dist.get_global_rank(self._group, 0)
        state = self._core.state
        with torch.no_grad():
            for name, p in sorted(_trainable(self._core.model).items()):
                if not _is_sharded(p):
                    dist.broadcast(p.data, src=src, group=self._group)
                    continue
                whole = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
                if self._rank == 0:
                    assert state is not None
                    whole.copy_(torch.from_numpy(state.params[name]))
                shard = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=0)
                p.to_local().copy_(shard.to_local())
            flag = torch.tensor([int(self._core.finished)], dtype=torch.int64)
            dist.broadcast(flag, src=src, group=self._group)
        self._core.finished = bool(flag.item())

    def close(self) -> None:
        self._core.handoff.close()
        if self._thread is not None:
            self._thread.join(timeout=60)


class AsyncOuterLoop:
    """The trio face: ``await join()`` and ``await step()`` (see :func:`open_outer_loop`)."""

    def __init__(
        self,
        core: _Core,
        nursery: Any,
        node: Any,
        key: MachineKey | Signer,
        cert: Path,
        result_path: Path | None,
    ) -> None:
        self._core = core
        self._nursery = nursery
        self._node = node
        self._key = key
        self._cert = cert
        self._result_path = result_path

    @property
    def finished(self) -> bool:
        return self._core.finished

    @property
    def result(self) -> dict[str, Any] | None:
        return self._core.result

    async def join(self) -> None:
        import trio

        from identity import Signer, SoftwareSigner

        core = self._core
        core.author = self._key.peer_id
        key = self._key
        signer = key if isinstance(key, Signer) else SoftwareSigner(key)

        async def main() -> None:
            try:
                result = await _run_worker(core, self._node, signer, self._cert, self._result_path)
            except Exception as exc:  # reported to the user's task by the hand-off
                core.worker_done(None, _describe(exc))
            else:
                core.worker_done(result, None)

        self._nursery.start_soon(main)
        if not await trio.to_thread.run_sync(
            partial(core.adopt, JOIN_WAIT),
            abandon_on_cancel=True,  # type: ignore[call-arg]  # trio-stubs predate it (trio 0.23)
        ):
            raise OuterLoopError(f"run {core.spec.run} ended before this worker joined")

    async def step(self, loss: float | None = None) -> bool:
        import trio

        core = self._core
        if not core.count(loss):
            return False
        sent = core.send()
        await trio.to_thread.run_sync(
            partial(core.adopt, HANDOFF_WAIT),
            abandon_on_cancel=True,  # type: ignore[call-arg]  # trio-stubs predate it (trio 0.23)
        )
        core.timed(sent)
        core.rounds_applied += 1
        return True


@asynccontextmanager
async def open_outer_loop(
    node: Any,
    *,
    key: MachineKey | Signer,
    spec: str,
    model: torch.nn.Module,
    certificate: str | Path,
    rounds: int | None = None,
    eval_fn: Callable[[Any, Any], Any] | None = None,
    eval_data: Any = None,
    bootstrap: Sequence[str] = (),
    result_path: str | Path | None = None,
    late: bool = False,
    keep_states: int | None = None,
) -> AsyncIterator[AsyncOuterLoop]:
    """The trio face of :class:`OuterLoop` on a ``p2p.Node`` opened with ``pubsub=True``
    and ``key`` (its machine key, or on a TPM-bound machine its
    ``identity.machine_signer``, whose attestations then carry the AK's co-signature).
    The options are :class:`OuterLoop`'s, less ``group`` and the replayed level's."""
    import trio

    rows = _eval_rows(node.store, eval_data) if eval_fn is not None else None
    core = _Core(
        spec=_load_spec(node.store, spec),
        model=model,
        rounds=rounds,
        eval_fn=eval_fn,
        eval_rows=rows,
        bootstrap=bootstrap,
        keep_states=keep_states,
    )
    core.join = late
    out = Path(result_path) if result_path is not None else None
    async with trio.open_nursery() as nursery:
        try:
            yield AsyncOuterLoop(core, nursery, node, key, Path(certificate), out)
        finally:
            core.handoff.close()
