"""Bounded, robust aggregation of a closure's updates, one update in memory at a time.

Theory of operation
-------------------
A closure names the updates of a round (``training.outer.agreement``); every worker turns
them into S_{r+1} with :func:`aggregate`, a pure function of S_r and the named blobs, so
equal inputs give equal bits everywhere (every op is float32 elementwise numpy, or a
float64 reduction over one array in a fixed layout, on one thread).

1. **Envelope.** An update blob is :func:`wrap_update`: magic, the round, the start root
   and the author's peer ID, then the codec payload; for a model with floating buffers
   (version 2), the payload's length first and the worker's buffers after it (u32 count,
   then each buffer's float32 values in name order; the shapes are the state's). A blob
   whose envelope names another round or root is *stale*; one whose author is not the
   peer the closure names it for is *a copy* (someone re-signed another worker's blob);
   either is excluded, and so is one whose buffers do not fit the state's or are not
   finite.
2. **Copies.** A payload byte-identical to that of an update earlier in ascending peer
   order (someone re-wrapped another worker's payload in their own envelope) is excluded;
   the payload counts once, so a copier changes nothing. (Which of the two authors did the
   work is for replay to tell, ``training.outer.replay``; the numbers are the same.) Near
   copies too: of two in-bound updates whose signs (at up to SKETCH_COORDS strided
   coordinates) agree with cosine >= NEAR_COPY_COSINE, the one with the larger norm is
   excluded. An honest update re-sent rescaled to the clip norm agrees with every honest
   worker, so no other rule sees it, and admitted it would apply that worker's coordinates
   about three times each round (its cost in held-out loss: the "amplified" rows of
   ``bench/figures/outer-byzantine-40rounds.json``).
3. **Bounds relative to the round.** For each update u_i, in ascending peer order, the L2
   norm n_i (float64). Excluded: ``n_i > MAX_PARAM_RATIO * ||params of S_r||`` (a step
   larger than the model itself is no pseudo-gradient), and, among the rest, with m the
   lower median of their norms, ``n_i > REFUSE_FACTOR * m`` (far outside what the
   round's other workers sent) or ``n_i < m / REFUSE_FACTOR`` (an empty or near-empty
   update: admitted, it would only dilute the mean by 1/k). The others get weight
   ``w_i = min(1, CLIP_FACTOR * m / n_i)`` (clipped to at most CLIP_FACTOR times the
   median norm).
4. **Direction.** With at least three updates left, each update votes with its signs:
   s_i = sign(u_i) per coordinate (0 where it sent nothing), V = sum of s_i, and c_i is
   the cosine between s_i and V - s_i (the others' votes). A vote is worth one per
   coordinate whatever the update's size, so one worker cannot outvote the others where
   they agree (a norm-weighted reference could be cancelled by one update at the clip),
   and every step is integer arithmetic: c_i is exact up to one final division.
   With c the lower median of the c_i, an update with
   ``c_i < c - max(AGREEMENT_MARGIN, (1 - MIN_AGREEMENT) * |c|)`` is excluded: far below
   what the round's median worker agrees with the others. Honest workers share one model
   and one corpus, so their signs agree (c_i of 0.3-0.5 on the tiny Llama's first rounds
   with SparseLoCo): random garbage is near-orthogonal to them (c_i ~ 0, under a quarter
   of c) and a negated or adversarial update points against them (c_i < 0). Such an
   update also drags the honest c_i down (it overlaps their supports with the opposite
   sign), which is why the bound is relative to the median and not a fixed floor, and
   why the rule removes one update at a time: the lowest, if under the bar, then the
   cosines again without its votes (at most a third of the round's updates); the margin
   keeps workers whose updates are independent noise (c_i within ~1e-2 of 0) from
   excluding one another.
5. **What one worker can do.** With at least three admitted updates the lower median is
   an honest worker's norm or lies between two honest norms, whatever one byzantine worker
   sends; so the mean g moves by at most ``CLIP_FACTOR * m / k`` from the honest mean for
   k admitted updates, and the outer step moves the parameters by at most
   ``lr * (1 + mu) * ||g|| + lr * mu**2 * ||momentum||``. Decoding already refuses NaN and
   infinity, and norms are float64 (a 1e30 scale squares to 1e60, still finite), so no
   admitted update can make the state non-finite. With fewer than three updates the
   MAX_PARAM_RATIO bound still holds. What this does not catch: an update in range that
   agrees with the others enough (bounded by rules 3 and 4, not detected; replaying a
   sample of updates is the remedy). The held-out loss with and without one byzantine
   worker of each kind: ``bench/figures/outer-byzantine-40rounds.json`` (``bench/outer.py
   --byzantine``).
6. **Memory and time.** Passes over the named blobs: norms, signatures and payload
   digests (a top-k update's from its kept values, a dense one's decoded, one at a time),
   then ``V += s_i``, then the dot products with V (again for each update rule 4
   removes), then ``S += w_i u_i`` over the admitted. A top-k update is parsed once and
   kept in its sparse form with the values it stands for (its kept positions, about 2% of
   the model at the default k), and the later passes touch those positions only: its signs and
   values are zero everywhere else, so the integers and float32 sums are the dense ones
   bit for bit (a sum starts at +0.0 and is never -0.0, so adding the zeros it skips
   changes nothing). The sparse forms kept take at most :data:`SPARSE_KEEP_SHARE` of the
   state's float32 parameters' bytes; an update past that room, or a dense-scheme one, is
   parsed again for each pass. Peak memory is the state, one decoded update, two
   accumulators and that room, O(model) whatever the number of workers, plus rule 2's
   signature of 32 KiB a worker.
7. **Determinism.** The norms are numpy's float64 sum over squares of float32 values
   (which float64 holds exactly), in a fixed layout on one thread (NORM_BLOCK values at a
   time): an update's over each tensor's nonzero values in position order, so a top-k
   update's kept values and the same tensors sent dense give the same bits (the sum's
   grouping follows the length of what it adds); rules 2 and 4 are
   integer arithmetic up to one final division; the float32 sum adds in ascending peer
   order.
8. **Buffers.** The next state's buffers are the coordinate-wise median of the admitted
   updates' (``training.outer.loop.median_buffers``): with at least three admitted, one
   byzantine worker moves them no further than the honest values span; with none
   admitted they stay as they were. They are a few values per channel beside the
   parameters, so each update carries them whole and they are held until the median.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import blake3
import numpy as np
import numpy.typing as npt

from training.outer.codec import F32, CodecError, Parsed, dequantised, parse
from training.outer.loop import OuterConfig, OuterState, median_buffers, outer_step, state_root

UPDATE_MAGIC = b"BNOU"
UPDATE_VERSION = 1
UPDATE_VERSION_BUFFERS = 2  # rule 1: the payload's length, then the worker's buffers
# Peer IDs are base58 multihashes, about 52 characters; one byte of length bounds them.
MAX_AUTHOR_LEN = 255
# Rule 2's factors. A pseudo-gradient after H inner steps moves the parameters by a small
# fraction of their norm (about 1e-2 on the tiny Llama at 5-20 steps); a whole norm is
# two orders of magnitude beyond any honest update.
MAX_PARAM_RATIO = 1.0
# Honest workers' update norms differ by well under 2x on one round (same model, same
# start, shards of one corpus); 8x the median is far outside that, 2x leaves them intact.
REFUSE_FACTOR = 8.0
CLIP_FACTOR = 2.0
# Rule 2's near-copy test: honest workers' signs agree with cosine 0.1-0.4 pairwise on the
# tiny Llama; 0.9 is a copy with a little noise, or another worker's update rescaled.
NEAR_COPY_COSINE = 0.9
# Rule 2's signature size: signs at this many coordinates (32 KiB a worker, next to the
# O(model) accumulators); an even sample, exact for models of up to 2^15 parameters. At
# 2% density it holds ~650 nonzeros: a cosine to within ~0.05, far from 0.9 either way.
SKETCH_COORDS = 1 << 15
# Point 6: the top-k updates' sparse forms kept between passes take at most this share of
# the state's float32 parameters' bytes. At the default k (~2% kept, 13 bytes a position
# with its value) that holds about 19 workers' updates; the rest are parsed again for each pass.
SPARSE_KEEP_SHARE = 0.5
# Rule 4: honest cosines with the others' votes are of one order (0.3-0.5 measured); a
# quarter of the round's median separates them from garbage (~0) and opposition (< 0)
# with room for an honest worker on an unusual batch.
MIN_AGREEMENT = 0.25
# Rule 4's least distance below the median: cosines of independent noise shrink as
# 1/sqrt(kept values), ~5e-3 at the tiny Llama's 2400 (0.02 at 256), so 0.03 does not
# split workers that merely do not agree, and still sits under honest agreement late in a
# run (median cosines fall to ~0.1 by round 40 on the tiny Llama).
AGREEMENT_MARGIN = 0.03
# Rule 4 removes at most a third of the round's updates: more disagreement than that is a
# split of the round, not outliers in it (replay is the remedy there).
MAX_OUTVOTED = 3
# Rule 4 needs a median of at least three to measure agreement against.
MIN_FOR_DIRECTION = 3

# The blocks a norm is summed in (rule 7): 512 KiB of float64, in a core's cache.
NORM_BLOCK = 1 << 16

_HEAD = struct.Struct("<4sBQ32sB")
_PAYLOAD_LEN = struct.Struct("<Q")
_COUNT = struct.Struct("<I")


class BadUpdate(CodecError):
    """An update blob that is not a well-formed envelope around a codec payload."""


def wrap_update(
    payload: bytes,
    *,
    round_: int,
    start_root: str,
    author: str,
    buffers: dict[str, F32] | None = None,
) -> bytes:
    """The update blob: envelope (rule 1) then the codec payload, and ``buffers`` (the
    worker's floating buffers, for a model that has some)."""
    raw = author.encode()
    if not 0 < len(raw) <= MAX_AUTHOR_LEN:
        raise ValueError(f"author {author!r} is not a peer ID")
    version = UPDATE_VERSION_BUFFERS if buffers else UPDATE_VERSION
    head = _HEAD.pack(UPDATE_MAGIC, version, round_, bytes.fromhex(start_root), len(raw))
    if not buffers:
        return head + raw + payload
    names = sorted(buffers, key=str.encode)
    values = [np.ascontiguousarray(buffers[n], dtype="<f4") for n in names]
    if not all(np.isfinite(v).all() for v in values):
        raise ValueError("the model's buffers hold NaN or infinity")
    tail = b"".join(v.tobytes() for v in values)
    return b"".join(
        [head, raw, _PAYLOAD_LEN.pack(len(payload)), payload, _COUNT.pack(len(values)), tail]
    )


@dataclass(frozen=True)
class Envelope:
    round: int
    start_root: str
    author: str
    payload: bytes
    buffers: bytes = b""  # rule 1's buffer section, undecoded (version 2 only)

    def decoded_buffers(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, F32]:
        """The buffers against the state's ``shapes`` (rule 1); :class:`BadUpdate` if they
        do not fit exactly or are not finite."""
        if not shapes:
            if self.buffers:
                raise BadUpdate("buffers: the update carries buffers the state has not")
            return {}
        names = sorted(shapes, key=str.encode)
        sizes = [math.prod(shapes[n]) for n in names]
        if len(self.buffers) != _COUNT.size + 4 * sum(sizes):
            raise BadUpdate("buffers: the update's do not fit the state's")
        (count,) = _COUNT.unpack_from(self.buffers)
        if count != len(names):
            raise BadUpdate("buffers: the update's do not fit the state's")
        out: dict[str, F32] = {}
        offset = _COUNT.size
        for name, size in zip(names, sizes, strict=True):
            raw = self.buffers[offset : offset + 4 * size]
            out[name] = np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(shapes[name])
            offset += 4 * size
            if not np.isfinite(out[name]).all():
                raise BadUpdate("buffers: the update's hold NaN or infinity")
        return out


def unwrap_update(data: bytes) -> Envelope:
    if len(data) < _HEAD.size:
        raise BadUpdate("update blob is shorter than its envelope")
    magic, version, round_, root, author_len = _HEAD.unpack_from(data)
    if magic != UPDATE_MAGIC or version not in (UPDATE_VERSION, UPDATE_VERSION_BUFFERS):
        raise BadUpdate("not an outer-loop update blob (bad magic or version)")
    end = _HEAD.size + author_len
    if author_len == 0 or len(data) < end:
        raise BadUpdate("update blob's author field is truncated")
    try:
        author = data[_HEAD.size : end].decode("ascii")
    except UnicodeDecodeError:
        raise BadUpdate("update blob's author is not a peer ID") from None
    if version == UPDATE_VERSION:
        return Envelope(int(round_), root.hex(), author, bytes(data[end:]))
    if len(data) < end + _PAYLOAD_LEN.size:
        raise BadUpdate("update blob's payload length is truncated")
    (length,) = _PAYLOAD_LEN.unpack_from(data, end)
    start = end + _PAYLOAD_LEN.size
    if length > len(data) - start:
        raise BadUpdate("update blob's payload is truncated")
    payload, buffers = bytes(data[start : start + length]), bytes(data[start + length :])
    if not buffers:
        raise BadUpdate("update blob's buffers are missing")
    return Envelope(int(round_), root.hex(), author, payload, buffers)


@dataclass(frozen=True)
class Exclusion:
    peer: str
    blob: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"peer": self.peer, "blob": self.blob, "reason": self.reason}


