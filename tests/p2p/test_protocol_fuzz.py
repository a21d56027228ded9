"""Property tests of the protocol core.

Invariant (after h11's fuzz harness): whatever bytes a peer sends, in whatever pieces they
arrive, a connection either returns events or raises RemoteProtocolError, never anything
else; and the events (and whether and how it fails) do not depend on how the bytes were
split. Connections speak 1.3.0, the superset: every request and response type is fuzzed.
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p.blob.messages import (
    MAX_CHUNKS_PER_REQUEST,
    MAX_RANGES_PER_REQUEST,
    Chunk,
    End,
    ErrorCode,
    ErrorResponse,
    GetRequest,
    HaveRequest,
    HaveResponse,
    ManifestRequest,
    ManifestResponse,
    RemoteProtocolError,
    Request,
    StatusRequest,
    StatusResponse,
    Version,
    encode_chunk_header,
    encode_request,
)
from p2p.blob.protocol import ClientConnection, ServerConnection

FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

BLOB = "5a" * 32


@st.composite
def ranges_strategy(draw: st.DrawFn) -> tuple[tuple[int, int], ...]:
    """Valid get ranges: sorted, non-overlapping, non-empty, within the limits."""
    count = draw(st.integers(1, 6))
    out: list[tuple[int, int]] = []
    position = draw(st.integers(0, 20))
    total = 0
    for _ in range(count):
        length = draw(st.integers(1, 5))
        if total + length > MAX_CHUNKS_PER_REQUEST or len(out) >= MAX_RANGES_PER_REQUEST:
            break
        out.append((position, position + length))
        total += length
        position += length + draw(st.integers(0, 4))
    return tuple(out)


requests = st.one_of(
    st.builds(ManifestRequest, st.just(BLOB)),
    st.builds(HaveRequest, st.just(BLOB)),
    st.builds(StatusRequest, st.just(BLOB)),
    st.builds(GetRequest, st.just(BLOB), ranges_strategy()),
)


def split_points(data: st.DataObject, length: int) -> list[int]:
    cuts = data.draw(st.lists(st.integers(0, length), max_size=12))
    return sorted(set(cuts))


def pieces(blob: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *cuts, len(blob)]
    return [blob[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def summarise(event: Any) -> Any:
    return ("chunk", event.index, bytes(event.data)) if isinstance(event, Chunk) else event


def run_server(chunks: list[bytes]) -> tuple[list[Any], str | None]:
    """Feed ``chunks`` then EOF; answer each request at once (as the shell does). A 1.1.0
    connection: several requests may arrive in one piece. (On 1.0.0 that is a violation
    seen only when the bytes come together, so whole and split feeds differ by design.)"""
    server = ServerConnection(Version.V1_3)
    events: list[Any] = []
    try:
        for piece in [*chunks, b""]:
            server.receive_data(piece)
            while (req := server.next_request()) is not None:
                events.append(req)
                server.send_response(ErrorResponse(ErrorCode.NOT_FOUND, "fuzz"))
    except RemoteProtocolError as exc:
        return events, str(exc)
    return events, None


def run_client(
    req: Request, chunks: list[bytes], *, resend: bool = True
) -> tuple[list[Any], str | None]:
    """Feed ``chunks`` then EOF to a client; with ``resend`` it sends ``req`` again after each
    response, so bytes past the first response are parsed too."""
    client = ClientConnection(Version.V1_3)
    client.send_request(req)
    events: list[Any] = []
    try:
        for piece in [*chunks, b""]:
            client.receive_data(piece)
            while (event := client.next_event()) is not None:
                events.append(summarise(event))
                if resend and client.outstanding_request is None:
                    client.send_request(req)
    except RemoteProtocolError as exc:
        return events, str(exc)
    return events, None


def valid_response(req: Request, data: st.DataObject) -> bytes:
    """A valid response stream for ``req`` (generated through a real ServerConnection)."""
    server = ServerConnection(Version.V1_3)
    server.receive_data(encode_request(req))
    assert server.next_request() == req
    if data.draw(st.integers(0, 4), label="answer with an error") == 0:
        return server.send_response(ErrorResponse(ErrorCode.BUSY, "try later"))
    if isinstance(req, ManifestRequest):
        return server.send_response(ManifestResponse(data.draw(st.binary(min_size=1))))
    if isinstance(req, HaveRequest):
        n = data.draw(st.integers(0, 40))
        bits = bytearray(data.draw(st.binary(min_size=(n + 7) // 8, max_size=(n + 7) // 8)))
        if n % 8:
            bits[-1] &= (1 << (n % 8)) - 1
        return server.send_response(HaveResponse(n, bytes(bits)))
    if isinstance(req, StatusRequest):
        n = data.draw(st.integers(0, 40))
        held = data.draw(st.integers(0, (1 << n) - 1)) if n else 0
        soon = data.draw(st.integers(0, (1 << n) - 1)) & ~held if n else 0
        size = (n + 7) // 8
        return server.send_response(
            StatusResponse(n, held.to_bytes(size, "little"), soon.to_bytes(size, "little"))
        )
    wanted = [i for start, end in req.ranges for i in range(start, end)]
    sent = data.draw(st.permutations(wanted))[: data.draw(st.integers(0, len(wanted)))]
    out = b""
    for index in sent:
        body = data.draw(st.binary(min_size=1, max_size=40))
        out += server.send_chunk_header(index, len(body)) + body
    return out + server.send_response(End(server.unsent_indices()))


@FUZZ
@given(blob=st.binary(max_size=300), data=st.data())
def test_server_arbitrary_bytes_only_raise_remote_errors(blob: bytes, data: st.DataObject) -> None:
    whole = run_server([blob])
    assert run_server(pieces(blob, split_points(data, len(blob)))) == whole
    assert run_server([blob[i : i + 1] for i in range(len(blob))]) == whole


@FUZZ
@given(reqs=st.lists(requests, min_size=1, max_size=4), data=st.data())
def test_server_mutated_request_streams_only_raise_remote_errors(
    reqs: list[Request], data: st.DataObject
) -> None:
    stream = bytearray(b"".join(encode_request(r) for r in reqs))
    valid_events, valid_error = run_server([bytes(stream)])
    assert (valid_events, valid_error) == (reqs, None)
    for _ in range(data.draw(st.integers(1, 3))):
        mutate(stream, data)
    blob = bytes(stream)
    whole = run_server([blob])
    assert run_server(pieces(blob, split_points(data, len(blob)))) == whole


@FUZZ
@given(req=requests, blob=st.binary(max_size=300), data=st.data())
def test_client_arbitrary_bytes_only_raise_remote_errors(
    req: Request, blob: bytes, data: st.DataObject
) -> None:
    whole = run_client(req, [blob])
    assert run_client(req, pieces(blob, split_points(data, len(blob)))) == whole
    assert run_client(req, [blob[i : i + 1] for i in range(len(blob))]) == whole


@FUZZ
@given(req=requests, data=st.data())
def test_client_valid_responses_round_trip_whole_or_split(
    req: Request, data: st.DataObject
) -> None:
    blob = valid_response(req, data)
    events, error = run_client(req, [blob], resend=False)
    assert error is None
    final = events[-1]
    assert isinstance(final, ManifestResponse | HaveResponse | StatusResponse | End | ErrorResponse)
    split = pieces(blob, split_points(data, len(blob)))
    assert run_client(req, split, resend=False) == (events, None)


@FUZZ
@given(req=requests, data=st.data())
def test_client_mutated_response_streams_only_raise_remote_errors(
    req: Request, data: st.DataObject
) -> None:
    stream = bytearray(valid_response(req, data))
    for _ in range(data.draw(st.integers(1, 3))):
        mutate(stream, data)
    blob = bytes(stream)
    whole = run_client(req, [blob])
    assert run_client(req, pieces(blob, split_points(data, len(blob)))) == whole


@FUZZ
@given(index=st.integers(0, 1000), length=st.integers(1, 1 << 24))
def test_chunk_header_round_trips(index: int, length: int) -> None:
    header = encode_chunk_header(index, length)
    client = ClientConnection()
    client.send_request(GetRequest(BLOB, ((index, index + 1),)))
    client.receive_data(header)
    assert client.next_event() is None
    assert client.bytes_needed() == length


@FUZZ
@given(req=requests)
def test_request_round_trips(req: Request) -> None:
    server = ServerConnection(Version.V1_3)
    server.receive_data(encode_request(req))
    assert server.next_request() == req
    assert server.next_request() is None  # a response is owed; nothing more was sent


def mutate(stream: bytearray, data: st.DataObject) -> None:
    """One random edit: flip a byte, delete a span, insert bytes, or truncate."""
    if not stream:
        stream += data.draw(st.binary(min_size=1, max_size=8))
        return
    kind = data.draw(st.sampled_from(["flip", "delete", "insert", "truncate"]))
    at = data.draw(st.integers(0, len(stream) - 1))
    if kind == "flip":
        stream[at] ^= data.draw(st.integers(1, 255))
    elif kind == "delete":
        del stream[at : at + data.draw(st.integers(1, 8))]
    elif kind == "insert":
        stream[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        del stream[at:]
