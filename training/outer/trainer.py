"""A worker's torch side (:class:`Trainer`): model, inner AdamW kept across rounds as in
DiLoCo, shard, batch sampler and error-feedback residual; :class:`Trained`, what one
round's training hands the update commitment; and :class:`ResumePoint`, what a worker
keeps to resume.

Resume points
-------------
1. Each round it trains, a worker that keeps one (``blob outer worker``) stores its inner
   state after the round (``Trainer.inner_state``: AdamW's moments and the error-feedback
   residual, canonically encoded; the outer momentum is in the run's state) as a blob
   tagged ``outer-<run>-resume-inner``, and a small record naming it
   (:class:`ResumePoint`: the run, the worker's peer ID, the round it trained, the digest
   of its model's trainable names and shapes, and its batch sampler's state) tagged
   ``outer-<run>-resume`` (:func:`resume_tags`). The record before is deleted; the inner
   state before is only untagged (it is the next round's inner state before, which the
   worker keeps for replay, ``training.outer.runs`` point 4, and deletes in its time).
2. ``--resume`` reads the record and refuses, in one line, one of another run, another
   peer (another machine's key) or another model shape (:func:`check_resume`); it loads the
   inner state and the sampler, then catches up from the run's tip as a joiner does. Its
   next update continues from its own residual and moments.
3. The inner state is what the trainer held after its last update, whether or not the
   round's closure included that update: as in a run without a restart, a left-out
   update's mass is not put back into the residual.

Overlapped rounds
-----------------
4. A round's inner steps start from the round's state S_r (a *plain* round: its torch seed
   from S_r's root and the author, :func:`round_seed`), or, in a run that overlaps rounds,
   from the worker's own end of the round before, E_{r-1} (an *overlapped* round).
5. With ``overlap`` 1, once it has made its update of round r (and unless r was the last
   round) the trainer trains round r+1 on from E_r in a thread of its own
   (``training.outer.ahead``), on rows its sampler draws then, seeded from the run, the
   round and the author (:func:`ahead_seed`: what the commitment names; S_{r+1}'s root is
   not known when the steps begin). The worker offers S_{r+1} as soon as it has it
   (:meth:`Trainer.ready`); at the first step boundary after, the model moves by
   S_{r+1} - E_r, parameters and floating buffers in float32, elementwise (the local drift
   kept: theta <- S_{r+1} + (theta - E_r), as ``training.outer.loop.shift_params``), and the
   step it moved at is recorded (H: after the last step, where the state came later). The
   update is then taken against S_{r+1}, as a plain round's is against S_r.
6. :meth:`Trainer.train` for S_{r+1} takes that round if it moved (or is to move) to that
   very state; any other state (one caught up to, or of another root or round) drops it,
   puts the inner state back as it was when that round began (the moments of however many
   steps it ran are discarded), and the round is trained plain from the state adopted: a
   joiner's, a resumed worker's and a caught-up worker's first round is plain, with no
   correction pending.
7. What a replayer needs of an overlapped round (:class:`Trained`): the rows, the inner
   state before (the inner state after round r), E_r (``training.outer.inner`` rule 2) and
   the step the model moved at; :meth:`Trainer.train_rows` recomputes the round from them
   with the same operations in the same order, so an honest update replays bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from blobstore.canonical import encode as encode_canonical
from blobstore.exitcodes import ExitCode
from identity import decode_msgpack_map
from training.errors import TrainingError
from training.outer.aggregate import wrap_update
from training.outer.ahead import Ahead
from training.outer.codec import F32, ErrorFeedback
from training.outer.inner import decode_inner, decode_origin, encode_inner, encode_origin
from training.outer.loop import (
    OuterState,
    load_params,
    make_update,
    model_params,
    run_inner_steps,
    shift_params,
    synthetic_tokens,
)
from training.outer.module_state import floating_buffers, load_into
from training.outer.params import RunParams, outer_kernel_class

# One per process, as torch's default generator is (see Trainer.train_rows). Whatever
# seeds, draws from, or saves and restores that generator (fork_rng in
# training.model.load_base_model) holds it.
TORCH_RNG_LOCK = threading.Lock()


class Trainer:
    """A worker's torch side: model, inner AdamW (local across rounds, as in DiLoCo),
    shard, batch sampler and error-feedback residual. Its methods run in one thread at a
    time (the worker's training thread), but for :meth:`ready`, which any thread may call;
    a round trained ahead (rule 5) runs in a thread of its own, which only :meth:`train`
    and :meth:`close` wait for."""

    def __init__(
        self,
        params: RunParams,
        shard: int,
        *,
        model: Any = None,
        tokens: np.ndarray[Any, np.dtype[np.int64]] | None = None,
        device: str = "cpu",
        threads: int = 1,
        pad_id: int | None = None,
        step_fn: Any = None,
        reset: Any = None,
    ) -> None:
        """``model`` (a causal LM taking ``input_ids`` and ``labels``) and ``tokens`` (rows
        of token IDs) default to the built-in tiny Llama and synthetic shard; ``pad_id``
        (tokenizer records pad past the vocabulary) is left out of the loss and read as 0.
        ``step_fn(model, batch) -> loss``: the user's loss on one batch of rows, in place
        of the causal-LM loss (``training.outer.api``, the replayed level). ``reset``:
        the run's fixed tensors that are buffers, loaded with every state
        (``training.outer.module_state`` point 1)."""
        import torch

        from training.model import make_tiny_llama

        self.params = params
        self.device = device
        self.threads = threads
        self.pad_id = pad_id
        self.step_fn = step_fn
        self.reset = dict(reset or {})
        with TORCH_RNG_LOCK:  # entering deterministic mode reseeds torch's one generator
            self.kernel_class = outer_kernel_class(device, threads)
        if model is None:
            with TORCH_RNG_LOCK:  # a seeded init, beside another thread's training
                model = make_tiny_llama(params.model_size, seed=params.seed)
        self.model = model.to(device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=params.inner_lr,
            betas=(0.9, 0.95),
            weight_decay=0.0,
            foreach=False,
            fused=False,
        )
        if tokens is None:
            tokens = synthetic_tokens(
                params.shard_seed(shard), params.shard_sequences, params.seq_len
            )
        self.tokens = tokens
        self.rng = np.random.default_rng([params.seed, shard])
        # Names and shapes travel once per run, in the state blob; updates carry a digest.
        self.feedback = ErrorFeedback(params.codec(), decay=params.ef_decay, schema_ref=True)
        self.ahead: _RoundAhead | None = None  # rule 5

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(v.shape) for name, v in model_params(self.model).items()}

    def next_rows(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The batch rows of the next round (inner steps x batch), from the sampler."""
        rows = self.tokens.shape[0]
        return np.stack(
            [
                self.rng.integers(0, rows, size=self.params.batch)
                for _ in range(self.params.inner_steps)
            ]
        )

    def train(self, state: OuterState, root: str, author: str, *, cheat: bool = False) -> Trained:
        """H inner steps for ``state`` (whose root is ``root``) on the sampler's next rows:
        the update blob (in its envelope, ``training.outer.aggregate.wrap_update``), the
        losses and what the update's commitment needs (``training.outer.replay``); the
        round trained ahead where it serves ``state`` (rules 5 and 6), else a plain
        round. ``cheat`` (a test hook) reports other rows than it trained on."""
        trained = self._take_ahead(state, root, author, cheat=cheat)
        if trained is None:
            before = self.inner_state()
            rows = self.next_rows()
            used = self.next_rows() if cheat else rows
            update, losses, after = self.train_rows(state, root, author, used)
            trained = Trained(update, losses, rows, before, after)
        if self.params.overlap and state.round + 1 < self.params.rounds:
            self._train_ahead(state, author, trained.inner_after)
        return trained

    def ready(self, state: OuterState, root: str) -> None:
        """Rule 5: the worker's next state, as soon as it is computed (any thread): the
        round trained ahead moves to it at its next step boundary."""
        held = self.ahead
        if held is not None:
            held.ahead.offer(state, root)

    def close(self) -> None:
        """Stop the round trained ahead, if any, and wait for its thread (the worker is
        leaving)."""
        held, self.ahead = self.ahead, None
        if held is not None:
            held.ahead.drop()
            held.ahead.result()

    def _train_ahead(self, state: OuterState, author: str, inner_before: bytes) -> None:
        """Rule 5: start round ``state.round + 1`` from the model as this round left it."""
        origin = Origin(
            model_params(self.model), floating_buffers(self.model) if state.buffers else {}
        )
        rows = self.next_rows()
        round_ = state.round + 1
        seed = ahead_seed(self.params.run_id, round_, author)

        def steps(ahead: Ahead) -> list[float]:
            def boundary(step: int) -> None:
                target = ahead.at_boundary(step)
                if target is not None:
                    self._move(target, origin)

            return self._steps(origin.params, origin.buffers, rows, seed, boundary)

        ahead = Ahead(round_, steps)
        self.ahead = _RoundAhead(ahead, origin, rows, inner_before)
        ahead.start()

    def _take_ahead(
        self, state: OuterState, root: str, author: str, *, cheat: bool
    ) -> Trained | None:
        """Rule 6: the round trained ahead, if it serves ``state`` (None: it does not, or
        there is none)."""
        held, self.ahead = self.ahead, None
        if held is None:
            return None
        ahead = held.ahead
        losses = ahead.result() if ahead.claim(state.round, root) else None
        if losses is None:
            # Dropped (its thread stopped at its next step boundary): the plain round
            # starts from the inner state the round ahead began with, not from moments
            # its unfinished steps left (how many ran is a matter of timing).
            ahead.result()
            self.load_inner(held.inner_before)
            return None
        target = ahead.at_boundary(len(held.rows))  # rule 4 of training.outer.ahead
        if target is not None:
            self._move(target, held.origin)
        moved_at = ahead.moved_at()
        assert moved_at is not None  # a claim holds only for a state it moved or moves to
        update, losses, after = self._made(state, root, author, losses)
        rows = self.next_rows() if cheat else held.rows
        origin = encode_origin(held.origin.params, held.origin.buffers)
        return Trained(update, losses, rows, held.inner_before, after, origin, moved_at)

    def train_rows(
        self,
        state: OuterState,
        root: str,
        author: str,
        rows: np.ndarray[Any, np.dtype[np.int64]],
        *,
        origin: Origin | None = None,
        moved_at: int = 0,
    ) -> tuple[bytes, list[float], bytes]:
        """H inner steps on these batch rows: (update blob, losses, inner state after).
        From ``state`` (a plain round), or from ``origin``, moving by ``state - origin``
        before step ``moved_at`` (H: after the last; an overlapped round, rule 7)."""
        if origin is None:
            losses = self._steps(state.params, state.buffers, rows, round_seed(root, author))
        else:
            seed = ahead_seed(self.params.run_id, state.round, author)

            def boundary(step: int) -> None:
                if step == moved_at:
                    self._move(state, origin)

            losses = self._steps(origin.params, origin.buffers, rows, seed, boundary)
            if moved_at == len(rows):
                self._move(state, origin)
        return self._made(state, root, author, losses)

    def _steps(
        self,
        params: Mapping[str, F32],
        buffers: Mapping[str, F32],
        rows: np.ndarray[Any, np.dtype[np.int64]],
        seed: int,
        boundary: Callable[[int], None] | None = None,
    ) -> list[float]:
        """The inner steps on these batch rows from these parameters and buffers, under
        ``seed``; ``boundary(i)`` before step i."""
        import torch

        torch.set_num_threads(self.threads)  # per OS thread under OpenMP: set where it runs
        batches = [torch.from_numpy(self.tokens[r]).to(self.device) for r in rows]
        stream = batches if boundary is None else _boundaries(batches, boundary)
        # Dropout and other random ops draw from torch's one process-wide generator, seeded
        # by what the commitment names so a replay in another process draws the same; the
        # lock keeps a replay and this worker's training, each in its own thread, from
        # drawing from it in turns (a replay of an honest GPT-2 update mismatched that way).
        with TORCH_RNG_LOCK:
            torch.manual_seed(seed)
            load_params(self.model, params)
            load_into(self.model, buffers, self.reset)
            if self.step_fn is not None:
                return _user_steps(self.model, self.optimizer, stream, self.step_fn)
            if self.pad_id is None:
                return run_inner_steps(self.model, self.optimizer, stream)
            return _padded_steps(self.model, self.optimizer, stream, self.pad_id)

    def _move(self, state: OuterState, origin: Origin) -> None:
        """Rule 5's correction: parameters and floating buffers by ``state - origin``; the
        run's fixed buffers reset, as with every state."""
        shift_params(self.model, state.params, origin.params)
        moved = {
            n: now + np.subtract(state.buffers[n], origin.buffers[n], dtype=np.float32)
            for n, now in (floating_buffers(self.model) if origin.buffers else {}).items()
        }
        load_into(self.model, moved, self.reset)

    def _made(
        self, state: OuterState, root: str, author: str, losses: list[float]
    ) -> tuple[bytes, list[float], bytes]:
        """The update from ``state`` to the model now, its losses, and the inner state."""
        payload = make_update(state.params, model_params(self.model), self.feedback)
        buffers = floating_buffers(self.model) if state.buffers else None
        update = wrap_update(
            payload, round_=state.round, start_root=root, author=author, buffers=buffers
        )
        return update, losses, self.inner_state()

    def origin_of(self, data: bytes, state: OuterState) -> Origin:
        """Rule 7: the origin an overlapped commitment names, from its blob's bytes;
        ``training.outer.inner.BadInnerState`` if they do not fit this model and ``state``'s
        buffers."""
        buffer_shapes = {n: tuple(v.shape) for n, v in state.buffers.items()}
        params, buffers = decode_origin(data, self.shapes(), buffer_shapes)
        return Origin(params, buffers)

    def inner_state(self) -> bytes:
        """The inner AdamW moments and the error-feedback residual, canonically encoded."""
        state = self.optimizer.state_dict()["state"]
        opt: list[tuple[bytes, bytes, bytes] | None] = []
        for i, _ in enumerate(self.model.parameters()):
            entry = state.get(i)
            if not entry:
                opt.append(None)
                continue
            opt.append(
                tuple(  # type: ignore[arg-type]
                    entry[key].detach().cpu().numpy().astype("<f4").tobytes()
                    for key in ("step", "exp_avg", "exp_avg_sq")
                )
            )
        return encode_inner(opt, self.feedback.residual)

    def sampler_state(self) -> bytes:
        """The batch sampler's position (its PCG64 state), canonically encoded."""
        state = self.rng.bit_generator.state
        inner = state["state"]
        fields = [
            int(inner["state"]).to_bytes(16, "little"),
            int(inner["inc"]).to_bytes(16, "little"),
            int(state["has_uint32"]),
            int(state["uinteger"]),
        ]
        data: bytes = encode_canonical(fields)
        return data

    def load_sampler(self, data: bytes) -> None:
        """Put the batch sampler where ``sampler_state`` says; BadResume if it cannot be."""
        import msgpack

        try:
            state, inc, has, value = msgpack.unpackb(data, raw=False)
            self.rng.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {
                    "state": int.from_bytes(state, "little"),
                    "inc": int.from_bytes(inc, "little"),
                },
                "has_uint32": int(has),
                "uinteger": int(value),
            }
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise BadResume(f"the resume point's sampler state is malformed: {exc}") from None

    def load_inner(self, data: bytes) -> None:
        """Adopt an inner state (``inner_state``'s bytes); BadInnerState if it does not fit."""
        import torch

        params = list(self.model.parameters())
        optimizer, residual = decode_inner(data, [p.numel() for p in params], self.shapes())
        saved = self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for i, (entry, p) in enumerate(zip(optimizer, params, strict=True)):
            if entry is None:
                continue
            step, m, v = (np.frombuffer(x, dtype="<f4").astype(np.float32) for x in entry)
            state[i] = {
                "step": torch.from_numpy(step).reshape(()),
                "exp_avg": torch.from_numpy(m).reshape(p.shape),
                "exp_avg_sq": torch.from_numpy(v).reshape(p.shape),
            }
        saved["state"] = state
        self.optimizer.load_state_dict(saved)
        self.feedback.residual = residual


