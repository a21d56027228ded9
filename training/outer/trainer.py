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
   update's mass is not put back into the residual."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from blobstore.canonical import encode as encode_canonical
from blobstore.exitcodes import ExitCode
from identity import decode_msgpack_map
from training.errors import TrainingError
from training.outer.aggregate import wrap_update
from training.outer.codec import ErrorFeedback
from training.outer.inner import decode_inner, encode_inner
from training.outer.loop import (
    OuterState,
    load_params,
    make_update,
    model_params,
    run_inner_steps,
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
    shard, batch sampler and error-feedback residual. Every method runs in one thread."""

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
        """H inner steps from ``state`` (whose root is ``root``) on the sampler's next rows:
        the update blob (in its envelope, ``training.outer.aggregate.wrap_update``), the
        losses and what the update's commitment needs (``training.outer.replay``).
        ``cheat`` (a test hook) trains on other rows than it reports."""
        before = self.inner_state()
        rows = self.next_rows()
        used = self.next_rows() if cheat else rows
        update, losses, after = self.train_rows(state, root, author, used)
        return Trained(update, losses, rows, before, after)

    def train_rows(
        self,
        state: OuterState,
        root: str,
        author: str,
        rows: np.ndarray[Any, np.dtype[np.int64]],
    ) -> tuple[bytes, list[float], bytes]:
        """H inner steps on these batch rows: (update blob, losses, inner state after)."""
        import torch

        torch.set_num_threads(self.threads)  # per OS thread under OpenMP: set where it runs
        batches = [torch.from_numpy(self.tokens[r]).to(self.device) for r in rows]
        # Dropout and other random ops draw from torch's one process-wide generator, seeded
        # by what the commitment names (start root and author) so a replay in another
        # process draws the same; the lock keeps a replay and the next round's training,
        # each in its own thread, from drawing from it in turns (a replay of an honest
        # GPT-2 update mismatched that way).
        with TORCH_RNG_LOCK:
            torch.manual_seed(round_seed(root, author))
            load_params(self.model, state.params)
            load_into(self.model, state.buffers, self.reset)
            if self.step_fn is not None:
                losses = _user_steps(self.model, self.optimizer, batches, self.step_fn)
            elif self.pad_id is None:
                losses = run_inner_steps(self.model, self.optimizer, batches)
            else:
                losses = _padded_steps(self.model, self.optimizer, batches, self.pad_id)
        payload = make_update(state.params, model_params(self.model), self.feedback)
        buffers = floating_buffers(self.model) if state.buffers else None
        update = wrap_update(
            payload, round_=state.round, start_root=root, author=author, buffers=buffers
        )
        return update, losses, self.inner_state()

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
    """One round's training: what the update commitment records (training.outer.replay)."""

    update: bytes
    losses: list[float]
    rows: np.ndarray[Any, np.dtype[np.int64]]
    inner_before: bytes
    inner_after: bytes


def round_seed(root: str, author: str) -> int:
    """The torch seed of one worker's inner steps from root ``root``."""
    import blake3

    digest = blake3.blake3(b"blobnet/outer-inner-seed\x00" + bytes.fromhex(root) + author.encode())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


# Labels the HF loss ignores (padding), as in training.rounds.trainer.
IGNORE_INDEX = -100


def _user_steps(model: Any, optimizer: Any, batches: list[Any], step_fn: Any) -> list[float]:
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


def _padded_steps(model: Any, optimizer: Any, batches: list[Any], pad_id: int) -> list[float]:
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