@dataclass(frozen=True)
class Aggregate:
    state: OuterState
    admitted: tuple[tuple[str, str, float], ...]  # (peer, blob, weight)
    excluded: tuple[Exclusion, ...]
    median_norm: float
    # Rule 4's cosine of each update with the others' sum (peer -> c_i), where measured.
    agreement: tuple[tuple[str, float], ...] = ()


def _norm(tensors: dict[str, F32]) -> float:
    """The L2 norm in float64: tensors in name order, each in NORM_BLOCK-element blocks
    squared into one scratch array (a float64 copy of a 124M-parameter state would be
    1 GB of memory to touch for one number)."""
    scratch = np.empty(NORM_BLOCK, dtype=np.float64)
    total = 0.0
    for name in sorted(tensors, key=lambda n: n.encode()):
        flat = tensors[name].reshape(-1)
        for lo in range(0, flat.size, NORM_BLOCK):
            block = scratch[: min(NORM_BLOCK, flat.size - lo)]
            np.square(flat[lo : lo + NORM_BLOCK], out=block, dtype=np.float64)
            total += float(np.sum(block))
    return math.sqrt(total)


def _parse(data: bytes, state: OuterState, peer: str) -> Parsed:
    """The update, parsed; :class:`CodecError` for a blob not made for this round by
    ``peer`` (rule 1) or not decodable against the state's shapes."""
    envelope = unwrap_update(data)
    if envelope.author != peer:
        raise BadUpdate(f"a copy: the blob is {envelope.author[-8:]}'s update")
    if envelope.round != state.round:
        raise BadUpdate(f"stale: made for round {envelope.round}")
    shapes = state.shapes()
    limit = sum(math.prod(s) for s in shapes.values())
    return parse(envelope.payload, max_elements=limit, expected=shapes)


