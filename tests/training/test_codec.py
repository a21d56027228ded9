"""SparseLoCo codec: round trips, canonical bytes, error feedback, strict decoding."""

from __future__ import annotations

import hashlib
import math
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from training.outer.codec import (
    MAGIC,
    CodecError,
    CodecParams,
    ErrorFeedback,
    SparseTensor,
    compress,
    decode,
    decode_sparse,
    decompress,
    encode,
    encode_dense,
    encode_sparse,
)

REPO = Path(__file__).resolve().parents[2]
# Every decode names its bound (codec.MAX_ELEMENTS): far above these tests' updates.
BOUND = 1 << 24


def reference_dequantised(
    values: np.ndarray, chunk: int, k: int, *, rice: bool = True
) -> np.ndarray:
    """Straight-line model of the codec: top-k by (-|v|, index), two group-mean scales; a
    short chunk of n keeps ceil(k n / chunk) (Rice layout) or min(k, n) (fixed layout)."""
    flat = values.reshape(-1)
    out = np.zeros(flat.size, dtype=np.float32)
    for start in range(0, flat.size, chunk):
        idx = list(range(start, min(start + chunk, flat.size)))
        m = min(len(idx), math.ceil(k * len(idx) / chunk)) if rice else min(k, len(idx))
        ranked = sorted(idx, key=lambda i: (-abs(float(flat[i])), i))[:m]
        n_high = (len(ranked) + 1) // 2
        high, low = ranked[:n_high], ranked[n_high:]
        for group in (high, low):
            if not group:
                continue
            # Summed in ascending position order in float64, as the codec does.
            scale = np.float32(sum(abs(float(flat[i])) for i in sorted(group)) / len(group))
            for i in group:
                out[i] = -scale if flat[i] < 0 else scale
    return out.reshape(values.shape)


float_arrays = hnp.arrays(
    dtype=np.float32,
    shape=st.one_of(
        hnp.array_shapes(min_dims=0, max_dims=1, min_side=0, max_side=300),
        hnp.array_shapes(min_dims=2, max_dims=3, min_side=0, max_side=9),
    ),
    # A small set of values makes ties common, where selection order matters most.
    elements=st.one_of(
        st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, -2.0]),
        st.floats(-1e3, 1e3, width=32, allow_subnormal=False),
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    values=float_arrays,
    log2_chunk=st.integers(4, 6),
    k_frac=st.floats(0.0, 1.0),
    rice=st.booleans(),
)
def test_round_trip_is_the_dequantised_top_k(
    values: np.ndarray, log2_chunk: int, k_frac: float, rice: bool
) -> None:
    chunk = 1 << log2_chunk
    k = max(1, round(k_frac * chunk))
    params = CodecParams(chunk=chunk, k=k, rice=rice)
    data = encode({"w": values}, params)
    decoded = decode(data, max_elements=BOUND)
    assert decoded.params == params
    out = decoded.tensors["w"]
    assert out.shape == values.shape
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, reference_dequantised(values, chunk, k, rice=rice))
    np.testing.assert_array_equal(out, decompress(compress({"w": values}, params), params)["w"])
    # At most k nonzeros per chunk, and each within the chunk's largest kept magnitude.
    flat_in, flat_out = values.reshape(-1), out.reshape(-1)
    for start in range(0, flat_in.size, chunk):
        got = flat_out[start : start + chunk]
        assert np.count_nonzero(got) <= k
        bound = np.abs(flat_in[start : start + chunk]).max()
        kept = got != 0
        assert (np.abs(got) <= bound * (1 + 1e-6)).all()
        assert (np.abs(got[kept] - flat_in[start : start + chunk][kept]) <= bound * 1.000001).all()
        original = flat_in[start : start + chunk][kept]
        # Signs survive; a kept zero (a chunk with fewer than k nonzeros) decodes as +scale.
        assert (np.sign(got[kept]) == np.where(original == 0, 1, np.sign(original))).all()


