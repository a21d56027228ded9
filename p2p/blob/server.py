"""Serving ``/blobnet/blob/1.0.0`` to ``/blobnet/blob/1.4.0``: manifests, bitmaps (with the
chunks being fetched, on 1.3.0, and how many others fetch the blob, on 1.4.0) and chunks of
complete and partial blobs, with every size, count, byte and wait bounded.

Theory of operation
1. One stream carries requests in sequence; the server answers each fully, in order,
   before it reads the next. On 1.0.0 a request sent before the previous response is
   complete is a violation; on 1.1.0 a client may pipeline up to
   ``proto.MAX_PIPELINED_REQUESTS`` (the sans-IO ``ServerConnection`` enforces both).
2. Budgets, each counted in all, per peer identity and per source address (identities are
   free, addresses are not): open streams (``MAX_STREAMS*``) and send-buffer bytes
   (``MAX_SEND_BYTES*``: each ``get`` holds one chunk-sized buffer while it is answered;
   each manifest or have response its frame). A stream over the stream budget gets one
   ``busy`` answer to its first request, then is closed; a request over the byte budget
   is answered ``busy`` before anything is read from disk, and the stream stays usable.
3. Waiting is bounded: an idle stream is closed after ``IDLE_TIMEOUT``; a request that
   has started must arrive whole within ``REQUEST_TIMEOUT``; every ``SEND_SLICE`` of a
   response must be written within ``SEND_TIMEOUT_BASE`` plus its size at
   ``MIN_SEND_RATE``, so a reader that stops reading loses its stream (and the buffer it
   pins) within seconds, not minutes.
4. A peer that breaks the protocol gets one error reply (where the framing still allows
   one): the server writes it, closes its side, waits up to ``RESET_GRACE`` for the peer to
   read it and close, then resets (an immediate reset lets go-yamux discard the frame). Its
   other streams are unaffected.
5. The store is asked at request time: a blob removed by ``blob rm``/``gc`` since the last
   request is ``not_found`` at once. Chunks of partial blobs are served only when verified.
6. Bit rot. The first time this process serves a chunk, it is read and hashed in a worker
   thread (BLAKE3 runs at ~3.4 GB/s here and releases the GIL, so the event loop keeps
   moving); later reads of it come from the page cache on the event loop, unhashed, or
   from disk in a thread, hashed. (The page cache alone is no proof: readahead fills it
   from disk unhashed.) ``verify_reads`` hashes every read. A chunk that fails is never
   sent: the request is answered ``internal``, the blob is quarantined (the store's
   ``quarantine`` when it has one, else this server's own list), one warning is logged,
   and every later request for it is ``not_found``.
7. Each body is read into one buffer per request, right behind its header, and written from
   there in slices (no copy per chunk on the fast path).
8. An upload limit (``upload_limit``, p2p.blob.pacing) paces chunks: each waits for its bytes'
   credit in one bucket that all streams share, before its send deadline starts.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.custom_types import TProtocol

import blobstore
from blobstore import (
    BadBlobId,
    BlobNotFound,
    ChunkReader,
    ChunkUnavailable,
    CorruptChunk,
    Manifest,
    Store,
    StoreError,
)
from p2p.blob import protocol as proto
from p2p.blob.pacing import Pacer
from p2p.blob.served import ServedLog
from p2p.blob.shell import StreamLost, close_quietly, read_some, reset_quietly, write_all
from p2p.blob.swarm import FELLOW_WINDOW, SwarmBook, fetching_board, listing
from p2p.transport.fast import fast_stream_of
from p2p.transport.host import remote_address_key

log = logging.getLogger(__name__)

# Store errors that mean "not here (any more)": answered `not_found`, so the client moves on.
# BlobQuarantined comes with the store's quarantine (issue 16, item 5).
_QUARANTINED = getattr(blobstore, "BlobQuarantined", None)
_NOT_HERE: tuple[type[Exception], ...] = (
    (BlobNotFound, BadBlobId, _QUARANTINED)
    if isinstance(_QUARANTINED, type)
    else (BlobNotFound, BadBlobId)
)

MiB = 1024 * 1024

# Parallel streams one peer may hold: the downloader opens a few per provider (DESIGN
# section 5); 16 leaves room for several concurrent downloads from one peer.
MAX_STREAMS_PER_PEER = 16
# ... from one source address, all identities together: a few local nodes or a NAT.
MAX_STREAMS_PER_IP = 128
# ... in all: tens of peers with a handful of streams each, well under the host's 4096.
MAX_STREAMS = 1024
# Send-buffer bytes held by requests being answered. A `get` holds one chunk-sized buffer
# (1 MiB by default, up to 16 MiB) until its response ends. Per peer: 4 requests at the
# largest chunk size, 64 at the default. Per address: two such peers. In all: a quarter
# of the 1 GiB a serving node may use (issue 16: 16 identities x 16 unread gets reached
# 4.2 GiB without these).
MAX_SEND_BYTES_PER_PEER = 64 * MiB
MAX_SEND_BYTES_PER_IP = 128 * MiB
MAX_SEND_BYTES = 256 * MiB
# A stream with no request for this long is closed; downloaders open streams on demand.
IDLE_TIMEOUT = 60.0
# Once a request's first byte arrives, the rest must follow quickly (slowloris).
REQUEST_TIMEOUT = 10.0
# Minimum rate a reader must sustain (bitswap uses 100 kbit/s; we ask for 64 KiB/s), plus
# a fixed allowance per write. Responses are written in slices so the deadline follows
# progress: a reader that stops reading is cut off within 10 s + 512 KiB / 64 KiB/s = 18 s
# (a whole 16 MiB chunk at that rate would have held its buffer for 266 s).
MIN_SEND_RATE = 64 * 1024
SEND_TIMEOUT_BASE = 10.0
SEND_SLICE = 512 * 1024
# After an error reply the server closes its side and waits this long for the peer to
# read it before resetting (a reset at once lets go-yamux drop the unread frame).
RESET_GRACE = 1.0
# A refused stream waits this long for its first request (to answer it `busy`)...
REFUSE_READ_TIMEOUT = 2.0
# ... and at most this many refusals wait at once; beyond, streams are reset unanswered.
MAX_REFUSING = 256
REQUEST_READ_SIZE = 64 * 1024
# Blobs whose verified-chunk bitmaps this server remembers (one bit per chunk: 128 KiB for a
# 1 TiB blob at 1 MiB chunks); past it the oldest is forgotten and its chunks hashed again.
MAX_VERIFIED_BLOBS = 1024
# A `peers` answer lists each fellow's addresses from the peerstore, and a swarm asks for
# them many times a second: each peer's are read (and turned into strings) at most this
# often, for at most this many peers (p2p.blob.swarm's MAX_SWARM_PEERS per blob, a few blobs).
ADDRS_CACHE_S = 2.0
MAX_ADDRS_CACHED = 4096
# Room for a chunk header in front of its body in the send buffer.
HEADER_ROOM = proto.CHUNK_HEADER_ROOM


class Budget:
    """One resource counted three ways: in all, per peer identity, per source address.
    Sans-IO bookkeeping; ``acquire`` says why it refuses, ``release`` gives back."""

    def __init__(self, name: str, total: int, per_peer: int, per_ip: int) -> None:
        self.name = name
        self.total = total
        self.per_peer = per_peer
        self.per_ip = per_ip
        self.used = 0
        self.by_peer: Counter[str] = Counter()
        self.by_ip: Counter[str] = Counter()

    def acquire(self, peer: str, ip: str, amount: int) -> str | None:
        """Take ``amount``; None on success, else the reason it does not fit."""
        if self.by_peer[peer] + amount > self.per_peer:
            return f"{self.name}: your peer holds {self.by_peer[peer]} of {self.per_peer}"
        if self.by_ip[ip] + amount > self.per_ip:
            return f"{self.name}: your address holds {self.by_ip[ip]} of {self.per_ip}"
        if self.used + amount > self.total:
            return f"{self.name}: the server is at its limit of {self.total}"
        self.used += amount
        self.by_peer[peer] += amount
        self.by_ip[ip] += amount
        return None

    def release(self, peer: str, ip: str, amount: int) -> None:
        self.used -= amount
        for counter, key in ((self.by_peer, peer), (self.by_ip, ip)):
            counter[key] -= amount
            if counter[key] <= 0:
                del counter[key]

    @contextmanager
    def hold(self, peer: str, ip: str, amount: int) -> Iterator[str | None]:
        """``acquire`` for a block: yields the refusal reason (None: held until exit)."""
        reason = self.acquire(peer, ip, amount)
        try:
            yield reason
        finally:
            if reason is None:
                self.release(peer, ip, amount)


class _Busy(Exception):
    """Internal: a request does not fit the send budget; answer `busy`."""


@dataclass
class ServerStats:
    """Counters for tests and the operator (``blob serve --json`` prints them on exit)."""

    requests: Counter[str] = field(default_factory=Counter)
    bytes_sent: int = 0
    chunks_sent: int = 0
    busy_rejections: int = 0
    # `try_get`s declined because others fetch the blob from us (1.5.0).
    tentative_declined: int = 0
    protocol_errors: int = 0
    quarantined: int = 0


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
        upload_limit: float | None = None,
    ) -> None:
        self.store = store
        # Bytes per second this server sends at most, over all streams (p2p.blob.pacing).
        self.pacer = None if upload_limit is None else Pacer(upload_limit, trio.current_time())
        # Chunks read from disk are always hashed (theory, rule 6); this hashes page-cache
        # reads as well, at the price of a BLAKE3 pass per byte served from memory.
        self.verify_reads = verify_reads
        self.max_streams_per_peer = max_streams_per_peer
        self.streams = Budget("streams", MAX_STREAMS, max_streams_per_peer, MAX_STREAMS_PER_IP)
        self.send_bytes = Budget(
            "send buffers", MAX_SEND_BYTES, MAX_SEND_BYTES_PER_PEER, MAX_SEND_BYTES_PER_IP
        )
        self.quarantined: set[str] = set()
        # Chunks hashed once by this process (theory, rule 6), by blob ID.
        self.verified: dict[str, bytearray] = {}
        self.refusing = 0
        self.stats = ServerStats()
        # Who asked for which blob lately (p2p.blob.swarm): answers 1.2.0's `peers`.
        self.swarm = SwarmBook()
        self._addrs_cache: dict[str, tuple[float, list[str]]] = {}
        self.host: Any = None
        # One log line per blob a peer fetched (p2p.blob.served), at INFO (-v).
        self.served = ServedLog()
        # Who may be served (p2p.node.admission.Gate: ``admitted(peer)`` and the refusal's
        # ``message``); None: everyone.
        self.gate: Any = None

    def install(self, host: Any) -> None:
        """Serve every protocol version (PROTOCOL.md section 1) on ``host``."""
        self.host = host
        for protocol_id in proto.SERVED_PROTOCOL_IDS:
            host.set_stream_handler(TProtocol(protocol_id), self.handle_stream)

    @property
    def streams_per_peer(self) -> Counter[str]:
        """Open blob streams by peer ID (empty when none is open)."""
        return self.streams.by_peer

    async def handle_stream(self, stream: Any) -> None:
        peer = str(stream.muxed_conn.peer_id)
        ip = remote_address_key(stream)
        max_pipelined = 1
        peer_exchange = status = fellows = tentative = False
        try:
            protocol_id = str(stream.get_protocol())
            if protocol_id in proto.SERVED_PROTOCOL_IDS and protocol_id != proto.PROTOCOL_ID:
                max_pipelined = proto.MAX_PIPELINED_REQUESTS
            peer_exchange = protocol_id == proto.PROTOCOL_ID_1_2
            status = protocol_id == proto.PROTOCOL_ID_1_3
            fellows = protocol_id == proto.PROTOCOL_ID_1_4
            tentative = protocol_id == proto.PROTOCOL_ID_1_5
        except Exception:
            pass
        reason = self.streams.acquire(peer, ip, 1)
        if reason is not None:
            self.stats.busy_rejections += 1
            await self._refuse(stream, reason)
            return
        self.served.begin(peer)
        try:
            if self.gate is not None and not self.gate.admitted(peer):
                # Within the stream budget: a flood of unadmitted streams is bounded too.
                await self._fail(stream, error_frame(proto.ErrorCode.NOT_FOUND, self.gate.message))
                return
            conn = proto.ServerConnection(
                max_pipelined=max_pipelined,
                peer_exchange=peer_exchange,
                status=status,
                fellows=fellows,
                tentative=tentative,
            )
            await self._serve(stream, conn)
        except Exception:
            # py-libp2p treats an exception escaping a stream handler as fatal to the
            # whole swarm: one bad request or disk error must cost one stream, not the node.
            log.exception("unexpected error serving %s; stream reset", peer)
            await reset_quietly(stream)
        finally:
            self.streams.release(peer, ip, 1)
            for line in self.served.end(peer):
                log.info("%s", line)

    async def _refuse(self, stream: Any, reason: str) -> None:
        """Answer a stream over the stream budget: its first request gets `busy`, then the
        stream ends (PROTOCOL.md 7.1 item 6 and 7.3: nothing is sent before a request)."""
        if self.refusing >= MAX_REFUSING:
            await reset_quietly(stream)
            return
        self.refusing += 1
        try:
            conn = proto.ServerConnection()
            request = None
            with trio.move_on_after(REFUSE_READ_TIMEOUT):
                try:
                    while (request := conn.next_request()) is None and not conn.eof_received:
                        conn.receive_data(await read_some(stream, REQUEST_READ_SIZE))
                except (StreamLost, proto.RemoteProtocolError):
                    request = None
            if request is None:
                await reset_quietly(stream)
                return
            busy = proto.ErrorResponse.truncated(proto.ErrorCode.BUSY, reason)
            await self._fail(stream, conn.send_response(busy))
        finally:
            self.refusing -= 1

    async def _fail(self, stream: Any, frame: bytes) -> None:
        """Write a last error frame, close our side, give the peer RESET_GRACE to read it
        and close, then reset (theory, rule 4)."""
        with trio.move_on_after(SEND_TIMEOUT_BASE):
            try:
                await write_all(stream, frame)
                await stream.close()
            except Exception:
                pass
        with trio.move_on_after(RESET_GRACE):
            try:
                while await read_some(stream, REQUEST_READ_SIZE):
                    pass  # discard: the peer has seen our error or will
            except Exception:
                pass
        await reset_quietly(stream)

    async def _serve(self, stream: Any, conn: proto.ServerConnection) -> None:
        peer = str(stream.muxed_conn.peer_id)
        ip = remote_address_key(stream)
        try:
            while True:
                request = await self._read_request(stream, conn)
                if request is None:
                    await close_quietly(stream)
                    return
                self.stats.requests[type(request).__name__] += 1
                self.swarm.seen(request.blob_id, peer, trio.current_time())
                if not isinstance(request, proto.PeersRequest | proto.ManifestRequest):
                    # Chunks wanted (p2p.blob.swarm rule 5); peer exchange asks every second
                    # for as long as a fetch runs, lingering included.
                    fetching_board(self.store).asked(request.blob_id, trio.current_time())
                await self._answer(stream, conn, request, peer, ip)
        except proto.RemoteProtocolError as exc:
            self.stats.protocol_errors += 1
            log.info("peer %s broke the protocol: %s", peer, exc)
            await self._fail(stream, error_frame(exc.code, str(exc)))
        except (StreamLost, trio.TooSlowError) as exc:
            # Idle, slow-reader and stalled-request cases send no frame (PROTOCOL.md 7.4).
            log.debug("stream from %s ended: %r", peer, exc)
            await reset_quietly(stream)

    async def _read_request(
        self, stream: Any, conn: proto.ServerConnection
    ) -> proto.Request | None:
        request = conn.next_request()
        if request is not None:
            return request
        if conn.eof_received:
            return None
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

    async def _send(self, stream: Any, data: bytes | memoryview, *, copy: bool = False) -> None:
        """Write ``data`` in slices, each within its own deadline (theory, rule 3);
        ``copy``: hand the stream a bytes copy of each slice (py-libp2p's own stack)."""
        view = memoryview(data)
        for offset in range(0, len(view), SEND_SLICE):
            piece = view[offset : offset + SEND_SLICE]
            with trio.fail_after(SEND_TIMEOUT_BASE + len(piece) / MIN_SEND_RATE):
                await write_all(stream, bytes(piece) if copy else piece)

    async def _send_held(
        self,
        stream: Any,
        conn: proto.ServerConnection,
        response: proto.ManifestResponse | proto.HaveResponse | proto.StatusResponse,
        payload: int,
        peer: str,
        ip: str,
    ) -> None:
        """Send a whole-frame response (manifest, have) within the send budget. Frames up to
        MAX_HEADER_SIZE are not counted: the stream budget bounds them."""
        size = payload + HEADER_ROOM if payload > proto.MAX_HEADER_SIZE else 0
        with self.send_bytes.hold(peer, ip, size) as refused:
            if refused is not None:
                raise _Busy(refused)
            await self._send(stream, conn.send_response(response))

    def _check_present(self, blob_id: str) -> None:
        """Raise BlobNotFound unless the blob (complete or partial) is in the store now:
        ``blob rm`` or ``gc`` in another process may have removed it since the last ask,
        and a quarantined blob is held but not offered."""
        if blob_id in self.quarantined:
            raise BlobNotFound(f"blob {blob_id} is quarantined here")
        self.store.resolve(blob_id)
        if self.store.has(blob_id):
            return
        reason = getattr(self.store, "quarantine_reason", None)
        if reason is not None and reason(blob_id) is not None:
            raise BlobNotFound(f"blob {blob_id} is quarantined here")

    def _manifest(self, blob_id: str) -> Manifest:
        self._check_present(blob_id)
        return self.store.manifest(blob_id)

    async def _answer(
        self,
        stream: Any,
        conn: proto.ServerConnection,
        request: proto.Request,
        peer: str,
        ip: str,
    ) -> None:
        try:
            if isinstance(request, proto.ManifestRequest):
                manifest = await trio.to_thread.run_sync(self._manifest, request.blob_id)
                encoded = manifest.encode()
                response: proto.ManifestResponse | proto.HaveResponse
                response = proto.ManifestResponse(encoded)
                await self._send_held(stream, conn, response, len(encoded), peer, ip)
            elif isinstance(request, proto.HaveRequest):
                manifest, bitmap = await trio.to_thread.run_sync(self._have, request.blob_id)
                response = proto.HaveResponse(num_chunks=manifest.num_chunks, bitmap=bitmap)
                await self._send_held(stream, conn, response, len(bitmap), peer, ip)
            elif isinstance(request, proto.StatusRequest):
                manifest, bitmap = await trio.to_thread.run_sync(self._have, request.blob_id)
                n = manifest.num_chunks
                soon = fetching_board(self.store).soon(request.blob_id, n, bitmap)
                count = self._fellows(request.blob_id, peer) if conn.counts_fellows else None
                status = proto.StatusResponse(num_chunks=n, bitmap=bitmap, soon=soon, fellows=count)
                await self._send_held(stream, conn, status, 2 * len(bitmap), peer, ip)
            elif isinstance(request, proto.PeersRequest):
                await trio.to_thread.run_sync(self._check_present, request.blob_id)
                listed = listing(
                    self.swarm, request.blob_id, peer, trio.current_time(), self._addrs_of
                )
                await self._send(stream, conn.send_response(proto.PeersResponse(listed)))
            elif request.tentative and self._fellows(request.blob_id, peer):
                # A `try_get` while others fetch this blob from us (1.5.0): declined, so
                # that N fetchers' first chunks, each asked with its manifest, do not
                # cross our uplink N times; each fetcher takes it as the swarm shares.
                self.stats.tentative_declined += 1
                await self._send(stream, conn.send_response(proto.End(conn.unsent_indices())))
            else:
                await self._send_chunks(stream, conn, request, peer, ip)
        except _Busy as exc:
            self.stats.busy_rejections += 1
            await self._error(stream, conn, proto.ErrorCode.BUSY, str(exc))
        except _NOT_HERE:
            await self._error(stream, conn, proto.ErrorCode.NOT_FOUND, "no such blob here")
        except CorruptChunk as exc:
            self._quarantine(request.blob_id, str(exc))
            await self._error(stream, conn, proto.ErrorCode.INTERNAL, "chunk damaged on disk")
        except StoreError as exc:
            log.warning("store error while serving %s: %s", request, exc)
            await self._error(stream, conn, proto.ErrorCode.INTERNAL, "store error")

    def _fellows(self, blob_id: str, peer: str) -> int:
        """How many peers besides ``peer`` asked us about ``blob_id`` lately and are
        connected now (1.4.0's `status` count, PROTOCOL.md section 5.5)."""
        count = self.swarm.fellows(
            blob_id, trio.current_time(), peer, FELLOW_WINDOW, self._connected
        )
        return min(proto.MAX_FELLOWS_COUNTED, count)

    async def _error(
        self, stream: Any, conn: proto.ServerConnection, code: proto.ErrorCode, message: str
    ) -> None:
        if conn.current_request is None:
            # The response was complete (manifest or have sent) when the error came;
            # nothing more may be said about this request.
            return
        await self._send(stream, conn.send_response(proto.ErrorResponse.truncated(code, message)))

    def _quarantine(self, blob_id: str, why: str) -> None:
        """Stop serving a blob found rotten. The store's quarantine (when it has one) takes
        it out of the published set until a put or fetch repairs it; a store without one
        gets this process's own list, which lasts until the server restarts."""
        if blob_id in self.quarantined:
            return
        self.verified.pop(blob_id, None)
        self.stats.quarantined += 1
        quarantine = getattr(self.store, "quarantine", None)
        if quarantine is None:
            self.quarantined.add(blob_id)
            where = "refused by this server until it restarts"
        else:
            try:
                quarantine(blob_id, f"found by blob serve: {why}")
                where = "moved aside in the store until it is fetched or put again"
            except Exception as exc:  # still refused here, whatever the store says
                self.quarantined.add(blob_id)
                where = f"refused by this server (the store could not quarantine it: {exc})"
        log.warning("blob %s is damaged on disk and no longer served (%s); %s", blob_id, why, where)

    def _addrs_of(self, peer: str) -> list[str]:
        """``peer``'s addresses in the host's peerstore (identify's listen addresses), read
        again at most every ADDRS_CACHE_S."""
        now = trio.current_time()
        cached = self._addrs_cache.get(peer)
        if cached is not None and now < cached[0]:
            return cached[1]
        addrs = self._read_addrs(peer)
        if len(self._addrs_cache) >= MAX_ADDRS_CACHED:
            self._addrs_cache.clear()
        self._addrs_cache[peer] = (now + ADDRS_CACHE_S, addrs)
        return addrs

    def _connected(self, peer: str) -> bool:
        """Whether ``peer`` has a connection to this node now (True without a host)."""
        if self.host is None:
            return True
        try:
            from libp2p.peer.id import ID

            return bool(self.host.get_network().get_connections(ID.from_base58(peer)))
        except Exception:  # a malformed peer ID: not anyone connected
            return False

    def _read_addrs(self, peer: str) -> list[str]:
        if self.host is None:
            return []
        try:
            from libp2p.peer.id import ID

            return [str(a) for a in self.host.get_peerstore().addrs(ID.from_base58(peer))]
        except Exception:  # unknown peer, or one the peerstore dropped
            return []

    def _have(self, blob_id: str) -> tuple[Manifest, bytes]:
        manifest = self._manifest(blob_id)
        return manifest, self.store.chunk_bitmap(blob_id)

    async def _send_chunks(
        self,
        stream: Any,
        conn: proto.ServerConnection,
        request: proto.GetRequest,
        peer: str,
        ip: str,
    ) -> None:
        manifest, bitmap = await trio.to_thread.run_sync(self._have, request.blob_id)
        n = manifest.num_chunks
        for start, end in request.ranges:
            if end > n:
                raise proto.RemoteProtocolError(
                    f"range [{start}, {end}) beyond the blob's {n} chunks",
                    code=proto.ErrorCode.BAD_REQUEST,
                )
        size = HEADER_ROOM + min(manifest.chunk_size, manifest.size)
        with self.send_bytes.hold(peer, ip, size) as refused:
            if refused is not None:
                raise _Busy(refused)
            await self._send_held_chunks(stream, conn, request, manifest, bitmap, size)

    async def _send_held_chunks(
        self,
        stream: Any,
        conn: proto.ServerConnection,
        request: proto.GetRequest,
        manifest: Manifest,
        bitmap: bytes,
        size: int,
    ) -> None:
        missing: list[int] = []
        peer = str(stream.muxed_conn.peer_id)
        verified = self._verified_bits(request.blob_id, manifest.num_chunks)
        # Our fast path seals the payload before write() returns, so one buffer serves
        # every chunk; py-libp2p's own stack gets a copy per slice, as bytes.
        copy_out = fast_stream_of(stream) is None
        buf = memoryview(bytearray(size))
        reader = await trio.to_thread.run_sync(self.store.open_reader, request.blob_id)
        try:
            for start, end in request.ranges:
                for index in range(start, end):
                    if not bitmap[index // 8] >> (index % 8) & 1:
                        missing.append(index)
                        continue
                    length = manifest.chunk_span(index)[1]
                    body = buf[HEADER_ROOM : HEADER_ROOM + length]
                    try:
                        # Page-cache reads of chunks hashed before stay on the event loop;
                        # every other read goes to a thread and is hashed there.
                        trusted = not self.verify_reads and verified[index // 8] >> (index % 8) & 1
                        inline = trusted and reader.read_into(
                            index, body, verify=False, cached_only=True
                        )
                        if not inline:
                            await trio.to_thread.run_sync(self._read_into, reader, index, body)
                            verified[index // 8] |= 1 << (index % 8)
                    except ChunkUnavailable:
                        missing.append(index)
                        continue
                    header = conn.send_chunk_header(index, length)
                    frame = buf[HEADER_ROOM - len(header) : HEADER_ROOM + length]
                    frame[: len(header)] = header
                    if self.pacer is not None:
                        await trio.sleep(self.pacer.delay(len(frame), trio.current_time()))
                    await self._send(stream, frame, copy=copy_out)
                    self.stats.chunks_sent += 1
                    self.stats.bytes_sent += length
                    self.served.sent(peer, request.blob_id, length, trio.current_time())
        finally:
            reader.close()
        await self._send(stream, conn.send_response(proto.End(tuple(missing))))

    def _verified_bits(self, blob_id: str, num_chunks: int) -> bytearray:
        bits = self.verified.pop(blob_id, None)
        if bits is None or len(bits) != (num_chunks + 7) // 8:
            bits = bytearray((num_chunks + 7) // 8)
        self.verified[blob_id] = bits  # most recently used last
        while len(self.verified) > MAX_VERIFIED_BLOBS:
            del self.verified[next(iter(self.verified))]
        return bits

    def _read_into(self, reader: ChunkReader, index: int, body: memoryview) -> None:
        reader.read_into(index, body, verify=True)
