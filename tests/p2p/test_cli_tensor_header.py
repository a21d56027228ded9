"""`blob get --tensor` trusts nothing in a safetensors header it has not checked: offsets
must match shapes and lie inside the blob, and its chunk requests stay inside the
protocol's limits however scattered the chunks are."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from blobstore import Store
from p2p.blob import messages
from p2p.fetch.tensors import (
    BadSafetensors,
    TensorInfo,
    _requests,
    decode_tensor,
    parse_header,
    read_local_tensors,
)


def header_of(blob: bytes) -> tuple[bytes, int]:
    (length,) = struct.unpack("<Q", blob[:8])
    return blob[8 : 8 + length], 8 + length


def test_header_offsets_are_checked_against_shape_and_file() -> None:
    blob = save({"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
    raw, start = header_of(blob)
    infos = parse_header(raw, start, len(blob))
    assert infos["w"] == TensorInfo("w", "F32", (3, 4), start, start + 48)
    lying = json.loads(raw)
    lying["w"]["shape"] = [3, 5]  # 60 bytes claimed, 48 present
    with pytest.raises(BadSafetensors, match="do not match"):
        parse_header(json.dumps(lying).encode(), start, len(blob))
    with pytest.raises(BadSafetensors, match="do not match"):
        parse_header(raw, start, len(blob) - 1)  # the tensor would run past the blob's end
    with pytest.raises(BadSafetensors, match="not JSON"):
        parse_header(b"\xff{", start, len(blob))


def test_bf16_is_widened_exactly() -> None:
    values = np.array([1.0, -2.5, 3.140625], dtype=np.float32)
    bf16 = (values.view("<u4") >> 16).astype("<u2").tobytes()
    info = TensorInfo("b", "BF16", (3,), 0, 6)
    assert np.array_equal(decode_tensor(info, bf16), values)


def test_scattered_chunks_become_requests_within_the_protocols_limits() -> None:
    scattered = list(range(0, 1000, 2))  # 500 runs of one chunk
    contiguous = list(range(2000, 2600))  # one run longer than a request may carry
    requests = list(_requests(scattered + contiguous))
    covered = [i for ranges, _ in requests for start, end in ranges for i in range(start, end)]
    assert covered == scattered + contiguous
    for ranges, count in requests:
        assert len(ranges) <= messages.MAX_RANGES_PER_REQUEST
        assert count == sum(end - start for start, end in ranges) <= messages.MAX_CHUNKS_PER_REQUEST


def _entry(
    dtype: object = "F32", shape: object = (1,), offsets: object = (0, 4)
) -> dict[str, object]:
    return {
        "dtype": dtype,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets,
    }


HOSTILE_HEADERS = {
    "a dtype that is not a string": json.dumps({"w": _entry(dtype=[])}).encode(),
    "JSON nested past the parser's recursion": b"[" * 100_000 + b"]" * 100_000,
    "an integer of 5,000 digits": b'{"w": {"dtype": "F32", "shape": [' + b"1" * 5000 + b"]}}",
    "more dimensions than numpy holds": json.dumps({"w": _entry(shape=[1] * 100)}).encode(),
    "an empty tensor of absurd extent": json.dumps(
        {"w": _entry(shape=(0, 2**70), offsets=(0, 0))}
    ).encode(),
    "two tensors over the same bytes": json.dumps(
        {"a": _entry(), "b": _entry(offsets=(2, 6))}
    ).encode(),
}


@pytest.mark.parametrize("raw", HOSTILE_HEADERS.values(), ids=HOSTILE_HEADERS.keys())
def test_a_hostile_header_is_bad_data_not_a_crash(raw: bytes) -> None:
    """Each of these once escaped as TypeError, RecursionError or ValueError (from json or
    later from numpy: a traceback, exit 1), or was accepted, instead of being bad data."""
    with pytest.raises(BadSafetensors):
        parse_header(raw, 8, 100)


def test_adjacent_and_empty_tensors_are_not_overlaps() -> None:
    raw = json.dumps(
        {"a": _entry(), "e": _entry(shape=(0, 7), offsets=(4, 4)), "b": _entry(offsets=(4, 8))}
    ).encode()
    assert sorted(parse_header(raw, 8, 16)) == ["a", "b", "e"]


@pytest.mark.parametrize(
    "length", [1 << 20, 100_000_001, 2**64 - 1], ids=["past-the-blob", "over-100MB", "2**64-1"]
)
async def test_a_header_length_past_the_blob_is_refused_before_reading_it(
    tmp_path: Path, length: int
) -> None:
    """The 8-byte length is checked against the blob's size and safetensors' own header
    limit before a byte of the header is read (or, for a remote blob, fetched)."""
    store = Store.open(tmp_path / "store")
    blob = save({"w": np.zeros(4, dtype=np.float32)})
    lying = store.put_bytes(struct.pack("<Q", length) + blob[8:])
    with pytest.raises(BadSafetensors, match=f"header would be {length} bytes"):
        await read_local_tensors(store, lying, ["w"])
    assert (await read_local_tensors(store, store.put_bytes(blob), ["w"])).tensors["w"].size == 4