def test_kept_positions_and_sizes() -> None:
    rng = np.random.default_rng(1)
    values = rng.standard_normal(5000).astype(np.float32)
    params = CodecParams(chunk=1024, k=8, rice=False)
    data = encode({"x": values}, params)
    parsed_params, sparse = decode_sparse(data, max_elements=BOUND)
    assert parsed_params == params
    entry = sparse["x"]
    # 4 full chunks of 1024 and one of 904: 5 * 8 kept, the 8 largest of each chunk.
    assert entry.positions.size == 40
    for c in range(5):
        part = np.abs(values[c * 1024 : (c + 1) * 1024])
        mine = entry.positions[entry.positions // 1024 == c] - c * 1024
        assert sorted(mine.tolist()) == sorted(np.argsort(-part, kind="stable")[:8].tolist())
    # 5 chunks: 8 bytes of scales, 40 * 10 index bits, 40 * 2 code bits, plus the header.
    header = struct.calcsize("<4sBBBBIIII") + 2 + 1 + 1 + 8
    assert len(data) == header + 5 * 8 + 50 + 10
    assert params.ratio_vs_fp32() == pytest.approx(32 * 1024 / (8 * 12 + 64))


def test_canonical_regardless_of_dict_order_and_input_type() -> None:
    import torch

    rng = np.random.default_rng(2)
    a = rng.standard_normal((64, 33)).astype(np.float32)
    b = rng.standard_normal(100).astype(np.float32)
    params = CodecParams(chunk=256, k=5)
    first = encode({"a": a, "b": b}, params)
    assert encode({"b": b, "a": a}, params) == first
    assert encode({"b": torch.from_numpy(b), "a": torch.from_numpy(a)}, params) == first
    assert first[:4] == MAGIC
    assert encode({"a": a, "b": b * 2}, params) != first


SUBPROCESS_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    import numpy as np, torch
    torch.set_num_threads(int(sys.argv[1]))
    from training.outer.codec import CodecParams, ErrorFeedback
    rng = np.random.default_rng(7)
    shapes = {"model.embed": (300, 64), "model.norm": (64,), "lm_head": (100, 333)}
    feedback = ErrorFeedback(CodecParams(chunk=4096, k=32))
    digest = hashlib.sha256()
    for _ in range(3):
        grads = {n: torch.from_numpy(rng.standard_normal(s).astype(np.float32) * 1e-3)
                 for n, s in shapes.items()}
        digest.update(feedback.step(grads))
    print(digest.hexdigest())
    """
)


def _digest_in_subprocess(threads: int) -> str:
    out = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_SCRIPT, str(threads)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=100,
    )
    return out.stdout.strip()


def test_bytes_identical_across_processes_and_thread_counts() -> None:
    """Guards against a per-process or thread-dependent encoding (dict order, reductions)."""
    rng = np.random.default_rng(7)
    shapes = {"model.embed": (300, 64), "model.norm": (64,), "lm_head": (100, 333)}
    feedback = ErrorFeedback(CodecParams(chunk=4096, k=32))
    digest = hashlib.sha256()
    for _ in range(3):
        grads = {
            n: rng.standard_normal(s).astype(np.float32) * np.float32(1e-3)
            for n, s in shapes.items()
        }
        digest.update(feedback.step(grads))
    assert _digest_in_subprocess(4) == digest.hexdigest()


def test_error_feedback_sends_what_was_dropped() -> None:
    rng = np.random.default_rng(3)
    params = CodecParams(chunk=64, k=4)
    feedback = ErrorFeedback(params)
    total_in = np.zeros((10, 64), np.float32)
    total_sent = np.zeros((10, 64), np.float32)
    for step in range(300):
        grad = (
            rng.standard_normal((10, 64)).astype(np.float32)
            if step < 30
            else np.zeros_like(total_in)
        )
        total_in += grad
        sent = decode(feedback.step({"g": grad}), max_elements=BOUND).tensors["g"]
        total_sent += sent
        # Conservation: everything sent plus the residual is everything put in.
        np.testing.assert_allclose(total_sent + feedback.residual["g"], total_in, atol=1e-3)
        if step == 0:
            first_error = np.linalg.norm(total_sent - total_in) / np.linalg.norm(total_in)
    final_error = np.linalg.norm(total_sent - total_in) / np.linalg.norm(total_in)
    assert first_error > 0.5
    assert final_error < 0.02


def test_a_refused_step_leaves_the_residual_as_it_was() -> None:
    """A NaN in a later tensor is refused before the residual changes, so the worker can
    restore its weights and send the round again (or a later one) as if nothing happened."""
    feedback = ErrorFeedback(CodecParams(chunk=16, k=2), decay=0.9)
    rng = np.random.default_rng(0)
    grads = {n: rng.normal(size=32).astype(np.float32) for n in ("a", "b", "c")}
    feedback.step(grads)
    before = {n: v.copy() for n, v in feedback.residual.items()}
    poisoned = {**grads, "c": np.full(32, np.nan, np.float32)}
    with pytest.raises(ValueError, match="NaN or infinity"):
        feedback.step(poisoned)
    assert all(np.array_equal(feedback.residual[n], before[n]) for n in before)
    again = ErrorFeedback(CodecParams(chunk=16, k=2), decay=0.9)
    again.step(grads)
    assert feedback.step(grads) == again.step(grads)  # the same bytes as if never refused


def test_error_feedback_rejects_changed_tensors() -> None:
    feedback = ErrorFeedback(CodecParams(chunk=16, k=2))
    feedback.step({"a": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="names changed"):
        feedback.step({"b": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="shape"):
        feedback.step({"a": np.ones(5, np.float32)})


def test_encoder_refuses_bad_input() -> None:
    params = CodecParams(chunk=16, k=2)
    with pytest.raises(ValueError, match="NaN"):
        encode({"a": np.array([1.0, np.nan], np.float32)}, params)
    with pytest.raises(ValueError, match="float32"):
        encode({"a": np.ones(3, np.float64)}, params)
    with pytest.raises(ValueError, match="power of two"):
        CodecParams(chunk=100, k=2)
    with pytest.raises(ValueError, match="k 17"):
        CodecParams(chunk=16, k=17)


def test_dense_round_trip() -> None:
    rng = np.random.default_rng(4)
    tensors = {"b": rng.standard_normal((3, 5)).astype(np.float32), "a": np.float32(2.5)}
    data = encode_dense(tensors)
    decoded = decode(data, max_elements=BOUND)
    assert decoded.params is None
    np.testing.assert_array_equal(decoded.tensors["b"], tensors["b"])
    assert decoded.tensors["a"].shape == ()
    assert float(decoded.tensors["a"]) == 2.5


# --- malformed inputs -------------------------------------------------------------------


def _sample(*, rice: bool = True) -> tuple[bytes, CodecParams]:
    rng = np.random.default_rng(5)
    params = CodecParams(chunk=16, k=3, rice=rice)
    tensors = {
        "a": rng.standard_normal(20).astype(np.float32),
        "b": rng.standard_normal((2, 3)).astype(np.float32),
    }
    return encode(tensors, params), params


@pytest.mark.parametrize("rice", [True, False])
def test_every_truncation_and_trailing_byte_rejected(rice: bool) -> None:
    data, _ = _sample(rice=rice)
    for cut in range(len(data)):
        with pytest.raises(CodecError):
            decode(data[:cut], max_elements=BOUND)
    for tail in (b"\x00", b"\x01", b"\x00" * 64):
        with pytest.raises(CodecError, match=r"header says|header allows|position stream"):
            decode(data + tail, max_elements=BOUND)


def _with_fixed(data: bytes, **fields: int) -> bytes:
    names = ["magic", "version", "scheme", "dtype", "index_bits", "chunk", "k", "bits", "count"]
    fmt = "<4sBBBBIIII"
    values = dict(zip(names, struct.unpack_from(fmt, data), strict=True))
    values.update(fields)
    return struct.pack(fmt, *(values[n] for n in names)) + data[struct.calcsize(fmt) :]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"magic": b"XXXX"}, "magic"),
        ({"version": 2}, "version"),
        ({"scheme": 7}, "scheme"),
        ({"dtype": 2}, "dtype"),
        ({"bits": 3}, "value width"),
        ({"index_bits": 5}, "chunk"),
        ({"chunk": 17}, "chunk"),
        ({"index_bits": 3, "chunk": 8}, "chunk"),
        ({"k": 0}, "bad k"),
        ({"k": 17}, "bad k"),
        ({"count": 0xFFFFFFFF}, "count"),
        ({"count": 3}, "truncated|increasing|length"),
        ({"k": 4}, "header (says|allows)|padding|high/low|position stream"),
    ],
)
def test_bad_header_rejected(fields: dict[str, object], message: str) -> None:
    data, _ = _sample()
    with pytest.raises(CodecError, match=message):
        decode(_with_fixed(data, **fields), max_elements=BOUND)  # type: ignore[arg-type]


def _raw_update(entries: list[tuple[bytes, tuple[int, ...]]], payload: bytes) -> bytes:
    fixed = struct.pack("<4sBBBBIIII", MAGIC, 1, 1, 1, 4, 16, 3, 2, len(entries))
    parts = [fixed]
    for name, shape in entries:
        parts.append(struct.pack("<H", len(name)) + name + struct.pack("<B", len(shape)))
        parts.append(struct.pack(f"<{len(shape)}Q", *shape))
    return b"".join(parts) + payload


def test_every_decode_names_its_bound() -> None:
    """Guards against a default bound: a 328 KiB top-k update can name 2^31 values (8 GiB
    dense), so no caller may decode without saying how many values its model holds, and
    no bound may exceed the codec's ceiling."""
    from training.outer.codec import MAX_ELEMENTS, parse

    claims = _raw_update([(b"w", (1 << 31,))], b"")
    for call in (decode, parse, decode_sparse):
        with pytest.raises(TypeError, match="max_elements"):
            call(claims)  # type: ignore[operator]
        with pytest.raises(ValueError, match="outside"):
            call(claims, max_elements=MAX_ELEMENTS + 1)  # type: ignore[operator]
        with pytest.raises(CodecError, match="more than 1000 values"):
            call(claims, max_elements=1000)  # type: ignore[operator]


def test_huge_shapes_rejected_before_allocation() -> None:
    """A 40-byte blob claiming 2^80 values must fail on the header, not in numpy."""
    with pytest.raises(CodecError, match="more than"):
        decode(_raw_update([(b"w", (1 << 40, 1 << 40))], b""), max_elements=BOUND)
    with pytest.raises(CodecError, match="more than"):
        decode(_raw_update([(b"w", (1000,))], b""), max_elements=999)
    with pytest.raises(CodecError, match="dims"):
        decode(_raw_update([(b"w", (1,) * 9)], b""), max_elements=BOUND)


def test_names_must_be_sorted_unique_utf8() -> None:
    with pytest.raises(CodecError, match="increasing"):
        decode(_raw_update([(b"b", (0,)), (b"a", (0,))], b""), max_elements=BOUND)
    with pytest.raises(CodecError, match="increasing"):
        decode(_raw_update([(b"a", (0,)), (b"a", (0,))], b""), max_elements=BOUND)
    with pytest.raises(CodecError, match="UTF-8"):
        decode(_raw_update([(b"\xff", (0,))], b""), max_elements=BOUND)
    with pytest.raises(CodecError, match="name length"):
        decode(_raw_update([(b"", (0,))], b""), max_elements=BOUND)
    # Empty tensors are fine.
    assert decode(_raw_update([(b"a", (0,)), (b"b", (2, 0))], b""), max_elements=BOUND).tensors[
        "b"
    ].shape == (2, 0)


def _encoded(
    positions: list[int],
    codes: list[int],
    scales: list[float] | None = None,
    numel: int = 20,
    *,
    rice: bool = False,
) -> bytes:
    params = CodecParams(chunk=16, k=3, rice=rice)
    n_chunks = -(-numel // 16)
    scale_array = np.array(scales or [0.5, 1.0] * n_chunks, np.float32).reshape(n_chunks, 2)
    sparse = SparseTensor(
        (numel,), scale_array, np.array(positions, np.int64), np.array(codes, np.uint8)
    )
    return encode_sparse({"a": sparse}, params)


def test_crafted_payloads() -> None:
    good = _encoded([0, 5, 9, 16, 17, 19], [2, 2, 1, 2, 3, 0])
    out = decode(good, max_elements=BOUND).tensors["a"]
    assert out[[0, 5, 9, 16, 17, 19]].tolist() == [1.0, 1.0, -0.5, 1.0, -1.0, 0.5]
    # Index 4 of the short last chunk (4 values) is past its end.
    with pytest.raises(CodecError, match="past the end"):
        decode(_encoded([0, 5, 9, 16, 17, 20], [2, 2, 1, 2, 3, 0]), max_elements=BOUND)
    with pytest.raises(CodecError, match="out of order"):
        decode(_encoded([0, 9, 5, 16, 17, 19], [2, 2, 1, 2, 3, 0]), max_elements=BOUND)
    with pytest.raises(CodecError, match="out of order"):
        decode(_encoded([0, 5, 5, 16, 17, 19], [2, 2, 1, 2, 3, 0]), max_elements=BOUND)
    with pytest.raises(CodecError, match="high/low"):
        decode(_encoded([0, 5, 9, 16, 17, 19], [2, 2, 3, 2, 3, 0]), max_elements=BOUND)
    with pytest.raises(CodecError, match="scale"):
        decode(
            _encoded([0, 5, 9, 16, 17, 19], [2, 2, 1, 2, 3, 0], [0.5, -1.0, 0.5, 1.0]),
            max_elements=BOUND,
        )
    with pytest.raises(CodecError, match="scale"):
        decode(
            _encoded([0, 5, 9, 16, 17, 19], [2, 2, 1, 2, 3, 0], [0.5, np.nan, 0.5, 1.0]),
            max_elements=BOUND,
        )
    with pytest.raises(CodecError, match="scale"):
        decode(
            _encoded([0, 5, 9, 16, 17, 19], [2, 2, 1, 2, 3, 0], [-0.0, 1.0, 0.5, 1.0]),
            max_elements=BOUND,
        )
    # The 6 codes take 12 bits: the last 4 bits of their byte must be zero.
    tampered = good[:-1] + bytes([good[-1] | 0x80])
    with pytest.raises(CodecError, match="padding"):
        decode(tampered, max_elements=BOUND)


def test_expected_shapes_checked() -> None:
    data, _ = _sample()
    assert set(decode(data, expected={"a": (20,), "b": (2, 3)}, max_elements=BOUND).tensors) == {
        "a",
        "b",
    }
    with pytest.raises(CodecError, match="do not match"):
        decode(data, expected={"a": (20,), "b": (3, 2)}, max_elements=BOUND)
    with pytest.raises(CodecError, match="do not match"):
        decode(data, expected={"a": (20,)}, max_elements=BOUND)


def test_dense_rejects_non_finite_and_bad_params() -> None:
    data = encode_dense({"a": np.ones(2, np.float32)})
    with pytest.raises(CodecError, match="NaN"):
        decode(data[:-4] + struct.pack("<f", float("inf")), max_elements=BOUND)
    with pytest.raises(CodecError, match="non-canonical"):
        decode(_with_fixed(data, k=1), max_elements=BOUND)
    with pytest.raises(CodecError, match="dense update"):
        decode_sparse(data, max_elements=BOUND)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_codec_error(data: bytes) -> None:
    try:
        decode(data, max_elements=BOUND)
    except CodecError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    position=st.integers(0, 10_000),
    value=st.integers(0, 255),
    cut=st.integers(0, 3),
    rice=st.booleans(),
)
def test_mutated_updates_raise_only_codec_error(
    position: int, value: int, cut: int, rice: bool
) -> None:
    data, _ = _sample(rice=rice)
    position %= len(data)
    mutated = data[:position] + bytes([value]) + data[position + 1 :]
    mutated = mutated[: len(mutated) - cut]
    try:
        decoded = decode(mutated, max_elements=BOUND)
    except CodecError:
        return
    # Whatever survived validation is a well-formed update: finite float32 tensors.
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in decoded.tensors.values())


