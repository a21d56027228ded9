"""Serving ``/blobnet/blob/1.0.0`` to ``/blobnet/blob/1.4.0``: manifests, bitmaps (with the
chunks being fetched, on 1.3.0, and how many others fetch the blob, on 1.4.0) and chunks of
complete and partial blobs, with every size, count, byte and wait bounded.

Theory of operation
1. One stream carries requests in sequence; the server answers each fully, in order,
   before it reads the next. On 1.0.0 a request sent before the previous response is
   complete is a violation; on 1.1.0 a client may pipeline up to
   ``messages.MAX_PIPELINED_REQUESTS`` (the sans-IO ``ServerConnection`` enforces both).
2. Budgets, each counted in all, per peer identity and per source address (identities are
   free, addresses are not): open streams (``ServerLimits.max_streams*``) and send-buffer
   bytes (``max_send_bytes*``: each ``get`` holds one chunk-sized buffer plus
   ``HEADER_ROOM`` while it is answered; each manifest or have response its frame). A
   stream over the stream budget gets one ``busy`` answer to its first request, then is
   closed; a request over the byte budget is answered ``busy`` before anything is read
   from disk, and the stream stays usable.
9. Room for newcomers. The last ``reserved_streams`` streams and ``reserved_send_bytes``
   bytes of each budget go only to a peer that holds little (under the ``light_*`` bounds,
   as an identity and as an address), so greedy peers filling the budget leave room for a
   new one. The send reserve asks for little of both budgets: a peer whose streams are
   many holds little send buffer only until its requests are answered (unread `get`s
   each pin a chunk), so it does not count as light for it. When even the reserve is
   full, a light peer's new stream evicts the stream idle longest (waiting for its next
   request) of the source address holding the most streams, if that address holds more
   than the newcomer's (else of the identity holding the most, if it holds more than the
   newcomer); a stream in the middle of a request or response is never evicted (its own
   deadlines bound it).
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
   thread: one of the server's own ``disk_threads``, as every read of the store is, so no
   other thread pool of the process can make them wait (BLAKE3 runs at 0.6 to 2.6 GiB/s a
   core here and releases the GIL, so the event loop keeps moving). Later reads of it come
   from the page cache on the event loop, unhashed, or from disk in a thread, hashed. (The
   page cache alone is no proof: readahead fills it from disk unhashed.) ``verify_reads``
   hashes every read. A chunk that fails is never sent: the request is answered
   ``internal``, the blob is quarantined (the store's ``quarantine`` when it has one, else
   this server's own list), one warning is logged, and every later request for it is
   ``not_found``. A stream its peer ends (resets or closes) soon after chunks went out, as
   a fetcher that found one bad does, gets its last chunks hashed again, within a byte
   budget (p2p.blob.recheck), and a failure there quarantines too.
7. Each body is read into one buffer per request, right behind its header, and written from
   there in slices (no copy per chunk on the fast path).
8. An upload limit (``upload_limit``, p2p.blob.pacing) paces chunks: each waits for its bytes'
   credit in one bucket that all streams share, before its send deadline starts.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

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
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.pacing import Pacer
from p2p.blob.recheck import Rechecks, Sent
from p2p.blob.served import ServedLog
from p2p.blob.shell import StreamLost, close_quietly, read_some, reset_quietly, write_all
from p2p.blob.swarm import FELLOW_WINDOW, FetchingBoard, SwarmBook, listing
from p2p.transport.fast import fast_stream_of
from p2p.transport.host import remote_address_key

log = logging.getLogger(__name__)
T = TypeVar("T")

# Store errors that mean "not here (any more)": answered `not_found`, so the client moves on.
# BlobQuarantined: a blob the store quarantined after it failed a re-hash.
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
# Room for a chunk header in front of its body in the send buffer; a `get` is charged its
# chunk size plus this.
HEADER_ROOM = messages.CHUNK_HEADER_ROOM
# Send-buffer bytes held by requests being answered. A `get` holds one chunk-sized buffer
# (1 MiB by default, up to 16 MiB) plus HEADER_ROOM until its response ends. Per peer: 4
# requests at the largest chunk size (64 MiB + 4 x 64 B), 63 at the default. Per address:
# two such peers. In all: a quarter of the 1 GiB a serving node may use (16 identities x 16
# unread gets reach 4.2 GiB without these).
MAX_SEND_BYTES_PER_PEER = 4 * (messages.MAX_CHUNK_SIZE + HEADER_ROOM)
MAX_SEND_BYTES_PER_IP = 2 * MAX_SEND_BYTES_PER_PEER
MAX_SEND_BYTES = 2 * MAX_SEND_BYTES_PER_IP
# Kept for peers holding little (theory, rule 9): a fetch's control stream and 8 lanes,
# many times over, and 4 such fetches' worth of 1 MiB-chunk buffers.
RESERVED_STREAMS = 128
RESERVED_SEND_BYTES = 64 * MiB
# "Holding little": at most a whole fetch's streams (a control stream and 8 lanes, and one
# more) as an identity, two fetches' as an address; and two 16 MiB `get`s in flight (a
# fetch's 8 lanes with a few 1 MiB requests each) per identity, two such per address.
LIGHT_PEER_STREAMS = 10
LIGHT_IP_STREAMS = 20
LIGHT_PEER_SEND_BYTES = 2 * (messages.MAX_CHUNK_SIZE + HEADER_ROOM)
LIGHT_IP_SEND_BYTES = 2 * LIGHT_PEER_SEND_BYTES
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
# Worker threads that read the store for peers (manifests, bitmaps, chunks, re-checks): a
# limiter of the server's own, so reads of the store never queue behind other threads of
# the process (trio's default 40, which a daemon's puts of users' files or a hung mount
# could fill). 16 keeps a disk's queue deep and every core hashing; more only queue.
DISK_THREADS = 16
# A `peers` answer lists each fellow's addresses from the peerstore, and a swarm asks for
# them many times a second: each peer's are read (and turned into strings) at most this
# often, for at most this many peers (p2p.blob.swarm's MAX_SWARM_PEERS per blob, a few blobs).
ADDRS_CACHE_S = 2.0
MAX_ADDRS_CACHED = 4096


@dataclass(frozen=True)
class ServerLimits:
    """Every bound and wait of the server (the constants above say why each value). A node
    hands one in through its config; a test builds the one it needs with ``with_``."""

    max_streams_per_peer: int = MAX_STREAMS_PER_PEER
    max_streams_per_ip: int = MAX_STREAMS_PER_IP
    max_streams: int = MAX_STREAMS
    reserved_streams: int = RESERVED_STREAMS
    light_peer_streams: int = LIGHT_PEER_STREAMS
    light_ip_streams: int = LIGHT_IP_STREAMS
    max_send_bytes_per_peer: int = MAX_SEND_BYTES_PER_PEER
    max_send_bytes_per_ip: int = MAX_SEND_BYTES_PER_IP
    max_send_bytes: int = MAX_SEND_BYTES
    reserved_send_bytes: int = RESERVED_SEND_BYTES
    light_peer_send_bytes: int = LIGHT_PEER_SEND_BYTES
    light_ip_send_bytes: int = LIGHT_IP_SEND_BYTES
    idle_timeout: float = IDLE_TIMEOUT
    request_timeout: float = REQUEST_TIMEOUT
    min_send_rate: float = MIN_SEND_RATE
    send_timeout_base: float = SEND_TIMEOUT_BASE
    send_slice: int = SEND_SLICE
    reset_grace: float = RESET_GRACE
    refuse_read_timeout: float = REFUSE_READ_TIMEOUT
    max_refusing: int = MAX_REFUSING
    request_read_size: int = REQUEST_READ_SIZE
    max_verified_blobs: int = MAX_VERIFIED_BLOBS
    addrs_cache_s: float = ADDRS_CACHE_S
    max_addrs_cached: int = MAX_ADDRS_CACHED
    disk_threads: int = DISK_THREADS

    def with_(self, **changes: Any) -> ServerLimits:
        """A copy with ``changes`` (field names as above)."""
        return replace(self, **changes)


class Budget:
    """One resource counted three ways: in all, per peer identity, per source address.
    Sans-IO bookkeeping; ``acquire`` says why it refuses, ``release`` gives back."""

    def __init__(
        self,
        name: str,
        total: int,
        per_peer: int,
        per_ip: int,
        *,
        reserved: int = 0,
        light_peer: int = 0,
        light_ip: int = 0,
    ) -> None:
        self.name = name
        self.total = total
        self.per_peer = per_peer
        self.per_ip = per_ip
        # The last ``reserved`` units go only to a peer holding under ``light_peer`` with
        # its address under ``light_ip`` (theory, rule 9).
        self.reserved = reserved
        self.light_peer = light_peer
        self.light_ip = light_ip
        self.used = 0
        self.by_peer: Counter[str] = Counter()
        self.by_ip: Counter[str] = Counter()

    def acquire(self, peer: str, ip: str, amount: int, *, heavy: str = "") -> str | None:
        """Take ``amount``; None on success, else the reason it does not fit. ``heavy``:
        what else the peer holds too much of (another budget's `heaviness`), which keeps it
        out of the reserve however little it holds here."""
        if self.by_peer[peer] + amount > self.per_peer:
            return f"{self.name}: your peer holds {self.by_peer[peer]} of {self.per_peer}"
        if self.by_ip[ip] + amount > self.per_ip:
            return f"{self.name}: your address holds {self.by_ip[ip]} of {self.per_ip}"
        if self.used + amount > self.total:
            return f"{self.name}: the server is at its limit of {self.total}"
        if self.used + amount > self.total - self.reserved and (
            heavy or not self.light(peer, ip, amount)
        ):
            return (
                f"{self.name}: the server keeps its last {self.reserved} for peers holding "
                f"less than {self.light_peer} (your peer holds {self.by_peer[peer]}, "
                f"your address {self.by_ip[ip]}{'; ' + heavy if heavy else ''})"
            )
        self.used += amount
        self.by_peer[peer] += amount
        self.by_ip[ip] += amount
        return None

    def light(self, peer: str, ip: str, amount: int = 1) -> bool:
        """Whether ``peer`` at ``ip`` holds little enough to use the reserve."""
        return (
            self.by_peer[peer] + amount <= self.light_peer
            and self.by_ip[ip] + amount <= self.light_ip
        )

    def heaviness(self, peer: str, ip: str) -> str:
        """What ``peer`` at ``ip`` holds beyond the light bounds here ("" if nothing)."""
        if self.by_peer[peer] > self.light_peer:
            return f"your peer holds {self.by_peer[peer]} {self.name}"
        if self.by_ip[ip] > self.light_ip:
            return f"your address holds {self.by_ip[ip]} {self.name}"
        return ""

    def release(self, peer: str, ip: str, amount: int) -> None:
        self.used -= amount
        for counter, key in ((self.by_peer, peer), (self.by_ip, ip)):
            counter[key] -= amount
            if counter[key] <= 0:
                del counter[key]

    @contextmanager
    def hold(self, peer: str, ip: str, amount: int, *, heavy: str = "") -> Iterator[str | None]:
        """``acquire`` for a block: yields the refusal reason (None: held until exit)."""
        reason = self.acquire(peer, ip, amount, heavy=heavy)
        try:
            yield reason
        finally:
            if reason is None:
                self.release(peer, ip, amount)


@dataclass
class StreamSlot:
    """One open stream's place in the stream budget."""

    peer: str
    ip: str
    held: bool = True


@dataclass
class _Waiting:
    slot: StreamSlot
    since: float
    evict: Callable[[], None]


class IdleStreams:
    """Streams waiting for their next request, and which one a newcomer may evict (theory,
    rule 9). Sans-IO: the caller passes the time and the holdings, and runs the eviction."""

    def __init__(self) -> None:
        self.waiting: dict[int, _Waiting] = {}
        # The same streams by source address and by identity: a newcomer's eviction looks
        # only at the holders with idle streams (scanning every waiting stream for every
        # holder cost a seeder shared by a thousand simulated fetchers ~12 ms a newcomer).
        self._by_ip: dict[str, dict[int, _Waiting]] = {}
        self._by_peer: dict[str, dict[int, _Waiting]] = {}

    def wait(self, slot: StreamSlot, now: float, evict: Callable[[], None]) -> None:
        self.working(slot)
        entry = self.waiting[id(slot)] = _Waiting(slot, now, evict)
        self._by_ip.setdefault(slot.ip, {})[id(slot)] = entry
        self._by_peer.setdefault(slot.peer, {})[id(slot)] = entry

    def working(self, slot: StreamSlot) -> None:
        entry = self.waiting.pop(id(slot), None)
        if entry is not None:
            self._unindex(id(slot), entry)

    def _unindex(self, key: int, entry: _Waiting) -> None:
        for index, holder in ((self._by_ip, entry.slot.ip), (self._by_peer, entry.slot.peer)):
            streams = index.get(holder)
            if streams is not None:
                streams.pop(key, None)
                if not streams:
                    del index[holder]

    def victim(
        self, by_ip: Counter[str], by_peer: Counter[str], ip: str, peer: str
    ) -> _Waiting | None:
        """The stream idle longest of the source address holding the most streams, among
        addresses holding more than ``ip`` will once served; failing that, of the identity
        holding the most, among those holding more than ``peer`` will (of equal holders, the
        one ``holdings`` lists first). None if there is none; the victim is no longer
        listed as waiting."""
        for holdings, mine, index in ((by_ip, ip, self._by_ip), (by_peer, peer, self._by_peer)):
            floor = holdings[mine] + 1
            holders = [key for key in holdings if key in index and holdings[key] > floor]
            if holders:
                streams = index[max(holders, key=holdings.__getitem__)]
                _, key = min((w.since, k) for k, w in streams.items())
                entry = self.waiting.pop(key)
                self._unindex(key, entry)
                return entry
        return None


class ServingBudgets:
    """Rules 2 and 9 in one part, sans-IO: the stream budget, the send-buffer budget and the
    idle streams a light newcomer may evict, built from one :class:`ServerLimits`."""

    def __init__(self, limits: ServerLimits) -> None:
        self.streams = Budget(
            "streams",
            limits.max_streams,
            limits.max_streams_per_peer,
            limits.max_streams_per_ip,
            reserved=limits.reserved_streams,
            light_peer=limits.light_peer_streams,
            light_ip=limits.light_ip_streams,
        )
        self.send_bytes = Budget(
            "send buffers",
            limits.max_send_bytes,
            limits.max_send_bytes_per_peer,
            limits.max_send_bytes_per_ip,
            reserved=limits.reserved_send_bytes,
            light_peer=limits.light_peer_send_bytes,
            light_ip=limits.light_ip_send_bytes,
        )
        self.idle = IdleStreams()

    def admit(self, peer: str, ip: str, evict: Callable[[_Waiting], None]) -> str | None:
        """Take a stream for ``peer`` at ``ip``: None when it is held, else why not. A light
        peer refused for want of room gets the slot of the stream idle longest of the
        heaviest holder (rule 9), which ``evict`` ends (it must release that slot)."""
        reason = self.streams.acquire(peer, ip, 1)
        if reason is not None and self.streams.light(peer, ip):
            victim = self.idle.victim(self.streams.by_ip, self.streams.by_peer, ip, peer)
            if victim is not None:
                evict(victim)
                reason = self.streams.acquire(peer, ip, 1)
        return reason

    def hold_send(self, peer: str, ip: str, size: int) -> AbstractContextManager[str | None]:
        """``send_bytes.hold``, with the send reserve kept from peers holding many streams
        (rule 9)."""
        return self.send_bytes.hold(peer, ip, size, heavy=self.streams.heaviness(peer, ip))


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
    # Chunks hashed again after their stream's peer reset it (p2p.blob.recheck).
    rechecked: int = 0


def error_frame(code: messages.ErrorCode, message: str) -> bytes:
    """An error reply outside the request state machine (refusals, protocol breaches)."""
    return messages.encode_response_header(
        messages.ErrorResponse(code, message[: messages.MAX_ERROR_MESSAGE // 4])
    )


class BlobServer:
    def __init__(
        self,
        store: Store,
        *,
        limits: ServerLimits | None = None,
        board: FetchingBoard | None = None,
        verify_reads: bool = False,
        upload_limit: float | None = None,
    ) -> None:
        self.store = store
        # What this node's downloads have in flight (the node owns it and hands it to
        # them; a server alone has a board of its own that nothing posts on).
        self.board = board if board is not None else FetchingBoard()
        self.limits = limits = limits if limits is not None else ServerLimits()
        # Bytes per second this server sends at most, over all streams (p2p.blob.pacing).
        self.pacer = None if upload_limit is None else Pacer(upload_limit, trio.current_time())
        # Chunks read from disk are always hashed (theory, rule 6); this hashes page-cache
        # reads as well, at the price of a BLAKE3 pass per byte served from memory.
        self.verify_reads = verify_reads
        # Rules 2 and 9: the stream and send-buffer budgets, and the idle streams a newcomer
        # may evict (a part of its own, which bench/sim drives in simulated time).
        self.budgets = ServingBudgets(limits)
        self.streams = self.budgets.streams
        self.send_bytes = self.budgets.send_bytes
        self.idle = self.budgets.idle
        # The threads this server reads the store in (DISK_THREADS says why its own).
        self.disk = trio.CapacityLimiter(limits.disk_threads)
        self.evicted = 0
        self.quarantined: set[str] = set()
        # Chunks hashed once by this process (theory, rule 6), by blob ID.
        self.verified: dict[str, bytearray] = {}
        # Which chunks to hash again when a peer resets a stream (theory, rule 6), and
        # the last chunks each open stream sent, by id of the stream.
        self.rechecks = Rechecks()
        self._sent: dict[int, deque[Sent]] = {}
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
        for protocol_id in messages.SERVED_PROTOCOL_IDS:
            host.set_stream_handler(TProtocol(protocol_id), self.handle_stream)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in one of this server's disk threads."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.disk)

    @property
    def streams_per_peer(self) -> Counter[str]:
        """Open blob streams by peer ID (empty when none is open)."""
        return self.streams.by_peer

    async def handle_stream(self, stream: Any) -> None:
        peer = str(stream.muxed_conn.peer_id)
        ip = remote_address_key(stream)
        version = messages.Version.V1_0
        try:
            version = messages.Version.of(str(stream.get_protocol())) or version
        except Exception:
            pass
        reason = self.budgets.admit(peer, ip, self._evict)
        if reason is not None:
            self.stats.busy_rejections += 1
            await self._refuse(stream, reason)
            return
        slot = StreamSlot(peer, ip)
        self.served.begin(peer)
        try:
            if self.gate is not None and not self.gate.admitted(peer):
                # Within the stream budget: a flood of unadmitted streams is bounded too.
                await self._fail(
                    stream, error_frame(messages.ErrorCode.NOT_FOUND, self.gate.message)
                )
                return
            conn = proto.ServerConnection(version)
            await self._serve(stream, conn, slot)
        except Exception:
            # py-libp2p treats an exception escaping a stream handler as fatal to the
            # whole swarm: one bad request or disk error must cost one stream, not the node.
            log.exception("unexpected error serving %s; stream reset", peer)
            await reset_quietly(stream)
        finally:
            self.idle.working(slot)
            self._release(slot)
            for line in self.served.end(peer):
                log.info("%s", line)

    def _release(self, slot: StreamSlot) -> None:
        if slot.held:
            slot.held = False
            self.streams.release(slot.peer, slot.ip, 1)

    def _evict(self, victim: _Waiting) -> None:
        """End an idle stream now to make room (theory, rule 9): its slot is free at once,
        and its wait for a request ends as an idle stream's does (a clean close)."""
        self.evicted += 1
        self._release(victim.slot)
        victim.evict()

    async def _refuse(self, stream: Any, reason: str) -> None:
        """Answer a stream over the stream budget: its first request gets `busy`, then the
        stream ends (PROTOCOL.md 7.1 item 6 and 7.3: nothing is sent before a request)."""
        if self.refusing >= self.limits.max_refusing:
            await reset_quietly(stream)
            return
        self.refusing += 1
        try:
            conn = proto.ServerConnection()
            request = None
            with trio.move_on_after(self.limits.refuse_read_timeout):
                try:
                    while (request := conn.next_request()) is None and not conn.eof_received:
                        conn.receive_data(await read_some(stream, self.limits.request_read_size))
                except (StreamLost, messages.RemoteProtocolError):
                    request = None
            if request is None:
                await reset_quietly(stream)
                return
            busy = messages.ErrorResponse.truncated(messages.ErrorCode.BUSY, reason)
            await self._fail(stream, conn.send_response(busy))
        finally:
            self.refusing -= 1

    async def _fail(self, stream: Any, frame: bytes) -> None:
        """Write a last error frame, close our side, give the peer RESET_GRACE to read it
        and close, then reset (theory, rule 4)."""
        with trio.move_on_after(self.limits.send_timeout_base):
            try:
                await write_all(stream, frame)
                await stream.close()
            except Exception:
                pass
        with trio.move_on_after(self.limits.reset_grace):
            try:
                while await read_some(stream, self.limits.request_read_size):
                    pass  # discard: the peer has seen our error or will
            except Exception:
                pass
        await reset_quietly(stream)

    async def _serve(self, stream: Any, conn: proto.ServerConnection, slot: StreamSlot) -> None:
        peer, ip = slot.peer, slot.ip
        sent = self._sent[id(stream)] = deque(maxlen=self.rechecks.per_stream)
        try:
            while True:
                request = await self._read_request(stream, conn, slot)
                if request is None:
                    await close_quietly(stream)
                    if conn.eof_received:
                        await self._recheck(sent, peer)
                    return
                self.stats.requests[type(request).__name__] += 1
                self.swarm.seen(request.blob_id, peer, trio.current_time())
                if not isinstance(request, messages.PeersRequest | messages.ManifestRequest):
                    # Chunks wanted (p2p.blob.swarm rule 5); peer exchange asks every second
                    # for as long as a fetch runs, lingering included.
                    self.board.asked(request.blob_id, trio.current_time())
                await self._answer(stream, conn, request, peer, ip)
        except messages.RemoteProtocolError as exc:
            self.stats.protocol_errors += 1
            log.info("peer %s broke the protocol: %s", peer, exc)
            await self._fail(stream, error_frame(exc.code, str(exc)))
        except (StreamLost, trio.TooSlowError) as exc:
            # Idle, slow-reader and stalled-request cases send no frame (PROTOCOL.md 7.4).
            log.debug("stream from %s ended: %r", peer, exc)
            await reset_quietly(stream)
            if isinstance(exc, StreamLost) and sent:
                await self._recheck(sent, peer)
        finally:
            del self._sent[id(stream)]

    async def _recheck(self, sent: deque[Sent], peer: str) -> None:
        """Hash again the chunks ``peer`` may have dropped the stream over (theory, rule 6;
        p2p.blob.recheck decides which, within its byte budget). Called whether the peer
        closed or reset the stream: py-libp2p's yamux reports some resets as a close."""
        for chunk in self.rechecks.due(sent, trio.current_time()):
            if chunk.blob_id in self.quarantined:
                continue
            self.stats.rechecked += 1
            try:
                await self._in_thread(self._reverify, chunk)
            except _NOT_HERE:  # removed or quarantined since (another stream found it)
                continue
            except CorruptChunk as exc:
                self._quarantine(chunk.blob_id, f"{exc} (hashed again after {peer} dropped it)")
            except (StoreError, OSError) as exc:  # no longer held here, or a read error
                log.debug("re-check of %s chunk %d skipped: %s", chunk.blob_id, chunk.index, exc)

    def _reverify(self, chunk: Sent) -> None:
        with self.store.open_reader(chunk.blob_id) as reader:
            reader.read(chunk.index, verify=True)

    async def _read_request(
        self, stream: Any, conn: proto.ServerConnection, slot: StreamSlot
    ) -> messages.Request | None:
        request = conn.next_request()
        if request is not None:
            return request
        if conn.eof_received:
            return None
        limits = self.limits
        with trio.move_on_after(limits.idle_timeout) as waiting:
            # Evictable until a request begins (theory, rule 9).
            self.idle.wait(slot, trio.current_time(), waiting.cancel)
            try:
                data = await read_some(stream, limits.request_read_size)
            finally:
                self.idle.working(slot)
            conn.receive_data(data)
            if not data:
                return conn.next_request()
            with trio.fail_after(limits.request_timeout):
                while (request := conn.next_request()) is None:
                    data = await read_some(stream, limits.request_read_size)
                    conn.receive_data(data)
                    if not data:
                        return conn.next_request()
                return request
        return None  # idle: close

    async def _send(self, stream: Any, data: bytes | memoryview, *, copy: bool = False) -> None:
        """Write ``data`` in slices, each within its own deadline (theory, rule 3);
        ``copy``: hand the stream a bytes copy of each slice (py-libp2p's own stack)."""
        limits = self.limits
        view = memoryview(data)
        for offset in range(0, len(view), limits.send_slice):
            piece = view[offset : offset + limits.send_slice]
            with trio.fail_after(limits.send_timeout_base + len(piece) / limits.min_send_rate):
                await write_all(stream, bytes(piece) if copy else piece)

    async def _send_held(
        self,
        stream: Any,
        conn: proto.ServerConnection,
        response: messages.ManifestResponse | messages.HaveResponse | messages.StatusResponse,
        payload: int,
        peer: str,
        ip: str,
    ) -> None:
        """Send a whole-frame response (manifest, have) within the send budget. Frames up to
        MAX_HEADER_SIZE are not counted: the stream budget bounds them."""
        size = payload + HEADER_ROOM if payload > messages.MAX_HEADER_SIZE else 0
        with self._hold_send_bytes(peer, ip, size) as refused:
            if refused is not None:
                raise _Busy(refused)
            await self._send(stream, conn.send_response(response))

    def _hold_send_bytes(self, peer: str, ip: str, size: int) -> AbstractContextManager[str | None]:
        return self.budgets.hold_send(peer, ip, size)

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
        request: messages.Request,
        peer: str,
        ip: str,
    ) -> None:
        try:
            if isinstance(request, messages.ManifestRequest):
                manifest = await self._in_thread(self._manifest, request.blob_id)
                encoded = manifest.encode()
                response: messages.ManifestResponse | messages.HaveResponse
                response = messages.ManifestResponse(encoded)
                await self._send_held(stream, conn, response, len(encoded), peer, ip)
            elif isinstance(request, messages.HaveRequest):
                manifest, bitmap = await self._in_thread(self._have, request.blob_id)
                response = messages.HaveResponse(num_chunks=manifest.num_chunks, bitmap=bitmap)
                await self._send_held(stream, conn, response, len(bitmap), peer, ip)
            elif isinstance(request, messages.StatusRequest):
                manifest, bitmap = await self._in_thread(self._have, request.blob_id)
                n = manifest.num_chunks
                soon = self.board.soon(request.blob_id, n, bitmap)
                count = self._fellows(request.blob_id, peer) if conn.counts_fellows else None
                status = messages.StatusResponse(
                    num_chunks=n, bitmap=bitmap, soon=soon, fellows=count
                )
                await self._send_held(stream, conn, status, 2 * len(bitmap), peer, ip)
            elif isinstance(request, messages.PeersRequest):
                await self._in_thread(self._check_present, request.blob_id)
                listed = listing(
                    self.swarm, request.blob_id, peer, trio.current_time(), self._addrs_of
                )
                await self._send(stream, conn.send_response(messages.PeersResponse(listed)))
            elif request.tentative and self._fellows(request.blob_id, peer):
                # A `try_get` while others fetch this blob from us (1.5.0): declined, so
                # that N fetchers' first chunks, each asked with its manifest, do not
                # cross our uplink N times; each fetcher takes it as the swarm shares.
                self.stats.tentative_declined += 1
                await self._send(stream, conn.send_response(messages.End(conn.unsent_indices())))
            else:
                await self._send_chunks(stream, conn, request, peer, ip)
        except _Busy as exc:
            self.stats.busy_rejections += 1
            await self._error(stream, conn, messages.ErrorCode.BUSY, str(exc))
        except _NOT_HERE:
            await self._error(stream, conn, messages.ErrorCode.NOT_FOUND, "no such blob here")
        except CorruptChunk as exc:
            self._quarantine(request.blob_id, str(exc))
            await self._error(stream, conn, messages.ErrorCode.INTERNAL, "chunk damaged on disk")
        except StoreError as exc:
            log.warning("store error while serving %s: %s", request, exc)
            await self._error(stream, conn, messages.ErrorCode.INTERNAL, "store error")

    def _fellows(self, blob_id: str, peer: str) -> int:
        """How many peers besides ``peer`` asked us about ``blob_id`` lately and are
        connected now (1.4.0's `status` count, PROTOCOL.md section 5.5)."""
        count = self.swarm.fellows(
            blob_id, trio.current_time(), peer, FELLOW_WINDOW, self._connected
        )
        return min(messages.MAX_FELLOWS_COUNTED, count)

    async def _error(
        self, stream: Any, conn: proto.ServerConnection, code: messages.ErrorCode, message: str
    ) -> None:
        if conn.current_request is None:
            # The response was complete (manifest or have sent) when the error came;
            # nothing more may be said about this request.
            return
        await self._send(
            stream, conn.send_response(messages.ErrorResponse.truncated(code, message))
        )

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
        if len(self._addrs_cache) >= self.limits.max_addrs_cached:
            self._addrs_cache.clear()
        self._addrs_cache[peer] = (now + self.limits.addrs_cache_s, addrs)
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
        request: messages.GetRequest,
        peer: str,
        ip: str,
    ) -> None:
        manifest, bitmap = await self._in_thread(self._have, request.blob_id)
        n = manifest.num_chunks
        for start, end in request.ranges:
            if end > n:
                raise messages.RemoteProtocolError(
                    f"range [{start}, {end}) beyond the blob's {n} chunks",
                    code=messages.ErrorCode.BAD_REQUEST,
                )
        size = HEADER_ROOM + min(manifest.chunk_size, manifest.size)
        with self._hold_send_bytes(peer, ip, size) as refused:
            if refused is not None:
                raise _Busy(refused)
            await self._send_held_chunks(stream, conn, request, manifest, bitmap, size)

    async def _send_held_chunks(
        self,
        stream: Any,
        conn: proto.ServerConnection,
        request: messages.GetRequest,
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
        sent = self._sent.get(id(stream))
        buf = memoryview(bytearray(size))
        reader = await self._in_thread(self.store.open_reader, request.blob_id)
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
                            await self._in_thread(self._read_into, reader, index, body)
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
                    if sent is not None:
                        sent.append(Sent(request.blob_id, index, length, trio.current_time()))
                    self.stats.chunks_sent += 1
                    self.stats.bytes_sent += length
                    self.served.sent(peer, request.blob_id, length, trio.current_time())
        finally:
            reader.close()
        await self._send(stream, conn.send_response(messages.End(tuple(missing))))

    def _verified_bits(self, blob_id: str, num_chunks: int) -> bytearray:
        bits = self.verified.pop(blob_id, None)
        if bits is None or len(bits) != (num_chunks + 7) // 8:
            bits = bytearray((num_chunks + 7) // 8)
        self.verified[blob_id] = bits  # most recently used last
        while len(self.verified) > self.limits.max_verified_blobs:
            del self.verified[next(iter(self.verified))]
        return bits

    def _read_into(self, reader: ChunkReader, index: int, body: memoryview) -> None:
        reader.read_into(index, body, verify=True)
