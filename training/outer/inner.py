"""A worker's inner state as bytes: what a replayer needs to train as its author did.

1. The inner state: the inner AdamW moments (per model parameter, in the model's order:
   ``step``, ``exp_avg`` and ``exp_avg_sq`` as float32 bytes, or nothing before the first
   step) and the error-feedback residual (by tensor name, sorted), canonically encoded
   (``v``, ``opt``, ``ef``).
2. The origin of an overlapped round (``training.outer.trainer`` rule 5): the model's
   trainable parameters and floating buffers where the round's steps started, E_r, the
   worker's own end of the round before (by tensor name, sorted, float32 bytes),
   canonically encoded (``v``, ``params``, ``buffers``).

Decoding is bounded by the model the bytes must fit (:func:`decode_inner`,
:func:`decode_origin`): a blob that does not fit is :class:`BadInnerState`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from blobstore.canonical import encode as encode_canonical
from blobstore.exitcodes import ExitCode
from identity import decode_msgpack_map
from training.errors import TrainingError

INNER_VERSION = 1
ORIGIN_VERSION = 1
# Bytes a canonical map spends on its keys and each tensor's name and framing beyond the
# names' own bytes; 64 KiB covers MAX_TENSORS names of framing many times over.
_FRAMING = 65536


class BadInnerState(TrainingError):
    """An inner-state blob that does not fit the model (the author's fault)."""

    exit_code = ExitCode.BAD_DATA


def encode_inner(
    optimizer: Sequence[tuple[bytes, bytes, bytes] | None], residual: Mapping[str, Any]
) -> bytes:
    """Canonical bytes of a worker's inner state: per model parameter (in the model's
    order) AdamW's ``(step, exp_avg, exp_avg_sq)`` as float32 bytes or nothing before the
    first step; the error-feedback residual by tensor name (sorted)."""
    opt = [[] if x is None else list(x) for x in optimizer]
    ef = [
        [name, np.ascontiguousarray(residual[name], dtype="<f4").tobytes()]
        for name in sorted(residual, key=lambda n: n.encode())
    ]
    data: bytes = encode_canonical({"v": INNER_VERSION, "opt": opt, "ef": ef})
    return data


def decode_inner(
    data: bytes,
    param_sizes: Sequence[int],
    shapes: Mapping[str, tuple[int, ...]],
) -> tuple[list[tuple[bytes, bytes, bytes] | None], dict[str, np.ndarray[Any, Any]]]:
    """The inner state if it fits a model with these parameter sizes (in order) and
    tensor shapes; :class:`BadInnerState` otherwise."""
    total = sum(param_sizes)
    limit = 3 * 4 * total + 4 * sum(int(np.prod(s)) for s in shapes.values()) + _FRAMING
    obj = decode_msgpack_map(data, max_size=limit, what="inner state", error=BadInnerState)
    opt, ef = obj.get("opt"), obj.get("ef")
    if obj.get("v") != INNER_VERSION or type(opt) is not list or type(ef) is not list:
        raise BadInnerState("inner state must be {v, opt, ef}")
    if len(opt) != len(param_sizes):
        raise BadInnerState("inner state has another number of parameters than the model")
    optimizer: list[tuple[bytes, bytes, bytes] | None] = []
    for entry, size in zip(opt, param_sizes, strict=True):
        if entry == []:
            optimizer.append(None)
            continue
        if (
            type(entry) is not list
            or len(entry) != 3
            or any(type(x) is not bytes for x in entry)
            or [len(x) for x in entry] != [4, 4 * size, 4 * size]
        ):
            raise BadInnerState("inner state optimizer entry does not fit its parameter")
        optimizer.append((entry[0], entry[1], entry[2]))
    residual: dict[str, np.ndarray[Any, Any]] = {}
    for entry in ef:
        if type(entry) is not list or len(entry) != 2 or entry[0] not in shapes:
            raise BadInnerState("inner state residual names an unknown tensor")
        name, raw = entry
        shape = shapes[name]
        if type(raw) is not bytes or len(raw) != 4 * int(np.prod(shape)):
            raise BadInnerState(f"inner state residual {name!r} does not fit its tensor")
        residual[name] = np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)
    if residual and set(residual) != set(shapes):
        raise BadInnerState("inner state residual lacks some tensors")
    return optimizer, residual


def encode_origin(params: Mapping[str, Any], buffers: Mapping[str, Any]) -> bytes:
    """Rule 2: canonical bytes of the state an overlapped round's steps started from."""

    def table(values: Mapping[str, Any]) -> list[list[Any]]:
        return [
            [name, np.ascontiguousarray(values[name], dtype="<f4").tobytes()]
            for name in sorted(values, key=lambda n: n.encode())
        ]

    data: bytes = encode_canonical(
        {"v": ORIGIN_VERSION, "params": table(params), "buffers": table(buffers)}
    )
    return data


def decode_origin(
    data: bytes,
    shapes: Mapping[str, tuple[int, ...]],
    buffer_shapes: Mapping[str, tuple[int, ...]],
) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, np.ndarray[Any, Any]]]:
    """Rule 2: (parameters, floating buffers) if the bytes hold exactly these tensors,
    finite; :class:`BadInnerState` otherwise."""
    values = sum(int(np.prod(s)) for s in [*shapes.values(), *buffer_shapes.values()])
    obj = decode_msgpack_map(
        data, max_size=4 * values + _FRAMING, what="origin state", error=BadInnerState
    )
    if obj.get("v") != ORIGIN_VERSION or set(obj) != {"v", "params", "buffers"}:
        raise BadInnerState("origin state must be {v, params, buffers}")
    out = []
    for key, expected in (("params", shapes), ("buffers", buffer_shapes)):
        entries = obj[key]
        if type(entries) is not list or len(entries) != len(expected):
            raise BadInnerState(f"origin state {key} are not the model's")
        table: dict[str, np.ndarray[Any, Any]] = {}
        for entry in entries:
            if type(entry) is not list or len(entry) != 2 or entry[0] not in expected:
                raise BadInnerState(f"origin state {key} name an unknown tensor")
            name, raw = entry
            shape = expected[name]
            if name in table or type(raw) is not bytes or len(raw) != 4 * int(np.prod(shape)):
                raise BadInnerState(f"origin state tensor {name!r} does not fit the model")
            value = np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)
            if not np.isfinite(value).all():
                raise BadInnerState(f"origin state tensor {name!r} holds NaN or infinity")
            table[name] = value
        out.append(table)
    if encode_origin(out[0], out[1]) != bytes(data):
        raise BadInnerState("origin state is not in canonical form")
    return out[0], out[1]