@dataclass(frozen=True)
class Trained:
    """One round's training: what the update commitment records (training.outer.replay).
    An overlapped round (rule 7) also hands the state its steps started from (``origin``,
    ``training.outer.inner`` rule 2) and the step the model moved at."""

    update: bytes
    losses: list[float]
    rows: np.ndarray[Any, np.dtype[np.int64]]
    inner_before: bytes
    inner_after: bytes
    origin: bytes = b""
    moved_at: int | None = None


@dataclass(frozen=True)
class Origin:
    """Rule 4: where an overlapped round's steps started, E_{r-1} (float32 copies)."""

    params: dict[str, F32]
    buffers: dict[str, F32]


@dataclass(frozen=True)
class _RoundAhead:
    """Rule 5: the round trained ahead, and what its update's commitment will need."""

    ahead: Ahead
    origin: Origin
    rows: np.ndarray[Any, np.dtype[np.int64]]
    inner_before: bytes


def round_seed(root: str, author: str) -> int:
    """Rule 4: the torch seed of one worker's plain round from root ``root``."""
    digest = blake3.blake3(b"blobnet/outer-inner-seed\x00" + bytes.fromhex(root) + author.encode())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def ahead_seed(run: str, round_: int, author: str) -> int:
    """Rule 5: the torch seed of one worker's overlapped round ``round_`` of run ``run``."""
    body = encode_canonical([run, round_, author])
    digest = blake3.blake3(b"blobnet/outer-ahead-seed\x00" + body)
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def _boundaries(batches: list[Any], boundary: Callable[[int], None]) -> Any:
    """``batches``, calling ``boundary(i)`` before batch i is handed to its step."""
    for i, batch in enumerate(batches):
        boundary(i)
        yield batch


