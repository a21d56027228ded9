"""``/blobnet/blob/1.1.0`` pipelining in the sans-IO core (PROTOCOL.md): a client
may have up to MAX_PIPELINED_REQUESTS requests outstanding, the server answers in order,
and 1.0.0 still calls pipelining a violation."""

from __future__ import annotations

import pytest

from p2p.blob.messages import (
    MAX_PIPELINED_REQUESTS,
    End,
    ErrorCode,
    ErrorResponse,
    GetRequest,
    HaveRequest,
    HaveResponse,
    LocalProtocolError,
    ManifestRequest,
    RemoteProtocolError,
    Version,
    encode_chunk_header,
    encode_request,
    encode_response_header,
)
from p2p.blob.protocol import ClientConnection, ServerConnection

BLOB = "ab" * 32


def have(i: int) -> HaveRequest:
    return HaveRequest(f"{i:02x}" * 32)


def test_server_hands_out_pipelined_requests_in_order_one_at_a_time() -> None:
    server = ServerConnection(Version.V1_1)
    server.receive_data(b"".join(encode_request(have(i)) for i in range(3)))
    for i in range(3):
        assert server.next_request() == have(i)
        # Not the next one until this one is answered.
        assert server.next_request() is None
        server.send_response(ErrorResponse(ErrorCode.NOT_FOUND, "no"))
    assert server.next_request() is None


def test_server_refuses_more_than_the_bound_after_answering_the_rest() -> None:
    server = ServerConnection(Version.V1_1)
    server.receive_data(
        b"".join(encode_request(have(i)) for i in range(MAX_PIPELINED_REQUESTS + 1))
    )
    for i in range(MAX_PIPELINED_REQUESTS):
        assert server.next_request() == have(i)
        server.send_response(ErrorResponse(ErrorCode.NOT_FOUND, "no"))
    with pytest.raises(RemoteProtocolError, match="outstanding") as info:
        server.next_request()
    assert info.value.code == ErrorCode.TOO_LARGE


def test_server_answers_requests_before_a_bad_frame_whatever_the_split() -> None:
    good = encode_request(have(1))
    bad = (2**31).to_bytes(4, "big")
    for pieces in ([good + bad], [good, bad], [good[:7], good[7:] + bad]):
        server = ServerConnection(Version.V1_1)
        seen, error = run(server, pieces)
        assert seen == [have(1)], pieces
        assert error is not None and "over the limit" in error


def run(server: ServerConnection, pieces: list[bytes]) -> tuple[list[object], str | None]:
    seen: list[object] = []
    try:
        for piece in pieces:
            server.receive_data(piece)
            while (request := server.next_request()) is not None:
                seen.append(request)
                server.send_response(ErrorResponse(ErrorCode.NOT_FOUND, "no"))
    except RemoteProtocolError as exc:
        return seen, str(exc)
    return seen, None


def test_1_0_server_calls_a_request_sent_with_another_a_violation() -> None:
    server = ServerConnection()
    server.receive_data(encode_request(have(1)) + encode_request(have(2)))
    assert server.next_request() == have(1)
    server.send_response(ErrorResponse(ErrorCode.NOT_FOUND, "no"))
    with pytest.raises(RemoteProtocolError, match="before reading the response"):
        server.next_request()


def test_client_pipelines_up_to_its_bound_and_matches_responses_in_order() -> None:
    client = ClientConnection(Version.V1_1, max_pipelined=3)
    sent = [
        client.send_request(ManifestRequest(BLOB)),
        client.send_request(GetRequest(BLOB, ((0, 2),))),
        client.send_request(HaveRequest(BLOB)),
    ]
    assert all(sent)
    assert client.outstanding_count == 3
    with pytest.raises(LocalProtocolError, match="3 requests already outstanding"):
        client.send_request(HaveRequest(BLOB))
    client.receive_data(encode_response_header(ErrorResponse(ErrorCode.NOT_FOUND, "no")))
    assert isinstance(client.next_event(), ErrorResponse)
    assert client.outstanding_request == GetRequest(BLOB, ((0, 2),))
    client.receive_data(encode_chunk_header(1, 3) + b"abc")
    chunk = client.next_event()
    assert chunk is not None and bytes(chunk.data) == b"abc"  # type: ignore[union-attr]
    client.receive_data(encode_response_header(End((0,))))
    assert client.next_event() == End((0,))
    client.receive_data(encode_response_header(HaveResponse(2, b"\x03")))
    assert client.next_event() == HaveResponse(2, b"\x03")
    assert client.outstanding_count == 0


def test_client_checks_each_response_against_the_oldest_request() -> None:
    client = ClientConnection(Version.V1_1, max_pipelined=2)
    client.send_request(HaveRequest(BLOB))
    client.send_request(GetRequest(BLOB, ((0, 1),)))
    # A chunk answers the get, but the have is still owed: a violation.
    client.receive_data(encode_chunk_header(0, 3) + b"abc")
    with pytest.raises(RemoteProtocolError, match="does not answer"):
        client.next_event()


def test_1_0_client_still_sends_one_request_at_a_time() -> None:
    client = ClientConnection()
    client.send_request(HaveRequest(BLOB))
    with pytest.raises(LocalProtocolError, match="already outstanding"):
        client.send_request(HaveRequest(BLOB))


@pytest.mark.parametrize("bound", [0, MAX_PIPELINED_REQUESTS + 1])
def test_pipelining_bound_is_checked(bound: int) -> None:
    with pytest.raises(LocalProtocolError):
        ClientConnection(Version.V1_1, max_pipelined=bound)


def test_a_version_carries_its_features_and_every_older_one() -> None:
    """One ordered version says what a stream carries: pipelining from 1.1.0, `peers` from
    1.2.0, `status` from 1.3.0, its fellow count from 1.4.0, `try_get` from 1.5.0."""
    assert [v.protocol_id for v in Version] == [f"/blobnet/blob/1.{m}.0" for m in range(6)]
    assert [v.max_pipelined for v in Version] == [1] + [MAX_PIPELINED_REQUESTS] * 5
    features = [(v.peer_exchange, v.status, v.fellows, v.tentative) for v in Version]
    assert features == [(n >= 2, n >= 3, n >= 4, n >= 5) for n in range(6)]
    assert all(Version.of(v.protocol_id) is v for v in Version)
    assert Version.of("/blobnet/blob/1.6.0") is None
    with pytest.raises(LocalProtocolError, match=r"1\.\.1 on"):
        ClientConnection(Version.V1_0, max_pipelined=2)  # 1.0.0 streams do not pipeline