# --- names and shapes once per run (scheme 2) ----------------------------------------


def test_schema_reference_drops_names_and_shapes_and_checks_them() -> None:
    """Tensor names and shapes (23% of an update sent in full) go by reference to a schema
    both sides hold, and are checked against it."""
    rng = np.random.default_rng(3)
    tensors = {
        f"model.layers.{i}.self_attn.q_proj.weight": rng.standard_normal((64, 64)).astype(
            np.float32
        )
        for i in range(8)
    }
    shapes = {n: tuple(v.shape) for n, v in tensors.items()}
    params = CodecParams(chunk=1024, k=16)
    full = ErrorFeedback(params).step(tensors)
    ref = ErrorFeedback(params, schema_ref=True).step(tensors)
    names_bytes = sum(2 + len(n) + 1 + 8 * 2 for n in tensors)
    assert len(full) - len(ref) == names_bytes - 32
    a = decode(full, expected=shapes, max_elements=BOUND).tensors
    b = decode(ref, expected=shapes, max_elements=BOUND).tensors
    assert all(np.array_equal(a[n], b[n]) for n in tensors)
    with pytest.raises(CodecError, match="model's are needed"):
        decode(ref, max_elements=BOUND)
    other = {**shapes, next(iter(shapes)): (32, 128)}
    with pytest.raises(CodecError, match="another model"):
        decode(ref, expected=other, max_elements=BOUND)
    with pytest.raises(CodecError, match="another model"):
        decode(ref, expected=dict(list(shapes.items())[:-1]), max_elements=BOUND)


