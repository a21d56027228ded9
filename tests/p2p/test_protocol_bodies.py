"""Zero-copy chunk bodies in the sans-IO client: ``set_body_allocator``, ``body_space`` and
``body_received``. The body of each chunk lands in a buffer of the caller's choosing, and
the bytes of it not already received with the header are written into it directly."""

from __future__ import annotations

import mmap
from typing import Any

import pytest

from p2p.blob.messages import (
    Chunk,
    End,
    GetRequest,
    HaveRequest,
    HaveResponse,
    LocalProtocolError,
    ManifestRequest,
    ManifestResponse,
    ProtocolError,
    RemoteProtocolError,
    Response,
    TruncatedStreamError,
    encode_chunk_header,
    encode_response_header,
)
from p2p.blob.protocol import ClientConnection

BLOB = "0123456789abcdef" * 4
GET = GetRequest(BLOB, ((0, 4),))


class Allocator:
    """Hands out fresh buffers (mmaps by default) and remembers them."""

    def __init__(self, extra: int = 0, kind: str = "mmap") -> None:
        self.extra = extra
        self.kind = kind
        self.given: list[Any] = []
        self.lengths: list[int] = []

    def __call__(self, length: int) -> Any:
        self.lengths.append(length)
        size = length + self.extra
        buf: Any = mmap.mmap(-1, size) if self.kind == "mmap" else bytearray(size)
        self.given.append(buf)
        return buf


def client_with(allocate: Any, req: GetRequest = GET) -> ClientConnection:
    client = ClientConnection()
    client.set_body_allocator(allocate)
    client.send_request(req)
    return client


def body_of(n: int, seed: int = 0) -> bytes:
    return bytes((seed + 7 * i) % 251 for i in range(n))


def fill(client: ClientConnection, data: bytes) -> None:
    """Write ``data`` into the body in progress through body_space / body_received."""
    space = client.body_space()
    assert space is not None
    assert not space.readonly
    assert len(space) >= len(data)
    space[: len(data)] = data
    client.body_received(len(data))


def test_no_body_space_outside_a_body() -> None:
    client = ClientConnection()
    assert client.body_space() is None
    client.set_body_allocator(Allocator())
    client.send_request(ManifestRequest(BLOB))
    assert client.body_space() is None
    frame = encode_response_header(ManifestResponse(b"m" * 50))
    client.receive_data(frame[:10])
    assert client.next_event() is None
    assert client.body_space() is None  # a manifest header is not a chunk body
    client.receive_data(frame[10:])
    assert client.next_event() == ManifestResponse(b"m" * 50)
    assert client.body_space() is None


def test_header_with_part_of_the_body_then_the_rest_into_body_space() -> None:
    alloc = Allocator()
    client = client_with(alloc)
    body = body_of(10_000)
    client.receive_data(encode_chunk_header(2, len(body)) + body[:1234])
    assert client.next_event() is None
    assert alloc.lengths == [10_000]
    buf = alloc.given[0]
    assert buf[:1234] == body[:1234]  # what came with the header was copied in
    space = client.body_space()
    assert space is not None
    assert len(space) == len(body) - 1234
    assert client.bytes_needed() == len(body) - 1234
    space[:] = body[1234:]
    client.body_received(len(space))
    assert client.body_space() is None  # complete: nothing more to receive into it
    event = client.next_event()
    assert isinstance(event, Chunk)
    assert event.index == 2
    assert event.data.readonly
    assert event.data.obj is buf
    assert bytes(event.data) == body
    assert client.body_space() is None


def test_header_alone_then_the_body_in_many_pieces() -> None:
    alloc = Allocator()
    client = client_with(alloc)
    body = body_of(5000, seed=3)
    client.receive_data(encode_chunk_header(0, len(body)))
    assert client.next_event() is None
    pos = 0
    step = 1
    while pos < len(body):
        space = client.body_space()
        assert space is not None
        assert len(space) == len(body) - pos
        assert client.bytes_needed() == len(body) - pos
        n = min(step, len(body) - pos)
        space[:n] = body[pos : pos + n]
        client.body_received(n)
        pos += n
        step = step * 2 + 1
        if pos < len(body):
            assert client.next_event() is None
    event = client.next_event()
    assert isinstance(event, Chunk)
    assert event.data.obj is alloc.given[0]
    assert bytes(event.data) == body


def test_receive_data_and_body_received_can_be_mixed() -> None:
    alloc = Allocator()
    client = client_with(alloc)
    body = body_of(300)
    client.receive_data(encode_chunk_header(1, 300) + body[:100])
    assert client.next_event() is None
    fill(client, body[100:150])
    client.receive_data(body[150:200])  # through the receive buffer, straight into the body
    fill(client, body[200:300])
    event = client.next_event()
    assert isinstance(event, Chunk)
    assert bytes(event.data) == body


def test_a_larger_buffer_holds_the_body_at_its_start() -> None:
    alloc = Allocator(extra=4096)
    client = client_with(alloc)
    body = body_of(100)
    client.receive_data(encode_chunk_header(0, 100))
    assert client.next_event() is None
    space = client.body_space()
    assert space is not None
    assert len(space) == 100  # the spare room past the body is not offered
    fill(client, body)
    event = client.next_event()
    assert isinstance(event, Chunk)
    assert len(event.data) == 100
    buf = alloc.given[0]
    assert buf[:100] == body
    assert event.data.obj is buf


