"""Manifest encoding, strict decoding and blob IDs (DESIGN section 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from blobstore import (
    DEFAULT_CHUNK_SIZE,
    MAX_BLOB_SIZE,
    MAX_CHUNK_SIZE,
    MAX_CHUNKS,
    MAX_MANIFEST_SIZE,
    MIN_CHUNK_SIZE,
    BadBlobId,
    BadManifest,
    Manifest,
    parse_blob_id,
)

C = MIN_CHUNK_SIZE
REPO = Path(__file__).resolve().parents[2]


def raw_map(*pairs: tuple[str, bytes]) -> bytes:
    """A msgpack map from (key, already-encoded value) pairs: for hand-made bad forms."""
    out = bytes([0x80 | len(pairs)])
    for key, value in pairs:
        out += msgpack.packb(key) + value
    return out


def good_pairs(size: int = 5, chunk: int = C) -> list[tuple[str, bytes]]:
    hashes = b"\x11" * 32 * -(-size // chunk)
    return [
        ("v", msgpack.packb(1)),
        ("size", msgpack.packb(size)),
        ("chunk", msgpack.packb(chunk)),
        ("hashes", msgpack.packb(hashes, use_bin_type=True)),
    ]


@pytest.mark.parametrize("size", [0, 1, C - 1, C, C + 1, 7 * C + 3])
def test_round_trip(size: int) -> None:
    data = os.urandom(size)
    m = Manifest.of_bytes(data, C)
    assert Manifest.decode(m.encode()) == m
    assert m.num_chunks == -(-size // C)
    assert sum(m.chunk_span(i)[1] for i in range(m.num_chunks)) == size
    for i in range(m.num_chunks):
        off, length = m.chunk_span(i)
        assert m.chunk_hash(i) == blake3(data[off : off + length]).digest()
    assert m.blob_id == blake3(m.encode()).hexdigest()
    assert parse_blob_id(m.blob_id) == m.blob_id


def test_exact_canonical_bytes() -> None:
    """Pins the wire form: keys in order, smallest ints, bin8 for an empty hash list."""
    m = Manifest(size=0, chunk_size=C, hashes=b"")
    assert m.encode() == b"\x84\xa1v\x01\xa4size\x00\xa5chunk\xce\x00\x01\x00\x00\xa6hashes\xc4\x00"


def test_hand_built_good_form_decodes() -> None:
    """Guards the malformed cases below: the same builder with nothing wrong is accepted."""
    assert Manifest.decode(raw_map(*good_pairs())).size == 5


def _swap(pairs: list[tuple[str, bytes]], i: int, j: int) -> list[tuple[str, bytes]]:
    pairs = list(pairs)
    pairs[i], pairs[j] = pairs[j], pairs[i]
    return pairs


MALFORMED = {
    "extra key": raw_map(*good_pairs(), ("x", msgpack.packb(0))),
    "missing key": raw_map(*good_pairs()[:3]),
    "reordered keys": raw_map(*_swap(good_pairs(), 1, 2)),
    "duplicate key": raw_map(*good_pairs()[:3], ("size", msgpack.packb(5))),
    "non-minimal size (uint32 for 5)": raw_map(
        good_pairs()[0], ("size", b"\xce\x00\x00\x00\x05"), *good_pairs()[2:]
    ),
    "non-minimal chunk (uint64)": raw_map(
        *good_pairs()[:2], ("chunk", b"\xcf" + C.to_bytes(8, "big")), good_pairs()[3]
    ),
    "str8 key": b"\x84\xd9\x01v\x01" + raw_map(*good_pairs()[1:])[1:],
    "bin16 hash list that fits bin8": raw_map(
        *good_pairs()[:3], ("hashes", b"\xc5\x00\x20" + b"\x11" * 32)
    ),
    "version 2": raw_map(("v", msgpack.packb(2)), *good_pairs()[1:]),
    "version true": raw_map(("v", b"\xc3"), *good_pairs()[1:]),
    "size is a bool": raw_map(good_pairs()[0], ("size", b"\xc3"), *good_pairs()[2:]),
    "negative size": raw_map(good_pairs()[0], ("size", msgpack.packb(-1)), *good_pairs()[2:]),
    "size beyond limit": raw_map(
        good_pairs()[0], ("size", msgpack.packb(MAX_BLOB_SIZE + 1)), *good_pairs()[2:]
    ),
    "chunk not a power of two": raw_map(*good_pairs(chunk=C + 1)),
    "chunk too small": raw_map(*good_pairs(chunk=C // 2)),
    "chunk too large": raw_map(*good_pairs(chunk=MAX_CHUNK_SIZE * 2)),
    "hash list one short": raw_map(
        *good_pairs(size=C + 1)[:3], ("hashes", msgpack.packb(b"\x11" * 32, use_bin_type=True))
    ),
    "hash list one long": raw_map(
        *good_pairs()[:3], ("hashes", msgpack.packb(b"\x11" * 64, use_bin_type=True))
    ),
    "hashes as str": raw_map(*good_pairs()[:3], ("hashes", msgpack.packb("x" * 32))),
    "trailing byte": raw_map(*good_pairs()) + b"\x00",
    "a list": msgpack.packb([1, 5, C, b"\x11" * 32], use_bin_type=True),
    "empty input": b"",
    "truncated": raw_map(*good_pairs())[:-3],
    "integer key": b"\x84\x01\x01" + raw_map(*good_pairs()[1:])[1:],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_rejected(name: str) -> None:
    with pytest.raises(BadManifest):
        Manifest.decode(MALFORMED[name])


def test_oversized_rejected_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    """A huge claim must cost nothing: the length check comes before msgpack runs."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpackb called on an oversized manifest")

    monkeypatch.setattr(msgpack, "unpackb", boom)
    with pytest.raises(BadManifest, match="over the limit"):
        Manifest.decode(b"\x84" + b"\x00" * MAX_MANIFEST_SIZE)


