"""The trio shell around the sans-IO protocol core: moves bytes between libp2p streams and
``p2p.protocol``'s connection objects, and turns every transport failure into one type.

All protocol decisions (framing, limits, what a valid response is) live in
``p2p.protocol``; this module only reads, writes, applies deadlines and maps exceptions.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio
from libp2p.exceptions import BaseLibp2pError

from p2p import protocol as proto

# Reads of at least 1 MiB: small reads cost py-libp2p 35-40% of its throughput
# (research/perf.md); larger ones fetch a whole chunk body per call.
READ_SIZE = 1024 * 1024


class StreamLost(Exception):
    """The stream or its connection failed under us (reset, closed, timed out)."""


class Stream(Protocol):
    """The part of libp2p's ``INetStream`` this module uses."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...

    async def reset(self) -> None: ...


async def read_some(stream: Stream, n: int) -> bytes:
    try:
        return await stream.read(n)
    except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        if "EOF" in type(exc).__name__:
            return b""
        raise StreamLost(f"{type(exc).__name__}: {exc}") from exc


async def write_all(stream: Stream, data: bytes) -> None:
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


class BlobClient:
    """Requests over one stream, one at a time (the protocol's sequencing rule)."""

    def __init__(self, stream: Stream, chunk_length: Callable[[int], int] | None = None) -> None:
        self.stream = stream
        self.conn = proto.ClientConnection()
        # With the manifest known, a chunk header announcing another length is refused
        # before its body is buffered.
        self.conn.set_expected_chunk_length(chunk_length)

    async def _next_response(self) -> proto.Response:
        """The next response event; a stream that ends mid-response is StreamLost (a peer
        that went away), not a protocol breach."""
        try:
            while True:
                event = self.conn.next_event()
                if event is not None:
                    return event
                if self.conn.eof_received:
                    raise StreamLost("peer closed the stream in the middle of a response")
                want = max(READ_SIZE, self.conn.bytes_needed())
                self.conn.receive_data(await read_some(self.stream, want))
        except proto.TruncatedStreamError as exc:
            raise StreamLost(str(exc)) from exc

    async def manifest(self, blob_id: str) -> bytes | proto.ErrorResponse:
        await write_all(self.stream, self.conn.send_request(proto.ManifestRequest(blob_id)))
        response = await self._next_response()
        if isinstance(response, proto.ManifestResponse):
            return response.manifest
        if isinstance(response, proto.ErrorResponse):
            return response
        raise proto.RemoteProtocolError(f"unexpected {type(response).__name__}")

    async def have(self, blob_id: str) -> proto.HaveResponse | proto.ErrorResponse:
        await write_all(self.stream, self.conn.send_request(proto.HaveRequest(blob_id)))
        response = await self._next_response()
        if isinstance(response, proto.HaveResponse | proto.ErrorResponse):
            return response
        raise proto.RemoteProtocolError(f"unexpected {type(response).__name__}")

    async def get(
        self,
        blob_id: str,
        ranges: tuple[tuple[int, int], ...],
        on_chunk: ChunkSink,
    ) -> tuple[int, ...] | proto.ErrorResponse:
        """Stream the chunks of ``ranges`` into ``on_chunk``; return the indices the peer
        reported missing, or its error reply."""
        await write_all(self.stream, self.conn.send_request(proto.GetRequest(blob_id, ranges)))
        while True:
            response = await self._next_response()
            if isinstance(response, proto.Chunk):
                await on_chunk(response.index, response.data)
            elif isinstance(response, proto.End):
                return response.missing
            elif isinstance(response, proto.ErrorResponse):
                return response
            else:
                raise proto.RemoteProtocolError(f"unexpected {type(response).__name__}")