def test_each_chunk_gets_its_own_buffer_and_following_frames_are_parsed() -> None:
    alloc = Allocator(kind="bytearray")
    client = client_with(alloc)
    a, b = body_of(64, 1), body_of(80, 2)
    # One read carrying a whole chunk, the next chunk's header and part of its body.
    client.receive_data(encode_chunk_header(0, 64) + a + encode_chunk_header(3, 80) + b[:30])
    first = client.next_event()
    assert isinstance(first, Chunk)
    assert client.next_event() is None
    assert alloc.lengths == [64, 80]
    fill(client, b[30:])
    second = client.next_event()
    assert isinstance(second, Chunk)
    assert first.data.obj is alloc.given[0]
    assert second.data.obj is alloc.given[1]
    assert (bytes(first.data), bytes(second.data)) == (a, b)
    client.receive_data(encode_response_header(End((1, 2))))
    assert client.next_event() == End((1, 2))
    assert alloc.lengths == [64, 80]  # the end frame took no buffer


def test_without_an_allocator_bodies_are_fresh_bytearrays() -> None:
    alloc = Allocator()
    client = client_with(alloc)
    client.set_body_allocator(None)
    client.receive_data(encode_chunk_header(0, 4))
    assert client.next_event() is None
    fill(client, b"abcd")  # body_space works with the default buffers too
    event = client.next_event()
    assert isinstance(event, Chunk)
    assert isinstance(event.data.obj, bytearray)
    assert event.data.readonly
    assert bytes(event.data) == b"abcd"
    assert alloc.lengths == []


def test_the_allocator_is_not_asked_for_have_or_manifest_responses() -> None:
    alloc = Allocator()
    client = ClientConnection()
    client.set_body_allocator(alloc)
    client.send_request(HaveRequest(BLOB))
    client.receive_data(encode_response_header(HaveResponse(3, b"\x05")))
    assert client.next_event() == HaveResponse(3, b"\x05")
    assert alloc.lengths == []


# --- misuse ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -1, 5])
def test_body_received_without_a_body_in_progress_is_a_local_error(n: int) -> None:
    client = client_with(Allocator())
    with pytest.raises(LocalProtocolError):
        client.body_received(n)


@pytest.mark.parametrize("n", [0, -3, 11])
def test_body_received_out_of_range_is_a_local_error_and_changes_nothing(n: int) -> None:
    client = client_with(Allocator())
    client.receive_data(encode_chunk_header(0, 16) + b"x" * 6)
    assert client.next_event() is None
    with pytest.raises(LocalProtocolError, match="body_received"):
        client.body_received(n)  # 10 bytes are missing: 11 is one too many
    space = client.body_space()
    assert space is not None
    assert len(space) == 10
    fill(client, b"y" * 10)
    event = client.next_event()
    assert isinstance(event, Chunk)
    assert bytes(event.data) == b"x" * 6 + b"y" * 10


def test_body_received_after_the_body_is_complete_is_a_local_error() -> None:
    client = client_with(Allocator())
    client.receive_data(encode_chunk_header(0, 4))
    assert client.next_event() is None
    fill(client, b"abcd")
    with pytest.raises(LocalProtocolError):
        client.body_received(1)
    event = client.next_event()
    assert isinstance(event, Chunk)
    assert bytes(event.data) == b"abcd"


@pytest.mark.parametrize(
    "allocate",
    [
        lambda n: bytes(n),  # read-only
        lambda n: memoryview(bytearray(n)).toreadonly(),  # read-only view
        lambda n: bytearray(n - 1),  # too short
        lambda n: mmap.mmap(-1, 4096, access=mmap.ACCESS_READ),  # read-only mapping
    ],
    ids=["bytes", "readonly-view", "short", "readonly-mmap"],
)
def test_an_allocator_giving_no_writable_buffer_of_the_length_is_a_local_error(
    allocate: Any,
) -> None:
    client = client_with(allocate)
    client.receive_data(encode_chunk_header(0, 8) + b"12345678")
    with pytest.raises(LocalProtocolError, match="allocator"):
        client.next_event()


def test_a_connection_whose_allocator_failed_stays_failed() -> None:
    client = client_with(lambda n: bytes(n))
    client.receive_data(encode_chunk_header(0, 8) + b"12345678")
    with pytest.raises(LocalProtocolError):
        client.next_event()
    client.set_body_allocator(None)
    with pytest.raises(ProtocolError):
        client.next_event()


# --- end of stream in a body ------------------------------------------------------------------


def drain(client: ClientConnection) -> list[Response]:
    events: list[Response] = []
    while (event := client.next_event()) is not None:
        events.append(event)
    return events


@pytest.mark.parametrize("received", [0, 1, 99])
def test_end_of_stream_in_a_body_is_a_truncated_stream(received: int) -> None:
    client = client_with(Allocator())
    client.receive_data(encode_chunk_header(0, 100))
    assert client.next_event() is None
    if received:
        fill(client, body_of(received))
    client.receive_data(b"")
    with pytest.raises(TruncatedStreamError, match="closed"):
        drain(client)
    with pytest.raises(RemoteProtocolError, match="already failed"):
        client.next_event()


def test_end_of_stream_right_after_a_complete_body_is_a_truncated_response() -> None:
    """The body is whole but the End frame never comes: the response is still cut short."""
    client = client_with(Allocator())
    client.receive_data(encode_chunk_header(0, 3))
    assert client.next_event() is None
    fill(client, b"abc")
    client.receive_data(b"")
    event = client.next_event()
    assert isinstance(event, Chunk)
    assert bytes(event.data) == b"abc"
    with pytest.raises(TruncatedStreamError):
        client.next_event()