class _Updates:
    """Point 6: each named update for the passes after the first, a top-k one from its
    sparse form and kept values (:meth:`keep`), a dense one decoded again from ``load``."""

    def __init__(self, state: OuterState, load: Callable[[str], bytes], keep_share: float) -> None:
        self.state = state
        self.load = load
        self.sparse: dict[str, tuple[Parsed, dict[str, F32]]] = {}
        self.room = int(keep_share * 4 * sum(v.size for v in state.params.values()))

    def keep(self, blob: str, parsed: Parsed, values: dict[str, F32] | None) -> None:
        """Keep a top-k update's sparse form and the values it stands for at its kept
        positions (``values``: as :func:`_measured` returned them)."""
        if parsed.sparse is None or values is None:
            return
        size = sum(
            t.positions.nbytes + t.codes.nbytes + t.scales.nbytes + values[n].nbytes
            for n, t in parsed.sparse.items()
        )
        if size <= self.room:  # past the room, parsed again for each pass
            self.room -= size
            self.sparse[blob] = (parsed, values)

    def _sparse(self, peer: str, blob: str) -> tuple[Parsed, dict[str, F32] | None]:
        kept = self.sparse.get(blob)
        if kept is not None:
            return kept
        parsed = _parse(self.load(blob), self.state, peer)
        if parsed.sparse is None:
            return parsed, None
        assert parsed.params is not None
        return parsed, {n: dequantised(t, parsed.params) for n, t in parsed.sparse.items()}

    def signs(self, peer: str, blob: str) -> dict[str, tuple[Any, npt.NDArray[np.int8]]]:
        """name -> (where, signs): the update's signs at ``where`` (a flat index array of a
        top-k update's kept positions, or ``...`` for all of a dense one's) and zero
        elsewhere."""
        return {n: (where, _sign8(v)) for n, (where, v) in self.values(peer, blob).items()}

    def values(self, peer: str, blob: str) -> dict[str, tuple[Any, F32]]:
        """name -> (where, values), as :meth:`signs`."""
        parsed, values = self._sparse(peer, blob)
        if parsed.sparse is None or values is None:
            return {n: (..., v.reshape(-1)) for n, v in parsed.tensors().items()}
        return {n: (t.positions, values[n]) for n, t in parsed.sparse.items()}