# Labels the HF loss ignores (padding), as in training.rounds.trainer.
IGNORE_INDEX = -100


def _user_steps(model: Any, optimizer: Any, batches: Any, step_fn: Any) -> list[float]:
    """``run_inner_steps`` with the user's loss: ``step_fn(model, batch)`` per batch."""
    import torch

    losses: list[float] = []
    model.train()
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = step_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        optimizer.step()
        losses.append(float(loss.item()))
    model.eval()
    return losses


def _padded_steps(model: Any, optimizer: Any, batches: Any, pad_id: int) -> list[float]:
    """``run_inner_steps`` on records that pad: padding is no label and reads as id 0."""
    import torch

    losses: list[float] = []
    model.train()
    for batch in batches:
        padding = batch == pad_id
        optimizer.zero_grad(set_to_none=True)
        loss = model(
            input_ids=batch.masked_fill(padding, 0), labels=batch.masked_fill(padding, IGNORE_INDEX)
        ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        optimizer.step()
        losses.append(float(loss.item()))
    model.eval()
    return losses


# --- resume points (the module's rules) -------------------------------------------------

RESUME_VERSION = 1
# A resume record is a few IDs, a digest and 34 bytes of sampler state.
MAX_RESUME_RECORD = 4096


class BadResume(TrainingError):
    """A resume point that is not this worker's in this run (the user's to fix: another
    store, or a restart with another key, run or model)."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class ResumePoint:
    """Rule 1: what a worker keeps to resume."""

    run: str
    peer: str
    round: int  # the round of the last update it trained
    layout: str  # layout_digest of its model's trainable parameters
    inner: str  # blob ID of its inner state after that round
    sampler: bytes  # Trainer.sampler_state

    def encode(self) -> bytes:
        data: bytes = encode_canonical(
            {
                "v": RESUME_VERSION,
                "run": self.run,
                "peer": self.peer,
                "round": self.round,
                "layout": self.layout,
                "inner": self.inner,
                "sampler": self.sampler,
            }
        )
        return data


def decode_resume(data: bytes) -> ResumePoint:
    """A resume record's fields; :class:`BadResume` if the bytes are not one."""
    obj = decode_msgpack_map(data, max_size=MAX_RESUME_RECORD, what="resume point", error=BadResume)
    try:
        if obj["v"] != RESUME_VERSION:
            raise BadResume(f"resume point version {obj['v']!r} is not {RESUME_VERSION}")
        point = ResumePoint(
            obj["run"], obj["peer"], obj["round"], obj["layout"], obj["inner"], obj["sampler"]
        )
    except KeyError as exc:
        raise BadResume(f"the resume point lacks the field {exc}") from None
    if point.encode() != bytes(data) or type(point.round) is not int:
        raise BadResume("the resume point is not in canonical form")
    return point


def layout_digest(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """A model's trainable names and shapes, as one hex digest (rule 2 compares them)."""
    fields = [[name, list(shapes[name])] for name in sorted(shapes)]
    return blake3.blake3(b"blobnet/outer-resume-layout/v1" + encode_canonical(fields)).hexdigest()


def resume_tags(run: str) -> tuple[str, str]:
    """Rule 1: the tags of a run's resume record and of its inner state."""
    return f"outer-{run}-resume", f"outer-{run}-resume-inner"


def check_resume(
    point: ResumePoint, *, run: str, peer: str, shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Rule 2: refuse, in one line, a resume point of another run, peer or model shape."""
    if point.run != run:
        raise BadResume(f"the resume point in this store is run {point.run!r}'s, not {run!r}'s")
    if point.peer != peer:
        raise BadResume(
            f"the resume point in this store is peer {point.peer[-8:]}'s, this key is "
            f"{peer[-8:]}'s: resume with the key that made it (--key)"
        )
    if point.layout != layout_digest(shapes):
        raise BadResume(
            "the resume point was kept by a model of other parameter names or shapes than "
            "this run's"
        )
