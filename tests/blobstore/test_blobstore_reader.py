"""ChunkReader: many chunks through one open file, with and without re-verification."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blobstore import ChunkUnavailable, CorruptChunk, Manifest, Store

CHUNK = 64 * 1024


def test_reads_every_chunk_of_a_complete_blob(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s")
    data = os.urandom(3 * CHUNK + 5)
    blob_id = store.put_bytes(data, chunk_size=CHUNK)
    with store.open_reader(blob_id) as reader:
        got = b"".join(reader.read(i) for i in range(reader.manifest.num_chunks))
    assert got == data


def test_partial_blob_serves_only_persisted_verified_chunks(tmp_path: Path) -> None:
    data = os.urandom(4 * CHUNK)
    manifest = Manifest.of_bytes(data, chunk_size=CHUNK)
    writer = Store.open(tmp_path / "s")
    with writer.begin_partial(manifest) as partial:
        partial.write_chunk(1, data[CHUNK : 2 * CHUNK])
        partial.flush()
    other = Store.open(tmp_path / "s")  # another process's view: the persisted bitmap
    with other.open_reader(manifest.blob_id) as reader:
        assert reader.read(1) == data[CHUNK : 2 * CHUNK]
        with pytest.raises(ChunkUnavailable):
            reader.read(0)


def test_bit_rot_is_caught_only_when_verifying(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s")
    data = bytes(2 * CHUNK)
    blob_id = store.put_bytes(data, chunk_size=CHUNK)
    path = store.path(blob_id)
    path.chmod(0o644)
    with path.open("r+b") as f:
        f.seek(CHUNK + 7)
        f.write(b"\x01")
    with store.open_reader(blob_id) as reader:
        with pytest.raises(CorruptChunk, match="chunk 1"):
            reader.read(1, verify=True)
        assert reader.read(1, verify=False) != data[CHUNK:]


def test_read_errors_become_store_errors(tmp_path: Path) -> None:
    """A failing disk must surface as the store's typed error, not a raw OSError."""
    from blobstore import StoreError

    store = Store.open(tmp_path / "s")
    blob_id = store.put_bytes(bytes(CHUNK), chunk_size=CHUNK)
    reader = store.open_reader(blob_id)
    assert reader._fd is not None
    os.close(reader._fd)  # the next pread fails with EBADF, as a dying disk fails with EIO
    with pytest.raises(StoreError):
        reader.read(0)
    reader._fd = None
