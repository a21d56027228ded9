"""The trio shell around the sans-IO protocol core: moves bytes between libp2p streams and
``p2p.blob.protocol``'s connection objects, and turns every transport failure into one type.

All protocol decisions (framing, limits, what a valid response is) live in
``p2p.blob.protocol``; this module only reads, writes, applies deadlines and maps exceptions.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio
from libp2p.exceptions import BaseLibp2pError

from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.buffers import ChunkBuffers
from p2p.transport.fast import fast_stream_of, read_into


class StreamLost(Exception):
    """The stream or its connection failed under us (reset, closed, timed out)."""


class ProtocolRefused(StreamLost):
    """The peer answered an optimistic proposal with another protocol (or ``na``): it does
    not speak that version, which is no fault of its own."""


class Stream(Protocol):
    """The part of libp2p's ``INetStream`` this module uses."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes | bytearray | memoryview) -> None: ...

    async def close(self) -> None: ...

    async def reset(self) -> None: ...


async def read_some(stream: Stream, n: int) -> bytes:
    """Up to ``n`` bytes; b"" at the end of the stream."""
    # On the fast path, read the muxed stream itself: py-libp2p's NetStream wrapper takes a
    # lock (a scheduler round trip) per read, which adds up for small protocol headers.
    fast = fast_stream_of(stream)
    try:
        return await (stream if fast is None else fast).read(n)
    except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        if "EOF" in type(exc).__name__:
            return b""
        raise StreamLost(f"{type(exc).__name__}: {exc}") from exc


async def read_some_into(stream: Stream, buf: memoryview) -> int:
    """Receive up to len(buf) bytes straight into ``buf`` (decrypted in place on blobnet's
    fast path, one copy elsewhere); 0 at the end of the stream."""
    try:
        return await read_into(stream, buf)
    except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        if "EOF" in type(exc).__name__:
            return 0
        raise StreamLost(f"{type(exc).__name__}: {exc}") from exc


async def write_all(stream: Stream, data: bytes | bytearray | memoryview) -> None:
    try:
        await stream.write(data)
    except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise StreamLost(f"{type(exc).__name__}: {exc}") from exc


async def reset_quietly(stream: Any) -> None:
    """Reset a stream, ignoring a transport that is already gone. Shielded: it is called
    while a download is being cancelled, and an unsent reset leaves the stream holding one
    of the provider's per-peer slots until its idle timeout."""
    with trio.CancelScope(shield=True), trio.move_on_after(2):
        try:
            await stream.reset()
        except Exception:  # the stream is being abandoned either way
            pass