def _weighted_sum(
    state: OuterState, admitted: Sequence[tuple[str, str, float]], updates: _Updates
) -> dict[str, F32]:
    """``sum of w_i u_i`` in ascending peer order, one decoded update at a time."""
    totals = {name: np.zeros(v.shape, dtype=np.float32) for name, v in state.params.items()}
    for peer, blob, weight in admitted:
        w = np.float32(weight)
        for name, (where, values) in updates.values(peer, blob).items():
            flat = totals[name].reshape(-1)  # a view: the totals are contiguous
            flat[where] += values if weight == 1.0 else w * values
    return totals


def _sign8(values: F32) -> npt.NDArray[np.int8]:
    """``np.sign(values).astype(np.int8)`` for finite values (every decoded update's are),
    in one byte per element throughout: two comparisons and a subtraction in place, where
    the float sign and its cast cost two full float32 passes."""
    positive = np.greater(values, 0).view(np.int8)
    return np.subtract(positive, np.less(values, 0).view(np.int8), out=positive)


def _measured(
    parsed: Parsed,
) -> tuple[float, npt.NDArray[np.int8], dict[str, F32] | None]:
    """Rule 3's norm and rule 2's signature of an update: a top-k one's from its kept
    values alone (point 6, which it returns too), a dense one's from its tensors."""
    values: dict[str, F32] | None = None
    parts: dict[str, tuple[Any, F32, int]]
    if parsed.sparse is None:
        parts = {n: (..., v.reshape(-1), v.size) for n, v in parsed.tensors().items()}
    else:
        assert parsed.params is not None
        values = {n: dequantised(t, parsed.params) for n, t in parsed.sparse.items()}
        parts = {n: (t.positions, values[n], math.prod(t.shape)) for n, t in parsed.sparse.items()}
    return _norm({n: _nonzero(v) for n, (_, v, _) in parts.items()}), _sketch(parts), values


