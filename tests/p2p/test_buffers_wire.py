"""ChunkBuffers (the bounded pool of page-aligned chunk buffers) and BlobClient.get with a
pool, over an in-memory stream whose far end is a real sans-IO ServerConnection."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import trio
import trio.testing
from fake_stream import FakeStream, Serve

from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.buffers import ChunkBuffers
from p2p.blob.shell import BlobClient, ChunkSink, StreamLost

BLOB = "0123456789abcdef" * 4


def address_of(buf: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


# --- ChunkBuffers ------------------------------------------------------------------------------


async def test_buffers_are_page_aligned_mmaps_of_the_size_and_are_reused() -> None:
    pool = ChunkBuffers(10_000, 3)
    assert pool.in_use == 0
    a = await pool.acquire()
    b = await pool.acquire()
    assert pool.in_use == 2
    for buf in (a, b):
        assert isinstance(buf, mmap.mmap)
        assert len(buf) == 10_000
        assert address_of(buf) % mmap.PAGESIZE == 0
        assert pool.owns(buf)
        assert pool.owns(memoryview(buf)[5:9].toreadonly())
    assert a is not b
    pool.release(a)
    assert pool.in_use == 1
    assert await pool.acquire() is a  # the freed one is handed out again
    pool.release(memoryview(a)[:100])  # a view of it returns it too
    pool.release(b)
    assert pool.in_use == 0


async def test_acquire_waits_while_every_buffer_is_in_use() -> None:
    pool = ChunkBuffers(4096, 2)
    first = await pool.acquire()
    await pool.acquire()
    got: list[mmap.mmap] = []

    async def third() -> None:
        got.append(await pool.acquire())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(third)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # blocked: both buffers are out
        assert pool.in_use == 2
        pool.release(first)
    assert got == [first]
    assert pool.in_use == 2


async def test_a_buffer_released_twice_is_refused() -> None:
    pool = ChunkBuffers(4096, 2)
    buf = await pool.acquire()
    pool.release(buf)
    with pytest.raises(ValueError, match="twice"):
        pool.release(buf)
    with pytest.raises(ValueError, match="twice"):
        pool.release(memoryview(buf).toreadonly())
    assert pool.in_use == 0
    # The pool still hands out at most `count` buffers, none of them twice.
    x, y = await pool.acquire(), await pool.acquire()
    assert x is not y
    with trio.move_on_after(0.05) as scope:
        await pool.acquire()
    assert scope.cancelled_caught


async def test_a_foreign_buffer_is_ignored() -> None:
    pool = ChunkBuffers(4096, 1)
    other = ChunkBuffers(4096, 1)
    mine = await pool.acquire()
    theirs = await other.acquire()
    stranger = mmap.mmap(-1, 4096)
    for foreign in (bytearray(4096), memoryview(bytearray(8)), stranger, theirs, b"xyz", None):
        assert not pool.owns(foreign)
        pool.release(foreign)
        assert pool.in_use == 1
    assert other.in_use == 1
    assert pool.owns(mine)
    pool.release(mine)
    assert pool.in_use == 0


@pytest.mark.parametrize(("size", "count"), [(0, 1), (4096, 0), (-1, 2)])
def test_a_pool_needs_a_positive_size_and_count(size: int, count: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        ChunkBuffers(size, count)


# --- an in-memory stream with a server behind it ------------------------------------------------


def body(index: int, length: int) -> bytes:
    return bytes((index * 31 + i) % 253 for i in range(length))


def serve_chunks(
    lengths: dict[int, int],
    *,
    cut_body_of: int | None = None,
    stall: bool = False,
    end: bool = True,
    error_after: int | None = None,
) -> Serve:
    """A server holding chunks of the given lengths. ``cut_body_of``: that chunk's body
    stops half way, then the stream ends (or, with ``stall``, goes quiet). ``end=False``:
    the stream ends after the chunks, before End. ``error_after``: an error response
    follows that many chunks."""

    def serve(server: proto.ServerConnection, req: messages.Request) -> tuple[bytes, bool]:
        if isinstance(req, messages.HaveRequest):
            bits = bytearray((len(lengths) + 7) // 8)
            for i in lengths:
                bits[i // 8] |= 1 << (i % 8)
            return server.send_response(messages.HaveResponse(len(lengths), bytes(bits))), False
        assert isinstance(req, messages.GetRequest)
        out = b""
        sent = 0
        for start, stop in req.ranges:
            for i in range(start, stop):
                if i not in lengths:
                    continue
                if error_after is not None and sent == error_after:
                    err = messages.ErrorResponse(messages.ErrorCode.INTERNAL, "disk read failed")
                    return out + server.send_response(err), False
                data = body(i, lengths[i])
                out += server.send_chunk_header(i, len(data))
                if i == cut_body_of:
                    return out + data[: len(data) // 2], not stall
                out += data
                sent += 1
        if not end:
            return out, True
        return out + server.send_response(messages.End(server.unsent_indices())), False

    return serve


Received = list[tuple[int, bytes]]


def releasing_sink(pool: ChunkBuffers, got: Received) -> ChunkSink:
    async def sink(index: int, data: memoryview) -> None:
        assert data.readonly
        assert isinstance(data.obj, mmap.mmap)
        assert pool.owns(data)
        got.append((index, bytes(data)))
        pool.release(data)

    return sink


# --- BlobClient.get with a pool -----------------------------------------------------------------


@pytest.mark.parametrize("piece", [None, 1000, 7])
async def test_chunks_arrive_in_pooled_buffers_and_all_come_back(piece: int | None) -> None:
    chunk = 8192
    lengths = {i: chunk for i in range(6)} | {6: 1234}
    stream = FakeStream(serve_chunks(lengths), piece=piece)
    client = BlobClient(stream, lambda i: lengths.get(i, chunk))
    pool = ChunkBuffers(chunk, 3)
    got: Received = []
    with trio.fail_after(5):
        missing = await client.get(BLOB, ((0, 7), (9, 10)), releasing_sink(pool, got), buffers=pool)
    assert missing == (9,)
    assert got == [(i, body(i, n)) for i, n in lengths.items()]
    assert pool.in_use == 0
    # The client is reusable: a second request on the same stream works as well.
    got.clear()
    with trio.fail_after(5):
        assert await client.get(BLOB, ((2, 4),), releasing_sink(pool, got), buffers=pool) == ()
    assert got == [(2, body(2, chunk)), (3, body(3, chunk))]
    assert pool.in_use == 0


async def test_a_sink_that_keeps_buffers_holds_the_stream_back_without_deadlock() -> None:
    """Count 2 and 40 chunks; the sink hands each buffer to a slower consumer task that
    releases it later (as the downloader's disk writers do)."""
    chunk = 4096
    lengths = dict.fromkeys(range(40), chunk)
    stream = FakeStream(serve_chunks(lengths), piece=1500)
    client = BlobClient(stream, lambda i: chunk)
    pool = ChunkBuffers(chunk, 2)
    send, receive = trio.open_memory_channel[tuple[int, memoryview]](100)
    got: Received = []
    most_in_use = 0

    async def sink(index: int, data: memoryview) -> None:
        nonlocal most_in_use
        most_in_use = max(most_in_use, pool.in_use)
        await send.send((index, data))

    async def consumer() -> None:
        async for index, data in receive:
            await trio.lowlevel.checkpoint()
            got.append((index, bytes(data)))
            pool.release(data)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            assert await client.get(BLOB, ((0, 40),), sink, buffers=pool) == ()
            await send.aclose()
    assert got == [(i, body(i, chunk)) for i in range(40)]
    assert most_in_use <= 2
    assert pool.in_use == 0


async def test_many_chunks_through_a_pool_of_one_with_prompt_release() -> None:
    chunk = 4096
    lengths = dict.fromkeys(range(200), chunk)
    stream = FakeStream(serve_chunks(lengths))
    client = BlobClient(stream, lambda i: chunk)
    pool = ChunkBuffers(chunk, 1)
    got: Received = []
    with trio.fail_after(5):
        assert await client.get(BLOB, ((0, 200),), releasing_sink(pool, got), buffers=pool) == ()
    assert [i for i, _ in got] == list(range(200))
    assert all(data == body(i, chunk) for i, data in got)
    assert pool.in_use == 0


class SinkFailed(Exception):
    pass


async def test_a_sink_that_raises_gives_its_buffer_back() -> None:
    chunk = 4096
    lengths = dict.fromkeys(range(4), chunk)
    stream = FakeStream(serve_chunks(lengths))
    client = BlobClient(stream, lambda i: chunk)
    pool = ChunkBuffers(chunk, 2)
    seen: list[int] = []

    async def sink(index: int, data: memoryview) -> None:
        seen.append(index)
        if index == 1:
            raise SinkFailed
        pool.release(data)

    with trio.fail_after(5), pytest.raises(SinkFailed):
        await client.get(BLOB, ((0, 4),), sink, buffers=pool)
    assert seen == [0, 1]
    assert pool.in_use == 0


async def test_a_stream_ending_mid_body_is_stream_lost_and_returns_every_buffer() -> None:
    chunk = 4096
    lengths = dict.fromkeys(range(4), chunk)
    stream = FakeStream(serve_chunks(lengths, cut_body_of=2), piece=1000)
    client = BlobClient(stream, lambda i: chunk)
    pool = ChunkBuffers(chunk, 2)
    got: Received = []
    with trio.fail_after(5), pytest.raises(StreamLost):
        await client.get(BLOB, ((0, 4),), releasing_sink(pool, got), buffers=pool)
    assert [i for i, _ in got] == [0, 1]
    assert pool.in_use == 0
    # Both buffers can be taken again: none is still lent to the cut body.
    with trio.fail_after(1):
        a, b = await pool.acquire(), await pool.acquire()
    pool.release(a)
    pool.release(b)


async def test_a_stream_ending_between_chunks_returns_the_spare_buffer() -> None:
    chunk = 4096
    lengths = dict.fromkeys(range(3), chunk)
    stream = FakeStream(serve_chunks(lengths, end=False))
    client = BlobClient(stream, lambda i: chunk)
    pool = ChunkBuffers(chunk, 2)
    got: Received = []
    with trio.fail_after(5), pytest.raises(StreamLost):
        await client.get(BLOB, ((0, 3),), releasing_sink(pool, got), buffers=pool)
    assert [i for i, _ in got] == [0, 1, 2]
    assert pool.in_use == 0


async def test_a_cancelled_get_mid_body_returns_the_buffer_it_was_filling() -> None:
    chunk = 4096
    lengths = dict.fromkeys(range(3), chunk)
    stream = FakeStream(serve_chunks(lengths, cut_body_of=1, stall=True))
    client = BlobClient(stream, lambda i: chunk)
    pool = ChunkBuffers(chunk, 2)
    got: Received = []
    with trio.fail_after(5):
        with trio.move_on_after(0.1) as scope:
            await client.get(BLOB, ((0, 3),), releasing_sink(pool, got), buffers=pool)
    assert scope.cancelled_caught
    assert [i for i, _ in got] == [0]
    assert pool.in_use == 0


async def abandon_mid_body(cut: str) -> tuple[FakeStream, BlobClient, ChunkBuffers]:
    """A client whose get was cut in the middle of chunk 1's body: by the stream ending
    ("eof") or by a cancellation while the stream was quiet ("cancel")."""
    chunk = 4096
    lengths = dict.fromkeys(range(3), chunk)
    stream = FakeStream(serve_chunks(lengths, cut_body_of=1, stall=cut == "cancel"))
    client = BlobClient(stream, lambda i: chunk)
    pool = ChunkBuffers(chunk, 2)
    got: Received = []
    with trio.fail_after(5), trio.move_on_after(0.1):
        try:
            await client.get(BLOB, ((0, 3),), releasing_sink(pool, got), buffers=pool)
        except StreamLost:
            pass
    assert [i for i, _ in got] == [0]
    assert pool.in_use == 0
    return stream, client, pool


@pytest.mark.parametrize("cut", ["eof", "cancel"])
async def test_a_client_abandoned_mid_body_never_reads_its_stream_again(cut: str) -> None:
    """The pooled buffer of the cut body went back to the pool (another stream may be
    filling it now), so nothing may ever be received into it: the next calls fail
    before reading."""
    stream, client, pool = await abandon_mid_body(cut)
    reads = stream.reads
    got: Received = []
    with trio.fail_after(5):
        with pytest.raises((StreamLost, messages.ProtocolError)):
            await client.have(BLOB)
        with pytest.raises((StreamLost, messages.ProtocolError)):
            await client.get(BLOB, ((2, 3),), releasing_sink(pool, got), buffers=pool)
    assert stream.reads == reads
    assert got == []
    assert pool.in_use == 0


@pytest.mark.parametrize("cut", ["eof", "cancel"])
async def test_a_client_abandoned_mid_body_says_its_stream_is_lost(cut: str) -> None:
    _, client, _ = await abandon_mid_body(cut)
    with trio.fail_after(5), pytest.raises(StreamLost):
        await client.have(BLOB)


async def test_a_chunk_larger_than_the_pool_buffers_gets_its_own_buffer() -> None:
    lengths = {0: 100, 1: 9000}
    stream = FakeStream(serve_chunks(lengths))
    client = BlobClient(stream)  # no length check: the 9000-byte chunk is let through
    pool = ChunkBuffers(4096, 2)
    got: Received = []
    owned: list[bool] = []

    async def sink(index: int, data: memoryview) -> None:
        owned.append(pool.owns(data))
        got.append((index, bytes(data)))
        pool.release(data)  # a no-op for the oversized one

    with trio.fail_after(5):
        assert await client.get(BLOB, ((0, 2),), sink, buffers=pool) == ()
    assert owned == [True, False]
    assert got == [(0, body(0, 100)), (1, body(1, 9000))]
    assert pool.in_use == 0


async def test_an_error_response_after_some_chunks_returns_every_buffer() -> None:
    chunk = 4096
    lengths = dict.fromkeys(range(4), chunk)
    stream = FakeStream(serve_chunks(lengths, error_after=2))
    client = BlobClient(stream, lambda i: chunk)
    pool = ChunkBuffers(chunk, 2)
    got: Received = []
    with trio.fail_after(5):
        reply = await client.get(BLOB, ((0, 4),), releasing_sink(pool, got), buffers=pool)
    assert reply == messages.ErrorResponse(messages.ErrorCode.INTERNAL, "disk read failed")
    assert [i for i, _ in got] == [0, 1]
    assert pool.in_use == 0


async def test_get_without_a_pool_still_gives_private_buffers() -> None:
    chunk = 4096
    lengths = dict.fromkeys(range(3), chunk)
    stream = FakeStream(serve_chunks(lengths), piece=999)
    client = BlobClient(stream, lambda i: chunk)
    views: list[memoryview] = []

    async def sink(index: int, data: memoryview) -> None:
        views.append(data)

    with trio.fail_after(5):
        assert await client.get(BLOB, ((0, 3),), sink) == ()
    # Each body kept its own buffer: none was overwritten by a later chunk.
    assert [bytes(v) for v in views] == [body(i, chunk) for i in range(3)]
    assert all(isinstance(v.obj, bytearray) for v in views)


# --- optimistic protocol negotiation -------------------------------------------------------


class Canned:
    """A stream whose far end has already answered with ``inbound``; writes are kept."""

    def __init__(self, inbound: bytes) -> None:
        self.inbound = bytearray(inbound)
        self.written = bytearray()

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        take = len(self.inbound) if n is None else min(n, len(self.inbound))
        out = bytes(self.inbound[:take])
        del self.inbound[:take]
        return out

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        self.written += data

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


def manifest_answer(body: bytes) -> bytes:
    server = proto.ServerConnection()
    server.receive_data(proto.ClientConnection().send_request(messages.ManifestRequest(BLOB)))
    assert server.next_request() is not None
    return server.send_response(messages.ManifestResponse(body))


async def test_an_optimistic_stream_checks_the_echo_before_the_first_response() -> None:
    """The protocol is proposed and the first request sent without
    waiting; the client reads the peer's echo of the proposal, then the response."""
    from p2p.blob.shell import OptimisticStream
    from p2p.node.connections import BLOB_PROPOSAL

    raw = Canned(BLOB_PROPOSAL + manifest_answer(b"the manifest"))
    client = BlobClient(OptimisticStream(raw, BLOB_PROPOSAL))
    assert await client.manifest(BLOB) == b"the manifest"
    request = proto.ClientConnection().send_request(messages.ManifestRequest(BLOB))
    assert raw.written.startswith(request)


@pytest.mark.parametrize(
    "answer",
    [b"\x03na\n", b"\x13/multistream/1.0.0\n\x03na\n", b"\x13/multistream/1.0.0\n"],
)
async def test_a_peer_refusing_the_protocol_is_a_lost_stream_not_garbage(answer: bytes) -> None:
    from p2p.blob.shell import OptimisticStream
    from p2p.node.connections import BLOB_PROPOSAL

    client = BlobClient(OptimisticStream(Canned(answer), BLOB_PROPOSAL))
    with pytest.raises(StreamLost, match=r"refused|negotiation"):
        await client.manifest(BLOB)
