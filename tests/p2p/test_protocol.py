"""The sans-IO protocol core: paired in-memory client and server, no sockets, no clocks.

Every message round-trips; every malformed form a peer can send is a RemoteProtocolError
(with the error code a server should answer with); every misuse of our own API is a
LocalProtocolError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from p2p.blob import messages, protocol
from p2p.blob.messages import (
    MAX_CHUNK_SIZE,
    MAX_CHUNKS_PER_REQUEST,
    MAX_ERROR_MESSAGE,
    MAX_HEADER_SIZE,
    MAX_MANIFEST_BYTES,
    MAX_NUM_CHUNKS,
    MAX_RANGES_PER_REQUEST,
    Chunk,
    End,
    ErrorCode,
    ErrorResponse,
    GetRequest,
    HaveRequest,
    HaveResponse,
    LocalProtocolError,
    ManifestRequest,
    ManifestResponse,
    ProtocolError,
    RemoteProtocolError,
    Request,
    Response,
    TruncatedStreamError,
    Version,
    encode_chunk_header,
    encode_request,
    encode_response_header,
)
from p2p.blob.protocol import ClientConnection, ServerConnection

BLOB = "0123456789abcdef" * 4
RAW_BLOB = bytes.fromhex(BLOB)


def frame(header: Any) -> bytes:
    """A frame around any msgpack-encodable header (used to build malformed messages)."""
    body = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def drain_client(client: ClientConnection) -> list[Response]:
    events: list[Response] = []
    while (event := client.next_event()) is not None:
        events.append(event)
    return events


def normalise(events: list[Response]) -> list[Any]:
    """Events with chunk bodies as bytes, so lists compare by content."""
    return [(e.index, bytes(e.data)) if isinstance(e, Chunk) else e for e in events]


class Pair:
    """A client and a server joined by an in-memory link."""

    def __init__(self) -> None:
        self.client = ClientConnection()
        self.server = ServerConnection()

    def request(self, req: Request) -> Request:
        self.server.receive_data(self.client.send_request(req))
        got = self.server.next_request()
        assert got is not None
        return got

    def respond(self, data: bytes, *, byte_at_a_time: bool = False) -> list[Any]:
        events: list[Response] = []
        if byte_at_a_time:
            for i in range(len(data)):
                self.client.receive_data(data[i : i + 1])
                events += drain_client(self.client)
        else:
            self.client.receive_data(data)
            events += drain_client(self.client)
        return normalise(events)


def get_response(server: ServerConnection, bodies: dict[int, bytes]) -> bytes:
    out = b""
    for index, body in bodies.items():
        out += server.send_chunk_header(index, len(body)) + body
    return out + server.send_response(End(server.unsent_indices()))


# --- Round trips ----------------------------------------------------------------------


def test_protocol_id_and_limits_are_what_the_spec_says() -> None:
    assert Version.V1_0.protocol_id == "/blobnet/blob/1.0.0"
    assert MAX_HEADER_SIZE == 64 * 1024
    assert MAX_CHUNK_SIZE == 16 * 1024 * 1024
    assert MAX_MANIFEST_BYTES == 16 * 1024 * 1024 + 64
    assert MAX_RANGES_PER_REQUEST == 64
    assert MAX_CHUNKS_PER_REQUEST == 256
    assert MAX_ERROR_MESSAGE == 1024


def test_worked_examples_in_protocol_md_match_the_encoder() -> None:
    """PROTOCOL.md's hex examples are what an independent client would copy: keep them true."""
    spec = (Path(protocol.__file__).parent / "PROTOCOL.md").read_text()
    blob_id = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    manifest_request = encode_request(ManifestRequest(blob_id)).hex()
    assert manifest_request == (
        "00000031"
        "82"
        "a174"
        "a86d616e6966657374"
        "a26964"
        "c420af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )
    get_request = encode_request(GetRequest(blob_id, ((0, 3), (10, 12)))).hex()
    examples = [
        manifest_request,
        get_request.replace(blob_id, "af1349b9…1f3262"),
        encode_chunk_header(5, 1 << 20).hex(),
        encode_response_header(End((1, 10))).hex(),
        encode_response_header(HaveResponse(10, bytes([0b101, 0b10]))).hex(),
        encode_response_header(ErrorResponse(ErrorCode.NOT_FOUND, "no such blob")).hex(),
    ]
    for example in examples:
        assert f"`{example}`" in spec


def test_manifest_round_trip() -> None:
    pair = Pair()
    assert pair.request(ManifestRequest(BLOB)) == ManifestRequest(BLOB)
    manifest = b"\x84manifest bytes"
    events = pair.respond(pair.server.send_response(ManifestResponse(manifest)))
    assert events == [ManifestResponse(manifest)]
    assert pair.client.outstanding_request is None
    assert pair.server.current_request is None


def test_largest_manifest_round_trips_and_one_byte_more_is_refused() -> None:
    pair = Pair()
    pair.request(ManifestRequest(BLOB))
    manifest = bytes(range(256)) * (MAX_MANIFEST_BYTES // 256) + b"x" * (MAX_MANIFEST_BYTES % 256)
    assert len(manifest) == MAX_MANIFEST_BYTES
    with pytest.raises(LocalProtocolError):
        pair.server.send_response(ManifestResponse(manifest + b"x"))
    events = pair.respond(pair.server.send_response(ManifestResponse(manifest)))
    assert events == [ManifestResponse(manifest)]


@pytest.mark.parametrize(
    ("num_chunks", "held"),
    [(0, []), (1, [0]), (8, [0, 7]), (13, [1, 2, 12]), (MAX_NUM_CHUNKS, [0, MAX_NUM_CHUNKS - 1])],
)
def test_have_round_trip(num_chunks: int, held: list[int]) -> None:
    bitmap = bytearray((num_chunks + 7) // 8)
    for i in held:
        bitmap[i // 8] |= 1 << (i % 8)
    pair = Pair()
    assert pair.request(HaveRequest(BLOB)) == HaveRequest(BLOB)
    events = pair.respond(pair.server.send_response(HaveResponse(num_chunks, bytes(bitmap))))
    assert events == [HaveResponse(num_chunks, bytes(bitmap))]
    have = events[0]
    assert isinstance(have, HaveResponse)
    assert [i for i in range(min(num_chunks, 16)) if have.has(i)] == [i for i in held if i < 16]
    assert not have.has(num_chunks)


def test_get_round_trip_with_missing_chunks() -> None:
    pair = Pair()
    req = GetRequest(BLOB, ((0, 3), (10, 12)))
    assert pair.request(req) == req
    bodies = {11: b"eleven", 0: b"zero", 2: b"two"}
    events = pair.respond(get_response(pair.server, bodies))
    assert events == [(11, b"eleven"), (0, b"zero"), (2, b"two"), End((1, 10))]
    assert pair.client.outstanding_request is None


def test_get_with_every_chunk_sent_ends_with_empty_missing() -> None:
    pair = Pair()
    pair.request(GetRequest(BLOB, ((5, 7),)))
    events = pair.respond(get_response(pair.server, {5: b"a", 6: b"b"}))
    assert events == [(5, b"a"), (6, b"b"), End(())]


def test_get_accepts_adjacent_ranges_and_the_largest_request() -> None:
    ranges = tuple((4 * i, 4 * i + 4) for i in range(MAX_RANGES_PER_REQUEST))
    assert sum(e - s for s, e in ranges) == MAX_CHUNKS_PER_REQUEST
    assert Pair().request(GetRequest(BLOB, ranges)) == GetRequest(BLOB, ranges)
    adjacent = GetRequest(BLOB, ((0, 2), (2, 4)))
    assert Pair().request(adjacent) == adjacent


@pytest.mark.parametrize(
    "req", [ManifestRequest(BLOB), HaveRequest(BLOB), GetRequest(BLOB, ((0, 1),))]
)
@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_answers_any_request(req: Request, code: ErrorCode) -> None:
    pair = Pair()
    pair.request(req)
    events = pair.respond(pair.server.send_response(ErrorResponse(code, "no such blob: é")))
    assert events == [ErrorResponse(code, "no such blob: é")]
    assert pair.client.outstanding_request is None


def test_error_after_some_chunks_ends_the_get() -> None:
    pair = Pair()
    pair.request(GetRequest(BLOB, ((0, 4),)))
    data = pair.server.send_chunk_header(1, 3) + b"one"
    data += pair.server.send_response(ErrorResponse(ErrorCode.INTERNAL, "disk read failed"))
    events = pair.respond(data)
    assert events == [(1, b"one"), ErrorResponse(ErrorCode.INTERNAL, "disk read failed")]
    # The request is over on both sides: the next request may be sent and read.
    assert pair.request(HaveRequest(BLOB)) == HaveRequest(BLOB)


def test_several_requests_in_sequence_on_one_stream() -> None:
    pair = Pair()
    seen: list[Any] = []
    pair.request(ManifestRequest(BLOB))
    seen += pair.respond(pair.server.send_response(ManifestResponse(b"m")))
    pair.request(HaveRequest(BLOB))
    seen += pair.respond(pair.server.send_response(HaveResponse(3, b"\x05")))
    pair.request(GetRequest(BLOB, ((0, 1), (2, 3))))
    seen += pair.respond(get_response(pair.server, {0: b"x", 2: b"z"}))
    assert seen == [ManifestResponse(b"m"), HaveResponse(3, b"\x05"), (0, b"x"), (2, b"z"), End(())]


def test_whole_and_byte_at_a_time_give_the_same_events() -> None:
    def run(byte_at_a_time: bool) -> list[Any]:
        pair = Pair()
        reqs: list[Request] = [ManifestRequest(BLOB), GetRequest(BLOB, ((0, 3),))]
        events: list[Any] = []
        for req in reqs:
            data = pair.client.send_request(req)
            for i in range(len(data)) if byte_at_a_time else [None]:
                pair.server.receive_data(data if i is None else data[i : i + 1])
                got = pair.server.next_request()
                if got is not None:
                    events.append(got)
            if isinstance(req, ManifestRequest):
                reply = pair.server.send_response(ManifestResponse(b"manifest"))
            else:
                reply = get_response(pair.server, {2: b"body two", 0: bytes(1000)})
            events += pair.respond(reply, byte_at_a_time=byte_at_a_time)
        return events

    whole = run(byte_at_a_time=False)
    assert whole == run(byte_at_a_time=True)
    assert len(whole) == 6  # 2 requests, a manifest, 2 chunks, an end


def test_largest_chunk_round_trips() -> None:
    pair = Pair()
    pair.request(GetRequest(BLOB, ((0, 1),)))
    body = b"\xab" * MAX_CHUNK_SIZE
    header = pair.server.send_chunk_header(0, len(body))
    pair.client.receive_data(header)
    assert pair.client.next_event() is None
    assert pair.client.bytes_needed() == MAX_CHUNK_SIZE
    pair.client.receive_data(body[:1000])
    assert pair.client.bytes_needed() == MAX_CHUNK_SIZE - 1000
    pair.client.receive_data(body[1000:])
    event = pair.client.next_event()
    assert isinstance(event, Chunk)
    assert event.index == 0
    assert event.data == body


def test_chunk_body_is_a_read_only_view_that_later_data_does_not_change() -> None:
    pair = Pair()
    pair.request(GetRequest(BLOB, ((0, 2),)))
    pair.client.receive_data(pair.server.send_chunk_header(0, 4) + b"abcd")
    first = pair.client.next_event()
    assert isinstance(first, Chunk)
    assert first.data.readonly
    pair.client.receive_data(pair.server.send_chunk_header(1, 4) + b"wxyz")
    second = pair.client.next_event()
    assert isinstance(second, Chunk)
    assert (bytes(first.data), bytes(second.data)) == (b"abcd", b"wxyz")


def test_memoryview_input_is_accepted() -> None:
    pair = Pair()
    pair.server.receive_data(memoryview(pair.client.send_request(HaveRequest(BLOB))))
    assert pair.server.next_request() == HaveRequest(BLOB)


def test_bytes_needed_tracks_the_frame_in_progress() -> None:
    client = ClientConnection()
    assert client.bytes_needed() == 0
    client.send_request(ManifestRequest(BLOB))
    frame_bytes = encode_response_header(ManifestResponse(b"m" * 100))
    client.receive_data(frame_bytes[:2])
    assert client.next_event() is None
    assert client.bytes_needed() == 2
    client.receive_data(frame_bytes[2:10])
    assert client.next_event() is None
    assert client.bytes_needed() == len(frame_bytes) - 10
    client.receive_data(frame_bytes[10:])
    assert client.next_event() == ManifestResponse(b"m" * 100)
    assert client.bytes_needed() == 0


def test_clean_end_of_stream_between_requests() -> None:
    pair = Pair()
    pair.request(HaveRequest(BLOB))
    pair.respond(pair.server.send_response(HaveResponse(0, b"")))
    pair.server.receive_data(b"")
    assert pair.server.next_request() is None
    assert pair.server.eof_received
    pair.client.receive_data(b"")
    assert pair.client.next_event() is None
    assert pair.client.eof_received


def test_client_may_close_its_side_while_awaiting_the_response() -> None:
    pair = Pair()
    pair.request(ManifestRequest(BLOB))
    pair.server.receive_data(b"")
    assert pair.server.next_request() is None
    assert pair.server.send_response(ErrorResponse(ErrorCode.NOT_FOUND, "no"))


# --- Malformed requests (server side) ---------------------------------------------------


def server_error(data: bytes) -> RemoteProtocolError:
    server = ServerConnection()
    server.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        server.next_request()
    return info.value


def test_oversized_length_prefix_is_refused_before_the_header_is_buffered() -> None:
    server = ServerConnection()
    server.receive_data((2**31).to_bytes(4, "big"))  # only the prefix: nothing else arrived
    with pytest.raises(RemoteProtocolError, match="over the limit") as info:
        server.next_request()
    assert info.value.code == ErrorCode.TOO_LARGE
    assert server_error((MAX_HEADER_SIZE + 1).to_bytes(4, "big")).code == ErrorCode.TOO_LARGE


def test_zero_length_header_is_refused() -> None:
    assert server_error(b"\x00\x00\x00\x00").code == ErrorCode.BAD_REQUEST


def get_map(ranges: Any, **extra: Any) -> dict[str, Any]:
    return {"t": "get", "id": RAW_BLOB, "r": ranges, **extra}


@pytest.mark.parametrize(
    ("header", "code", "match"),
    [
        (get_map([[2 * i, 2 * i + 1] for i in range(65)]), ErrorCode.TOO_LARGE, "65 ranges"),
        (get_map([[0, 257]]), ErrorCode.TOO_LARGE, "256 chunks"),
        (get_map([[0, 200], [300, 357]]), ErrorCode.TOO_LARGE, "256 chunks"),
        (get_map([[0, 5], [4, 8]]), ErrorCode.BAD_REQUEST, "overlap"),
        (get_map([[10, 12], [0, 2]]), ErrorCode.BAD_REQUEST, "sorted"),
        (get_map([[3, 3]]), ErrorCode.BAD_REQUEST, "bad range"),
        (get_map([[4, 3]]), ErrorCode.BAD_REQUEST, "bad range"),
        (get_map([[-1, 3]]), ErrorCode.BAD_REQUEST, "bad range"),
        (get_map([[0, MAX_NUM_CHUNKS + 1]]), ErrorCode.BAD_REQUEST, "bad range"),
        (get_map([]), ErrorCode.BAD_REQUEST, "at least one range"),
        (get_map([[0, 1, 2]]), ErrorCode.BAD_REQUEST, "pair"),
        (get_map([[0, True]]), ErrorCode.BAD_REQUEST, "integers"),
        (get_map([[0.0, 1]]), ErrorCode.BAD_REQUEST, "integers"),
        (get_map("0-1"), ErrorCode.BAD_REQUEST, "list"),
        (get_map([[0, 1]], extra=1), ErrorCode.BAD_REQUEST, "unexpected keys"),
        ({"t": "get", "id": RAW_BLOB}, ErrorCode.BAD_REQUEST, "missing keys"),
        ({"t": "delete", "id": RAW_BLOB}, ErrorCode.BAD_REQUEST, "unknown message type"),
        ({"t": "chunk", "i": 0, "n": 1}, ErrorCode.BAD_REQUEST, "unknown message type"),
        ({"id": RAW_BLOB}, ErrorCode.BAD_REQUEST, "unknown message type"),
        ({"t": b"have", "id": RAW_BLOB}, ErrorCode.BAD_REQUEST, "unknown message type"),
        ({"t": "have", "id": RAW_BLOB[:31]}, ErrorCode.BAD_REQUEST, "32 bytes"),
        ({"t": "have", "id": BLOB}, ErrorCode.BAD_REQUEST, "32 bytes"),
        ([("t", "have")], ErrorCode.BAD_REQUEST, "map"),
        (b"\xc1", ErrorCode.BAD_REQUEST, "not valid msgpack"),
        (b"\x81\xa1t", ErrorCode.BAD_REQUEST, "not valid msgpack"),
        (msgpack.packb({"t": "have", "id": RAW_BLOB}) + b"\x00", ErrorCode.BAD_REQUEST, "msgpack"),
    ],
)
def test_malformed_requests_are_remote_errors(header: Any, code: ErrorCode, match: str) -> None:
    error = server_error(frame(header))
    assert error.code == code
    assert match in str(error)


@pytest.mark.parametrize(
    "header",
    [
        # Keys out of canonical order.
        b"\x82\xa2id\xc4\x20" + RAW_BLOB + b"\xa1t\xa4have",
        # "t" as str8 instead of fixstr.
        b"\x82\xa1t\xd9\x04have\xa2id\xc4\x20" + RAW_BLOB,
        # A range bound as uint32 instead of a positive fixint.
        b"\x83\xa1t\xa3get\xa2id\xc4\x20" + RAW_BLOB + b"\xa1r\x91\x92\x00\xce\x00\x00\x00\x01",
        # A map16 header for a two-entry map.
        b"\xde\x00\x02\xa1t\xa4have\xa2id\xc4\x20" + RAW_BLOB,
        # The id as bin16 instead of bin8.
        b"\x82\xa1t\xa4have\xa2id\xc5\x00\x20" + RAW_BLOB,
    ],
)
def test_non_canonical_msgpack_is_refused(header: bytes) -> None:
    # Each decodes to a valid request; only the encoding is wrong.
    assert msgpack.unpackb(header)["t"] in ("have", "get")
    error = server_error(frame(header))
    assert "canonical" in str(error)


def test_duplicate_keys_are_refused() -> None:
    """msgpack keeps the last of duplicate keys; the canonical re-encoding catches them."""
    header = b"\x83\xa1t\xa4have\xa2id\xc4\x20" + RAW_BLOB + b"\xa2id\xc4\x20" + RAW_BLOB
    assert msgpack.unpackb(header) == {"t": "have", "id": RAW_BLOB}
    assert "canonical" in str(server_error(frame(header)))


def test_pipelined_request_while_a_response_is_owed_is_refused() -> None:
    client_bytes = encode_request(HaveRequest(BLOB)) + encode_request(ManifestRequest(BLOB))
    server = ServerConnection()
    server.receive_data(client_bytes)
    assert server.next_request() == HaveRequest(BLOB)
    with pytest.raises(RemoteProtocolError, match="before reading the response"):
        server.next_request()


def test_stream_closed_mid_request_is_refused() -> None:
    server = ServerConnection()
    server.receive_data(encode_request(HaveRequest(BLOB))[:-1])
    assert server.next_request() is None
    server.receive_data(b"")
    with pytest.raises(TruncatedStreamError, match="closed"):
        server.next_request()


def test_a_failed_server_connection_stays_failed() -> None:
    server = ServerConnection()
    server.receive_data(frame({"t": "nope"}) + encode_request(HaveRequest(BLOB)))
    with pytest.raises(RemoteProtocolError):
        server.next_request()
    with pytest.raises(RemoteProtocolError, match="already failed"):
        server.next_request()


# --- Malformed responses (client side) --------------------------------------------------


def client_error(req: Request, data: bytes, **kwargs: Any) -> RemoteProtocolError:
    client = ClientConnection()
    if "expected" in kwargs:
        client.set_expected_chunk_length(kwargs["expected"])
    client.send_request(req)
    client.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        drain_client(client)
    return info.value


GET = GetRequest(BLOB, ((0, 2), (5, 6)))


def chunk(index: int, body: bytes) -> bytes:
    return encode_chunk_header(index, len(body)) + body


@pytest.mark.parametrize(
    ("req", "data", "match"),
    [
        (GET, chunk(2, b"x"), "not requested"),
        (GET, chunk(6, b"x"), "not requested"),
        (GET, chunk(0, b"x") + chunk(0, b"x"), "twice"),
        (GET, frame({"t": "chunk", "i": 0, "n": MAX_CHUNK_SIZE + 1}), "outside"),
        (GET, frame({"t": "chunk", "i": 0, "n": 0}), "outside"),
        (GET, frame({"t": "chunk", "i": -1, "n": 1}), "index"),
        (GET, frame({"t": "chunk", "i": 0, "n": 1, "x": 0}) + b"x", "unexpected keys"),
        (GET, frame({"t": "end", "missing": [0, 1]}), "end.missing"),
        (GET, frame({"t": "end", "missing": [0, 1, 5, 6]}), "end.missing"),
        (GET, frame({"t": "end", "missing": [1, 0, 5]}), "ascending"),
        (GET, frame({"t": "end", "missing": [0, 0, 1, 5]}), "ascending"),
        (GET, chunk(0, b"x") + frame({"t": "end", "missing": [0, 1, 5]}), "end.missing"),
        (GET, frame({"t": "manifest", "m": b"m"}), "does not answer"),
        (GET, frame({"t": "have", "n": 0, "bits": b""}), "does not answer"),
        (ManifestRequest(BLOB), frame({"t": "end", "missing": []}), "does not answer"),
        (ManifestRequest(BLOB), chunk(0, b"x"), "does not answer"),
        (ManifestRequest(BLOB), frame({"t": "manifest", "m": b""}), "manifest of 0 bytes"),
        (ManifestRequest(BLOB), frame({"t": "manifest", "m": "text"}), "must be bytes"),
        (HaveRequest(BLOB), frame({"t": "manifest", "m": b"m"}), "does not answer"),
        (HaveRequest(BLOB), frame({"t": "have", "n": 9, "bits": b"\x00"}), "bitmap"),
        (HaveRequest(BLOB), frame({"t": "have", "n": 3, "bits": b"\x08"}), "past the last"),
        (HaveRequest(BLOB), frame({"t": "have", "n": -1, "bits": b""}), "count"),
        (HaveRequest(BLOB), frame({"t": "have", "n": MAX_NUM_CHUNKS + 1, "bits": b""}), "count"),
        (HaveRequest(BLOB), frame({"t": "error", "code": "teapot", "msg": ""}), "error code"),
        (HaveRequest(BLOB), frame({"t": "error", "code": "busy", "msg": "x" * 1025}), "over"),
        (HaveRequest(BLOB), frame({"t": "error", "code": "busy", "msg": "é" * 513}), "over"),
        (HaveRequest(BLOB), frame({"t": "error", "code": "busy", "msg": b"x"}), "string"),
        (HaveRequest(BLOB), frame({"t": "error", "code": "busy"}), "missing keys"),
    ],
)
def test_malformed_responses_are_remote_errors(req: Request, data: bytes, match: str) -> None:
    assert match in str(client_error(req, data))


def test_chunk_longer_than_the_limit_is_refused_before_its_body_arrives() -> None:
    client = ClientConnection()
    client.send_request(GET)
    client.receive_data(frame({"t": "chunk", "i": 0, "n": MAX_CHUNK_SIZE + 1}))
    with pytest.raises(RemoteProtocolError) as info:
        client.next_event()
    assert info.value.code == ErrorCode.TOO_LARGE


def test_chunk_length_other_than_expected_is_refused_before_its_body_arrives() -> None:
    lengths = {0: 1000, 1: 1000, 5: 17}
    client = ClientConnection()
    client.set_expected_chunk_length(lengths.__getitem__)
    client.send_request(GET)
    client.receive_data(chunk(5, b"x" * 17) + encode_chunk_header(0, 1001))
    event = client.next_event()
    assert isinstance(event, Chunk)
    assert bytes(event.data) == b"x" * 17
    with pytest.raises(RemoteProtocolError, match="expected 1000"):
        client.next_event()


def test_expected_length_check_can_be_turned_off() -> None:
    client = ClientConnection()
    client.set_expected_chunk_length(lambda index: 1)
    client.set_expected_chunk_length(None)
    client.send_request(GET)
    client.receive_data(chunk(0, b"abc"))
    event = client.next_event()
    assert isinstance(event, Chunk)
    assert bytes(event.data) == b"abc"


def test_oversized_response_header_is_refused_before_buffering() -> None:
    cases: list[tuple[Request, int]] = [
        (GET, MAX_HEADER_SIZE),
        (ManifestRequest(BLOB), messages.max_response_header_size(ManifestRequest(BLOB))),
        (HaveRequest(BLOB), messages.max_response_header_size(HaveRequest(BLOB))),
    ]
    for req, limit in cases:
        error = client_error(req, (limit + 1).to_bytes(4, "big"))
        assert error.code == ErrorCode.TOO_LARGE
    assert client_error(GET, (2**32 - 1).to_bytes(4, "big")).code == ErrorCode.TOO_LARGE


def test_response_to_nothing_is_refused() -> None:
    client = ClientConnection()
    client.receive_data(encode_response_header(End(())))
    with pytest.raises(RemoteProtocolError, match="no request was outstanding"):
        client.next_event()


def test_extra_message_after_the_response_is_refused() -> None:
    pair = Pair()
    pair.request(ManifestRequest(BLOB))
    data = pair.server.send_response(ManifestResponse(b"m"))
    with pytest.raises(RemoteProtocolError, match="no request was outstanding"):
        pair.respond(data + encode_response_header(ManifestResponse(b"m")))


def test_chunk_after_an_error_is_refused() -> None:
    error = encode_response_header(ErrorResponse(ErrorCode.BUSY, "slow down"))
    client = ClientConnection()
    client.send_request(GET)
    client.receive_data(error + chunk(1, b"late"))
    assert client.next_event() == ErrorResponse(ErrorCode.BUSY, "slow down")
    with pytest.raises(RemoteProtocolError, match="no request was outstanding"):
        client.next_event()


@pytest.mark.parametrize(
    "data",
    [b"", encode_chunk_header(0, 10) + b"short", encode_response_header(End((0, 1, 5)))[:-1]],
)
def test_stream_closed_before_the_response_is_complete(data: bytes) -> None:
    client = ClientConnection()
    client.send_request(GET)
    client.receive_data(data)
    client.receive_data(b"")
    with pytest.raises(TruncatedStreamError, match="closed"):
        drain_client(client)


def test_a_failed_client_connection_stays_failed() -> None:
    client = ClientConnection()
    client.send_request(GET)
    client.receive_data(chunk(3, b"x"))
    with pytest.raises(RemoteProtocolError):
        client.next_event()
    with pytest.raises(RemoteProtocolError, match="already failed"):
        client.next_event()
    with pytest.raises(LocalProtocolError, match="already failed"):
        client.send_request(HaveRequest(BLOB))


# --- Our own misuse ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "req",
    [
        GetRequest(BLOB, ()),
        GetRequest(BLOB, ((2, 2),)),
        GetRequest(BLOB, ((3, 1),)),
        GetRequest(BLOB, ((0, 4), (2, 6))),
        GetRequest(BLOB, ((5, 6), (0, 1))),
        GetRequest(BLOB, tuple((i, i + 1) for i in range(0, 130, 2))),
        GetRequest(BLOB, ((0, 257),)),
        GetRequest(BLOB, ((0, MAX_NUM_CHUNKS + 1),)),
        ManifestRequest(BLOB.upper()),
        ManifestRequest(BLOB[:-2]),
        ManifestRequest("zz" * 32),
        HaveRequest(RAW_BLOB),  # type: ignore[arg-type]
    ],
)
def test_invalid_requests_are_local_errors(req: Request) -> None:
    client = ClientConnection()
    with pytest.raises(LocalProtocolError):
        client.send_request(req)
    assert client.outstanding_request is None
    with pytest.raises(LocalProtocolError):
        encode_request(req)


def test_second_request_while_one_is_outstanding_is_a_local_error() -> None:
    client = ClientConnection()
    client.send_request(HaveRequest(BLOB))
    with pytest.raises(LocalProtocolError, match="already outstanding"):
        client.send_request(ManifestRequest(BLOB))


def test_request_with_list_ranges_is_normalised() -> None:
    client = ClientConnection()
    client.send_request(GetRequest(BLOB, [[0, 2]]))  # type: ignore[arg-type]
    assert client.outstanding_request == GetRequest(BLOB, ((0, 2),))


def test_server_misuse_is_a_local_error() -> None:
    server = ServerConnection()
    with pytest.raises(LocalProtocolError, match="no request"):
        server.send_response(ManifestResponse(b"m"))
    with pytest.raises(LocalProtocolError):
        server.send_chunk_header(0, 1)

    server.receive_data(encode_request(ManifestRequest(BLOB)))
    assert server.next_request() == ManifestRequest(BLOB)
    with pytest.raises(LocalProtocolError):
        server.send_response(HaveResponse(0, b""))
    with pytest.raises(LocalProtocolError):
        server.send_response(End(()))
    with pytest.raises(LocalProtocolError):
        server.send_chunk_header(0, 1)
    with pytest.raises(LocalProtocolError):
        server.unsent_indices()
    with pytest.raises(LocalProtocolError, match="body"):
        server.send_response(Chunk(0, memoryview(b"x")))
    with pytest.raises(LocalProtocolError):
        server.send_response(ErrorResponse(ErrorCode.INTERNAL, "x" * (MAX_ERROR_MESSAGE + 1)))
    assert server.current_request == ManifestRequest(BLOB)  # nothing above moved the state


def test_server_get_misuse_is_a_local_error() -> None:
    server = ServerConnection()
    server.receive_data(encode_request(GET))
    assert server.next_request() == GET
    with pytest.raises(LocalProtocolError, match="not requested"):
        server.send_chunk_header(2, 10)
    with pytest.raises(LocalProtocolError):
        server.send_chunk_header(0, MAX_CHUNK_SIZE + 1)
    with pytest.raises(LocalProtocolError):
        server.send_chunk_header(0, 0)
    assert server.send_chunk_header(0, 10)
    with pytest.raises(LocalProtocolError, match="already sent"):
        server.send_chunk_header(0, 10)
    with pytest.raises(LocalProtocolError, match="missing"):
        server.send_response(End((1,)))
    with pytest.raises(LocalProtocolError, match="missing"):
        server.send_response(End((0, 1, 5)))
    with pytest.raises(LocalProtocolError):
        server.send_response(ManifestResponse(b"m"))
    assert server.unsent_indices() == (1, 5)
    assert server.send_response(End((1, 5)))
    assert server.current_request is None


@pytest.mark.parametrize(
    "resp",
    [
        HaveResponse(9, b"\x00"),
        HaveResponse(1, b"\x02"),
        ManifestResponse(b""),
        End((2, 1)),
        ErrorResponse("nope", "x"),  # type: ignore[arg-type]
        ErrorResponse(ErrorCode.BUSY, "\udc80"),
    ],
)
def test_invalid_responses_are_local_errors(resp: Response) -> None:
    with pytest.raises(LocalProtocolError):
        encode_response_header(resp)


def test_data_after_end_of_stream_is_a_local_error() -> None:
    for conn in (ServerConnection(), ClientConnection()):
        conn.receive_data(b"")
        conn.receive_data(b"")  # repeated EOF is harmless
        with pytest.raises(LocalProtocolError):
            conn.receive_data(b"x")


def test_protocol_error_base_is_abstract() -> None:
    with pytest.raises(TypeError):
        ProtocolError("which side?")
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert issubclass(LocalProtocolError, ProtocolError)
    assert RemoteProtocolError("x", ErrorCode.TOO_LARGE).code == ErrorCode.TOO_LARGE


def test_truncated_error_fits_the_limit_at_a_character_boundary() -> None:
    error = ErrorResponse.truncated(ErrorCode.INTERNAL, "é" * 2000)
    assert error.message == "é" * (MAX_ERROR_MESSAGE // 2)
    assert encode_response_header(error)
    assert ErrorResponse.truncated(ErrorCode.BUSY, "short").message == "short"


def test_the_largest_chunk_header_fits_the_servers_room_for_it() -> None:
    """The server writes each chunk header into HEADER_ROOM bytes just before the body."""
    from p2p.blob.server import HEADER_ROOM

    largest = messages.encode_chunk_header(messages.MAX_NUM_CHUNKS - 1, MAX_CHUNK_SIZE)
    assert len(largest) <= HEADER_ROOM
