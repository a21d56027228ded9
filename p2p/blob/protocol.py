"""The sans-IO core of the ``/blobnet/blob/1.0.0`` to ``/blobnet/blob/1.5.0`` wire protocol.

Bytes in, events out; events in, bytes out. Nothing here touches a socket, a clock or the
store: the trio shell (server, client, downloader) moves bytes between these objects and
libp2p streams. ``p2p/blob/PROTOCOL.md`` is the wire specification; this module implements it.

Theory of operation
===================

1. Framing. Every message is a frame: a 4-byte big-endian header length ``H``, then ``H``
   bytes of a canonical msgpack map, then, for a ``chunk`` message only, exactly ``n`` raw
   body bytes. The length prefix is checked against a limit the moment its 4 bytes are
   here, before any of the header is buffered; the body length ``n`` is checked (against
   ``MAX_CHUNK_SIZE`` and the caller's expected length) before any of the body is buffered.

2. Canonical headers. A decoder builds the event from the map, re-encodes the event and
   compares the bytes: key order, integer widths, str-vs-bin and duplicate keys are all
   caught by that one comparison, so each message has exactly one valid encoding. Missing
   or extra keys, wrong types and out-of-range values are rejected before that, with a
   precise message.

3. Requests in order per stream. On 1.0.0 the client sends a request, reads the whole
   response, then may send the next. On 1.1.0 (``max_pipelined=MAX_PIPELINED_REQUESTS``) it
   may have up to that many requests outstanding; responses come in request order. The
   server reads a request, answers it completely, then takes the next. Both sides track the
   outstanding requests and check every message against the oldest: a ``get`` response
   carries only chunk indices that were asked for, each at most once, and ends with ``end``
   whose ``missing`` list is exactly the indices not sent.

4. Whose fault. Anything the peer sent that breaks these rules raises
   ``RemoteProtocolError`` (the shell resets the stream and scores the peer down; a server
   may first answer with the error code the exception hints at). Anything our own code asks
   for that the protocol forbids raises ``LocalProtocolError``: that is a bug. Once a
   connection has raised ``RemoteProtocolError`` it stays failed.

5. Copies. Received bytes are appended to one ``bytearray`` read from an offset (compacted
   once the consumed prefix dominates). A chunk body is copied exactly once, from the
   caller's buffer into a ``bytearray`` of exactly its length, and handed out as a read-only
   ``memoryview`` of it. Outgoing bodies are never copied: the shell writes
   ``encode_chunk_header(...)`` and then the body itself.

This module checks only what the protocol itself can check. Verifying that manifest bytes
hash to the blob ID, and that each chunk hashes to its manifest entry, is the receiver's
job (the downloader, with ``blobstore``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, TypeAlias

from p2p.blob.messages import (
    ALLOWED_RESPONSES,
    LENGTH_PREFIX_SIZE,
    MAX_HEADER_SIZE,
    T_CHUNK,
    Chunk,
    End,
    ErrorCode,
    GetRequest,
    HaveRequest,
    HaveResponse,
    Invalid,
    LocalProtocolError,
    ManifestRequest,
    ManifestResponse,
    PeersRequest,
    PeersResponse,
    RemoteProtocolError,
    Request,
    Response,
    StatusRequest,
    StatusResponse,
    Truncated,
    Version,
    check_ranges,
    decode_request,
    decode_response,
    encode_chunk_header,
    encode_request,
    encode_response_header,
    is_int,
    max_response_header_size,
    to_remote_error,
)

__all__ = ["BodyAllocator", "ClientConnection", "ServerConnection"]

# Compact the receive buffer once the consumed prefix is at least this large and at least
# half of the buffer, so a long stream of small frames costs amortised O(1) per byte.
_COMPACT_THRESHOLD = 64 * 1024


# --- Receive buffer -----------------------------------------------------------------------


BodyAllocator: TypeAlias = Callable[[int], Any]


class _ReceiveBuffer:
    """Bytes received and not yet parsed, read from an offset; plus an optional chunk body
    being filled in place (bytes for it skip the buffer)."""

    __slots__ = ("_body", "_body_filled", "_buf", "_pos", "eof")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._body: memoryview | None = None
        self._body_filled = 0
        self.eof = False

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self.eof:
            if len(data) == 0:
                return
            raise LocalProtocolError("receive_data() after end of stream")
        if len(data) == 0:
            self.eof = True
            return
        view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
        with view:
            body = self._body
            if body is not None and self._body_filled < len(body):
                take = min(len(body) - self._body_filled, len(view))
                body[self._body_filled : self._body_filled + take] = view[:take]
                self._body_filled += take
                view = view[take:]
            if len(view):
                self._buf += view

    def __len__(self) -> int:
        return len(self._buf) - self._pos

    def _consume(self, n: int) -> None:
        self._pos += n
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos >= _COMPACT_THRESHOLD and self._pos * 2 >= len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0

    def header_length(self) -> int | None:
        """The next frame's header length, or None if its prefix is not all here."""
        if len(self) < LENGTH_PREFIX_SIZE:
            return None
        return int.from_bytes(self._buf[self._pos : self._pos + LENGTH_PREFIX_SIZE], "big")

    def take_header(self, max_size: int) -> bytes | None:
        """The next frame's header bytes, checking the length prefix against ``max_size``
        as soon as it is here; None if the frame is not complete yet."""
        length = self.header_length()
        if length is None:
            return None
        if length == 0:
            raise Invalid("header length 0")
        if length > max_size:
            raise Invalid(
                f"header length {length} over the limit of {max_size}", ErrorCode.TOO_LARGE
            )
        end = self._pos + LENGTH_PREFIX_SIZE + length
        if end > len(self._buf):
            return None
        header = bytes(self._buf[self._pos + LENGTH_PREFIX_SIZE : end])
        self._consume(LENGTH_PREFIX_SIZE + length)
        return header

    def start_body(self, length: int, allocate: BodyAllocator | None) -> None:
        """Take a body of ``length`` bytes (from ``allocate(length)``, a writable buffer of
        at least that size, else a new bytearray) and move already-buffered bytes into it."""
        body = memoryview(bytearray(length) if allocate is None else allocate(length))
        body = body.cast("B")[:length]
        if body.readonly or len(body) != length:
            raise LocalProtocolError(f"body allocator gave no writable {length}-byte buffer")
        take = min(length, len(self))
        if take:
            with memoryview(self._buf) as view:
                body[:take] = view[self._pos : self._pos + take]
            self._consume(take)
        self._body = body
        self._body_filled = take

    def body_space(self) -> memoryview | None:
        """The unfilled part of the body in progress, to receive into directly."""
        body = self._body
        if body is None or self._body_filled == len(body):
            return None
        return body[self._body_filled :]

    def body_received(self, n: int) -> None:
        body = self._body
        if body is None or not 0 < n <= len(body) - self._body_filled:
            raise LocalProtocolError(f"body_received({n}) does not fit the body in progress")
        self._body_filled += n

    def body_missing(self) -> int | None:
        """Bytes the body in progress still needs, or None when no body is in progress."""
        if self._body is None:
            return None
        return len(self._body) - self._body_filled

    def take_body(self) -> memoryview:
        body = self._body
        assert body is not None
        assert self._body_filled == len(body)
        self._body = None
        self._body_filled = 0
        return body.toreadonly()

    def bytes_needed(self, max_header: int) -> int:
        """Bytes still needed to complete the frame in progress (0 if nothing is pending
        or the frame is already complete)."""
        missing = self.body_missing()
        if missing is not None:
            return missing
        length = self.header_length()
        if length is None:
            return LENGTH_PREFIX_SIZE - len(self) if len(self) else 0
        if length == 0 or length > max_header:
            return 0
        return max(0, LENGTH_PREFIX_SIZE + length - len(self))


