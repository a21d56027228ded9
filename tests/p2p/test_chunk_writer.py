"""p2p.fetch.chunk_writer: chunks verified and written by the download's own threads, with the
store's answers and errors handed back to the waiting task, never abandoned on cancel."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import trio
from blake3 import blake3

from blobstore import CorruptChunk, Manifest, Store
from p2p.fetch.chunk_writer import MAX_WRITER_THREADS, ChunkWriter, default_writer_threads

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 * 1024
DATA = os.urandom(5 * CHUNK + 99)
MANIFEST = Manifest.of_bytes(DATA, chunk_size=CHUNK)
# How long a test waits for a thread to reach a point it must reach.
WAIT_S = 10


def _chunk(index: int) -> memoryview:
    offset, length = MANIFEST.chunk_span(index)
    return memoryview(DATA)[offset : offset + length]


class BlockingSink:
    """A stand-in partial whose writes wait until the test lets them finish."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.written: list[int] = []
        self.digests: list[bytes | None] = []
        self.threads: set[int] = set()

    def write_chunk(self, index: int, data: memoryview, *, digest: bytes | None = None) -> bool:
        self.threads.add(threading.get_ident())
        self.digests.append(digest)
        self.entered.release()
        if not self.release.wait(WAIT_S):
            raise TimeoutError("the test never released the write")
        self.written.append(index)
        return True


async def test_chunks_land_verified_and_the_blob_publishes(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "store")
    partial = store.begin_partial(MANIFEST)
    async with ChunkWriter(partial, threads=2) as writer, trio.open_nursery() as nursery:
        results: dict[int, bool] = {}

        async def write(index: int) -> None:
            results[index] = await writer.write(index, _chunk(index))

        for index in range(MANIFEST.num_chunks):
            nursery.start_soon(write, index)
    assert results == {i: True for i in range(MANIFEST.num_chunks)}
    async with ChunkWriter(partial) as writer:
        assert await writer.write(0, _chunk(0)) is False  # already verified: not rewritten
    partial.publish()
    assert store.path(MANIFEST.blob_id).read_bytes() == DATA


async def test_a_callers_digest_reaches_the_store_and_is_held_to_the_manifest(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "store")
    partial = store.begin_partial(MANIFEST)
    async with ChunkWriter(partial) as writer:
        assert await writer.write(0, _chunk(0), blake3(_chunk(0)).digest()) is True
        with pytest.raises(CorruptChunk):  # the digest of another chunk's bytes
            await writer.write(1, _chunk(1), blake3(_chunk(2)).digest())
    assert partial.missing() == list(range(1, MANIFEST.num_chunks))
    partial.close()
    sink = BlockingSink()
    sink.release.set()
    async with ChunkWriter(sink) as writer:
        await writer.write(4, memoryview(b"x"), b"d" * 32)
        await writer.write(5, memoryview(b"y"))
    assert sink.digests == [b"d" * 32, None]


async def test_a_corrupt_chunk_raises_the_stores_error_in_the_caller(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "store")
    partial = store.begin_partial(MANIFEST)
    bad = bytearray(_chunk(2))
    bad[7] ^= 1
    async with ChunkWriter(partial) as writer:
        with pytest.raises(CorruptChunk):
            await writer.write(2, memoryview(bad))
        assert await writer.write(1, _chunk(1)) is True  # the thread survives the error
    assert partial.missing() == [i for i in range(MANIFEST.num_chunks) if i != 1]
    partial.close()


async def test_a_cancelled_caller_waits_for_the_thread_that_owns_its_buffer() -> None:
    sink = BlockingSink()
    returned: list[bool] = []
    scope = trio.CancelScope()

    async def cancel_once_writing() -> None:
        assert await trio.to_thread.run_sync(sink.entered.acquire, True, WAIT_S)
        scope.cancel()
        await trio.sleep(0.05)  # the cancelled write must still be waiting
        assert returned == []
        sink.release.set()

    async with ChunkWriter(sink, threads=1) as writer, trio.open_nursery() as nursery:
        nursery.start_soon(cancel_once_writing)
        with scope:
            returned.append(await writer.write(3, memoryview(b"x")))
            await trio.sleep(WAIT_S)  # the cancellation lands here, after the answer
    assert scope.cancelled_caught
    assert returned == [True]
    assert sink.written == [3]


async def test_writes_run_on_all_of_the_writers_threads_at_once() -> None:
    sink = BlockingSink()
    async with ChunkWriter(sink, threads=2) as writer, trio.open_nursery() as nursery:
        for index in (0, 1):
            nursery.start_soon(writer.write, index, memoryview(b"x"))
        for _ in range(2):  # both writes are inside write_chunk before either may finish
            assert await trio.to_thread.run_sync(sink.entered.acquire, True, WAIT_S)
        sink.release.set()
    assert sorted(sink.written) == [0, 1]
    assert len(sink.threads) == 2


async def test_leaving_the_block_finishes_queued_writes_and_stops_the_threads() -> None:
    sink = BlockingSink()
    sink.release.set()
    writer = ChunkWriter(sink, threads=2)
    async with writer:
        assert writer.threads == 2
        assert await writer.write(0, memoryview(b"x")) is True
    assert not any(t.is_alive() for t in writer._threads)
    with pytest.raises(RuntimeError, match="outside"):
        await writer.write(1, memoryview(b"x"))


def test_thread_count_follows_the_cpus_within_bounds() -> None:
    assert 1 <= default_writer_threads() <= MAX_WRITER_THREADS
    with pytest.raises(ValueError, match="at least one thread"):
        ChunkWriter(BlockingSink(), threads=0)
