"""Serving ``/blobnet/blob/1.0.0``: manifests, bitmaps and chunks of complete and partial
blobs, with every size, count and wait bounded.

Theory of operation
1. One stream carries requests in sequence; the server answers each fully before it
   reads the next (the sans-IO ``ServerConnection`` enforces this).
2. A peer may hold at most ``MAX_STREAMS_PER_PEER`` blob streams at once; the next one
   gets a ``busy`` error and is reset, so one peer cannot starve the others.
3. Waiting is bounded: an idle stream is closed after ``IDLE_TIMEOUT``; a request that
   has started must arrive whole within ``REQUEST_TIMEOUT``; every chunk write must finish
   within ``SEND_TIMEOUT_BASE`` plus its size at ``MIN_SEND_RATE`` (a reader that stops
   reading cannot hold a slot forever).
4. A peer that breaks the protocol gets one error reply (where the framing still allows
   one) and a reset; its other streams are unaffected.
5. Chunks of partial blobs are served only when verified. Each body is read into one
   buffer per request, right behind its header, and written from there (no copy per
   chunk). A chunk the page cache holds is read inline; one that would wait for the disk
   is read in a worker thread, so the event loop keeps moving other streams. Chunks are
   not hashed again on the way out unless ``verify_reads`` is set: they were verified on
   the way in, and the fetcher verifies each one and bans a peer that sends a bad one.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import trio

from blobstore import (
    BadBlobId,
    BlobNotFound,
    ChunkReader,
    ChunkUnavailable,
    Manifest,
    Store,
    StoreError,
)
from p2p import protocol as proto
from p2p.fast import fast_stream_of
from p2p.wire import StreamLost, close_quietly, read_some, reset_quietly, write_all

log = logging.getLogger(__name__)

# Parallel streams one peer may hold: the downloader opens a few per provider (DESIGN
# section 5); 16 leaves room for several concurrent downloads from one peer.
MAX_STREAMS_PER_PEER = 16
# A stream with no request for this long is closed; downloaders open streams on demand.
IDLE_TIMEOUT = 60.0
# Once a request's first byte arrives, the rest must follow quickly (slowloris).
REQUEST_TIMEOUT = 10.0
# Minimum rate a reader must sustain for chunk bodies (bitswap uses 100 kbit/s; blob
# chunks are large, so we ask for 64 KiB/s) plus a fixed allowance per write.
MIN_SEND_RATE = 64 * 1024
SEND_TIMEOUT_BASE = 10.0
REQUEST_READ_SIZE = 64 * 1024
# Room for a chunk header in front of its body in the send buffer (they take ~12 bytes).
HEADER_ROOM = 64


@dataclass
class ServerStats:
    """Counters for tests and the operator (``blob serve --json`` prints them on exit)."""

    requests: Counter[str] = field(default_factory=Counter)
    bytes_sent: int = 0
    chunks_sent: int = 0
    busy_rejections: int = 0
    protocol_errors: int = 0


def error_frame(code: proto.ErrorCode, message: str) -> bytes:
    """An error reply outside the request state machine (refusals, protocol breaches)."""
    return proto.encode_response_header(
        proto.ErrorResponse(code, message[: proto.MAX_ERROR_MESSAGE // 4])
    )


class BlobServer:
    def __init__(
        self,
        store: Store,
        *,
        max_streams_per_peer: int = MAX_STREAMS_PER_PEER,
        verify_reads: bool = False,
    ) -> None:
        self.store = store
        # Every chunk was verified on its way into the store and is verified again by the
        # fetcher, who bans a peer that sends a bad one; hashing again here only guards
        # against our own disk, at the price of a second BLAKE3 pass per byte served.
        self.verify_reads = verify_reads
        self.max_streams_per_peer = max_streams_per_peer
        self.streams_per_peer: Counter[str] = Counter()
        self.stats = ServerStats()

    async def handle_stream(self, stream: Any) -> None:
        peer = str(stream.muxed_conn.peer_id)
        if self.streams_per_peer[peer] >= self.max_streams_per_peer:
            self.stats.busy_rejections += 1
            await self._refuse(stream, proto.ErrorCode.BUSY, "too many streams from your peer")
            return
        self.streams_per_peer[peer] += 1
        try:
            await self._serve(stream)
        except Exception:
            # py-libp2p treats an exception escaping a stream handler as fatal to the
            # whole swarm: one bad request or disk error must cost one stream, not the node.
            log.exception("unexpected error serving %s; stream reset", peer)
            await reset_quietly(stream)
        finally:
            self.streams_per_peer[peer] -= 1
            if self.streams_per_peer[peer] <= 0:
                del self.streams_per_peer[peer]

    async def _refuse(self, stream: Any, code: proto.ErrorCode, message: str) -> None:
        with trio.move_on_after(SEND_TIMEOUT_BASE):
            try:
                await write_all(stream, error_frame(code, message))
            except StreamLost:
                pass
        await reset_quietly(stream)

    async def _serve(self, stream: Any) -> None:
        conn = proto.ServerConnection()
        try:
            while True:
                request = await self._read_request(stream, conn)
                if request is None:
                    await close_quietly(stream)
                    return
                self.stats.requests[type(request).__name__] += 1
                await self._answer(stream, conn, request)
        except proto.RemoteProtocolError as exc:
            self.stats.protocol_errors += 1
            log.info("peer %s broke the protocol: %s", stream.muxed_conn.peer_id, exc)
            with trio.move_on_after(SEND_TIMEOUT_BASE):
                try:
                    await write_all(stream, error_frame(exc.code, str(exc)))
                except (StreamLost, proto.LocalProtocolError):
                    pass
            await reset_quietly(stream)
        except (StreamLost, trio.TooSlowError) as exc:
            log.debug("stream from %s ended: %r", stream.muxed_conn.peer_id, exc)
            await reset_quietly(stream)

    async def _read_request(
        self, stream: Any, conn: proto.ServerConnection
    ) -> proto.Request | None:
        request = conn.next_request()
        if request is not None:
            return request
        with trio.move_on_after(IDLE_TIMEOUT):
            data = await read_some(stream, REQUEST_READ_SIZE)
            conn.receive_data(data)
            if not data:
                return conn.next_request()
            with trio.fail_after(REQUEST_TIMEOUT):
                while (request := conn.next_request()) is None:
                    data = await read_some(stream, REQUEST_READ_SIZE)
                    conn.receive_data(data)
                    if not data:
                        return conn.next_request()
                return request
        return None  # idle: close

    async def _send(self, stream: Any, data: bytes | memoryview) -> None:
        with trio.fail_after(SEND_TIMEOUT_BASE + len(data) / MIN_SEND_RATE):
            await write_all(stream, data)

    async def _answer(
        self, stream: Any, conn: proto.ServerConnection, request: proto.Request
    ) -> None:
        try:
            if isinstance(request, proto.ManifestRequest):
                manifest = await trio.to_thread.run_sync(self.store.manifest, request.blob_id)
                await self._send(
                    stream, conn.send_response(proto.ManifestResponse(manifest.encode()))
                )
            elif isinstance(request, proto.HaveRequest):
                manifest, bitmap = await trio.to_thread.run_sync(self._have, request.blob_id)
                response = proto.HaveResponse(num_chunks=manifest.num_chunks, bitmap=bitmap)
                await self._send(stream, conn.send_response(response))
            else:
                await self._send_chunks(stream, conn, request)
        except (BlobNotFound, BadBlobId):
            error = proto.ErrorResponse(proto.ErrorCode.NOT_FOUND, "no such blob here")
            await self._send(stream, conn.send_response(error))
        except StoreError as exc:
            log.warning("store error while serving %s: %s", request, exc)
            error = proto.ErrorResponse(proto.ErrorCode.INTERNAL, "store error")
            await self._send(stream, conn.send_response(error))

    def _have(self, blob_id: str) -> tuple[Manifest, bytes]:
        return self.store.manifest(blob_id), self.store.chunk_bitmap(blob_id)

    async def _send_chunks(
        self, stream: Any, conn: proto.ServerConnection, request: proto.GetRequest
    ) -> None:
        manifest, bitmap = await trio.to_thread.run_sync(self._have, request.blob_id)
        n = manifest.num_chunks
        missing: list[int] = []
        # Our fast path seals the payload before write() returns, so one buffer serves
        # every chunk; py-libp2p's own stack gets a copy per chunk, as bytes.
        copy_out = fast_stream_of(stream) is None
        buf = memoryview(bytearray(HEADER_ROOM + min(manifest.chunk_size, manifest.size)))
        reader = await trio.to_thread.run_sync(self.store.open_reader, request.blob_id)
        try:
            for start, end in request.ranges:
                if end > n:
                    raise proto.RemoteProtocolError(
                        f"range [{start}, {end}) beyond the blob's {n} chunks",
                        code=proto.ErrorCode.BAD_REQUEST,
                    )
                for index in range(start, end):
                    if not bitmap[index // 8] >> (index % 8) & 1:
                        missing.append(index)
                        continue
                    length = manifest.chunk_span(index)[1]
                    body = buf[HEADER_ROOM : HEADER_ROOM + length]
                    try:
                        # Hashing again (verify_reads) is too slow for the event loop.
                        inline = not self.verify_reads and reader.read_into(
                            index, body, verify=False, cached_only=True
                        )
                        if not inline:
                            await trio.to_thread.run_sync(self._read_into, reader, index, body)
                    except ChunkUnavailable:
                        missing.append(index)
                        continue
                    header = conn.send_chunk_header(index, length)
                    frame = buf[HEADER_ROOM - len(header) : HEADER_ROOM + length]
                    frame[: len(header)] = header
                    await self._send(stream, bytes(frame) if copy_out else frame)
                    self.stats.chunks_sent += 1
                    self.stats.bytes_sent += length
        finally:
            reader.close()
        await self._send(stream, conn.send_response(proto.End(tuple(missing))))

    def _read_into(self, reader: ChunkReader, index: int, body: memoryview) -> None:
        reader.read_into(index, body, verify=self.verify_reads)