async def close_quietly(stream: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(2):
        try:
            await stream.close()
        except Exception:  # the stream is being abandoned either way
            pass


ChunkSink = Callable[[int, memoryview], Awaitable[None]]

# multistream-select 1.0.0 (libp2p's protocol negotiation): a message is its length plus one
# as an unsigned varint, the text, and a newline. Every message here is under 128 bytes, so
# the varint is one byte.
MULTISTREAM = b"/multistream/1.0.0"


def multistream_message(text: bytes) -> bytes:
    if len(text) + 1 >= 0x80:
        raise ValueError(f"multistream message too long for a one-byte length: {text!r}")
    return bytes([len(text) + 1]) + text + b"\n"


def proposal(protocol_id: str) -> bytes:
    """What an optimistic stream's first write says: the multistream header and
    ``protocol_id``, which a server that speaks it echoes."""
    return multistream_message(MULTISTREAM) + multistream_message(protocol_id.encode())


async def open_optimistic(host: Any, peer_id: Any, protocol_id: str) -> OptimisticStream:
    """A new stream to ``peer_id`` on ``host`` (a libp2p host) with ``protocol_id`` proposed
    but not confirmed (see `OptimisticStream`); libp2p's errors pass through."""
    from libp2p.custom_types import TProtocol

    stream = await host.get_network().new_stream(peer_id)
    ask = proposal(protocol_id)
    try:
        await stream.write(ask)
    except BaseException:
        await reset_quietly(stream)
        raise
    stream.set_protocol(TProtocol(protocol_id))
    return OptimisticStream(stream, ask)


class OptimisticStream:
    """A libp2p stream whose protocol was proposed without waiting for the answer.

    ``p2p.node.node`` writes the multistream header and ``/blobnet/blob/1.0.0`` together and hands
    the stream over at once, so the first request follows in the same round trip (as
    go-libp2p's lazy negotiation does); `BlobClient` reads and checks the two echoed
    messages (``expect``) before the first response. This saves the two round trips that
    py-libp2p's ``new_stream`` spends on every stream."""

    def __init__(self, stream: Any, expect: bytes) -> None:
        self.stream = stream
        self.expect = expect

    @property
    def muxed_stream(self) -> Any:
        return getattr(self.stream, "muxed_stream", self.stream)

    async def read(self, n: int | None = None) -> bytes:
        return bytes(await self.stream.read(n))

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.write(data)

    async def close(self) -> None:
        await self.stream.close()

    async def reset(self) -> None:
        await self.stream.reset()


class BlobClient:
    """Requests over one stream, one at a time (the protocol's sequencing rule), or, on a
    stream opened for ``/blobnet/blob/1.1.0`` or later with ``pipelined``, several ``get``
    requests sent ahead (`send_get`) and their responses read in order (`read_get`)."""

    def __init__(
        self,
        stream: Stream,
        chunk_length: Callable[[int], int] | None = None,
        *,
        version: messages.Version = messages.Version.V1_0,
        pipelined: bool = False,
    ) -> None:
        self.stream = stream
        self.pipelined = pipelined
        self._chunk_length: Callable[[int], int] | None = None
        # ``version``: the stream's (what may be asked on it); ``pipelined``: send up to
        # the version's ``max_pipelined`` requests ahead instead of one at a time.
        self.conn = proto.ClientConnection(
            version, max_pipelined=version.max_pipelined if pipelined else 1
        )
        self.set_chunk_length(chunk_length)
        self.conn.set_body_allocator(self._allocate)
        # A pooled buffer taken before reading a response header, so the body (whose
        # length only the header tells) can land in it without waiting.
        self._spare: Any = None
        # The pooled buffer a body in progress is landing in (not yet given to a sink).
        self._lent: Any = None
        self._abandoned = False
        # When the first chunk body on this stream began to arrive (trio time; None: not
        # yet): a fetch's transfer rate counts from there, as raw TCP's does (bench/wan).
        self.first_body_at: float | None = None
        # The negotiation answer still to come on an optimistically opened stream.
        self._expect = stream.expect if isinstance(stream, OptimisticStream) else b""

    @property
    def negotiated(self) -> bool:
        """The peer confirmed the protocol (always, on a stream not opened optimistically)."""
        return not self._expect

    def set_chunk_length(self, chunk_length: Callable[[int], int] | None) -> None:
        """With the manifest known: a chunk header announcing another length is refused
        before its body is buffered, and a `get` grants credit for its whole answer."""
        self._chunk_length = chunk_length
        self.conn.set_expected_chunk_length(chunk_length)

    def _allocate(self, length: int) -> Any:
        spare = self._spare
        if spare is not None and len(spare) >= length:
            self._spare = None
            self._lent = spare
            return spare
        return bytearray(length)

    def _check_usable(self) -> None:
        if self._abandoned:
            raise StreamLost("stream abandoned in the middle of a chunk body")

    async def _negotiated(self) -> None:
        """Read the peer's echo of an optimistic protocol proposal, byte for byte; a peer
        that answers anything else does not serve blobs here (StreamLost: not a breach)."""
        expect = self._expect
        got = b""
        while len(got) < len(expect):
            more = await read_some(self.stream, len(expect) - len(got))
            if not more:
                raise StreamLost("peer closed the stream during protocol negotiation")
            got += more
            if not expect.startswith(got):
                raise ProtocolRefused(f"peer refused the protocol proposed: answered {got[:64]!r}")
        self._expect = b""

    async def _next_response(self) -> messages.Response:
        """The next response event; a stream that ends mid-response is StreamLost (a peer
        that went away), not a protocol breach."""
        if self._expect:
            await self._negotiated()
        try:
            while True:
                event = self.conn.next_event()
                if event is not None:
                    return event
                if self.conn.eof_received:
                    raise StreamLost("peer closed the stream in the middle of a response")
                space = self.conn.body_space()
                if space is not None:
                    if self.first_body_at is None:
                        self.first_body_at = trio.current_time()
                    n = await read_some_into(self.stream, space)
                    if n:
                        self.conn.body_received(n)
                    else:
                        self.conn.receive_data(b"")
                    continue
                # Headers are read exactly (the core knows each frame's length once its
                # prefix is here), so no chunk body is pulled through the header buffer.
                want = self.conn.bytes_needed() or messages.LENGTH_PREFIX_SIZE
                self.conn.receive_data(await read_some(self.stream, want))
        except messages.TruncatedStreamError as exc:
            raise StreamLost(str(exc)) from exc

    async def manifest(self, blob_id: str) -> bytes | messages.ErrorResponse:
        await self.send_manifest(blob_id)
        return await self.read_manifest()

    async def send_manifest(self, blob_id: str) -> None:
        """Ask for the manifest; on a pipelined stream, `get` requests may follow at once."""
        self._check_usable()
        await write_all(self.stream, self.conn.send_request(messages.ManifestRequest(blob_id)))

    async def read_manifest(self) -> bytes | messages.ErrorResponse:
        """The answer to the oldest request outstanding, a manifest request."""
        self._check_usable()
        response = await self._next_response()
        if isinstance(response, messages.ManifestResponse):
            return response.manifest
        if isinstance(response, messages.ErrorResponse):
            return response
        raise messages.RemoteProtocolError(f"unexpected {type(response).__name__}")

    async def have(self, blob_id: str) -> messages.HaveResponse | messages.ErrorResponse:
        self._check_usable()
        await write_all(self.stream, self.conn.send_request(messages.HaveRequest(blob_id)))
        response = await self._next_response()
        if isinstance(response, messages.HaveResponse | messages.ErrorResponse):
            return response
        raise messages.RemoteProtocolError(f"unexpected {type(response).__name__}")

    async def peers(self, blob_id: str) -> messages.PeersResponse | messages.ErrorResponse:
        """(1.2.0) Who else fetches or holds ``blob_id``, as the server saw them."""
        self._check_usable()
        await write_all(self.stream, self.conn.send_request(messages.PeersRequest(blob_id)))
        response = await self._next_response()
        if isinstance(response, messages.PeersResponse | messages.ErrorResponse):
            return response
        raise messages.RemoteProtocolError(f"unexpected {type(response).__name__}")

    async def status(self, blob_id: str) -> messages.StatusResponse | messages.ErrorResponse:
        """(1.3.0) The chunks the peer holds and those it is fetching now (and, 1.4.0,
        how many others fetch the blob from it)."""
        self._check_usable()
        await write_all(self.stream, self.conn.send_request(messages.StatusRequest(blob_id)))
        response = await self._next_response()
        if isinstance(response, messages.StatusResponse | messages.ErrorResponse):
            return response
        raise messages.RemoteProtocolError(f"unexpected {type(response).__name__}")

    async def get(
        self,
        blob_id: str,
        ranges: tuple[tuple[int, int], ...],
        on_chunk: ChunkSink,
        *,
        buffers: ChunkBuffers | None = None,
    ) -> tuple[int, ...] | messages.ErrorResponse:
        """Stream the chunks of ``ranges`` into ``on_chunk``; return the indices the peer
        reported missing, or its error reply (`send_get`, then `read_get`)."""
        await self.send_get(blob_id, ranges)
        return await self.read_get(on_chunk, buffers=buffers)

    async def send_get(
        self,
        blob_id: str,
        ranges: tuple[tuple[int, int], ...],
        *,
        answer_bytes: int | None = None,
        tentative: bool = False,
    ) -> None:
        """Send a ``get``; on a pipelined stream while earlier ones are still answered.
        ``answer_bytes``: the answer's size where the chunk lengths are not known yet (a
        `get` sent with the manifest request), for the credit granted below.
        ``tentative`` (a 1.5.0 stream): send it as a ``try_get``, which the server may
        decline (`read_get` then reports nothing missing)."""
        self._check_usable()
        request = messages.GetRequest(blob_id, ranges, tentative)
        await write_all(self.stream, self.conn.send_request(request))
        fast = fast_stream_of(self.stream)
        if fast is None:
            return  # py-libp2p's own streams take no credit ahead
        if answer_bytes is None and self._chunk_length is not None:
            length = self._chunk_length
            answer_bytes = sum(
                length(i) + messages.CHUNK_HEADER_ROOM
                for start, end in ranges
                for i in range(start, end)
            )
        if answer_bytes:
            # Credit for the whole answer now: a new stream's window would otherwise grow
            # from 256 KiB a round trip at a time, behind TCP's own slow start.
            fast.expect(answer_bytes)

    async def read_get(
        self, on_chunk: ChunkSink, *, buffers: ChunkBuffers | None = None
    ) -> tuple[int, ...] | messages.ErrorResponse:
        """Read the response to the oldest ``get`` outstanding: its chunks go to
        ``on_chunk``; returns the indices the peer reported missing, or its error reply.

        With ``buffers``, each chunk body is received straight into a buffer of that pool
        and ``on_chunk`` owns it once it returns: it must hand it back with
        ``buffers.release(data)`` when done with it. A sink that raises must neither keep
        nor release it: ``read_get`` releases it then. After a body was cut short (the
        stream failed or the call was cancelled mid-body) the client refuses further
        requests with StreamLost.

        The answer to a ``try_get`` reports nothing missing: what it lists there the
        server declined to send, which says nothing about what it holds.
        """
        self._check_usable()
        asked = self.conn.outstanding_request
        declinable = isinstance(asked, messages.GetRequest) and asked.tentative
        try:
            while True:
                if buffers is not None and self._spare is None:
                    self._spare = await buffers.acquire()
                response = await self._next_response()
                if isinstance(response, messages.Chunk):
                    self._lent = None
                    try:
                        await on_chunk(response.index, response.data)
                    except BaseException:
                        if buffers is not None:
                            buffers.release(response.data)
                        raise
                elif isinstance(response, messages.End):
                    return () if declinable else response.missing
                elif isinstance(response, messages.ErrorResponse):
                    return response
                else:
                    raise messages.RemoteProtocolError(f"unexpected {type(response).__name__}")
        finally:
            if buffers is not None:
                for buf in (self._spare, self._lent):
                    if buf is not None:
                        buffers.release(buf)
                if self._lent is not None:
                    # A body was cut short and its buffer is back in the pool: the
                    # stream must not be read again (the caller resets it anyway).
                    self._abandoned = True
                self._spare = self._lent = None
