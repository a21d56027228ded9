"""Blobs made by an adversary: collection-shaped bombs and hostile paths.

A collection is decoded incrementally from its verified chunks, with the entry count
refused before anything is allocated for it, so a blob built to inflate costs a few MiB
of memory whatever it claims. tracemalloc sees every allocation Python and msgpack
make, so a decoder that joins the blob or unpacks it whole fails the bound at once.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest

from blobstore import BadCollection, Store
from blobstore.collection import COLLECTION_MAGIC, MAX_COLLECTION_ENTRIES

MIB = 1024 * 1024
HEADER = COLLECTION_MAGIC + msgpack.packb("entries")
CHILD = "ab" * 32


def array32(n: int) -> bytes:
    return b"\xdd" + struct.pack(">I", n)


@contextmanager
def peak_memory() -> Iterator[Callable[[], int]]:
    """Peak bytes allocated inside the block (read the callable after it)."""
    tracemalloc.start()
    peak = [0]
    try:
        yield lambda: peak[0]
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def test_64mib_collection_bomb_is_refused_without_inflating(store: Store) -> None:
    """64 Mi empty entries in 64 MiB: once 4.8 GiB on `blob get`; now refused at the
    array header, having read one piece of the blob."""
    bomb = HEADER + array32(64 * MIB) + b"\x90" * (64 * MIB)
    blob_id = store.put_bytes(bomb, chunk_size=MIB)
    del bomb
    with peak_memory() as peak, pytest.raises(BadCollection, match="claims 67108864 entries"):
        store.read_collection(blob_id)
    # The store's 8 MiB read buffer plus the decoder's small window; the blob is 64 MiB.
    assert peak() < 12 * MIB
    with peak_memory() as peak, pytest.raises(BadCollection):
        store.is_collection(blob_id)
    assert peak() < 12 * MIB


def test_bomb_within_the_entry_limit_fails_at_its_first_bad_entry(store: Store) -> None:
    """A header that claims an allowed count cannot buy memory with bogus entries."""
    bomb = HEADER + array32(MAX_COLLECTION_ENTRIES) + b"\x90" * (32 * MIB)
    blob_id = store.put_bytes(bomb, chunk_size=MIB)
    with peak_memory() as peak, pytest.raises(BadCollection, match=r"\[path, blob_id, size\]"):
        store.read_collection(blob_id)
    assert peak() < 12 * MIB


@pytest.mark.parametrize(
    "entry",
    [
        b"\x93" + b"\xdb" + struct.pack(">I", 48 * MIB) + b"a" * (48 * MIB),  # a 48 MiB path
        b"\x93" + array32(48 * MIB) + b"\xc0" * (48 * MIB),  # a path of 48 Mi nils
    ],
    ids=["huge-path", "nested-array"],
)
def test_one_huge_entry_is_refused_within_a_bounded_buffer(store: Store, entry: bytes) -> None:
    blob_id = store.put_bytes(HEADER + array32(1) + entry, chunk_size=MIB)
    with peak_memory() as peak, pytest.raises(BadCollection):
        store.read_collection(blob_id)
    assert peak() < 12 * MIB


def test_count_over_the_limit_is_refused_even_when_entries_are_valid() -> None:
    from blobstore.collection import decode_collection

    entry = msgpack.packb(["a", CHILD, 1])
    with pytest.raises(BadCollection, match="over 1000000"):
        decode_collection(HEADER + array32(MAX_COLLECTION_ENTRIES + 1) + entry)


@pytest.mark.parametrize(
    "tail",
    [b"\x00", msgpack.packb(["b", CHILD, 1])],
    ids=["trailing-byte", "trailing-entry"],
)
def test_trailing_bytes_after_the_entries_are_refused(tail: bytes) -> None:
    from blobstore.collection import decode_collection

    good = msgpack.packb({"collection": 1, "entries": [["a", CHILD, 1]]})
    assert [e.path for e in decode_collection(good)] == ["a"]
    with pytest.raises(BadCollection):
        decode_collection(good + tail)


def test_non_canonical_integer_is_refused() -> None:
    """Same values, other bytes (int16 where uint8 belongs): not the canonical form."""
    from blobstore.collection import decode_collection

    good = msgpack.packb({"collection": 1, "entries": [["a", CHILD, 200]]})
    assert good.endswith(b"\xcc\xc8")
    with pytest.raises(BadCollection, match="canonical"):
        decode_collection(good[:-2] + b"\xd1\x00\xc8")


def test_export_refuses_a_malformed_collection(store: Store, tmp_path: Path) -> None:
    """Not written as a plain file, nothing left behind: exit 4 and a reason."""
    blob_id = store.put_bytes(HEADER + array32(2) + b"\x90\x90", chunk_size=64 * 1024)
    with pytest.raises(BadCollection, match="malformed collection") as info:
        store.export(blob_id, tmp_path / "out")
    assert info.value.exit_code == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
