"""The outer loop's global state as one canonical blob.

A worker that joins a run mid-way, or a verifier, fetches the global state ``S_r`` as a
blob and must get exactly the state the other workers hold. The encoding is a pure
function of the state, so every worker that agrees on ``S_r`` also puts the same blob ID:
the blob ID is a second witness of agreement besides ``state_root``.

Layout (integers little-endian)::

    magic b"BNOS"  version u8 (=1)  dtype u8 (1 = float32)  reserved u16 (=0)
    round u64  count u32 (tensors)
    per tensor, in strictly increasing UTF-8 byte order of names:
        name_len u16, name, ndim u8, dims u64 * ndim (each >= 1)
    the parameters' raw float32 bytes, tensor after tensor, same order
    the outer momentum's raw float32 bytes, same order and shapes

and nothing after; a state with floating buffers (``training.outer.module_state``) is
version 2, which goes on with the buffers' count u32, their headers as above, and their
raw float32 bytes, so a state without buffers keeps its version-1 bytes. The decoder
checks every length against the named limits before it allocates, requires the exact
total size, rejects NaN and infinity, and optionally the shapes a model expects.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping

import numpy as np

from blobstore.exitcodes import ExitCode
from training.errors import TrainingError
from training.outer.codec import F32, MAX_ELEMENTS, MAX_NAME_LEN, MAX_NDIM, MAX_TENSORS, ByteReader
from training.outer.loop import OuterState

MAGIC = b"BNOS"
VERSION = 1
VERSION_BUFFERS = 2
DTYPE_FLOAT32 = 1
# Names, ranks and sizes are bounded as in the pseudo-gradient codec (MAX_TENSORS and the
# rest, imported above): a state blob holds the same named tensors, twice.
# Rounds are counted in a u64 on the wire; a run of more than 2^32 rounds is a bug.
MAX_ROUND = 1 << 32

_HEAD = struct.Struct("<4sBBHQI")
_COUNT = struct.Struct("<I")


class BadStateBlob(TrainingError):
    """Bytes that are not a canonical global-state blob (a peer's fault)."""

    exit_code = ExitCode.BAD_DATA


def _name_key(name: str) -> bytes:
    return name.encode()


def encode_state(state: OuterState) -> bytes:
    """Canonical bytes of ``state`` (parameters and momentum must share names and shapes)."""
    return b"".join(state_blocks(state))


def state_blocks(state: OuterState) -> list[bytes | memoryview]:
    """:func:`encode_state` as blocks to concatenate: the header's bytes, then each
    tensor's float32 values as a view of its array where it is already contiguous and
    little-endian (a 124M state is 1 GB: put from the views, it is copied once, into the
    store, and not twice more into one bytes object first)."""
    names = sorted(state.params, key=_name_key)
    if sorted(state.momentum, key=_name_key) != names:
        raise ValueError("parameters and momentum name different tensors")
    if not 0 <= state.round < MAX_ROUND:
        raise ValueError(f"round {state.round} is out of range")
    version = VERSION_BUFFERS if state.buffers else VERSION
    parts: list[bytes | memoryview] = [
        _HEAD.pack(MAGIC, version, DTYPE_FLOAT32, 0, state.round, len(names))
    ]
    for name in names:
        value = state.params[name]
        if value.dtype != np.float32 or state.momentum[name].shape != value.shape:
            raise ValueError(f"tensor {name!r} is not float32 with matching momentum")
        parts.extend(_header(name, value))
    for table in (state.params, state.momentum):
        parts.extend(_values(table, names))
    if state.buffers:
        buffers = sorted(state.buffers, key=_name_key)
        parts.append(_COUNT.pack(len(buffers)))
        for name in buffers:
            if state.buffers[name].dtype != np.float32:
                raise ValueError(f"buffer {name!r} is not float32")
            parts.extend(_header(name, state.buffers[name]))
        parts.extend(_values(state.buffers, buffers))
    return parts


def _header(name: str, value: F32) -> list[bytes | memoryview]:
    raw = name.encode()
    return [
        struct.pack(f"<H{len(raw)}sB", len(raw), raw, value.ndim),
        struct.pack(f"<{value.ndim}Q", *value.shape),
    ]


def _values(table: Mapping[str, F32], names: list[str]) -> list[bytes | memoryview]:
    out: list[bytes | memoryview] = []
    for name in names:
        values = np.ascontiguousarray(table[name], dtype="<f4").reshape(-1)
        out.append(values.view(np.uint8).data)
    return out


def state_size(blocks: list[bytes | memoryview]) -> int:
    """The blob's size in bytes, from :func:`state_blocks`."""
    return sum(memoryview(b).nbytes for b in blocks)


def _truncated(what: str) -> BadStateBlob:
    return BadStateBlob(f"state blob ends inside its {what}")


def decode_state(
    data: bytes,
    *,
    expected: Mapping[str, tuple[int, ...]] | None = None,
    buffers: Mapping[str, tuple[int, ...]] | None = None,
) -> OuterState:
    """Strictly parse a state blob; ``expected`` (name -> shape) and ``buffers`` (the
    floating buffers' name -> shape; empty: none) must then match exactly."""
    reader = ByteReader(bytes(data), _truncated)
    magic, version, dtype, reserved, round_, count = _HEAD.unpack(reader.take(_HEAD.size, "header"))
    if magic != MAGIC:
        raise BadStateBlob("not a global-state blob (bad magic)")
    if version not in (VERSION, VERSION_BUFFERS) or dtype != DTYPE_FLOAT32 or reserved != 0:
        raise BadStateBlob(f"unsupported state blob version {version} / dtype {dtype}")
    if round_ >= MAX_ROUND:
        raise BadStateBlob(f"state blob round {round_} is out of range")
    if not 1 <= count <= MAX_TENSORS:
        raise BadStateBlob(f"state blob holds {count} tensors (1..{MAX_TENSORS} allowed)")
    shapes, total = _headers(reader, count, 0)
    tables: list[dict[str, F32]] = [{}, {}, {}]
    buffer_shapes: list[tuple[str, tuple[int, ...]]] = []
    if version == VERSION:
        if reader.remaining() != 2 * 4 * total:
            raise BadStateBlob(
                f"state blob payload is {reader.remaining()} bytes; its header says {8 * total}"
            )
    else:
        if reader.remaining() < 2 * 4 * total + _COUNT.size:
            raise _truncated("buffers")
        after = ByteReader(reader.data[reader.pos + 8 * total :], _truncated)
        (held,) = _COUNT.unpack(after.take(_COUNT.size, "buffer count"))
        if not 1 <= held <= MAX_TENSORS - count:
            raise BadStateBlob(f"state blob holds {held} buffers (1..{MAX_TENSORS - count})")
        buffer_shapes, extra = _headers(after, held, total)
        if after.remaining() != 4 * extra:
            raise BadStateBlob(
                f"state blob buffers are {after.remaining()} bytes; their headers say {4 * extra}"
            )
        if {n for n, _ in buffer_shapes} & {n for n, _ in shapes}:
            raise BadStateBlob("a buffer has a parameter's name")
    if expected is not None and dict(shapes) != dict(expected):
        raise BadStateBlob("state blob tensors do not match the model's names and shapes")
    if buffers is not None and dict(buffer_shapes) != dict(buffers):
        raise BadStateBlob("state blob buffers do not match the model's names and shapes")
    for table in tables[:2]:
        _read_values(reader, shapes, table)
    if version == VERSION_BUFFERS:
        _read_values(after, buffer_shapes, tables[2])
    return OuterState(int(round_), tables[0], tables[1], tables[2])


def _headers(
    reader: ByteReader, count: int, total: int
) -> tuple[list[tuple[str, tuple[int, ...]]], int]:
    """``count`` tensor headers (names strictly increasing); (shapes, values in them), the
    running ``total`` of values bounded by MAX_ELEMENTS."""
    shapes: list[tuple[str, tuple[int, ...]]] = []
    own = 0
    previous: bytes | None = None
    for _ in range(count):
        (name_len,) = struct.unpack("<H", reader.take(2, "name length"))
        if not 1 <= name_len <= MAX_NAME_LEN:
            raise BadStateBlob(f"tensor name length {name_len} is out of range")
        raw = reader.take(name_len, "name")
        if previous is not None and raw <= previous:
            raise BadStateBlob("tensor names are not in strictly increasing order")
        previous = raw
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadStateBlob("a tensor name is not UTF-8") from None
        (ndim,) = struct.unpack("<B", reader.take(1, "rank"))
        if ndim > MAX_NDIM:
            raise BadStateBlob(f"tensor {name!r} has rank {ndim} (at most {MAX_NDIM})")
        dims = struct.unpack(f"<{ndim}Q", reader.take(8 * ndim, "dims"))
        if any(d < 1 or d > MAX_ELEMENTS for d in dims):
            raise BadStateBlob(f"tensor {name!r} has a dimension out of range")
        own += math.prod(dims)
        if total + own > MAX_ELEMENTS:
            raise BadStateBlob(f"state blob holds more than {MAX_ELEMENTS} values")
        shapes.append((name, tuple(int(d) for d in dims)))
    return shapes, own


def _read_values(
    reader: ByteReader, shapes: list[tuple[str, tuple[int, ...]]], table: dict[str, F32]
) -> None:
    for name, shape in shapes:
        raw_values = reader.take(4 * math.prod(shape), "values")
        values = np.frombuffer(raw_values, dtype="<f4").astype(np.float32).reshape(shape)
        if not np.isfinite(values).all():
            raise BadStateBlob(f"tensor {name!r} holds NaN or infinity")
        table[name] = values
