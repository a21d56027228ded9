"""ChunkReader: many chunks through one open file, with and without re-verification."""

from __future__ import annotations

import mmap
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


def bit_rotted_blob(tmp_path: Path) -> tuple[Store, str, bytes]:
    """A two-chunk blob of zeros whose chunk 1 has one byte changed on disk."""
    store = Store.open(tmp_path / "s")
    data = bytes(2 * CHUNK)
    blob_id = store.put_bytes(data, chunk_size=CHUNK)
    path = store.path(blob_id)
    path.chmod(0o644)
    with path.open("r+b") as f:
        f.seek(CHUNK + 7)
        f.write(b"\x01")
    return store, blob_id, data


def test_bit_rot_is_caught_only_when_verifying(tmp_path: Path) -> None:
    store, blob_id, data = bit_rotted_blob(tmp_path)
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


# --- read_into ------------------------------------------------------------------------------


def test_read_into_fills_the_buffer_with_what_read_returns(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s")
    data = os.urandom(3 * CHUNK + 5)
    blob_id = store.put_bytes(data, chunk_size=CHUNK)
    pool = mmap.mmap(-1, CHUNK)  # a page-aligned buffer, as the server's pool hands out
    with store.open_reader(blob_id) as reader:
        for i in range(reader.manifest.num_chunks):
            length = reader.manifest.chunk_span(i)[1]
            out = memoryview(pool)[:length]
            out[:] = b"\xee" * length  # stale bytes from a previous chunk must not survive
            assert reader.read_into(i, out) is True
            assert bytes(out) == reader.read(i)
            other = bytearray(length)
            assert reader.read_into(i, memoryview(other), verify=False) is True
            assert bytes(other) == data[i * CHUNK : i * CHUNK + length]


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT on this platform")
def test_read_into_cached_only_serves_a_just_written_blob_from_the_page_cache(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "s")
    data = os.urandom(2 * CHUNK)
    blob_id = store.put_bytes(data, chunk_size=CHUNK)
    with store.open_reader(blob_id) as reader:
        reader.read(1)  # make sure its pages are cached, whatever put_bytes did
        out = bytearray(CHUNK)
        assert reader.read_into(1, memoryview(out), cached_only=True) is True
        assert bytes(out) == data[CHUNK:]


def test_read_into_refuses_a_buffer_of_the_wrong_length(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s")
    blob_id = store.put_bytes(os.urandom(CHUNK + 10), chunk_size=CHUNK)
    with store.open_reader(blob_id) as reader:
        for index, size in [(0, CHUNK - 1), (0, CHUNK + 1), (1, CHUNK), (1, 9)]:
            with pytest.raises(ValueError, match="buffer"):
                reader.read_into(index, memoryview(bytearray(size)))
        assert reader.read_into(1, memoryview(bytearray(10))) is True


@pytest.mark.parametrize("cached_only", [False, True])
def test_read_into_a_truncated_file_is_a_corrupt_chunk(tmp_path: Path, cached_only: bool) -> None:
    store = Store.open(tmp_path / "s")
    data = os.urandom(2 * CHUNK)
    blob_id = store.put_bytes(data, chunk_size=CHUNK)
    path = store.path(blob_id)
    path.chmod(0o644)
    os.truncate(path, CHUNK + 100)
    with store.open_reader(blob_id) as reader:
        assert reader.read_into(0, memoryview(bytearray(CHUNK))) is True
        with pytest.raises(CorruptChunk, match="chunk 1"):
            # Cached or not, the bytes past the end are known to be missing: never "False".
            reader.read_into(1, memoryview(bytearray(CHUNK)), cached_only=cached_only)
        with pytest.raises(CorruptChunk, match="chunk 1"):
            reader.read_into(1, memoryview(bytearray(CHUNK)), verify=False)


def test_read_into_checks_the_hash_only_when_verifying(tmp_path: Path) -> None:
    store, blob_id, _ = bit_rotted_blob(tmp_path)
    with store.open_reader(blob_id) as reader:
        out = bytearray(CHUNK)
        with pytest.raises(CorruptChunk, match="chunk 1"):
            reader.read_into(1, memoryview(out))
        assert reader.read_into(1, memoryview(out), verify=False) is True
        assert out[7] == 1


def test_read_into_a_chunk_not_held_is_unavailable(tmp_path: Path) -> None:
    data = os.urandom(3 * CHUNK)
    manifest = Manifest.of_bytes(data, chunk_size=CHUNK)
    writer = Store.open(tmp_path / "s")
    with writer.begin_partial(manifest) as partial:
        partial.write_chunk(2, data[2 * CHUNK :])
        partial.flush()
    other = Store.open(tmp_path / "s")
    with other.open_reader(manifest.blob_id) as reader:
        out = memoryview(bytearray(CHUNK))
        for cached_only in (False, True):
            with pytest.raises(ChunkUnavailable):
                reader.read_into(0, out, cached_only=cached_only)
        assert reader.read_into(2, out) is True
        assert bytes(out) == data[2 * CHUNK :]


def test_read_into_a_live_partial_waits_for_no_cache_but_reads_when_allowed(
    tmp_path: Path,
) -> None:
    """A partial this process is writing is never served inline (its reads go through the
    partial's own checks), but a plain read_into gets its verified chunks."""
    data = os.urandom(2 * CHUNK)
    manifest = Manifest.of_bytes(data, chunk_size=CHUNK)
    store = Store.open(tmp_path / "s")
    with store.begin_partial(manifest) as partial:
        partial.write_chunk(0, data[:CHUNK])
        with store.open_reader(manifest.blob_id) as reader:
            out = bytearray(CHUNK)
            assert reader.read_into(0, memoryview(out), cached_only=True) is False
            assert out == bytearray(CHUNK)  # untouched
            assert reader.read_into(0, memoryview(out)) is True
            assert bytes(out) == data[:CHUNK]
            with pytest.raises(ChunkUnavailable):
                reader.read_into(1, memoryview(out))


@pytest.mark.skipif(
    not hasattr(os, "RWF_NOWAIT") or not hasattr(os, "posix_fadvise"),
    reason="no RWF_NOWAIT or posix_fadvise on this platform",
)
def test_read_into_cached_only_gives_up_on_a_chunk_not_in_the_page_cache(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s")
    data = os.urandom(4 * CHUNK)
    blob_id = store.put_bytes(data, chunk_size=CHUNK)  # fsynced: its pages are clean
    fd = os.open(store.path(blob_id), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evict them
    finally:
        os.close(fd)
    with store.open_reader(blob_id) as reader:
        out = memoryview(bytearray(CHUNK))
        assert reader.read_into(3, out, cached_only=True) is False
        assert reader.read_into(3, out) is True  # from a thread, in the server
        assert bytes(out) == data[3 * CHUNK :]
        assert reader.read_into(3, out, cached_only=True) is True  # now it is cached