def test_largest_manifest_fits_the_limit() -> None:
    """The named limits agree: a manifest with MAX_CHUNKS hashes decodes."""
    m = Manifest(size=MAX_CHUNKS * C, chunk_size=C, hashes=bytes(32 * MAX_CHUNKS))
    data = m.encode()
    assert len(data) <= MAX_MANIFEST_SIZE
    assert Manifest.decode(data).num_chunks == MAX_CHUNKS
    with pytest.raises(BadManifest, match="more than the limit"):
        Manifest(size=MAX_CHUNKS * C + 1, chunk_size=C, hashes=bytes(32 * (MAX_CHUNKS + 1)))


def test_every_manifest_the_store_accepts_fits_one_protocol_frame() -> None:
    """A blob the store holds can also be served: its largest manifest is within what one
    manifest response of the wire protocol carries (else a peer could hold it and never
    hand it on)."""
    from p2p.blob import messages

    m = Manifest(size=MAX_CHUNKS * C, chunk_size=C, hashes=bytes(32 * MAX_CHUNKS))
    assert len(m.encode()) <= messages.MAX_MANIFEST_BYTES
    assert MAX_MANIFEST_SIZE <= messages.MAX_MANIFEST_BYTES


@given(st.binary(max_size=512))
@settings(max_examples=400, deadline=None)
def test_arbitrary_bytes_raise_only_bad_manifest(data: bytes) -> None:
    try:
        m = Manifest.decode(data)
    except BadManifest:
        return
    assert m.encode() == data  # anything accepted is canonical


@given(st.integers(0, 3 * C), st.sampled_from([C, 2 * C]), st.data())
@settings(max_examples=150, deadline=None)
def test_mutated_manifests_raise_only_bad_manifest(
    size: int, chunk: int, data: st.DataObject
) -> None:
    good = Manifest(size=size, chunk_size=chunk, hashes=b"\x22" * 32 * -(-size // chunk)).encode()
    pos = data.draw(st.integers(0, len(good) - 1))
    mutated = data.draw(
        st.sampled_from(
            [
                good[:pos] + bytes([good[pos] ^ data.draw(st.integers(1, 255))]) + good[pos + 1 :],
                good[:pos] + good[pos + 1 :],
                good[:pos] + data.draw(st.binary(min_size=1, max_size=4)) + good[pos:],
            ]
        )
    )
    try:
        m = Manifest.decode(mutated)
    except BadManifest:
        return
    assert m.encode() == mutated


def test_same_id_across_processes(tmp_path: Path) -> None:
    """IDs depend only on content and chunk size, not on the process (hash seeds etc.)."""
    data = bytes(range(256)) * 1000
    (tmp_path / "d").write_bytes(data)
    code = (
        "import sys; from blobstore import Manifest; "
        "print(Manifest.of_bytes(open(sys.argv[1], 'rb').read(), int(sys.argv[2])).blob_id)"
    )
    ids = set()
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "d"), str(C)],
            check=True,
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": seed},
            timeout=60,
        )
        ids.add(out.stdout.strip())
    assert ids == {Manifest.of_bytes(data, C).blob_id}
    assert Manifest.of_bytes(data, 2 * C).blob_id not in ids  # chunk size is part of the ID


@pytest.mark.parametrize(
    "text", ["", "ab" * 31, "AB" * 32, "g" * 64, "a" * 65, " " + "a" * 63, "a" * 63 + "\n"]
)
def test_parse_blob_id_rejects(text: str) -> None:
    with pytest.raises(BadBlobId):
        parse_blob_id(text)


def test_default_chunk_size_is_one_mib() -> None:
    assert DEFAULT_CHUNK_SIZE == 1 << 20
    assert Manifest.of_bytes(b"x").chunk_size == DEFAULT_CHUNK_SIZE
