"""Pseudo-gradient codec: SparseLoCo top-k + 2-bit quantisation, with error feedback.

Theory of operation
-------------------
A DiLoCo worker sends, once per round, its pseudo-gradient (global start minus its own end
state) for every parameter tensor. Sent densely that is 4 bytes per parameter; this codec
sends a few bits per kept value instead:

1. Each tensor is flattened (C order) and cut into chunks of ``chunk`` values (a power of
   two); the last chunk may be shorter. A full chunk keeps ``k`` values. A short last chunk
   of ``n`` values keeps ``ceil(k * n / chunk)`` (Rice layout: the same density as a full
   chunk, so a 64-value norm weight keeps 1 value, not 48 of its 64) or ``min(k, n)``
   (fixed layout, schemes 1 and 2).
2. Selection is by magnitude with a total order on ties: larger ``|v|`` first, then lower
   index. It is computed from a per-chunk threshold (the k-th largest magnitude) plus the
   lowest-index values equal to it, so it is a pure function of the values, with no
   dependence on sort stability or thread count.
3. The kept values of a chunk, ranked in that same order, are split into a high group (the
   first ``ceil(m/2)`` of the ``m`` kept) and a low group. Each value becomes a 2-bit code:
   bit 0 is its sign (1 = negative), bit 1 its group (1 = high). The chunk carries two
   float32 scales, the mean magnitude of its low and of its high group (computed in float64,
   then rounded once), and a code decodes to ``±scale``.
4. Positions. Fixed layout: each kept value's in-chunk index in ``log2(chunk)`` bits (12 at
   chunk 4096, about 15.3 bits per kept value with codes and scales). Rice layout (schemes 3
   and 4, the default): the gaps between a chunk's kept indices (the first index, then each
   index minus the previous minus one) are Golomb-Rice coded with ``b = floor(log2(chunk //
   k))``, a pure function of the parameters: the low ``b`` bits of each gap fixed-width, the
   rest (``gap >> b``) in unary. For top-k positions that is within about 0.2 bits of the
   entropy of the kept set (7.5 bits per value at k 64 of 4096, instead of 12).
5. Error feedback (``ErrorFeedback``) keeps, per worker, what was not sent:
   ``residual = decay * residual + grad; send C(residual); residual -= D(C(residual))``,
   so dropped and quantised-away mass is sent in later rounds.

Wire format (all integers little-endian; "bits" fields are LSB-first bit streams)::

    magic  b"BNPG"        4
    version u8 (=1)       scheme u8 (0 dense float32, 1 top-k 2-bit, 3 top-k 2-bit Rice)
    dtype u8 (1 float32)  index_bits u8 (log2 chunk; 0 for dense)
    chunk u32  k u32  value_bits u32 (2; 32 for dense)  count u32 (tensors)
    per tensor, in strictly increasing UTF-8 byte order of names:
        name_len u16, name, ndim u8, dims u64 * ndim
      (schemes 2 and 4 instead: a 32-byte BLAKE3 digest of those entries, the "schema"; the
      receiver must know the names and shapes, and the digest must match them)
    per tensor, same order:
        dense:  numel float32 values
        top-k:  scales float32 [n_chunks, 2] (low, high), then the kept entries' in-chunk
                indices (index_bits each, strictly increasing within a chunk), zero-padded
                to a byte, then their 2-bit codes, zero-padded to a byte
        Rice:   scales float32 [n_chunks, 2], then the low b bits of every gap, zero-padded
                to a byte, then the 2-bit codes, zero-padded to a byte
    Rice only, after the last tensor: one unary stream for the gaps of every tensor in
        order, ``gap >> b`` zero bits then a one bit each, zero-padded to a byte

and nothing after. Every field is a pure function of the input values and parameters, so
the bytes are canonical: the same update gives the same bytes in any process with any
thread count (all arithmetic is numpy on one thread; nothing iterates a dict or set).
``decode`` accepts only what ``encode`` could have produced: it checks magic, version,
parameters, name order and uniqueness, shapes against bounds (before allocating), the exact
total length (for the Rice layout: the fixed part exactly, the unary stream against the
most a valid one can take, ``sum over chunks of m + ((n - m) >> b)`` bits, before unpacking
it, then its exact count of one bits and its padding), index ranges and order, padding
bits, finite non-negative scales and the high/low split of the codes; any failure is a
``CodecError``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import numpy.typing as npt

from blobstore.exitcodes import ExitCode
from training.errors import TrainingError

F32 = npt.NDArray[np.float32]

MAGIC = b"BNPG"
VERSION = 1
SCHEME_DENSE = 0
SCHEME_TOPK = 1
# Top-k whose tensor names and shapes are not repeated: the header carries a digest of
# them instead, and the receiver supplies them (from the run's state blob, which it holds).
# Names and shapes would be 23% of an update on the tiny model, sent every round.
SCHEME_TOPK_REF = 2
# Top-k with Rice-coded positions and density-proportional short chunks (module docstring,
# items 1 and 4), with names and shapes inline (3) or by schema digest (4).
SCHEME_RICE = 3
SCHEME_RICE_REF = 4
TOPK_SCHEMES = (SCHEME_TOPK, SCHEME_TOPK_REF, SCHEME_RICE, SCHEME_RICE_REF)
REF_SCHEMES = (SCHEME_TOPK_REF, SCHEME_RICE_REF)
SCHEMA_DOMAIN = b"blobnet/pg-schema/v1"
SCHEMA_DIGEST_LEN = 32
DTYPE_FLOAT32 = 1
SPARSE_VALUE_BITS = 2
DENSE_VALUE_BITS = 32

# Chunks are powers of two so an in-chunk index takes exactly log2(chunk) bits. 16 values is
# the smallest chunk where sparsifying is worth a header; 65536 keeps indices in 16 bits.
MIN_CHUNK_LOG2 = 4
MAX_CHUNK_LOG2 = 16
# A model's parameter tensors: a 70B model has well under 10^4 named tensors.
MAX_TENSORS = 1 << 16
# Parameter names are dotted module paths; nothing sane comes near 1 KiB.
MAX_NAME_LEN = 1024
# Parameter tensors have at most a handful of dimensions (conv kernels have 5).
MAX_NDIM = 8
# Decoding allocates 4 bytes per element of every tensor, and a top-k payload can be
# thousands of times smaller than that (8 bytes of scales per chunk of up to 65536 values):
# a 328 KiB update can name 2^31 values. So every decode names its bound (``max_elements``,
# no default: the model's size, which its caller knows), and none may exceed this ceiling
# (2^31 float32 = 8 GiB, the pseudo-gradient of a 2B-parameter model).
MAX_ELEMENTS = 1 << 31

_FIXED = struct.Struct("<4sBBBBIIII")


class CodecError(TrainingError):
    """An encoded pseudo-gradient is malformed (a remote peer's fault: drop the update)."""

    exit_code = ExitCode.BAD_DATA


@dataclass(frozen=True)
class CodecParams:
    """Top-k parameters: ``k`` kept values per ``chunk`` values (``chunk`` a power of 2);
    ``rice``: the Rice layout (schemes 3 and 4), else the fixed layout (schemes 1 and 2)."""

    chunk: int = 4096
    k: int = 32
    rice: bool = True

    def __post_init__(self) -> None:
        if (
            self.chunk <= 0
            or self.chunk & (self.chunk - 1)
            or not MIN_CHUNK_LOG2 <= self.chunk.bit_length() - 1 <= MAX_CHUNK_LOG2
        ):
            raise ValueError(
                f"chunk {self.chunk} must be a power of two in "
                f"{1 << MIN_CHUNK_LOG2}..{1 << MAX_CHUNK_LOG2}"
            )
        if not 1 <= self.k <= self.chunk:
            raise ValueError(f"k {self.k} must be in 1..{self.chunk}")

    @property
    def index_bits(self) -> int:
        return self.chunk.bit_length() - 1

    @property
    def rice_bits(self) -> int:
        """Rice parameter b: floor(log2(chunk // k)), near-optimal for gaps averaging
        chunk / k (within about 0.1 bit per value of the best b on top-k positions)."""
        return (self.chunk // self.k).bit_length() - 1

    def ratio_vs_fp32(self) -> float:
        """Compression against dense float32 on full chunks (scales included; for the Rice
        layout the worst case, every gap's unary part at its largest)."""
        if self.rice:
            b = self.rice_bits
            position_bits = self.k * (b + 1) + ((self.chunk - self.k) >> b)
        else:
            position_bits = self.k * self.index_bits
        bits = position_bits + self.k * SPARSE_VALUE_BITS + 64
        return 32 * self.chunk / bits


@dataclass(frozen=True)
class SparseTensor:
    """One tensor's compressed form: per-chunk scales, kept flat positions and codes."""

    shape: tuple[int, ...]
    scales: F32  # [n_chunks, 2]: low, high
    positions: npt.NDArray[np.int64]  # flat indices, ascending
    codes: npt.NDArray[np.uint8]  # 2-bit code per position


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _short_kept(n: int, params: CodecParams) -> int:
    """Kept values of a chunk of ``n <= chunk`` values (module docstring, item 1)."""
    if params.rice:
        return min(n, -(-params.k * n // params.chunk))
    return min(params.k, n)


def _kept_total(numel: int, params: CodecParams) -> tuple[int, int]:
    """(chunks, kept values) of a tensor of ``numel`` values, without allocating."""
    n_chunks = -(-numel // params.chunk)
    if n_chunks == 0:
        return 0, 0
    rem = numel - (n_chunks - 1) * params.chunk
    return n_chunks, (n_chunks - 1) * params.k + _short_kept(rem, params)


def _chunk_counts(numel: int, params: CodecParams) -> npt.NDArray[np.int64]:
    """Kept values per chunk: ``k`` for full chunks, fewer for a short last one."""
    n_chunks = -(-numel // params.chunk)
    counts = np.full(n_chunks, params.k, dtype=np.int64)
    rem = numel - (n_chunks - 1) * params.chunk if n_chunks else 0
    if n_chunks and rem < params.chunk:
        counts[-1] = _short_kept(rem, params)
    return counts


def _checked_float32(value: Any, name: str) -> F32:
    """A float32 numpy view (or CPU copy) of a numpy array or torch tensor, all finite."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().to("cpu").contiguous().numpy()
    array = np.asarray(value)
    if array.dtype != np.float32:
        raise ValueError(f"tensor {name!r} is {array.dtype}, expected float32")
    if not np.isfinite(array).all():
        raise ValueError(f"tensor {name!r} holds NaN or infinity; refusing to send it")
    return array


def _as_float32(value: Any, name: str) -> F32:
    """A C-contiguous float32 numpy copy of a numpy array or CPU torch tensor."""
    # np.array keeps 0-d arrays 0-d (ascontiguousarray would make them 1-d).
    return np.array(_checked_float32(value, name), dtype=np.float32, order="C", copy=True)


def _check_names(names: list[str]) -> None:
    if len(names) > MAX_TENSORS:
        raise ValueError(f"{len(names)} tensors exceed the limit of {MAX_TENSORS}")
    for name in names:
        if not name or len(name.encode()) > MAX_NAME_LEN:
            raise ValueError(f"tensor name {name!r} is empty or longer than {MAX_NAME_LEN}")


def _sorted_names(tensors: Mapping[str, Any]) -> list[str]:
    names = sorted(tensors, key=lambda n: n.encode())
    _check_names(names)
    return names


# Chunks compressed together: their temporaries (magnitudes, a partition copy, masks) are
# a few bytes per value of the block, never of the whole tensor, so a 1B-parameter update
# needs no full-size scratch; 64 chunks of 4096 are 256K values (1 MiB of float32), which
# keeps a block in cache (1M-value blocks compressed 30% slower here).
BLOCK_VALUES = 1 << 18


def compress_tensor(values: F32, params: CodecParams) -> SparseTensor:
    """Top-k + 2-bit quantisation of one float32 tensor (see the module docstring),
    a block of whole chunks at a time (each chunk's selection and scales are its own)."""
    shape = tuple(int(d) for d in values.shape)
    flat = values.reshape(-1)
    numel = flat.size
    counts = _chunk_counts(numel, params)
    n_chunks = counts.size
    if n_chunks == 0:
        return SparseTensor(
            shape, np.zeros((0, 2), np.float32), np.zeros(0, np.int64), np.zeros(0, np.uint8)
        )
    chunk = params.chunk
    rows_per_block = max(1, BLOCK_VALUES // chunk)
    scales = np.empty((n_chunks, 2), dtype=np.float32)
    positions: list[npt.NDArray[np.int64]] = []
    codes: list[npt.NDArray[np.uint8]] = []
    for first in range(0, n_chunks, rows_per_block):
        last = min(first + rows_per_block, n_chunks)
        block = flat[first * chunk : min(last * chunk, numel)]
        pos, code = _compress_block(block, counts[first:last], params, scales[first:last])
        positions.append(pos + first * chunk)
        codes.append(code)
    return SparseTensor(shape, scales, np.concatenate(positions), np.concatenate(codes))


def _compress_block(
    flat: F32, counts: npt.NDArray[np.int64], params: CodecParams, scales_out: F32
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    """Select and quantise whole chunks ``flat`` (the last one may be short): positions
    relative to the block, their codes; each chunk's (low, high) scales into ``scales_out``."""
    chunk = params.chunk
    n_chunks = counts.size
    numel = flat.size
    # Padded magnitudes; padding is -1 so it never beats a real value (|v| >= 0).
    if numel == n_chunks * chunk:
        mags = np.abs(flat)
    else:
        mags = np.full(n_chunks * chunk, -1.0, dtype=np.float32)
        np.abs(flat, out=mags[:numel])
    mags2 = mags.reshape(n_chunks, chunk)
    groups = 1 << (params.k - 1).bit_length()  # the smallest power of two >= k
    full = n_chunks if numel == n_chunks * chunk else n_chunks - 1  # chunks keeping k
    if chunk >= 4 * groups and full:
        rows, cols = _select_by_candidates(mags2[:full], params.k, groups)
        if full < n_chunks:  # the short last chunk
            last_rows, last_cols = _select_by_partition(mags2[full:], counts[full:], params.k)
            rows = np.concatenate((rows, last_rows + full))
            cols = np.concatenate((cols, last_cols))
    else:
        rows, cols = _select_by_partition(mags2, counts, params.k)
    positions = rows.astype(np.int64) * chunk + cols.astype(np.int64)
    kept = flat[positions]
    # Rank within each chunk by (-|v|, position); the first ceil(m/2) form the high group.
    mags64 = np.abs(kept).astype(np.float64)
    order = np.lexsort((positions, -mags64, rows))
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank = np.empty(positions.size, dtype=np.int64)
    rank[order] = np.arange(positions.size) - np.repeat(starts, counts)
    n_high = (counts + 1) // 2
    n_low = counts - n_high
    high = rank < np.repeat(n_high, counts)
    # Group means: float64 sums in ascending position order (bincount adds sequentially),
    # one rounding to float32 at the end.
    sum_high = np.bincount(rows[high], weights=mags64[high], minlength=n_chunks)
    sum_low = np.bincount(rows[~high], weights=mags64[~high], minlength=n_chunks)
    scales = np.zeros((n_chunks, 2), dtype=np.float64)
    scales[:, 1] = sum_high / n_high
    np.divide(sum_low, n_low, out=scales[:, 0], where=n_low > 0)
    scales_out[:] = scales.astype(np.float32)
    codes = ((kept < 0).astype(np.uint8) | (high.astype(np.uint8) << 1)).astype(np.uint8)
    return positions, codes


def _select_by_partition(
    mags2: F32, counts: npt.NDArray[np.int64], k: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Rule 2's selection in every chunk (row) of ``mags2``, by a partition of each row:
    (rows, cols) of the kept values, row-major (ascending positions)."""
    chunk = mags2.shape[1]
    # k-th largest magnitude per chunk (a value, so independent of partition's order). A
    # short last chunk keeping m < k takes its own m-th largest (a real value, m <= n).
    kth = chunk - k
    thresh = np.partition(mags2, kth, axis=1)[:, kth : kth + 1]
    if counts[-1] != k:
        last_kth = chunk - int(counts[-1])
        thresh[-1, 0] = np.partition(mags2[-1], last_kth)[last_kth]
    keep = mags2 >= thresh
    # Ties at the threshold beyond what a chunk keeps: the lowest indices equal to it win.
    extra = keep.sum(axis=1) - counts
    for row in np.flatnonzero(extra):
        equal = mags2[row] == thresh[row, 0]
        need = int(counts[row]) - int((mags2[row] > thresh[row, 0]).sum())
        keep[row] = (mags2[row] > thresh[row, 0]) | (equal & (np.cumsum(equal) <= need))
    rows, cols = np.nonzero(keep)
    return rows, cols


def _select_by_candidates(
    mags2: F32, k: int, groups: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """The same selection as :func:`_select_by_partition` for full chunks keeping ``k``,
    without partitioning whole chunks. Each chunk is cut into ``groups >= k`` disjoint
    strided groups; the k-th largest of their maxima is a lower bound of the chunk's k-th
    largest value (k groups hold a value at least that large), so every value the chunk
    keeps is among those at least that bound: a few percent of the chunk, which alone are
    partitioned. Same threshold, same ties rule, same output."""
    n_rows, chunk = mags2.shape
    maxima = mags2.reshape(n_rows, chunk // groups, groups).max(axis=1)
    bound = np.partition(maxima, groups - k, axis=1)[:, groups - k]
    # Flat indices, ascending (np.nonzero of the 2-D mask is several times slower).
    flat_index = np.flatnonzero(mags2 >= bound[:, None])
    rows, cols = np.divmod(flat_index, chunk)
    values = mags2.reshape(-1)[flat_index]
    per_row = np.bincount(rows, minlength=n_rows)
    starts = np.cumsum(per_row) - per_row
    slot = np.arange(rows.size) - np.repeat(starts, per_row)
    width = int(per_row.max())
    candidates = np.full((n_rows, width), -1.0, dtype=np.float32)
    candidates[rows, slot] = values
    thresh = np.partition(candidates, width - k, axis=1)[:, width - k]
    above = values > thresh[rows]
    equal = values == thresh[rows]
    # Ties at the threshold: the lowest indices equal to it win (candidates are in
    # ascending position order within a row).
    need = k - np.bincount(rows[above], minlength=n_rows)
    tie_rank = np.cumsum(equal) - 1
    tie_start = np.concatenate(([0], np.cumsum(np.bincount(rows[equal], minlength=n_rows))))[:-1]
    keep = above | (equal & (tie_rank - tie_start[rows] < need[rows]))
    return rows[keep], cols[keep]


def dequantised(sparse: SparseTensor, params: CodecParams) -> F32:
    """The values a ``SparseTensor`` stands for at its kept positions (``±scale``)."""
    chunk_of = sparse.positions // params.chunk
    magnitude = sparse.scales[chunk_of, (sparse.codes >> 1).astype(np.int64)]
    values: F32 = np.where(sparse.codes & 1, -magnitude, magnitude)
    return values


def decompress_tensor(sparse: SparseTensor, params: CodecParams) -> F32:
    """The dense float32 tensor a ``SparseTensor`` stands for (zeros where nothing kept)."""
    numel = _numel(sparse.shape)
    out = np.zeros(numel, dtype=np.float32)
    if sparse.positions.size:
        out[sparse.positions] = dequantised(sparse, params)
    return out.reshape(sparse.shape)


def compress(tensors: Mapping[str, Any], params: CodecParams) -> dict[str, SparseTensor]:
    """Compress every tensor (float32 numpy arrays or CPU torch tensors), reading them in
    place (compression writes nothing back)."""
    return {
        n: compress_tensor(np.asarray(_checked_float32(tensors[n], n), order="C"), params)
        for n in _sorted_names(tensors)
    }


def decompress(sparse: Mapping[str, SparseTensor], params: CodecParams) -> dict[str, F32]:
    return {n: decompress_tensor(sparse[n], params) for n in _sorted_names(sparse)}


# --- bit packing ---------------------------------------------------------------------


def _pack_bits(values: npt.NDArray[Any], bits: int) -> bytes:
    """``values`` (non-negative, < 2**bits) as an LSB-first bit stream, zero-padded."""
    if values.size == 0:
        return b""
    shifts = np.arange(bits, dtype=np.uint32)
    planes = ((values.astype(np.uint32)[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def _unpack_bits(data: bytes, count: int, bits: int, what: str) -> npt.NDArray[np.int64]:
    """Inverse of ``_pack_bits``; ``data`` must be exactly the padded length, padding zero."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    flat = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if flat[count * bits :].any():
        raise CodecError(f"nonzero padding bits after the {what}")
    planes = flat[: count * bits].reshape(count, bits).astype(np.int64)
    values: npt.NDArray[np.int64] = (planes << np.arange(bits, dtype=np.int64)).sum(axis=1)
    return values


def _nbytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def _gaps(positions: npt.NDArray[np.int64], chunk: int) -> npt.NDArray[np.int64]:
    """Rice layout's gaps: per chunk, the first kept index, then each index minus the
    previous one minus one (``positions`` ascending, so every gap is >= 0)."""
    local = positions % chunk
    gaps = local.copy()
    if positions.size > 1:
        same = (positions[1:] // chunk) == (positions[:-1] // chunk)
        gaps[1:] = np.where(same, local[1:] - local[:-1] - 1, local[1:])
    return gaps


def _pack_unary(quotients: npt.NDArray[np.int64]) -> bytes:
    """``q`` zero bits then a one bit for each quotient, LSB-first, zero-padded."""
    if quotients.size == 0:
        return b""
    ones = np.cumsum(quotients + 1) - 1
    bits = np.zeros(int(ones[-1]) + 1, dtype=np.uint8)
    bits[ones] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def _unpack_unary(data: bytes, count: int) -> npt.NDArray[np.int64]:
    """Inverse of ``_pack_unary``: exactly ``count`` one bits, then under a byte of zeros."""
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    ones = np.flatnonzero(bits).astype(np.int64)
    if ones.size != count:
        raise CodecError(f"position stream holds {ones.size} gaps; the header says {count}")
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    if len(data) != _nbytes(int(ones[-1]) + 1, 1):
        raise CodecError("position stream has padding past its last byte")
    return np.diff(ones, prepend=-1) - 1


# --- encoding ------------------------------------------------------------------------


def _shape_entries(shapes: list[tuple[str, tuple[int, ...]]]) -> list[bytes]:
    parts = []
    for name, shape in shapes:
        raw = name.encode()
        if len(shape) > MAX_NDIM:
            raise ValueError(f"tensor {name!r} has {len(shape)} dims, limit {MAX_NDIM}")
        parts.append(struct.pack("<H", len(raw)) + raw + struct.pack("<B", len(shape)))
        parts.append(struct.pack(f"<{len(shape)}Q", *shape))
    return parts


def schema_digest(shapes: Mapping[str, tuple[int, ...]]) -> bytes:
    """The digest schemes 2 and 4 carry in place of the tensor names and shapes."""
    ordered = [(n, tuple(shapes[n])) for n in sorted(shapes, key=lambda n: n.encode())]
    return blake3.blake3(SCHEMA_DOMAIN + b"".join(_shape_entries(ordered))).digest()


def _header(
    scheme: int, params: CodecParams | None, shapes: list[tuple[str, tuple[int, ...]]]
) -> bytes:
    if params is None:
        fixed = _FIXED.pack(
            MAGIC, VERSION, scheme, DTYPE_FLOAT32, 0, 0, 0, DENSE_VALUE_BITS, len(shapes)
        )
    else:
        fixed = _FIXED.pack(
            MAGIC,
            VERSION,
            scheme,
            DTYPE_FLOAT32,
            params.index_bits,
            params.chunk,
            params.k,
            SPARSE_VALUE_BITS,
            len(shapes),
        )
    if scheme in REF_SCHEMES:
        return fixed + schema_digest(dict(shapes))
    return fixed + b"".join(_shape_entries(shapes))


def encode_sparse(
    sparse: Mapping[str, SparseTensor], params: CodecParams, *, schema_ref: bool = False
) -> bytes:
    """Canonical bytes of a compressed update (``schema_ref``: by schema digest, without
    names; ``params.rice``: the Rice layout)."""
    names = _sorted_names(sparse)
    if params.rice:
        scheme = SCHEME_RICE_REF if schema_ref else SCHEME_RICE
    else:
        scheme = SCHEME_TOPK_REF if schema_ref else SCHEME_TOPK
    parts = [_header(scheme, params, [(n, sparse[n].shape) for n in names])]
    quotients = []
    for name in names:
        entry = sparse[name]
        parts.append(entry.scales.astype("<f4").tobytes())
        if params.rice:
            gaps = _gaps(entry.positions, params.chunk)
            b = params.rice_bits
            parts.append(_pack_bits(gaps & ((1 << b) - 1), b) if b else b"")
            quotients.append(gaps >> b)
        else:
            parts.append(_pack_bits(entry.positions % params.chunk, params.index_bits))
        parts.append(_pack_bits(entry.codes, SPARSE_VALUE_BITS))
    if params.rice:
        parts.append(_pack_unary(np.concatenate(quotients) if quotients else np.zeros(0, np.int64)))
    return b"".join(parts)


def encode(tensors: Mapping[str, Any], params: CodecParams) -> bytes:
    """Compress and encode ``tensors`` (no error feedback; see ``ErrorFeedback``)."""
    return encode_sparse(compress(tensors, params), params)


def encode_dense(tensors: Mapping[str, Any]) -> bytes:
    """Canonical bytes of an uncompressed float32 update (the dense DiLoCo baseline)."""
    names = _sorted_names(tensors)
    arrays = {n: _as_float32(tensors[n], n) for n in names}
    parts = [_header(SCHEME_DENSE, None, [(n, tuple(arrays[n].shape)) for n in names])]
    parts.extend(arrays[n].astype("<f4").tobytes() for n in names)
    return b"".join(parts)


# --- decoding ------------------------------------------------------------------------


class ByteReader:
    """Sequential reads of a byte string; running past its end raises ``truncated(what)``,
    so each format names its own error (the codec's, the state blob's)."""

    def __init__(self, data: bytes, truncated: Callable[[str], Exception]) -> None:
        self.data = data
        self.pos = 0
        self._truncated = truncated

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self._truncated(what)
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def remaining(self) -> int:
        return len(self.data) - self.pos


def _truncated_update(what: str) -> CodecError:
    return CodecError(f"update truncated in the {what}")


@dataclass(frozen=True)
class Decoded:
    """A parsed update: its scheme, parameters (``None`` for dense) and dense tensors."""

    scheme: int
    params: CodecParams | None
    tensors: dict[str, F32]


def _parse_header(
    reader: ByteReader,
    max_elements: int,
    expected: Mapping[str, tuple[int, ...]] | None,
) -> tuple[int, CodecParams | None, list[tuple[str, tuple[int, ...]]]]:
    fixed = reader.take(_FIXED.size, "header")
    magic, version, scheme, dtype, index_bits, chunk, k, value_bits, count = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise CodecError("not a pseudo-gradient update (bad magic)")
    if version != VERSION:
        raise CodecError(f"unknown update version {version}")
    if dtype != DTYPE_FLOAT32:
        raise CodecError(f"unknown dtype code {dtype}")
    params: CodecParams | None
    if scheme == SCHEME_DENSE:
        if (index_bits, chunk, k, value_bits) != (0, 0, 0, DENSE_VALUE_BITS):
            raise CodecError("dense update with non-canonical parameters")
        params = None
    elif scheme in TOPK_SCHEMES:
        if value_bits != SPARSE_VALUE_BITS:
            raise CodecError(f"unsupported value width {value_bits} bits")
        if not MIN_CHUNK_LOG2 <= index_bits <= MAX_CHUNK_LOG2 or chunk != 1 << index_bits:
            raise CodecError(f"bad chunk {chunk} / index bits {index_bits}")
        if not 1 <= k <= chunk:
            raise CodecError(f"bad k {k} for chunk {chunk}")
        params = CodecParams(chunk=chunk, k=k, rice=scheme in (SCHEME_RICE, SCHEME_RICE_REF))
    else:
        raise CodecError(f"unknown scheme {scheme}")
    if scheme in REF_SCHEMES:
        return scheme, params, _referenced_shapes(reader, count, max_elements, expected)
    # Each tensor entry takes at least 3 header bytes: bound the count before looping.
    if count > MAX_TENSORS or count * 3 > reader.remaining():
        raise CodecError(f"tensor count {count} is out of bounds")
    shapes: list[tuple[str, tuple[int, ...]]] = []
    total = 0
    previous: bytes | None = None
    for _ in range(count):
        (name_len,) = struct.unpack("<H", reader.take(2, "tensor name length"))
        if not 1 <= name_len <= MAX_NAME_LEN:
            raise CodecError(f"tensor name length {name_len} is out of bounds")
        raw = reader.take(name_len, "tensor name")
        if previous is not None and raw <= previous:
            raise CodecError("tensor names are not in strictly increasing order")
        previous = raw
        try:
            name = raw.decode()
        except UnicodeDecodeError as exc:
            raise CodecError("tensor name is not UTF-8") from exc
        (ndim,) = struct.unpack("<B", reader.take(1, "tensor rank"))
        if ndim > MAX_NDIM:
            raise CodecError(f"tensor {name!r} has {ndim} dims, limit {MAX_NDIM}")
        shape = struct.unpack(f"<{ndim}Q", reader.take(8 * ndim, "tensor shape"))
        numel = math.prod(shape)
        total += numel
        if total > max_elements:
            raise CodecError(f"update holds more than {max_elements} values")
        shapes.append((name, tuple(int(d) for d in shape)))
    if expected is not None:
        got = dict(shapes)
        if got != dict(expected):
            missing = sorted(set(expected) - set(got))
            extra = sorted(set(got) - set(expected))
            raise CodecError(
                f"update tensors do not match the model (missing {missing[:3]}, "
                f"unexpected {extra[:3]}, or shapes differ)"
            )
    return scheme, params, shapes


def _referenced_shapes(
    reader: ByteReader,
    count: int,
    max_elements: int,
    expected: Mapping[str, tuple[int, ...]] | None,
) -> list[tuple[str, tuple[int, ...]]]:
    """Scheme 2's names and shapes: the receiver's, if their digest is the header's."""
    digest = reader.take(SCHEMA_DIGEST_LEN, "schema digest")
    if expected is None:
        raise CodecError("update names its tensors by schema digest; the model's are needed")
    if count != len(expected) or digest != schema_digest(expected):
        raise CodecError("update was made for another model (schema digest differs)")
    shapes = [(n, tuple(expected[n])) for n in sorted(expected, key=lambda n: n.encode())]
    if sum(math.prod(s) for _, s in shapes) > max_elements:
        raise CodecError(f"update holds more than {max_elements} values")
    return shapes


def _position_bits(params: CodecParams) -> int:
    """Fixed-width position bits per kept value: the index, or the gap's low Rice bits."""
    return params.rice_bits if params.rice else params.index_bits


def _payload_size(params: CodecParams | None, numel: int) -> int:
    """Bytes of a tensor's fixed-size part (for the Rice layout, all but the unary stream)."""
    if params is None:
        return 4 * numel
    n_chunks, kept = _kept_total(numel, params)
    return 8 * n_chunks + _nbytes(kept, _position_bits(params)) + _nbytes(kept, SPARSE_VALUE_BITS)


def _max_unary_bits(numel: int, params: CodecParams) -> int:
    """The most unary bits a tensor's gaps can take: per chunk of n values with m kept the
    gaps sum to at most n - m, so their quotients to at most (n - m) >> b."""
    n_chunks, kept = _kept_total(numel, params)
    if n_chunks == 0:
        return 0
    b = params.rice_bits
    rem = numel - (n_chunks - 1) * params.chunk
    full = (n_chunks - 1) * ((params.chunk - params.k) >> b)
    return kept + full + ((rem - _short_kept(rem, params)) >> b)


@dataclass(frozen=True)
class _Parsed:
    """A top-k tensor's fields before its positions are known (the Rice layout's gaps
    need the unary stream at the end of the update)."""

    shape: tuple[int, ...]
    counts: npt.NDArray[np.int64]
    scales: F32
    low_bits: npt.NDArray[np.int64]  # indices (fixed layout) or gaps' low bits (Rice)
    codes: npt.NDArray[np.uint8]


def _parse_fields(
    reader: ByteReader, name: str, shape: tuple[int, ...], params: CodecParams
) -> _Parsed:
    numel = _numel(shape)
    counts = _chunk_counts(numel, params)
    n_chunks = counts.size
    kept = int(counts.sum())
    scales = (
        np.frombuffer(reader.take(8 * n_chunks, "scales"), dtype="<f4")
        .astype(np.float32)
        .reshape(n_chunks, 2)
    )
    if not np.isfinite(scales).all() or np.signbit(scales).any():
        raise CodecError(f"tensor {name!r} has a negative or non-finite scale")
    bits = _position_bits(params)
    low_bits = _unpack_bits(reader.take(_nbytes(kept, bits), "indices"), kept, bits, name)
    codes = _unpack_bits(
        reader.take(_nbytes(kept, SPARSE_VALUE_BITS), "codes"), kept, SPARSE_VALUE_BITS, name
    ).astype(np.uint8)
    chunk_of = np.repeat(np.arange(n_chunks, dtype=np.int64), counts)
    n_high = np.bincount(chunk_of, weights=(codes >> 1).astype(np.float64), minlength=n_chunks)
    if (n_high != (counts + 1) // 2).any():
        raise CodecError(f"tensor {name!r} has a non-canonical high/low split")
    return _Parsed(shape, counts, scales, low_bits, codes)


def _finish_sparse(
    parsed: _Parsed,
    name: str,
    params: CodecParams,
    quotients: npt.NDArray[np.int64] | None,
) -> SparseTensor:
    """The tensor's positions, from its indices (fixed layout) or its gaps' low bits and
    unary ``quotients`` (Rice layout), checked against its chunks."""
    counts = parsed.counts
    n_chunks = counts.size
    kept = int(counts.sum())
    numel = _numel(parsed.shape)
    chunk_of = np.repeat(np.arange(n_chunks, dtype=np.int64), counts)
    if quotients is None:
        local = parsed.low_bits
        if kept > 1:
            same_chunk = chunk_of[1:] == chunk_of[:-1]
            if (same_chunk & (local[1:] <= local[:-1])).any():
                raise CodecError(f"tensor {name!r} has indices out of order within a chunk")
    else:
        # Gaps to in-chunk indices: a running sum of (gap + 1) restarted at each chunk.
        steps = np.cumsum((quotients << params.rice_bits) + parsed.low_bits + 1)
        starts = np.cumsum(counts) - counts
        before = np.concatenate(([0], steps))[starts]
        local = steps - np.repeat(before, counts) - 1
    lengths = np.minimum(params.chunk, numel - np.arange(n_chunks, dtype=np.int64) * params.chunk)
    if kept and (local >= lengths[chunk_of]).any():
        raise CodecError(f"tensor {name!r} has an index past the end of its chunk")
    positions = chunk_of * params.chunk + local
    return SparseTensor(parsed.shape, parsed.scales, positions, parsed.codes)


def _parse_payload(
    reader: ByteReader, params: CodecParams, shapes: list[tuple[str, tuple[int, ...]]]
) -> dict[str, SparseTensor]:
    """Every tensor of a top-k update, after its exact (fixed layout) or bounded (Rice
    layout) size is checked against what is left, before anything is unpacked."""
    size = sum(_payload_size(params, _numel(shape)) for _, shape in shapes)
    if not params.rice:
        if size != reader.remaining():
            raise CodecError(
                f"update payload is {reader.remaining()} bytes; its header says {size}"
            )
        return {
            name: _finish_sparse(_parse_fields(reader, name, shape, params), name, params, None)
            for name, shape in shapes
        }
    most = _nbytes(sum(_max_unary_bits(_numel(shape), params) for _, shape in shapes), 1)
    if not size <= reader.remaining() <= size + most:
        raise CodecError(
            f"update payload is {reader.remaining()} bytes; its header allows {size}..{size + most}"
        )
    parsed = [(name, _parse_fields(reader, name, shape, params)) for name, shape in shapes]
    total = sum(int(p.counts.sum()) for _, p in parsed)
    quotients = _unpack_unary(reader.take(reader.remaining(), "position stream"), total)
    out: dict[str, SparseTensor] = {}
    offset = 0
    for name, p in parsed:
        kept = int(p.counts.sum())
        out[name] = _finish_sparse(p, name, params, quotients[offset : offset + kept])
        offset += kept
    return out


def _check_bound(max_elements: int) -> None:
    """A caller's bound above the ceiling is our own misuse (MAX_ELEMENTS says why)."""
    if not 0 <= max_elements <= MAX_ELEMENTS:
        raise ValueError(f"max_elements {max_elements} is outside 0..{MAX_ELEMENTS}")


@dataclass(frozen=True)
class Parsed:
    """A parsed and validated update, not yet made dense: a top-k one's ``sparse``
    tensors (with its ``params``), or a dense one's ``dense`` tensors."""

    scheme: int
    params: CodecParams | None
    sparse: dict[str, SparseTensor] | None
    dense: dict[str, F32] | None

    def tensors(self) -> dict[str, F32]:
        """The dense float32 tensors (a top-k update's decompressed afresh)."""
        if self.sparse is None:
            assert self.dense is not None
            return self.dense
        assert self.params is not None
        return decompress(self.sparse, self.params)


def decode(
    data: bytes,
    *,
    max_elements: int,
    expected: Mapping[str, tuple[int, ...]] | None = None,
) -> Decoded:
    """Parse, validate and decompress an update; raises ``CodecError`` if malformed.

    ``max_elements`` bounds the values it may hold (the model's parameter count; at most
    ``MAX_ELEMENTS``), checked before anything is allocated. ``expected`` (name -> shape),
    when given, must match the update's tensors exactly.
    """
    parsed = parse(data, max_elements=max_elements, expected=expected)
    return Decoded(parsed.scheme, parsed.params, parsed.tensors())


def parse(
    data: bytes,
    *,
    max_elements: int,
    expected: Mapping[str, tuple[int, ...]] | None = None,
) -> Parsed:
    """Parse and validate an update as :func:`decode` does, leaving a top-k one sparse."""
    _check_bound(max_elements)
    reader = ByteReader(bytes(data), _truncated_update)
    scheme, params, shapes = _parse_header(reader, max_elements, expected)
    if params is not None:
        return Parsed(scheme, params, _parse_payload(reader, params, shapes), None)
    size = sum(_payload_size(params, _numel(shape)) for _, shape in shapes)
    if size != reader.remaining():
        raise CodecError(f"update payload is {reader.remaining()} bytes; its header says {size}")
    tensors: dict[str, F32] = {}
    for name, shape in shapes:
        raw = reader.take(4 * _numel(shape), "values")
        values = np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(shape)
        if not np.isfinite(values).all():
            raise CodecError(f"tensor {name!r} holds NaN or infinity")
        tensors[name] = values
    return Parsed(scheme, params, None, tensors)


def decode_sparse(
    data: bytes, expected: Mapping[str, tuple[int, ...]] | None = None, *, max_elements: int
) -> tuple[CodecParams, dict[str, SparseTensor]]:
    """Parse a top-k update without decompressing it (for inspection and tests)."""
    _check_bound(max_elements)
    reader = ByteReader(bytes(data), _truncated_update)
    _scheme, params, shapes = _parse_header(reader, max_elements, expected)
    if params is None:
        raise CodecError("dense update where a top-k one was expected")
    return params, _parse_payload(reader, params, shapes)


# --- error feedback ------------------------------------------------------------------


class ErrorFeedback:
    """A worker's error-feedback residual: what compression has not yet sent.

    ``step(grads)`` adds ``grads`` to ``decay * residual``, compresses the sum, subtracts what
    the receivers will decode, and returns the encoded bytes. With ``decay = 1`` (classic
    error feedback) the sum of everything sent plus the residual equals the sum of all
    inputs, up to float32 rounding.
    """

    def __init__(
        self, params: CodecParams, decay: float = 1.0, *, schema_ref: bool = False
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay {decay} must be in (0, 1]")
        self.params = params
        self.schema_ref = schema_ref
        self.decay = np.float32(decay)
        self.residual: dict[str, F32] = {}

    def step(self, grads: Mapping[str, Any]) -> bytes:
        sparse = self.step_sparse(grads)
        return encode_sparse(sparse, self.params, schema_ref=self.schema_ref)

    def step_sparse(self, grads: Mapping[str, Any]) -> dict[str, SparseTensor]:
        """As :meth:`step`, unencoded. Every input is checked (names, shapes, finite values)
        before the residual changes, so a refused step leaves the residual as it was."""
        names = _sorted_names(grads)
        if self.residual and set(self.residual) != set(names):
            raise ValueError("error feedback: tensor names changed between rounds")
        checked = {name: _checked_float32(grads[name], name) for name in names}
        for name, grad in checked.items():
            previous = self.residual.get(name)
            if previous is not None and previous.shape != grad.shape:
                raise ValueError(f"error feedback: shape of {name!r} changed")
        sparse: dict[str, SparseTensor] = {}
        for name in names:
            previous = self.residual.get(name)
            if previous is None:
                # np.array keeps 0-d arrays 0-d: a copy of its own, the residual from now.
                accumulated = np.array(checked[name], dtype=np.float32, order="C", copy=True)
            else:
                # In place, in float32: the same roundings as decay * residual + grad.
                accumulated = previous
                if self.decay != 1:
                    accumulated *= self.decay
                accumulated += checked[name]
            entry = compress_tensor(accumulated, self.params)
            # What the receivers decode is nonzero only where a value was kept.
            flat = accumulated.reshape(-1)
            flat[entry.positions] -= dequantised(entry, self.params)
            self.residual[name] = accumulated
            sparse[name] = entry
        return sparse