# --- Connections --------------------------------------------------------------------------


class _RequestState:
    """What a `get` response may still carry: the requested indices, those already sent."""

    __slots__ = ("requested", "sent")

    def __init__(self, request: Request) -> None:
        self.requested: frozenset[int] = frozenset()
        if type(request) is GetRequest:
            self.requested = frozenset(
                i for start, end in request.ranges for i in range(start, end)
            )
        self.sent: set[int] = set()

    def unsent(self) -> tuple[int, ...]:
        return tuple(sorted(self.requested - self.sent))


class ServerConnection:
    """The server's side of one stream: read a request, answer it, read the next.

    Loop: feed bytes with ``receive_data`` until ``next_request`` returns a request (None
    with ``eof_received`` set means the client closed the stream cleanly), then answer it with
    ``send_response`` / ``send_chunk_header`` and write the bytes they return. The request is
    answered after a ManifestResponse, HaveResponse, End or ErrorResponse.

    ``version`` is the stream's: on 1.0.0 one request at a time; from 1.1.0 requests that
    arrive while one is being answered are parsed and queued (a violation beyond
    ``max_pipelined`` outstanding), and ``next_request`` hands them out in order; each later
    version adds the requests and answer fields :class:`Version` lists.
    """

    def __init__(self, version: Version = Version.V1_0) -> None:
        self._version = version
        self._max_pipelined = version.max_pipelined
        self._recv = _ReceiveBuffer()
        self._request: Request | None = None
        self._state: _RequestState | None = None
        self._queued: deque[Request] = deque()
        # 1.0.0: bytes were already here behind the request being answered, so the client
        # sent them before reading its response; the next next_request() fails.
        self._sent_early = False
        self._deferred: Invalid | None = None
        self._failed: str | None = None

    @property
    def eof_received(self) -> bool:
        """The client closed its side of the stream (``receive_data(b"")``)."""
        return self._recv.eof

    @property
    def counts_fellows(self) -> bool:
        """A 1.4.0 or later stream: `status` answers carry the ``fellows`` count."""
        return self._version.fellows

    @property
    def current_request(self) -> Request | None:
        """The request being answered, or None between requests."""
        return self._request

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes read from the stream; ``b""`` means the client closed its side."""
        self._recv.feed(data)

    def bytes_needed(self) -> int:
        """Bytes the request frame in progress still needs (0 if none is in progress)."""
        return self._recv.bytes_needed(MAX_HEADER_SIZE)

    def next_request(self) -> Request | None:
        """The next request, or None when more bytes are needed, while a response is owed
        (or, with ``eof_received``, when the stream ended cleanly). Raises
        RemoteProtocolError on anything malformed or oversized, on a stream cut mid-frame,
        on bytes sent while a response is owed (1.0.0), and on more than ``max_pipelined``
        requests outstanding (1.1.0)."""
        if self._failed is not None:
            raise RemoteProtocolError(f"connection already failed: {self._failed}")
        try:
            if self._max_pipelined == 1:
                request = self._next_sequential()
            else:
                request = self._next_pipelined()
        except Invalid as exc:
            self._failed = str(exc)
            raise to_remote_error(exc) from None
        if request is not None:
            self._request = request
            self._state = _RequestState(request)
        return request

    def _next_sequential(self) -> Request | None:
        if self._sent_early or (self._request is not None and len(self._recv)):
            raise Invalid("client sent a new request before reading the response")
        if self._request is not None:
            return None
        request = self._take_request()
        self._sent_early = request is not None and len(self._recv) > 0
        return request

    def _next_pipelined(self) -> Request | None:
        # A violation behind queued requests waits until they are handed out, so what the
        # peer sees does not depend on how its bytes were split into reads.
        if self._deferred is None:
            try:
                while (request := self._take_request()) is not None:
                    if len(self._queued) + (self._request is not None) >= self._max_pipelined:
                        raise Invalid(
                            f"more than {self._max_pipelined} requests outstanding on one stream",
                            ErrorCode.TOO_LARGE,
                        )
                    self._queued.append(request)
            except Invalid as exc:
                self._deferred = exc
        if self._request is not None:
            return None
        if self._queued:
            return self._queued.popleft()
        if self._deferred is not None:
            raise self._deferred
        return None

    def _take_request(self) -> Request | None:
        header = self._recv.take_header(MAX_HEADER_SIZE)
        if header is None:
            if self._recv.eof and len(self._recv):
                raise Truncated("stream closed in the middle of a request")
            return None
        return decode_request(header, self._version)

    def unsent_indices(self) -> tuple[int, ...]:
        """Indices of the current `get` not sent yet, ascending: the ``missing`` list of an
        End sent now."""
        if self._state is None or type(self._request) is not GetRequest:
            raise LocalProtocolError("no get request is being answered")
        return self._state.unsent()

    def send_response(self, resp: Response) -> bytes:
        """The frame of a manifest, have, end or error response to the current request.
        Each of these completes the request."""
        request = self._request
        if request is None or self._state is None:
            raise LocalProtocolError(f"no request to answer with {type(resp).__name__}")
        if type(resp) is ManifestResponse and type(request) is not ManifestRequest:
            raise LocalProtocolError("a manifest response answers only a manifest request")
        if type(resp) is HaveResponse and type(request) is not HaveRequest:
            raise LocalProtocolError("a have response answers only a have request")
        if type(resp) is PeersResponse and type(request) is not PeersRequest:
            raise LocalProtocolError("a peers response answers only a peers request")
        if type(resp) is StatusResponse and type(request) is not StatusRequest:
            raise LocalProtocolError("a status response answers only a status request")
        if type(resp) is StatusResponse and (resp.fellows is not None) != self._version.fellows:
            raise LocalProtocolError(
                "a status answer counts fellows on a 1.4.0 or 1.5.0 stream, and only there"
            )
        if type(resp) is End:
            if type(request) is not GetRequest:
                raise LocalProtocolError("end answers only a get request")
            if tuple(resp.missing) != self._state.unsent():
                raise LocalProtocolError(
                    "end.missing must list exactly the requested chunks not sent, ascending"
                )
        data = encode_response_header(resp)
        self._request = None
        self._state = None
        return data

    def send_chunk_header(self, index: int, length: int) -> bytes:
        """The header frame of one chunk of the current `get`; write the ``length`` body
        bytes right after it."""
        if type(self._request) is not GetRequest or self._state is None:
            raise LocalProtocolError("chunks answer only a get request")
        if not is_int(index) or index not in self._state.requested:
            raise LocalProtocolError(f"chunk {index} was not requested")
        if index in self._state.sent:
            raise LocalProtocolError(f"chunk {index} already sent")
        data = encode_chunk_header(index, length)
        self._state.sent.add(index)
        return data


ExpectedLength: TypeAlias = Callable[[int], int]


class ClientConnection:
    """The client's side of one stream: send a request, read its whole response, repeat.

    ``next_event`` returns the response's events; the request is complete after a
    ManifestResponse, HaveResponse, End or ErrorResponse, and then ``send_request`` may be
    called again. Chunk bodies arrive whole, as read-only memoryviews.

    Zero-copy bodies: with ``set_body_allocator`` each chunk body lands in a buffer of the
    caller's choosing, and while a body is in progress ``body_space`` is a writable view of
    its unfilled part: receive into it and report the count with ``body_received`` instead
    of passing bytes through ``receive_data``.

    Pipelining (1.1.0 and later streams): with ``max_pipelined`` > 1 up to that
    many requests may be sent before their responses complete; the server answers in order,
    so every event belongs to ``outstanding_request`` (the oldest), and ``send_request`` may
    be called again whenever ``outstanding_count < max_pipelined``.
    """

    def __init__(self, version: Version = Version.V1_0, *, max_pipelined: int = 1) -> None:
        if not 1 <= max_pipelined <= version.max_pipelined:
            raise LocalProtocolError(
                f"max_pipelined must be 1..{version.max_pipelined} on a {version.protocol_id} "
                "stream"
            )
        self._version = version
        self._max_pipelined = max_pipelined
        self._recv = _ReceiveBuffer()
        self._request: Request | None = None
        self._state: _RequestState | None = None
        self._queued: deque[tuple[Request, _RequestState]] = deque()
        self._pending_index: int | None = None
        self._expected_length: ExpectedLength | None = None
        self._allocate: BodyAllocator | None = None
        self._failed: str | None = None

    @property
    def eof_received(self) -> bool:
        """The server closed its side of the stream (``receive_data(b"")``)."""
        return self._recv.eof

    @property
    def outstanding_request(self) -> Request | None:
        """The request whose response is being read (the oldest outstanding), or None."""
        return self._request

    @property
    def outstanding_count(self) -> int:
        """Requests sent whose responses are not complete (at most ``max_pipelined``)."""
        return (self._request is not None) + len(self._queued)

    def set_expected_chunk_length(self, fn: ExpectedLength | None) -> None:
        """Check each chunk header's length against ``fn(index)`` before buffering its body
        (a mismatch is a RemoteProtocolError). None turns the check off."""
        self._expected_length = fn

    def set_body_allocator(self, allocate: BodyAllocator | None) -> None:
        """Take each chunk body's buffer from ``allocate(length)`` (a writable buffer of at
        least ``length`` bytes; the body is its first ``length``). None: new bytearrays."""
        self._allocate = allocate

    def body_space(self) -> memoryview | None:
        """While a chunk body is arriving, the writable view its next bytes belong in;
        None otherwise (then read ``bytes_needed`` bytes and use ``receive_data``)."""
        return self._recv.body_space()

    def body_received(self, n: int) -> None:
        """``n`` (> 0) bytes were written at the start of ``body_space()``. The end of the
        stream is still reported with ``receive_data(b"")``."""
        self._recv.body_received(n)

    def send_request(self, req: Request) -> bytes:
        """The frame of ``req``. LocalProtocolError if a request is outstanding or ``req``
        is invalid (bad blob ID, ranges unsorted/overlapping/empty/over the limits)."""
        if self._failed is not None:
            raise LocalProtocolError(f"connection already failed: {self._failed}")
        if self.outstanding_count >= self._max_pipelined:
            raise LocalProtocolError(
                "a request is already outstanding on this stream"
                if self._max_pipelined == 1
                else f"{self._max_pipelined} requests already outstanding on this stream"
            )
        if self._recv.eof:
            raise LocalProtocolError("the server closed the stream")
        if type(req) is PeersRequest and not self._version.peer_exchange:
            raise LocalProtocolError("peers is a /blobnet/blob/1.2.0 request")
        if type(req) is StatusRequest and not self._version.status:
            raise LocalProtocolError("status is a /blobnet/blob/1.3.0 request")
        if type(req) is GetRequest and req.tentative and not self._version.tentative:
            raise LocalProtocolError("try_get is a /blobnet/blob/1.5.0 request")
        data = encode_request(req)
        if type(req) is GetRequest:
            # Normalise lists to tuples so the stored request matches what is on the wire.
            req = GetRequest(req.blob_id, check_ranges(req.ranges), req.tentative)
        if self._request is None:
            self._request = req
            self._state = _RequestState(req)
        else:
            self._queued.append((req, _RequestState(req)))
        return data

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes read from the stream; ``b""`` means the server closed its side."""
        self._recv.feed(data)

    def bytes_needed(self) -> int:
        """Bytes the frame in progress still needs: a good size for the next read when a
        large chunk body or manifest is arriving. 0 if unknown."""
        limit = (
            MAX_HEADER_SIZE if self._request is None else max_response_header_size(self._request)
        )
        return self._recv.bytes_needed(limit)

    def next_event(self) -> Response | None:
        """The next response event, or None when more bytes are needed (or, with
        ``eof_received`` and no request outstanding, when the stream ended cleanly).
        Raises RemoteProtocolError if the server broke the protocol."""
        if self._failed is not None:
            raise RemoteProtocolError(f"connection already failed: {self._failed}")
        try:
            return self._next_event()
        except Invalid as exc:
            self._failed = str(exc)
            raise to_remote_error(exc) from None
        except LocalProtocolError as exc:  # a refused body buffer: the framing is lost
            self._failed = str(exc)
            raise

    def _next_event(self) -> Response | None:
        if self._pending_index is not None:
            return self._finish_chunk()
        request = self._request
        if request is None or self._state is None:
            if len(self._recv):
                raise Invalid("server sent data while no request was outstanding")
            return None
        header = self._recv.take_header(max_response_header_size(request))
        if header is None:
            if self._recv.eof:
                raise Truncated("stream closed before the response was complete")
            return None
        kind, decoded = decode_response(
            header, ALLOWED_RESPONSES[type(request)], self._version.fellows
        )
        state = self._state
        if kind == T_CHUNK:
            index, length = decoded
            if index not in state.requested:
                raise Invalid(f"server sent chunk {index}, which was not requested")
            if index in state.sent:
                raise Invalid(f"server sent chunk {index} twice")
            if self._expected_length is not None:
                expected = self._expected_length(index)
                if length != expected:
                    raise Invalid(f"chunk {index} is {length} bytes; expected {expected}")
            self._recv.start_body(length, self._allocate)  # may refuse the buffer
            state.sent.add(index)
            self._pending_index = index
            return self._finish_chunk()
        event: Response = decoded
        if type(event) is End and event.missing != state.unsent():
            raise Invalid("end.missing is not exactly the requested chunks that were not sent")
        self._request, self._state = self._queued.popleft() if self._queued else (None, None)
        return event

    def _finish_chunk(self) -> Chunk | None:
        if self._recv.body_missing():
            if self._recv.eof:
                raise Truncated("stream closed in the middle of a chunk body")
            return None
        index = self._pending_index
        assert index is not None
        self._pending_index = None
        return Chunk(index, self._recv.take_body())
