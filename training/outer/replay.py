"""Sampled replay of outer-loop updates: each update commits to how it was computed, and a
sample of every round's included updates is recomputed by another admitted worker.

Theory of operation
-------------------
1. **Commitment.** With its update for round r a worker stores an *update commitment*
   blob (:class:`UpdateCommitment`, canonical msgpack): the run, the round, the start root
   R_r, the author, its data shard, the inner steps and batch size, the batch rows it drew
   (uint32), each step's loss (float32 bits), the codec settings, the blob of its *inner
   state* before the round (the inner AdamW moments and the error-feedback residual,
   ``training.outer.inner``), the BLAKE3 of its inner state after the round, and the
   update blob. Its update attestation's subjects are ``[update blob, R_r, commitment blob]``, so
   the closure that names the update names the commitment too, under the author's key.
   An *overlapped* update (``training.outer.trainer`` rules 4 to 7: its steps began from the
   worker's own end of round r-1, E_{r-1}, and moved by S_r - E_{r-1} at a step boundary)
   is commitment version 2, which adds ``from`` (the blob of E_{r-1},
   ``training.outer.inner`` rule 2, stored and kept by its author like its inner state) and
   ``moved`` (the boundary it moved at, 0..H; H: after the last step); its steps' torch seed
   comes from the run, the round and the author; in a run that does not overlap rounds it
   is a mismatch, found before any blob it names is fetched. Every other commitment is
   version 1 without those keys, so its bytes are as they were.
2. **Sample.** Round r's admitted updates are sampled with R_{r+1}, the root that round
   r's closure produced (:func:`sampled`): peer p's update is replayed iff
   ``BLAKE3(SAMPLE_DOMAIN || R_{r+1} || p) < rate``. R_{r+1} depends on every included
   update, so while computing its update nobody can know whether it will be checked.
   (R_r would not do: it is known before training, and a cheater would cheat only in the
   rounds where it is not sampled.)
3. **Replayer.** Among the closure's other admitted workers of another operator, the one
   with the lowest ``BLAKE3(REPLAYER_DOMAIN || R_{r+1} || p || q)`` replays p's update
   (:func:`replayer_for`): it fetches the commitment and the inner-state blob (and, for an
   overlapped update, the ``from`` blob), loads S_r (or E_{r-1}) and the inner state into a
   fresh model, trains on the committed rows (moving by S_r - E_{r-1} where the commitment
   says), and compares the loss bits, the end inner state and the update's bytes
   (:func:`replay`). Every worker of
   a run holds a certificate for the run's one kernel class, and deterministic mode makes
   equal inputs give equal bits there, so an honest update replays exactly.
4. **Verdict.** The replayer signs a verdict (kind :data:`REPLAY_KIND`, digest
   :func:`verdict_digest` over the run, round, author, both blobs and the outcome, subjects
   ``[update blob, commitment blob]``; outcome ``match``, ``mismatch: <what differs>`` or
   ``unavailable``) and announces it. Every
   worker records the verdicts it hears (the run's milestones list them beside the
   included updates: included vs verified). A ``mismatch`` counts for a worker only once
   its own replay agrees (a false accusation costs its maker nothing else, and the
   accused nothing). A worker that holds a confirmed mismatch for an operator leaves that
   operator's updates out of every closure it proposes from then on, with the reason
   ``failed replay of round r``. The round the cheat was in is already applied: it was
   bounded like any update (``training.outer.aggregate``); replay makes cheating a
   one-round, detected, unpaid act rather than preventing it.
5. **Cost and catch.** At rate q each worker replays about q updates per round: q times
   its own training compute (H inner steps), plus fetching the inner state (3x the model
   in float32: AdamW's two moments and the residual) per replay; storing its own
   commitment and inner state costs each worker one inner-state blob per round, kept
   until the sample is known. A worker that cheats in n rounds escapes with probability
   (1 - q)^n; at q = 0.25 a cheat in 8 rounds is caught with probability 0.90.
6. **What is not checked.** The inner state a worker starts from is committed, not
   derived: a worker could start from a fabricated residual or optimizer state, or, in an
   overlapped round, a fabricated E_{r-1} (what it sends is still bounded by the
   aggregation rules, and taken against S_r like any update); chaining each commitment's
   start to the previous one's end would close that. The shard is the author's claim. A withheld
   commitment or inner state gives the verdict ``unavailable``: not verified, not banned.

Nothing here reads a clock or does I/O; :func:`replay` runs torch (in a worker thread).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np

from blobstore.canonical import encode as encode_canonical
from blobstore.exitcodes import ExitCode
from identity import (
    AdmissionCertificate,
    Attestation,
    Rejected,
    Signer,
    TrustStore,
    decode_msgpack_map,
    sign_attestation,
    verify_attestation,
)
from training.errors import TrainingError
from training.outer.inner import BadInnerState
from training.outer.trainer import Trainer
from training.outer.verification import Level

if TYPE_CHECKING:
    from training.outer.loop import OuterState
    from training.outer.params import RunParams

REPLAY_KIND = "blobnet/outer-replay"
COMMITMENT_DOMAIN = b"blobnet/outer-update-commitment/v1"
VERDICT_DOMAIN = b"blobnet/outer-replay-verdict/v1"
SAMPLE_DOMAIN = b"blobnet/outer-sample/v1"
REPLAYER_DOMAIN = b"blobnet/outer-replayer/v1"
COMMITMENT_VERSION = 1
OVERLAPPED_VERSION = 2  # rule 1: with ``from`` and ``moved``
MATCH = "match"
UNAVAILABLE = "unavailable"
MISMATCH = "mismatch"
# Bounds on a commitment before it is parsed: batch rows per round (inner steps x batch
# size) and inner steps. A round of 1000 steps at batch 64 is far beyond what one outer
# round trains; the commitment then stays under 300 KiB.
MAX_ROWS = 1 << 16
MAX_STEPS = 4096
MAX_COMMITMENT_SIZE = 4 * MAX_ROWS + 4 * MAX_STEPS + 4096
# Outcome texts are short ("mismatch: update bytes differ"); 128 bounds them.
MAX_OUTCOME_LEN = 128

_HEX = frozenset("0123456789abcdef")


class BadCommitment(TrainingError):
    """Bytes that are not a canonical update commitment (the author's fault)."""

    exit_code = ExitCode.BAD_DATA


def _hex64(value: Any, what: str) -> str:
    if type(value) is not str or len(value) != 64 or not set(value) <= _HEX:
        raise BadCommitment(f"commitment field {what} must be 64 lowercase hex digits")
    return value


@dataclass(frozen=True)
class UpdateCommitment:
    """How one update was computed (rule 1)."""

    run: str
    round: int
    start_root: str
    author: str
    shard: int
    steps: int
    batch: int
    rows: bytes  # steps * batch uint32, little-endian
    losses: bytes  # steps float32, little-endian
    chunk: int
    k: int
    inner: str  # blob ID of the inner state before the round
    inner_end: str  # BLAKE3 (hex) of the inner state after the round
    update: str  # the update blob
    # The verification level the author's worker offered (training.outer.spec point 3):
    # written only when it is not "replayed", so a replayable update's bytes are as before.
    level: Level = Level.REPLAYED
    # An overlapped update (rule 1): the blob of the state its steps started from, E_{r-1},
    # and the step boundary they moved by S_r - E_{r-1} at; "" and 0 otherwise.
    origin: str = ""
    moved: int = 0

    def __post_init__(self) -> None:
        # A level given as its string becomes the member; an unknown one stays as given, for
        # decode_commitment to refuse (BadCommitment) and encode to refuse in turn.
        if self.level in tuple(Level):
            object.__setattr__(self, "level", Level(self.level))

    @property
    def overlapped(self) -> bool:
        return bool(self.origin)

    def fields(self) -> dict[str, Any]:
        out = {
            "v": OVERLAPPED_VERSION if self.overlapped else COMMITMENT_VERSION,
            "run": self.run,
            "round": self.round,
            "start": self.start_root,
            "author": self.author,
            "shard": self.shard,
            "steps": self.steps,
            "batch": self.batch,
            "rows": self.rows,
            "losses": self.losses,
            "codec": [self.chunk, self.k],
            "inner": self.inner,
            "inner_end": self.inner_end,
            "update": self.update,
        }
        if self.level != Level.REPLAYED:
            out["level"] = self.level
        if self.overlapped:
            out["from"] = self.origin
            out["moved"] = self.moved
        return out

    def encode(self) -> bytes:
        data: bytes = encode_canonical(self.fields())
        try:
            ok = decode_commitment(data) == self
        except BadCommitment as exc:
            raise ValueError(f"commitment does not round-trip: {exc}") from None
        if not ok:
            raise ValueError("commitment does not round-trip (a malformed field)")
        return data

    def row_array(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        rows = np.frombuffer(self.rows, dtype="<u4").astype(np.int64)
        return rows.reshape(self.steps, self.batch)


def decode_commitment(data: bytes) -> UpdateCommitment:
    """Strictly parse a commitment; raises :class:`BadCommitment` only."""
    obj = decode_msgpack_map(
        data, max_size=MAX_COMMITMENT_SIZE, what="update commitment", error=BadCommitment
    )
    try:
        version = obj["v"]
        if version not in (COMMITMENT_VERSION, OVERLAPPED_VERSION):
            raise BadCommitment("commitment has an unknown version")
        overlapped = version == OVERLAPPED_VERSION
        origin = _hex64(obj["from"], "from") if overlapped else ""
        moved = obj["moved"] if overlapped else 0
        codec = obj["codec"]
        if type(codec) is not list or len(codec) != 2:
            raise BadCommitment("commitment codec must be [chunk, k]")
        ints = [obj["round"], obj["shard"], obj["steps"], obj["batch"], *codec]
        strs = [obj["run"], obj["author"]]
        rows, losses = obj["rows"], obj["losses"]
    except KeyError as exc:
        raise BadCommitment(f"commitment lacks the field {exc}") from None
    if any(type(x) is not int or not 0 <= x < 1 << 32 for x in ints):
        raise BadCommitment("commitment integers must be in 0..2^32")
    if any(type(x) is not str or not 0 < len(x) <= 128 for x in strs):
        raise BadCommitment("commitment run and author must be short strings")
    round_, shard, steps, batch, chunk, k = ints
    if not 0 < steps <= MAX_STEPS or batch <= 0 or steps * batch > MAX_ROWS:
        raise BadCommitment("commitment steps or batch out of range")
    if type(rows) is not bytes or len(rows) != 4 * steps * batch:
        raise BadCommitment("commitment rows must be steps x batch uint32")
    if type(losses) is not bytes or len(losses) != 4 * steps:
        raise BadCommitment("commitment losses must be one float32 per step")
    if type(moved) is not int or not 0 <= moved <= steps:
        raise BadCommitment("commitment moved must be a step boundary, 0..steps")
    c = UpdateCommitment(
        obj["run"],
        round_,
        _hex64(obj["start"], "start"),
        obj["author"],
        shard,
        steps,
        batch,
        rows,
        losses,
        chunk,
        k,
        _hex64(obj["inner"], "inner"),
        _hex64(obj["inner_end"], "inner_end"),
        _hex64(obj["update"], "update"),
        obj.get("level", Level.REPLAYED),
        origin,
        moved,
    )
    if not isinstance(c.level, Level):
        raise BadCommitment("commitment names an unknown verification level")
    if encode_canonical(c.fields()) != bytes(data):
        raise BadCommitment("commitment is not in canonical form")
    return c


def loss_bits(losses: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(losses)}f", *losses)


def inner_digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


# --- rules 2 and 3: who is sampled, who replays ---------------------------------------


def sampled(next_root: str, peer: str, rate: float) -> bool:
    """Rule 2: is ``peer``'s update of the round that produced ``next_root`` replayed?"""
    if rate <= 0.0:
        return False
    h = blake3.blake3(SAMPLE_DOMAIN + bytes.fromhex(next_root) + peer.encode()).digest()
    return int.from_bytes(h[:8], "big") < rate * 2.0**64


def replayer_for(next_root: str, author: str, operators: Mapping[str, str]) -> str | None:
    """Rule 3: who replays ``author``'s update, among the round's admitted workers
    (peer -> operator); None if no worker of another operator was admitted."""
    own = operators.get(author)
    eligible = [p for p, op in operators.items() if p != author and op != own]
    if not eligible:
        return None
    root = bytes.fromhex(next_root)
    return min(
        eligible,
        key=lambda q: blake3.blake3(
            REPLAYER_DOMAIN + root + author.encode() + b"\0" + q.encode()
        ).digest(),
    )


# --- rule 4: verdicts ----------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    run: str
    round: int
    author: str
    update: str
    commitment: str
    outcome: str

    @property
    def matched(self) -> bool:
        return self.outcome == MATCH

    @property
    def mismatched(self) -> bool:
        return self.outcome.startswith(MISMATCH)

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "author": self.author,
            "update": self.update,
            "commitment": self.commitment,
            "outcome": self.outcome,
        }


def verdict_digest(v: Verdict) -> bytes:
    body: bytes = encode_canonical([v.run, v.round, v.author, v.update, v.commitment, v.outcome])
    return blake3.blake3(VERDICT_DOMAIN + struct.pack("<Q", len(body)) + body).digest()


def sign_verdict(
    signer: Signer,
    verdict: Verdict,
    *,
    kernel_class: str,
    certificate: AdmissionCertificate,
    time: int,
) -> bytes:
    return sign_attestation(
        signer,
        kind=REPLAY_KIND,
        digest=verdict_digest(verdict),
        kernel_class=kernel_class,
        subjects=[verdict.update, verdict.commitment],
        time=time,
        certificate=certificate,
    ).encode()


class BadVerdict(Exception):
    """A verdict whose attestation does not verify or does not match it."""


def check_verdict(
    verdict: Verdict, attestation: bytes, *, trust: TrustStore, now: float
) -> Attestation:
    """The verdict's attestation if it is a valid replay verdict by an admitted worker."""
    if not 0 < len(verdict.outcome) <= MAX_OUTCOME_LEN:
        raise BadVerdict("verdict outcome is empty or too long")
    try:
        signed = verify_attestation(attestation, trust=trust, now=now, kind=REPLAY_KIND)
    except Rejected as exc:
        raise BadVerdict(str(exc)) from None
    if signed.digest != verdict_digest(verdict):
        raise BadVerdict("verdict attestation is over another verdict")
    if signed.subjects != (verdict.update, verdict.commitment):
        raise BadVerdict("verdict attestation names other subjects")
    return signed


# --- the replay itself ------------------------------------------------------------------


def check_claims(
    c: UpdateCommitment,
    *,
    run: str,
    round_: int,
    start_root: str,
    author: str,
    update: str,
    overlap: int,
) -> str:
    """What, if anything, the commitment claims differently from the closure and the run
    (whose spec's ``overlap`` is ``overlap``) ('' if nothing): a mismatch found without
    training, before any blob the commitment names is fetched (an author cannot turn a
    mismatch into ``unavailable`` by withholding a blob it need not have named)."""
    if (c.run, c.round, c.start_root) != (run, round_, start_root):
        return "commitment names another run, round or start root"
    if c.author != author:
        return "commitment names another author"
    if c.update != update:
        return "commitment names another update blob"
    return _overlap_claim(c, overlap)


def _overlap_claim(c: UpdateCommitment, overlap: int) -> str:
    """An overlapped commitment (rule 1) only in a run that overlaps rounds."""
    if c.overlapped and not overlap:
        return "commitment is overlapped in a run that does not overlap rounds"
    return ""


def replay(
    params: RunParams,
    c: UpdateCommitment,
    inner: bytes,
    start: OuterState,
    update: bytes,
    make_trainer: Callable[[RunParams, int], Trainer] | None = None,
    origin: bytes = b"",
) -> str:
    """Rule 3: recompute ``c``'s update from S_r (``start``), the inner state and, for an
    overlapped update, the bytes of the state its steps started from (``origin``, the blob
    ``c.origin`` names), and compare with ``update`` (the included blob's bytes):
    :data:`MATCH` or ``mismatch: <the first thing that differs>``."""
    if (c.chunk, c.k) != (params.chunk, params.k):
        return f"{MISMATCH}: codec settings are not the run's"
    if c.steps != params.inner_steps or c.batch != params.batch:
        return f"{MISMATCH}: inner steps or batch size are not the run's"
    if claim := _overlap_claim(c, params.overlap):
        return f"{MISMATCH}: {claim}"
    trainer = (make_trainer or Trainer)(params, c.shard)
    rows = c.row_array()
    if int(rows.max()) >= trainer.tokens.shape[0]:
        return f"{MISMATCH}: a batch row is outside the shard"
    try:
        trainer.load_inner(inner)
        began = trainer.origin_of(origin, start) if c.overlapped else None
    except BadInnerState as exc:
        return f"{MISMATCH}: {exc}"
    ours, losses, end = trainer.train_rows(
        start, c.start_root, c.author, rows, origin=began, moved_at=c.moved
    )
    bits = loss_bits(losses)
    if bits != c.losses:
        first = next(
            i for i in range(c.steps) if bits[4 * i : 4 * i + 4] != c.losses[4 * i : 4 * i + 4]
        )
        return f"{MISMATCH}: loss of step {first} differs"
    if inner_digest(end) != c.inner_end:
        return f"{MISMATCH}: inner state after the round differs"
    if ours != update:
        return f"{MISMATCH}: update bytes differ"
    return MATCH