# --- Rice-coded positions (schemes 3 and 4) --------------------------------------------


def _bits_per_kept(data: bytes, params: CodecParams, numel: int) -> float:
    """Bits per kept value of a one-tensor update, header and scales left out."""
    header = struct.calcsize("<4sBBBBIIII") + 2 + 1 + 1 + 8
    chunks = -(-numel // params.chunk)
    kept = numel // params.chunk * params.k
    return (len(data) - header - 8 * chunks) * 8 / kept


def test_rice_positions_cost_a_third_less_and_decode_the_same() -> None:
    """Rice-coded positions: fixed 12-bit indices cost about 15.3 bits per kept value with
    codes and scales; the Rice layout is within a bit of the entropy of the kept set and
    decodes the same."""
    rng = np.random.default_rng(11)
    values = rng.standard_normal(16 * 4096).astype(np.float32)
    rice, fixed = CodecParams(4096, 64), CodecParams(4096, 64, rice=False)
    a, b = encode({"w": values}, rice), encode({"w": values}, fixed)
    assert _bits_per_kept(b, fixed, values.size) == 12 + 2
    entropy = math.log2(math.comb(4096, 64)) / 64  # 7.36 bits per position
    assert _bits_per_kept(a, rice, values.size) < entropy + 0.5 + 2
    assert len(a) < 0.75 * len(b)  # scales (64 bits a chunk) are the same in both
    np.testing.assert_array_equal(
        decode(a, max_elements=BOUND).tensors["w"], decode(b, max_elements=BOUND).tensors["w"]
    )
    assert rice.ratio_vs_fp32() > 1.3 * fixed.ratio_vs_fp32()  # a worst-case bound


def test_short_chunks_keep_the_density_of_a_full_one() -> None:
    """A 64-value norm weight kept 48 of its 64 values at k 48 / chunk 4096 (75% dense);
    the Rice layout keeps ceil(48 * 64 / 4096) = 1, and 33 of a 2816-value chunk."""
    rng = np.random.default_rng(12)
    params = CodecParams(4096, 48)
    norm = rng.standard_normal(64).astype(np.float32)
    mlp = rng.standard_normal(4096 + 2816).astype(np.float32)
    _, sparse = decode_sparse(encode({"norm": norm, "mlp": mlp}, params), max_elements=BOUND)
    assert sparse["norm"].positions.tolist() == [int(np.argmax(np.abs(norm)))]
    assert sparse["mlp"].positions.size == 48 + 33
    _, fixed = decode_sparse(
        encode({"norm": norm}, CodecParams(4096, 48, rice=False)), max_elements=BOUND
    )
    assert fixed["norm"].positions.size == 48


def test_tiny_llama_update_is_146x_smaller_than_dense() -> None:
    """An update is 146x smaller than dense, on the tiny Llama's shapes at the simulation's
    default codec (k 80 of 4096), with the names sent by digest as on the wire."""
    from training.outer.simconfig import SimConfig

    shapes = {"embed": (260, 64), "lm_head": (260, 64), "norm": (64,)}
    for layer in range(2):
        for name, shape in {
            "q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64),
            "gate": (172, 64), "up": (172, 64), "down": (64, 172),
            "in_norm": (64,), "post_norm": (64,),
        }.items():  # fmt: skip
            shapes[f"layers.{layer}.{name}"] = shape
    assert sum(math.prod(s) for s in shapes.values()) == 124224
    rng = np.random.default_rng(13)
    feedback = ErrorFeedback(CodecParams(SimConfig.chunk, SimConfig.k), decay=1.0, schema_ref=True)
    for _ in range(3):
        grads = {n: (rng.standard_normal(s) * 1e-3).astype(np.float32) for n, s in shapes.items()}
        data = feedback.step(grads)
        assert len(data) * 146 <= 4 * 124224
        assert decode(data, expected=shapes, max_elements=BOUND).params == CodecParams(
            SimConfig.chunk, SimConfig.k
        )


def _rice_update() -> tuple[bytes, int]:
    """A crafted Rice update (chunk 16, k 3, 20 values: 3 kept, then 1 of the last 4) and
    the offset of its unary stream (one byte: gaps 0, 4, 3 and 3 have quotients 0, 1, 0, 0
    with b = 2, so the stream is 1 01 1 1 = 5 bits)."""
    sparse = SparseTensor(
        (20,),
        np.array([[0.5, 1.0], [0.0, 1.0]], np.float32),
        np.array([0, 5, 9, 19], np.int64),
        np.array([2, 2, 1, 2], np.uint8),
    )
    data = encode_sparse({"a": sparse}, CodecParams(chunk=16, k=3))
    return data, len(data) - 1


def test_crafted_rice_streams() -> None:
    data, tail = _rice_update()
    out = decode(data, max_elements=BOUND).tensors["a"]
    assert out[[0, 5, 9, 19]].tolist() == [1.0, 1.0, -0.5, 1.0]
    assert data[tail] == 0b11101

    def with_stream(stream: bytes) -> bytes:
        return data[:tail] + stream

    with pytest.raises(CodecError, match="holds 5 gaps"):
        decode(with_stream(bytes([0b111101])), max_elements=BOUND)  # a one bit in the padding
    with pytest.raises(CodecError, match="holds 3 gaps"):
        decode(
            with_stream(bytes([0b01101])), max_elements=BOUND
        )  # the last gap's terminator dropped
    # Two full chunks keeping 0, 1, 2 each: 6 one bits; 12 bits would be the most.
    sparse = SparseTensor(
        (32,),
        np.array([[0.5, 1.0], [0.5, 1.0]], np.float32),
        np.array([0, 1, 2, 16, 17, 18], np.int64),
        np.array([2, 2, 0, 2, 2, 0], np.uint8),
    )
    packed = encode_sparse({"a": sparse}, CodecParams(chunk=16, k=3))
    assert packed[-1] == 0b111111
    assert decode(packed, max_elements=BOUND).tensors["a"][[0, 18]].tolist() == [1.0, 0.5]
    with pytest.raises(CodecError, match="padding past its last byte"):
        decode(packed + b"\x00", max_elements=BOUND)
    # The last chunk has 4 values: a gap of 4 (quotient 1, low bits 0) is past its end.
    with pytest.raises(CodecError, match="past the end"):
        decode(with_stream(bytes([0b101101])), max_elements=BOUND)
    # A stream longer than any valid one is refused before it is unpacked.
    with pytest.raises(CodecError, match="header allows"):
        decode(with_stream(b"\x00" * 10_000 + bytes([0b11101])), max_elements=BOUND)


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: rng.standard_normal((24, 4096)),
        lambda rng: np.round(rng.standard_normal((24, 4096)) * 2),  # ties at the threshold
        lambda rng: np.zeros((24, 4096)),  # every value ties
        lambda rng: np.where(rng.random((24, 4096)) < 0.01, 1e6, 1.0),  # a few giants
        lambda rng: rng.standard_normal((24, 4096)) * np.linspace(1e-30, 1e30, 4096),
    ],
    ids=["normal", "ties", "zeros", "giants", "scales"],
)
@pytest.mark.parametrize("k", [1, 80, 128])
def test_the_candidate_selection_keeps_what_a_partition_keeps(make: Any, k: int) -> None:
    """The fast top-k (a bound from strided group maxima, then a partition of the values
    above it only) selects exactly the values, ties included, that partitioning each
    whole chunk selects: the bytes of an update do not depend on which path ran."""
    from training.outer.codec import _select_by_candidates, _select_by_partition

    mags = np.abs(make(np.random.default_rng(k))).astype(np.float32)
    groups = 1 << (k - 1).bit_length()
    fast = _select_by_candidates(mags, k, groups)
    slow = _select_by_partition(mags, np.full(mags.shape[0], k, dtype=np.int64), k)
    assert np.array_equal(fast[0], slow[0]) and np.array_equal(fast[1], slow[1])
    assert np.bincount(fast[0], minlength=mags.shape[0]).tolist() == [k] * mags.shape[0]
