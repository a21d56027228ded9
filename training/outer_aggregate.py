"""Bounded, robust aggregation of a closure's updates, one update in memory at a time.

Theory of operation
-------------------
A closure names the updates of a round (``training.outer_agreement``); every worker turns
them into S_{r+1} with :func:`aggregate`, a pure function of S_r and the named blobs, so
equal inputs give equal bits everywhere (every op is float32 elementwise numpy, or a
float64 reduction over one array in a fixed layout, on one thread).

1. **Envelope.** An update blob is :func:`wrap_update`: magic, the round, the start root
   and the author's peer ID, then the codec payload. A blob whose envelope names another
   round or root is *stale*; one whose author is not the peer the closure names it for is
   *a copy* (someone re-signed another worker's blob); either is excluded.
2. **Bounds relative to the round.** For each update u_i, in ascending peer order, the L2
   norm n_i (float64). Excluded: ``n_i > MAX_PARAM_RATIO * ||params of S_r||`` (a step
   larger than the model itself is no pseudo-gradient), and, among the rest, with m the
   lower median of their norms, ``n_i > REFUSE_FACTOR * m`` (far outside what the
   round's other workers sent). The others get weight ``w_i = min(1, CLIP_FACTOR * m / n_i)``
   (clipped to at most CLIP_FACTOR times the median norm).
3. **What one worker can do.** With at least three admitted updates the lower median is
   an honest worker's norm or lies between two honest norms, whatever one byzantine worker
   sends; so the mean g moves by at most ``CLIP_FACTOR * m / k`` from the honest mean for
   k admitted updates, and the outer step moves the parameters by at most
   ``lr * (1 + mu) * ||g|| + lr * mu**2 * ||momentum||``. Decoding already refuses NaN and
   infinity, and norms are float64 (a 1e30 scale squares to 1e60, still finite), so no
   admitted update can make the state non-finite. With fewer than three updates the
   MAX_PARAM_RATIO bound still holds. What this does not catch: garbage whose norm is in
   range (bounded by rule 2, not detected; replaying a sample of updates is the remedy).
4. **Memory.** Two passes over the named blobs, each decoding one update at a time:
   norms first, then ``total += w_i * u_i``; peak memory is the state, one decoded update
   and the accumulator, O(model) whatever the number of workers.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from training.codec import F32, CodecError, decode
from training.outer import OuterConfig, OuterState, outer_step

UPDATE_MAGIC = b"BNOU"
UPDATE_VERSION = 1
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

_HEAD = struct.Struct("<4sBQ32sB")


class BadUpdate(CodecError):
    """An update blob that is not a well-formed envelope around a codec payload."""


def wrap_update(payload: bytes, *, round_: int, start_root: str, author: str) -> bytes:
    """The update blob: envelope (rule 1) then the codec payload."""
    raw = author.encode()
    if not 0 < len(raw) <= MAX_AUTHOR_LEN:
        raise ValueError(f"author {author!r} is not a peer ID")
    head = _HEAD.pack(UPDATE_MAGIC, UPDATE_VERSION, round_, bytes.fromhex(start_root), len(raw))
    return head + raw + payload


@dataclass(frozen=True)
class Envelope:
    round: int
    start_root: str
    author: str
    payload: bytes


def unwrap_update(data: bytes) -> Envelope:
    if len(data) < _HEAD.size:
        raise BadUpdate("update blob is shorter than its envelope")
    magic, version, round_, root, author_len = _HEAD.unpack_from(data)
    if magic != UPDATE_MAGIC or version != UPDATE_VERSION:
        raise BadUpdate("not an outer-loop update blob (bad magic or version)")
    end = _HEAD.size + author_len
    if author_len == 0 or len(data) < end:
        raise BadUpdate("update blob's author field is truncated")
    try:
        author = data[_HEAD.size : end].decode("ascii")
    except UnicodeDecodeError:
        raise BadUpdate("update blob's author is not a peer ID") from None
    return Envelope(int(round_), root.hex(), author, bytes(data[end:]))


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


def _norm(tensors: dict[str, F32]) -> float:
    total = 0.0
    for name in sorted(tensors, key=lambda n: n.encode()):
        total += float(np.sum(np.square(tensors[name], dtype=np.float64)))
    return math.sqrt(total)


def _decode(data: bytes, state: OuterState, peer: str) -> dict[str, F32]:
    """The update's tensors; :class:`CodecError` for a blob not made for this round by
    ``peer`` (rule 1) or not decodable against the state's shapes."""
    envelope = unwrap_update(data)
    if envelope.author != peer:
        raise BadUpdate(f"a copy: the blob is {envelope.author[-8:]}'s update")
    if envelope.round != state.round:
        raise BadUpdate(f"stale: made for round {envelope.round}")
    shapes = state.shapes()
    limit = sum(math.prod(s) for s in shapes.values())
    return decode(envelope.payload, max_elements=limit, expected=shapes).tensors


def aggregate(
    state: OuterState,
    entries: Sequence[tuple[str, str]],
    load: Callable[[str], bytes],
    config: OuterConfig,
    *,
    start_root: str | None = None,
) -> Aggregate:
    """S_{r+1} from S_r and the named ``(peer, blob)`` updates (rules 1-4); ``load(blob)``
    returns a blob's bytes. ``start_root`` (S_r's root) is checked against envelopes."""
    order = sorted(entries, key=lambda e: e[0].encode())
    excluded: list[Exclusion] = []
    norms: dict[str, float] = {}
    param_norm = _norm(state.params)
    for peer, blob in order:
        try:
            data = load(blob)
            if start_root is not None and unwrap_update(data).start_root != start_root:
                raise BadUpdate("stale: made from another state root")
            n = _norm(_decode(data, state, peer))
        except CodecError as exc:
            excluded.append(Exclusion(peer, blob, str(exc).split(":")[0] or "undecodable"))
            continue
        if n > MAX_PARAM_RATIO * param_norm:
            excluded.append(Exclusion(peer, blob, "norm out of bounds (larger than the model)"))
            continue
        norms[peer] = n
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
        weights[peer] = 1.0 if n <= CLIP_FACTOR * median else CLIP_FACTOR * median / n
    admitted = [(p, b, weights[p]) for p, b in order if p in weights]
    excluded.sort(key=lambda e: e.peer.encode())
    if not admitted:
        return Aggregate(
            OuterState(state.round + 1, state.params, state.momentum), (), tuple(excluded), median
        )
    totals = {name: np.zeros(v.shape, dtype=np.float32) for name, v in state.params.items()}
    for peer, blob, weight in admitted:
        tensors = _decode(load(blob), state, peer)
        w = np.float32(weight)
        for name, total in totals.items():
            total += tensors[name] if weight == 1.0 else w * tensors[name]
        del tensors
    count = np.float32(len(admitted))
    mean = {name: total / count for name, total in totals.items()}
    following = outer_step(state, mean, config)
    return Aggregate(following, tuple(admitted), tuple(excluded), median)