def _nonzero(flat: F32) -> F32:
    """The nonzero values of a flat array, in position order: what an update's norm sums
    (rule 7), so that a top-k update's kept values and its dense decoding sum alike."""
    kept: F32 = flat[flat != 0]
    return kept


def _sketch(parts: dict[str, tuple[Any, F32, int]]) -> npt.NDArray[np.int8]:
    """Rule 2's signature of an update: its signs at SKETCH_COORDS evenly strided
    coordinates of the parameters in name order (all of them in a smaller model).
    ``parts``: name -> (where, values, size): a top-k update's values at its kept flat
    positions (its signs are zero elsewhere), or ``...`` and all of a dense one's."""
    names = sorted(parts, key=str.encode)
    total = sum(parts[n][2] for n in names)
    stride = max(1, -(-total // SKETCH_COORDS))
    sketch = np.zeros(-(-total // stride), dtype=np.int8)
    offset = 0
    for name in names:
        where, values, size = parts[name]
        if where is ...:
            sampled = values[-offset % stride :: stride]
            first = -(-offset // stride)
            sketch[first : first + sampled.size] = _sign8(sampled)
        else:
            at = where + offset
            hit = at % stride == 0
            sketch[at[hit] // stride] = _sign8(values[hit])
        offset += size
    return sketch


def _near_copies(sketches: dict[str, npt.NDArray[np.int8]], norms: dict[str, float]) -> list[str]:
    """Rule 2's near-copies: of two updates whose signs agree with cosine at least
    NEAR_COPY_COSINE, the larger (then the later in peer order) goes."""
    peers = sorted(sketches, key=str.encode)
    out: set[str] = set()
    own = {p: int(np.count_nonzero(sketches[p])) for p in peers}
    for i, a in enumerate(peers):
        for b in peers[i + 1 :]:
            if a in out or b in out or not own[a] or not own[b]:
                continue
            dot = int(np.dot(sketches[a].astype(np.int32), sketches[b].astype(np.int32)))
            if dot >= NEAR_COPY_COSINE * math.sqrt(own[a] * own[b]):
                out.add(b if (norms[b], 1) >= (norms[a], 0) else a)
    return sorted(out, key=str.encode)


def _cosines(
    candidates: Sequence[tuple[str, str, float]],
    votes: dict[str, npt.NDArray[np.int32]],
    updates: _Updates,
) -> list[tuple[str, float]]:
    """Rule 4's cosine of each candidate's signs with the others' votes (``votes`` minus
    its own), in integers up to one final division."""
    votes_sq = sum(int(np.sum(v * v, dtype=np.int64)) for v in votes.values())
    out = []
    for peer, blob, _ in candidates:
        signs = updates.signs(peer, blob)
        dot = 0  # <s_i, V>
        own = 0  # <s_i, s_i>
        for name, (where, s) in signs.items():
            dot += int(np.sum(s * votes[name].reshape(-1)[where], dtype=np.int64))
            own += int(np.count_nonzero(s))
        others_sq = votes_sq - 2 * dot + own  # |V - s_i|^2
        out.append((peer, (dot - own) / math.sqrt(own * others_sq) if own and others_sq else 0.0))
    return out


def _disagreeing(
    state: OuterState,
    candidates: list[tuple[str, str, float]],
    updates: _Updates,
) -> tuple[list[str], list[tuple[str, float]]]:
    """Rule 4: the candidates excluded for disagreeing, worst first, and the first
    measurement of every candidate's cosine."""
    # int32: a vote count is at most the number of workers.
    votes = {name: np.zeros(v.shape, dtype=np.int32) for name, v in state.params.items()}
    for peer, blob, _ in candidates:
        for name, (where, sign) in updates.signs(peer, blob).items():
            votes[name].reshape(-1)[where] += sign
    first: list[tuple[str, float]] = []
    out: list[str] = []
    left = list(candidates)
    while len(left) >= MIN_FOR_DIRECTION and len(out) < len(candidates) // MAX_OUTVOTED:
        cosines = _cosines(left, votes, updates)
        first = first or cosines
        ranked = sorted(c for _, c in cosines)
        median = ranked[(len(ranked) - 1) // 2]
        bar = median - max(AGREEMENT_MARGIN, (1 - MIN_AGREEMENT) * abs(median))
        worst, lowest = min(cosines, key=lambda pc: (pc[1], pc[0].encode()))
        if lowest >= bar:
            break
        out.append(worst)
        entry = next(e for e in left if e[0] == worst)
        for name, (where, sign) in updates.signs(worst, entry[1]).items():
            votes[name].reshape(-1)[where] -= sign
        left.remove(entry)
    return out, first


def aggregate(
    state: OuterState,
    entries: Sequence[tuple[str, str]],
    load: Callable[[str], bytes],
    config: OuterConfig,
    *,
    start_root: str | None = None,
    sparse_keep_share: float = SPARSE_KEEP_SHARE,
) -> Aggregate:
    """S_{r+1} from S_r and the named ``(peer, blob)`` updates (rules 1-7); ``load(blob)``
    returns a blob's bytes. ``start_root`` (S_r's root) is checked against envelopes.
    ``sparse_keep_share``: see :data:`SPARSE_KEEP_SHARE` (point 6)."""
    order = sorted(entries, key=lambda e: e[0].encode())
    excluded: list[Exclusion] = []
    norms: dict[str, float] = {}
    payloads: dict[bytes, str] = {}
    sketches: dict[str, npt.NDArray[np.int8]] = {}
    param_norm = _norm(state.params)
    updates = _Updates(state, load, sparse_keep_share)
    buffer_shapes = {n: tuple(v.shape) for n, v in state.buffers.items()}
    buffers: dict[str, dict[str, F32]] = {}
    for peer, blob in order:
        try:
            data = load(blob)
            envelope = unwrap_update(data)
            if start_root is not None and envelope.start_root != start_root:
                raise BadUpdate("stale: made from another state root")
            parsed = _parse(data, state, peer)
            n, sketch, values = _measured(parsed)
            held = envelope.decoded_buffers(buffer_shapes)
        except CodecError as exc:
            excluded.append(Exclusion(peer, blob, str(exc).split(":")[0] or "undecodable"))
            continue
        digest = blake3.blake3(envelope.payload).digest()
        if digest in payloads:
            excluded.append(Exclusion(peer, blob, "a copy of another update's payload"))
            continue
        payloads[digest] = peer
        if n > MAX_PARAM_RATIO * param_norm:
            excluded.append(Exclusion(peer, blob, "norm out of bounds (larger than the model)"))
            continue
        norms[peer] = n
        sketches[peer] = sketch
        buffers[peer] = held
        updates.keep(blob, parsed, values)
    blobs = dict(order)
    for peer in _near_copies(sketches, norms):
        excluded.append(Exclusion(peer, blobs[peer], "a near-copy of another update"))
        del norms[peer]
    ranked = sorted(norms.values())
    median = ranked[(len(ranked) - 1) // 2] if ranked else 0.0
    weights: dict[str, float] = {}
    for peer, blob in order:
        if peer not in norms:
            continue
        n = norms[peer]
        if n > REFUSE_FACTOR * median:
            excluded.append(Exclusion(peer, blob, "norm far above the round's median"))
            continue
        if n * REFUSE_FACTOR < median:
            excluded.append(Exclusion(peer, blob, "norm far below the round's median"))
            continue
        weights[peer] = 1.0 if n <= CLIP_FACTOR * median else CLIP_FACTOR * median / n
    admitted = [(p, b, weights[p]) for p, b in order if p in weights]
    if not admitted:
        excluded.sort(key=lambda e: e.peer.encode())
        unchanged = OuterState(state.round + 1, state.params, state.momentum, state.buffers)
        return Aggregate(unchanged, (), tuple(excluded), median)
    against, agreement = _disagreeing(state, admitted, updates)
    for peer, blob, _ in admitted:
        if peer in against:
            excluded.append(Exclusion(peer, blob, "disagrees with the round's updates"))
    admitted = [a for a in admitted if a[0] not in against]
    totals = _weighted_sum(state, admitted, updates)
    excluded.sort(key=lambda e: e.peer.encode())
    count = np.float32(len(admitted))
    for total in totals.values():
        total /= count  # the mean, in place: the sums are this function's own arrays
    # The totals are this function's own: the new momentum is written over them.
    following = outer_step(state, totals, config, grad_is_spare=True)
    if buffer_shapes:  # rule 8
        held_by = [buffers[peer] for peer, _, _ in admitted]
        following = replace(following, buffers=median_buffers(held_by, buffer_shapes))
    return Aggregate(following, tuple(admitted), tuple(excluded), median, tuple(agreement))


def rooted(agg: Aggregate) -> tuple[Aggregate, str]:
    """``agg`` and its next state's root, computed together off the event loop (at 124M
    parameters the root hashes 1 GB)."""
    return agg, state_root(agg.state)
