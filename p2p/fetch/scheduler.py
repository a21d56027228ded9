"""Which chunks of one blob to request from which peer: a sans-IO download scheduler.

The trio downloader shell owns the streams, the clock and the disk; this module owns the
decisions. Every method is synchronous, does no I/O and never reads a clock: time is the
``now`` argument (seconds, monotonic), and `next_deadline` tells the shell when it next
needs waking.

Theory of operation
===================

Each chunk index is in exactly one of three states:

- *pool*: not verified, not requested from anyone; free to hand out;
- *in flight*: not verified, named by at least one live request that has not delivered it;
- *verified*: the shell reported it arrived and matched its hash (or it was verified before
  this download started, on resume).

A request ("ticket") names a set of chunk indices of one peer, sent as sorted, merged
half-open ranges, with a deadline. It is live from `next_request` until the shell reports
it done, failed, cancelled, or its peer is banned, dropped or removed; leaving the live set
is *releasing* it.

Invariants (each is checked by tests/p2p/test_scheduler*.py):

1. A verified chunk is never requested again: tickets are built only from pool chunks
   (or, in endgame, in-flight chunks), and a chunk leaves the verified state never.
2. Outside endgame no chunk is named by two live requests: a pool chunk becomes in flight
   the moment it is handed out. Endgame is the state where no pool chunk is held by any
   usable peer; only then may an idle peer (no live request) be handed copies of chunks
   in flight elsewhere, at most ``1 + endgame_duplicates`` live requests per chunk, oldest
   request first (the one most likely stuck behind a slow peer), and only of requests
   that are late (``ENDGAME_PATIENCE_RTTS``; ``next_late_at`` says when the next one is).
3. A banned peer never gets a request. A peer is banned for this download when one of its
   chunks fails its hash or it breaks the protocol; its live requests are released at
   once. A banned peer stays banned even if it is added again.
4. Every released chunk that is still unverified and no longer in flight at any other
   request goes back to the pool, and from there to every usable peer that holds it.
5. Requests never exceed the configured limits: at most ``max_chunks_per_request`` chunks
   in at most ``max_ranges_per_request`` ranges, at most
   ``max_inflight_requests_per_peer`` live requests per peer (fewer while the peer's
   `inflight_limit` is lower; ``depth`` per connection for a peer whose stripes the
   shell pipelines, see `set_connections`).
6. `done` is true iff every chunk is verified.

Policy
======

- Rarest first. A chunk's rarity is the number of usable *partial* peers that hold it
  (a peer with everything adds one to every chunk and so cannot change the order). Pool
  chunks are handed out by (rarity, index): chunks that only few peers can serve go first,
  while those peers are still here; equal rarity goes by index, which keeps ranges
  contiguous and writes sequential. The index is counted from the scheduler's ``start``
  (wrapping), which a fetcher derives from its peer ID: fetchers of one blob that all ask
  one seeder take different chunks from it first (issue 21).
- Swarming (config, off by default; ``p2p.node.node`` turns it on with peer exchange): a peer
  with every chunk is handed only chunks no usable partial peer holds or *claims* while a
  partial peer at least as fast holds or claims any (``defer_to_partial_holders``), and
  requests hold at most ``max_request_seconds`` of a peer's rate (``unmeasured_batch_bytes``
  before it is measured), so a slow seeder is never asked for much more than it is sending
  now. These opening caps are off for a seeder that said nobody else fetches from it
  (``set_alone``, from 1.4.0's ``status``) while no partial peer is known.
  A partial peer claims the chunks it said it is fetching now (``soon``, from a 1.3.0
  ``status``): they are not requested from it until its bitmap holds them, but they are
  left to it rather than asked of the seeder a second time. Among pool chunks of equal
  rarity an unclaimed one goes first (the hand-out key's rank is 2 x rarity + claimed).
- Swarm partition (with ``defer_to_partial_holders`` and the fetcher's own peer name): the
  chunks nobody holds are split among the fetchers without a word exchanged, by
  rendezvous hashing: chunk i belongs to whichever of this fetcher and its fetching
  fellows (usable partial peers that said they are fetching something) has the largest
  ``_mix(hash(name), i)``, and a chunk that belongs to a fellow counts as claimed by it.
  Fetchers that know one another compute the same split, so each asks the seeder for its
  own share first and takes the rest from the fellows; the largest of any set of fetchers
  always owns its chunk in its own view, so no chunk is left to nobody. A fellow that stops
  fetching or leaves drops out of the split at once. Blobs over ``MAX_PARTITION_CHUNKS``
  chunks are not split (the hashes cost O(chunks) per fellow).
- Rate-scaled batches. Each peer's rate is an exponentially weighted average of the bytes
  per second it delivers while it has requests in flight. A peer's batch is the full batch
  scaled by its rate over the best peer's rate, so a slow peer holds few chunks when the
  download nears its end. An unmeasured peer gets the full batch while nobody is measured
  yet, else a probe of a quarter batch. Near the end of the pool, a batch is also capped at
  this peer's rate-weighted share of the remaining pool next to the idle usable peers, so
  that the last chunks are spread out rather than queued at whoever asked first.
- Requests sized to the path. A peer may hold as many live requests as cover its
  bandwidth-delay product (measured rate x smallest measured RTT, in requests of its
  rate-scaled batch) plus one, and at least one and a half per connection the shell stripes it
  over (``depth`` per connection where it pipelines them), within
  ``min_inflight_requests_per_peer`` .. ``max_inflight_requests_per_peer``.
  A far peer so gets more requests in flight than a near one at the same rate, and a slow
  peer fewer than a fast one at the same distance; until both are measured it gets the
  minimum. The bytes in flight cost the fetcher no memory (the muxer's windows bound
  what is buffered); they cost the server one stream and send buffer each (a request
  queued behind another on a pipelined stream costs it neither until its turn).
- A ``busy`` reply while other requests are live at the peer (its server's per-peer
  stream budget, shared with our other downloads, is spent) caps the peer at the requests
  it took, raised by one per request completed; with nothing else live it is a failure.
- Deadlines. A request must finish by ``now + request_timeout_base + bytes /
  min_rate_bytes_per_s``, where ``bytes`` counts this request plus what the peer still owes
  on its earlier live requests (pipelined requests share the peer's link).
- Late data. A chunk of a released request that still arrives and verifies is kept (it
  is correct data); a server that ends a request without sending a chunk and without
  calling it missing gets that chunk released to the pool, its bitmap unchanged.
- Failures. A request that times out or loses its stream releases its chunks and counts a
  failure; ``max_failures_before_drop`` failures in a row drop the peer (not a ban: it may
  be added again). Delivering a chunk or finishing a request resets the streak.

Cost
====

Pool chunks sit in min-heaps keyed by ``rank * num_chunks + index``: one shared heap for
peers that have every chunk and one heap per usable partial peer, with lazy deletion (an
entry is skipped when its chunk is no longer in the pool or its rarity changed).
`next_request`, `on_chunk` and the request-end events cost O(batch * log n) amortised,
plus O(number of peers) for the rate ranking and for re-offering released chunks to their
holders. A change in the set of usable partial peers (join, leave, ban, a large bitmap
change) costs O(num_chunks) at once and marks the heaps for one O(num_chunks * partial
peers) rebuild at the next `next_request`. Small bitmap changes (a few chunks reported
missing) are applied per chunk.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from p2p.blob.protocol import MAX_CHUNKS_PER_REQUEST, MAX_RANGES_PER_REQUEST

__all__ = [
    "ENDGAME_MIN_PATIENCE_S",
    "ENDGAME_PATIENCE_RTTS",
    "PROTOCOL_MAX_CHUNKS_PER_REQUEST",
    "PROTOCOL_MAX_RANGES_PER_REQUEST",
    "SWARM_ENDGAME_PATIENCE_S",
    "PeerScores",
    "PeerStats",
    "RequestTicket",
    "Scheduler",
    "SchedulerConfig",
    "ScoreConfig",
    "StripeConfig",
    "StripeGrowth",
    "bitmap_of",
]

# The wire protocol's hard limits on one `get` request: a config can never build a request
# that a server would refuse as `too_large` / `bad_request`.
PROTOCOL_MAX_CHUNKS_PER_REQUEST = MAX_CHUNKS_PER_REQUEST
PROTOCOL_MAX_RANGES_PER_REQUEST = MAX_RANGES_PER_REQUEST

_POOL = 0
_INFLIGHT = 1
_VERIFIED = 2

# In a swarm a seeder duplicates a fellow's request in the endgame only once it is this
# old: a fellow sends a chunk in well under a second, and the seeder's uplink is the
# scarce link (each copy there costs every other fetcher).
SWARM_ENDGAME_PATIENCE_S = 2.0
# Any other endgame copy waits until the request it copies is late: out for longer than
# ENDGAME_PATIENCE_RTTS round trips of its peer plus the time its peer's measured rate
# needs for the chunks it still owes (each counted at the first chunk's length), and at
# least ENDGAME_MIN_PATIENCE_S. Copied at once, a blob of one chunk (an outer-loop update)
# fetched from two holders crossed the wire twice: 2.75x the update per round instead of
# 2.16x (bench/outer_net.py --model-size small). A request on time needs no copy; a
# stalled or slow one still gets one.
ENDGAME_PATIENCE_RTTS = 2.0
ENDGAME_MIN_PATIENCE_S = 0.1
# A request to a striped provider holds this many round trips of one connection's share.
STRIPED_REQUEST_RTTS = 3.0
# A seeder defers to fellows at least this fraction of its rate: a fellow's rate is
# measured on a few one-chunk requests (a round trip each), so a fellow on a link ten times
# the seeder's can measure below it; one under a quarter of it would make us wait.
DEFER_RATE_FRACTION = 0.25
# A seeder that said only once that nobody else fetches from it (set_alone's ``once``) is
# owed at most this fraction of the blob at a time: a fetcher that was first of several to
# ask takes at most an eighth of the blob on that one answer (it took a 32 MiB blob nearly
# whole, in 16 MiB requests). A lone fetch pays for it: eu->asia 256 MiB ran ~5% slower
# than with no budget (bench/figures/wan-opening-caps.md), and a quarter was less safe.
ALONE_ONCE_SHARE = 8
# The swarm partition (see "Swarm partition") hashes every chunk once per fellow: ~2 us a
# chunk here, so 65536 chunks (64 GiB at 1 MiB) cost ~0.15 s per fellow, once.
MAX_PARTITION_CHUNKS = 1 << 16
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit integer."""
    z = (z + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _chunk_hashes(name: str, n: int) -> list[int]:
    """The rendezvous weight of each of ``n`` chunks for peer ``name``."""
    h = _name_hash(name)
    return [_mix(h ^ (i * _GOLDEN & _M64)) for i in range(n)]


# _BITS[b]: the positions of the set bits of byte b, LSB first (chunk i = byte i//8, bit i%8).
_BITS: tuple[tuple[int, ...], ...] = tuple(
    tuple(bit for bit in range(8) if b >> bit & 1) for b in range(256)
)


@dataclass(frozen=True)
class SchedulerConfig:
    """Tunables of one download. All limits are checked on construction."""

    # 16 chunks = 16 MiB at the default chunk size: long enough to amortise a request's
    # round trip at ~50 MB/s per peer connection (research/perf.md), short enough that a
    # released or endgame-duplicated batch is cheap to redo.
    max_chunks_per_request: int = 16
    # Live requests per peer follow its bandwidth-delay product (invariant 5 and "Requests
    # sized to the path" below), between these bounds. Two at least keep a link busy while
    # the next request's round trip is in flight (pipelining across streams). At most 12:
    # each live request holds one server stream and a chunk-sized send buffer there, and
    # a blobnet server allows 16 streams per peer (p2p.blob.server.MAX_STREAMS_PER_PEER),
    # which leaves room for the control streams of a few downloads at once.
    min_inflight_requests_per_peer: int = 2
    max_inflight_requests_per_peer: int = 12
    # Fixed part of every deadline: connection setup, a stream open and a disk-bound server
    # reading its first chunk can each take seconds on a loaded host.
    request_timeout_base: float = 10.0
    # The slowest send rate worth waiting for: 256 KiB/s moves a 1 MiB chunk in 4 s. A peer
    # slower than this is treated as stalled; the endgame covers merely slow ones.
    min_rate_bytes_per_s: float = 256 * 1024
    # One timeout can be a blip (GC pause, a lost connection that reconnects); three in a
    # row means the peer is not serving us and keeps chunks hostage until each deadline.
    max_failures_before_drop: int = 3
    # One extra copy of each tail chunk is enough to route around one slow peer while
    # bounding wasted bandwidth to the in-flight tail; 0 turns the endgame off.
    endgame_duplicates: int = 1
    # The protocol's cap on ranges per request (see PROTOCOL_MAX_RANGES_PER_REQUEST).
    max_ranges_per_request: int = PROTOCOL_MAX_RANGES_PER_REQUEST
    # Time constant of the rate average: ~2 s follows a peer whose link changes within a
    # few requests without jumping on every burst of TCP delivery.
    rate_time_constant_s: float = 2.0
    # Swarming (issue 21): a measured peer's request holds at most this many seconds of
    # its rate, and an unmeasured peer's first requests at most this many bytes, so a slow
    # sole seeder is never handed a large part of the blob at once: what it has not been
    # asked for yet can still come from fellow fetchers. None: no such cap.
    max_request_seconds: float | None = None
    unmeasured_batch_bytes: int | None = None
    # Swarming: a peer with every chunk is handed only chunks no usable partial peer holds
    # while a partial peer at least as fast as it (or not measured yet) holds some pool
    # chunk: a slow seeder then sends each chunk about once, and the fellow fetchers that
    # hold a chunk hand it on. The endgame still duplicates tail chunks onto it.
    defer_to_partial_holders: bool = False
    # Swarming (with defer_to_partial_holders): live requests a peer with every chunk may
    # hold before its rate is measured. Fetchers that all start on one seeder know nothing
    # of each other for their first second (peer exchange takes a dial and two round
    # trips), and each used to queue a dozen chunks there at once (six requests over four
    # striped connections), most of them the same chunks as its fellows'. Two requests
    # of `unmeasured_batch_bytes` keep a 100 Mbit/s seeder's link busy meanwhile.
    swarm_unmeasured_inflight_requests: int = 2
    # Swarming: once the blob is complete the fetch stays while fellows still ask this
    # node for chunks (p2p.blob.swarm rule 5). For a one-shot `blob get`, whose node ends with
    # the fetch; a long-lived node serves on after its fetch returns anyway, and would
    # only wait longer for it.
    linger_while_asked: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_chunks_per_request <= PROTOCOL_MAX_CHUNKS_PER_REQUEST:
            raise ValueError(
                f"max_chunks_per_request must be in 1..{PROTOCOL_MAX_CHUNKS_PER_REQUEST}, "
                f"not {self.max_chunks_per_request}"
            )
        if not 1 <= self.max_ranges_per_request <= PROTOCOL_MAX_RANGES_PER_REQUEST:
            raise ValueError(
                f"max_ranges_per_request must be in 1..{PROTOCOL_MAX_RANGES_PER_REQUEST}, "
                f"not {self.max_ranges_per_request}"
            )
        if self.max_inflight_requests_per_peer < 1:
            raise ValueError("max_inflight_requests_per_peer must be at least 1")
        if self.min_inflight_requests_per_peer < 1:
            raise ValueError("min_inflight_requests_per_peer must be at least 1")
        if not self.request_timeout_base > 0:
            raise ValueError("request_timeout_base must be positive")
        if not self.min_rate_bytes_per_s > 0:
            raise ValueError("min_rate_bytes_per_s must be positive")
        if self.max_failures_before_drop < 1:
            raise ValueError("max_failures_before_drop must be at least 1")
        if self.endgame_duplicates < 0:
            raise ValueError("endgame_duplicates must not be negative")
        if not self.rate_time_constant_s > 0:
            raise ValueError("rate_time_constant_s must be positive")
        if self.max_request_seconds is not None and not self.max_request_seconds > 0:
            raise ValueError("max_request_seconds must be positive")
        if self.unmeasured_batch_bytes is not None and self.unmeasured_batch_bytes < 1:
            raise ValueError("unmeasured_batch_bytes must be at least 1")
        if self.swarm_unmeasured_inflight_requests < 1:
            raise ValueError("swarm_unmeasured_inflight_requests must be at least 1")


@dataclass(frozen=True)
class RequestTicket:
    """One `get` request to send: `ranges` are sorted, merged, half-open index ranges."""

    request_id: int
    peer: str
    ranges: tuple[tuple[int, int], ...]
    deadline: float
    indices: frozenset[int]
    # True when the ticket duplicates chunks in flight elsewhere (invariant 2).
    endgame: bool = False


@dataclass(frozen=True)
class PeerStats:
    """What one peer did for this download (for progress reports and logs)."""

    bytes_received: int
    chunks_received: int
    rate_bytes_per_s: float  # 0.0 until measured
    inflight: int  # live requests
    banned: bool
    dropped: bool
    failures: int  # total failed requests
    connected: bool = True
    last_error: str | None = None
    rtt_s: float | None = None  # smallest round trip measured
    inflight_limit: int = 0  # live requests allowed now (rate x RTT, bounded)
    connections: int = 1


def bitmap_of(indices: Iterable[int], num_chunks: int) -> bytes:
    """The have-bitmap (LSB-first, byte i//8 bit i%8) of `indices` out of `num_chunks`."""
    bm = bytearray((num_chunks + 7) // 8)
    for i in indices:
        if not 0 <= i < num_chunks:
            raise ValueError(f"chunk index {i} out of range 0..{num_chunks - 1}")
        bm[i >> 3] |= 1 << (i & 7)
    return bytes(bm)


def _to_ranges(sorted_indices: list[int]) -> tuple[tuple[int, int], ...]:
    ranges: list[tuple[int, int]] = []
    start = prev = sorted_indices[0]
    for i in sorted_indices[1:]:
        if i != prev + 1:
            ranges.append((start, prev + 1))
            start = i
        prev = i
    ranges.append((start, prev + 1))
    return tuple(ranges)


def _set_bits(bm: bytes | bytearray) -> Iterator[int]:
    for byte_index, b in enumerate(bm):
        if b:
            base = byte_index << 3
            for bit in _BITS[b]:
                yield base + bit


@dataclass(eq=False)
class _Peer:
    name: str
    bitmap: bytearray | None  # None: holds every chunk
    connected: bool = True
    banned: bool = False
    dropped: bool = False
    heap: list[int] = field(default_factory=list)  # pool keys, partial peers only
    soon: bytearray | None = None  # chunks it is fetching now (claims; partial peers only)
    soon_count: int = 0
    beats: int | None = None  # chunks whose partition weight beats ours (bit i), cached
    requests: dict[int, _Request] = field(default_factory=dict)
    rate: float | None = None
    mark: float = 0.0  # last time the rate average was advanced
    unfolded_bytes: int = 0  # bytes that arrived at `mark` itself, not yet averaged
    outstanding_bytes: int = 0  # bytes still owed on live requests
    bytes_received: int = 0
    chunks_received: int = 0
    failures: int = 0
    streak: int = 0  # failures in a row
    last_error: str | None = None
    rtt: float | None = None  # smallest round trip measured, seconds
    connections: int = 1  # TCP connections the shell stripes this peer's streams over
    depth: int = 1  # requests the shell keeps outstanding per stream (set_connections)
    busy_limit: int | None = None  # live requests the server last took before saying busy
    alone: bool = False  # a seeder that said nobody else fetches from it (set_alone)
    alone_once: bool = False  # ... said so only once yet (set_alone)

    @property
    def usable(self) -> bool:
        return self.connected and not self.banned and not self.dropped

    def holds(self, i: int) -> bool:
        bm = self.bitmap
        return bm is None or bool(bm[i >> 3] >> (i & 7) & 1)


@dataclass(eq=False)
class _Request:
    ticket: RequestTicket
    peer: _Peer
    issued_at: float
    unreceived: set[int]


class Scheduler:
    """Chunk scheduling for one blob of `num_chunks` chunks; see the module docstring."""

    def __init__(
        self,
        num_chunks: int,
        chunk_length: Callable[[int], int],
        verified: Iterable[int] = (),
        config: SchedulerConfig = SchedulerConfig(),  # frozen: safe to share
        start: int = 0,
        own: str = "",
    ) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must not be negative, not {num_chunks}")
        self._n = num_chunks
        self._stride = max(num_chunks, 1)
        # Equal rarity goes by index counted from `start` (wrapping): fetchers of one blob
        # that start at different chunks take different chunks from a sole seeder first.
        self._start = start % self._stride
        self._chunk_length = chunk_length
        self._cfg = config
        self._state = bytearray(num_chunks)  # all _POOL
        self._rarity = [0] * num_chunks
        # Usable partial peers that claim each chunk (they said it is soon theirs).
        self._claims = [0] * num_chunks
        # The swarm partition: this fetcher's weights, and the chunks (bitmap) that
        # belong to a fetching fellow, recomputed at each rebuild.
        self._own_weights: list[int] | None = (
            _chunk_hashes(own, num_chunks)
            if own and config.defer_to_partial_holders and num_chunks <= MAX_PARTITION_CHUNKS
            else None
        )
        self._elsewhere = bytes((num_chunks + 7) // 8)
        self._verified_count = 0
        for i in verified:
            self._check_index(i)
            if self._state[i] != _VERIFIED:
                self._state[i] = _VERIFIED
                self._verified_count += 1
        self._pool_count = num_chunks - self._verified_count
        # Pool chunks with no usable partial holder (rarity 0): fetchable only from a peer
        # that has everything.
        self._orphans = self._pool_count
        self._full_usable = 0
        # Keys are rarity * stride + position (index counted from `start`); every rarity
        # is 0 here, so the sorted positions of pool chunks are already a heap.
        self._full_heap = sorted(self._pos(i) for i in range(num_chunks) if self._state[i] == _POOL)
        self._dirty = False
        self._pushes = 0  # heap entries pushed since the last rebuild
        self._inflight: dict[int, set[int]] = {}  # chunk -> live request ids still owing it
        self._requests: dict[int, _Request] = {}
        self._request_peer: dict[int, str] = {}  # every id ever issued -> its peer
        self._deadlines: list[tuple[float, int]] = []
        self._overdue: set[int] = set()
        self._next_id = 1
        self._peers: dict[str, _Peer] = {}
        self._partials: dict[str, _Peer] = {}  # usable peers with a partial bitmap

    # ----------------------------------------------------------------- peers

    def add_peer(
        self, peer: str, now: float, bitmap: bytes | None = None, soon: bytes | None = None
    ) -> None:
        """Add a provider (or update a known one); `bitmap` None means it has every chunk;
        `soon`: the chunks it is fetching now (a partial peer's claims, see the policy).

        A dropped or removed peer becomes usable again; a banned one stays banned.
        """
        parsed = self._parse_bitmap(bitmap)
        claims = self._parse_soon(soon, parsed)
        p = self._peers.get(peer)
        if p is None:
            p = _Peer(peer, parsed, mark=now)
            self._set_soon_unused(p, claims)
            self._peers[peer] = p
            self._contribute(p, +1)
            return
        if not p.usable:
            p.bitmap = parsed
            self._set_soon_unused(p, claims)
            p.connected = True
            p.dropped = False
            p.streak = 0
            if p.usable:
                self._contribute(p, +1)
            return
        self._replace_bitmap(p, parsed)
        self._replace_soon(p, claims)

    def on_rtt(self, peer: str, rtt: float) -> None:
        """A round trip to `peer` took `rtt` seconds (a small request answered, timed by the
        shell). The smallest sample is kept: queues only ever add to a path's delay."""
        p = self._peer(peer)
        if rtt >= 0.0 and (p.rtt is None or rtt < p.rtt):
            p.rtt = rtt

    def set_connections(self, peer: str, count: int, depth: int = 1) -> None:
        """The shell now stripes `peer`'s streams over `count` connections; each should
        carry a live request (see `inflight_limit`). ``depth``: the shell pipelines that
        many requests on each connection's stream (1.1.0), so a connection never waits a
        round trip between two requests; a striped peer may then hold ``depth`` live
        requests per connection."""
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        p = self._peer(peer)
        p.connections = max(1, count)
        p.depth = depth

    def set_alone(self, peer: str, alone: bool, *, once: bool = False) -> None:
        """`peer` (a seeder, asked with 1.4.0's ``status``) said whether anyone else
        fetches the blob from it now. While it says nobody and no partial peer is known,
        the swarm's opening caps do not apply to it (``swarm_unmeasured_inflight_requests``,
        ``unmeasured_batch_bytes``, ``max_request_seconds``): they keep fetchers that do
        not know each other yet from queueing the same chunks at one seeder, and cost a
        fetch that has the seeder to itself most of its ramp across a continent. ``once``:
        it said nobody only once so far. Fetchers started together reach it a little
        apart, so the first to ask hears nobody; until the seeder says so again, what is
        asked of it and not yet received stays within ``ALONE_ONCE_SHARE`` of the blob,
        so a fetcher that is not alone after all has not taken most of it by the time it
        knows."""
        p = self._peer(peer)
        p.alone, p.alone_once = alone, alone and once

    def _uncapped(self, p: _Peer) -> bool:
        """The swarm's opening caps are off for `p` (see set_alone)."""
        return p.alone and p.bitmap is None and not self._partials

    def inflight_limit(self, peer: str) -> int:
        """Live requests `peer` may hold now: enough to cover its rate x RTT (see the
        module docstring), at least one per connection, within the configured bounds."""
        return self._inflight_limit(self._peer(peer))

    def update_peer_bitmap(
        self, peer: str, bitmap: bytes | None, soon: bytes | None = None
    ) -> None:
        """The peer's have-bitmap changed (a partial peer fetched more chunks); `soon`:
        what it is fetching now (None: nothing, or it does not say)."""
        p = self._peer(peer)
        parsed = self._parse_bitmap(bitmap)
        self._replace_bitmap(p, parsed)
        self._replace_soon(p, self._parse_soon(soon, parsed))

    def drop_claims(self, peer: str) -> None:
        """Forget what `peer` said it is fetching (its status is no longer refreshed)."""
        p = self._peers.get(peer)
        if p is not None:
            self._replace_soon(p, None)

    def in_flight(self) -> list[int]:
        """Chunks requested and not verified yet (what a ``status`` answer calls soon)."""
        return list(self._inflight)

    def remove_peer(self, peer: str, reason: str) -> None:
        """The peer disconnected or was killed: release its requests (no penalty)."""
        p = self._peers.get(peer)
        if p is None:
            return
        p.last_error = reason
        if p.usable:
            self._contribute(p, -1)
        p.connected = False
        self._release_all(p)

    # -------------------------------------------------------------- requests

    def next_request(
        self, peer: str, now: float, max_chunks: int | None = None
    ) -> RequestTicket | None:
        """The next request to send to `peer`, or None if it has nothing useful to do now;
        ``max_chunks``: the shell's own cap on its size."""
        p = self._peers.get(peer)
        if p is None or not p.usable:
            return None
        if len(p.requests) >= self._inflight_limit(p):
            return None
        if self._dirty:
            self._rebuild()
        limit = self._batch_size(p)
        if max_chunks is not None:
            limit = min(limit, max(1, max_chunks))
        if p.alone_once and self._uncapped(p):
            chunk = max(1, self._chunk_length(0))
            room = self._n * chunk // ALONE_ONCE_SHARE - p.outstanding_bytes
            if room < chunk and p.requests:
                return None
            # Spread over every request the peer may hold (each lane's, pipelined), so
            # that all its connections ramp up together rather than two of them.
            spread = self._n // ALONE_ONCE_SHARE // max(1, p.connections * p.depth)
            limit = min(limit, max(1, room // chunk), max(1, spread))
        picked = self._pick_pool(p, limit)
        endgame = False
        if not picked and not p.requests and self._fetchable_pool() == 0:
            picked = self._pick_endgame(p, limit, now)
            endgame = True
        if not picked:
            return None
        return self._issue(p, picked, now, endgame)

    def claim(self, peer: str, now: float, indices: Iterable[int]) -> RequestTicket | None:
        """A live request for exactly ``indices``, a `get` the shell sent before this
        scheduler could choose (the first chunk, asked with the manifest), or None when
        any of them is not free for ``peer`` (held, in flight, not its to give): the
        shell then drops that answer unread."""
        p = self._peers.get(peer)
        picked = sorted(set(indices))
        if p is None or not p.usable or not picked:
            return None
        if any(not 0 <= i < self._n or self._state[i] != _POOL or not p.holds(i) for i in picked):
            return None
        return self._issue(p, picked, now, False)

    def expects(self, request_id: int, index: int) -> bool:
        """Whether `index` belongs to live request `request_id` (the shell checks a served
        chunk with this before hashing: a chunk outside its request is a protocol error)."""
        req = self._requests.get(request_id)
        return req is not None and index in req.ticket.indices

    def is_obsolete(self, request_id: int) -> bool:
        """Whether every chunk the live request still owes is already verified (an endgame
        loser): the shell may reset its stream and report `cancel`."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        state = self._state
        return all(state[i] == _VERIFIED for i in req.unreceived)

    # ---------------------------------------------------------------- events

    def on_chunk(self, request_id: int, index: int, nbytes: int, now: float) -> bool:
        """Chunk `index` of the request arrived and verified. True if it is new (write it),
        False if it was already verified (an endgame duplicate: discard it)."""
        self._check_index(index)
        req = self._requests.get(request_id)
        if req is None:
            # A late chunk of a released request: the data is verified, so keep it.
            name = self._known_request(request_id)
            p = self._peers[name]
            p.bytes_received += nbytes
            p.chunks_received += 1
            return self._mark_verified(index)
        if index not in req.ticket.indices:
            raise ValueError(
                f"chunk {index} is not part of request {request_id} (a server sending it "
                "is a protocol error; check with expects() before reporting)"
            )
        p = req.peer
        if index in req.unreceived:
            req.unreceived.discard(index)
            p.outstanding_bytes -= self._chunk_length(index)
        p.bytes_received += nbytes
        p.chunks_received += 1
        p.streak = 0
        self._observe(p, nbytes, now)
        return self._mark_verified(index)

    def on_bad_chunk(self, request_id: int, index: int, now: float) -> None:
        """The chunk failed its hash: ban the peer for this download."""
        self._check_index(index)
        self._ban(self._known_request(request_id), f"chunk {index} failed its hash")

    def on_protocol_error(self, request_id: int, now: float, reason: str) -> None:
        """The peer broke the protocol on this request: ban it for this download."""
        self._ban(self._known_request(request_id), reason)

    def on_request_done(self, request_id: int, now: float, missing: Iterable[int] = ()) -> None:
        """The server finished the request; `missing` are indices it said it lacks.

        Missing chunks leave the peer's bitmap; every chunk not delivered returns to the
        pool. A request already released (banned, failed, removed) is ignored.
        """
        req = self._requests.get(request_id)
        if req is None:
            self._known_request(request_id)
            return
        lacked = set(missing)
        stray = lacked - req.ticket.indices
        if stray:
            raise ValueError(
                f"request {request_id} did not ask for chunks {sorted(stray)[:8]} reported "
                "missing (a server doing so is a protocol error)"
            )
        p = req.peer
        p.streak = 0
        if p.busy_limit is not None:
            # Additive increase after a busy reply: one more live request per success.
            p.busy_limit += 1
            if p.busy_limit >= self._cfg.max_inflight_requests_per_peer:
                p.busy_limit = None
        if lacked:
            self._forget_chunks(p, lacked)
        self._release(req)

    def on_request_failed(self, request_id: int, now: float, reason: str) -> None:
        """Stall, timeout, stream error or lost connection: release the request and count a
        failure; enough failures in a row drop the peer (it may be added again)."""
        req = self._requests.get(request_id)
        if req is None:
            self._known_request(request_id)
            return
        p = req.peer
        self._observe(p, 0, now)
        self._release(req)
        p.failures += 1
        p.streak += 1
        p.last_error = reason
        if p.streak >= self._cfg.max_failures_before_drop:
            self._contribute(p, -1)
            p.dropped = True
            self._release_all(p)

    def on_request_busy(self, request_id: int, now: float) -> None:
        """The server answered `busy` (its per-peer stream budget is spent, maybe by our
        other downloads). With other requests still live at this peer it is a limit, not a
        failure: release the request and hold the peer to the requests it did take, growing
        again by one per success. With nothing else live it counts as a failure."""
        req = self._requests.get(request_id)
        if req is None:
            self._known_request(request_id)
            return
        p = req.peer
        if len(p.requests) <= 1:
            self.on_request_failed(request_id, now, "busy")
            return
        self._release(req)
        p.busy_limit = max(1, len(p.requests))
        p.last_error = "busy"

    def cancel(self, request_id: int, now: float) -> None:
        """The shell abandoned a live request on its own account (e.g. `is_obsolete`):
        release it without penalising the peer."""
        req = self._requests.get(request_id)
        if req is None:
            self._known_request(request_id)
            return
        self._release(req)

    # ---------------------------------------------------------------- timers

    def expired(self, now: float) -> list[RequestTicket]:
        """Live requests whose deadline is at or before `now`, earliest first. They stay
        live until the shell reports them (normally `on_request_failed`)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, rid = heapq.heappop(deadlines)
            if rid in self._requests:
                self._overdue.add(rid)
        tickets = [self._requests[rid].ticket for rid in self._overdue]
        tickets.sort(key=lambda t: (t.deadline, t.request_id))
        return tickets

    def next_deadline(self) -> float | None:
        """The earliest deadline of a live request, or None when nothing is in flight."""
        if self._overdue:
            return min(self._requests[rid].ticket.deadline for rid in self._overdue)
        deadlines = self._deadlines
        while deadlines and deadlines[0][1] not in self._requests:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    # ------------------------------------------------------------ inspection

    @property
    def done(self) -> bool:
        return self._verified_count == self._n

    @property
    def verified_count(self) -> int:
        return self._verified_count

    @property
    def num_chunks(self) -> int:
        return self._n

    @property
    def unheld_count(self) -> int:
        """Unrequested chunks that no usable peer holds (waiting for a new provider)."""
        return 0 if self._full_usable else self._orphans

    def missing(self) -> list[int]:
        """Indices not yet verified, ascending (O(num_chunks): for reports, not hot paths)."""
        state = self._state
        return [i for i in range(self._n) if state[i] != _VERIFIED]

    @property
    def fetchable_count(self) -> int:
        """Unrequested chunks that some usable peer holds (work still to hand out)."""
        return self._fetchable_pool()

    def stalled(self) -> bool:
        """Not done, and no usable peer can make progress: nothing is in flight and no
        usable peer holds a missing chunk (every holder banned, dropped or gone)."""
        if self.done or self._requests or self._full_usable:
            return False
        return self._pool_count == self._orphans

    def peer_stats(self) -> dict[str, PeerStats]:
        return {name: self._stats(p) for name, p in self._peers.items()}

    def stats_of(self, peer: str) -> PeerStats | None:
        """One peer's `PeerStats` (None: unknown): O(1), for the shell's hot loops, where
        `peer_stats` built every peer's (a swarm fetch has tens of fellows)."""
        p = self._peers.get(peer)
        return None if p is None else self._stats(p)

    def still_used(self, peer: str) -> bool:
        """Whether ``peer`` is known and neither banned nor dropped (cheaper than
        `stats_of`, which also works out its request limit)."""
        p = self._peers.get(peer)
        return p is not None and not p.banned and not p.dropped

    def _stats(self, p: _Peer) -> PeerStats:
        return PeerStats(
            bytes_received=p.bytes_received,
            chunks_received=p.chunks_received,
            rate_bytes_per_s=p.rate or 0.0,
            inflight=len(p.requests),
            banned=p.banned,
            dropped=p.dropped,
            failures=p.failures,
            connected=p.connected,
            last_error=p.last_error,
            rtt_s=p.rtt,
            inflight_limit=self._inflight_limit(p) if p.usable else 0,
            connections=p.connections,
        )

    def banned_peers(self) -> set[str]:
        return {name for name, p in self._peers.items() if p.banned}

    # ----------------------------------------------------------- internals

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self._n:
            raise ValueError(f"chunk index {i} out of range 0..{self._n - 1}")

    def _peer(self, name: str) -> _Peer:
        p = self._peers.get(name)
        if p is None:
            raise KeyError(f"unknown peer {name!r}: add_peer() it first")
        return p

    def _known_request(self, request_id: int) -> str:
        name = self._request_peer.get(request_id)
        if name is None:
            raise ValueError(f"request {request_id} was never issued by this scheduler")
        return name

    def _parse_bitmap(self, bitmap: bytes | None) -> bytearray | None:
        if bitmap is None:
            return None
        n = self._n
        if len(bitmap) != (n + 7) // 8:
            raise ValueError(
                f"have-bitmap is {len(bitmap)} bytes, a blob of {n} chunks needs "
                f"{(n + 7) // 8} (a peer sending it is a protocol error)"
            )
        bm = bytearray(bitmap)
        if n & 7:
            bm[-1] &= (1 << (n & 7)) - 1
        if int.from_bytes(bm, "little").bit_count() == n:
            return None  # holds everything: share the full heap
        return bm

    def _parse_soon(self, soon: bytes | None, bitmap: bytearray | None) -> bytearray | None:
        """A peer's soon-bitmap, less what it holds; None when it claims nothing."""
        if soon is None or bitmap is None:
            return None  # a peer with every chunk claims none
        claims = self._parse_bitmap(soon)
        if claims is None:
            claims = bytearray(b"\xff" * len(bitmap))
            if self._n & 7:
                claims[-1] = (1 << (self._n & 7)) - 1
        held = int.from_bytes(bitmap, "little")
        bits = int.from_bytes(claims, "little") & ~held
        if not bits:
            return None
        return bytearray(bits.to_bytes(len(bitmap), "little"))

    def _set_soon_unused(self, p: _Peer, claims: bytearray | None) -> None:
        """Set the claims of a peer whose holdings count nowhere (not usable yet)."""
        p.soon = claims
        p.soon_count = 0 if claims is None else int.from_bytes(claims, "little").bit_count()

    def _replace_soon(self, p: _Peer, new: bytearray | None) -> None:
        if not p.usable or p.bitmap is None:
            self._set_soon_unused(p, new if p.bitmap is not None else None)
            return
        old = int.from_bytes(p.soon, "little") if p.soon is not None else 0
        now = int.from_bytes(new, "little") if new is not None else 0
        diff = old ^ now
        fetching = p.soon_count > 0
        self._set_soon_unused(p, new)
        if self._own_weights is not None and fetching != (p.soon_count > 0):
            self._dirty = True  # it joins or leaves the partition
        claims = self._claims
        state = self._state
        while diff:
            low = diff & -diff
            i = low.bit_length() - 1
            diff ^= low
            before = claims[i]
            claims[i] = before + (1 if now & low else -1)
            if state[i] == _POOL and (before == 0) != (claims[i] == 0):
                self._offer(i)

    # Rarity and heap bookkeeping.

    def _contribute(self, p: _Peer, sign: int) -> None:
        """Add (+1) or remove (-1) a usable peer's holdings from the rarity counts (and a
        partial peer's claims from the claim counts)."""
        bm = p.bitmap
        if bm is None:
            self._full_usable += sign
            return
        if p.soon is not None:
            claims = self._claims
            for i in _set_bits(p.soon):
                claims[i] += sign
        if sign > 0:
            self._partials[p.name] = p
        else:
            self._partials.pop(p.name, None)
            p.heap = []
        rarity = self._rarity
        state = self._state
        orphans = 0
        for i in _set_bits(bm):
            r = rarity[i]
            rarity[i] = r + sign
            if state[i] == _POOL and (r == 0 or r + sign == 0):
                orphans -= sign
        self._orphans += orphans
        self._dirty = True

    def _replace_bitmap(self, p: _Peer, new: bytearray | None) -> None:
        old = p.bitmap
        if not p.usable:
            p.bitmap = new
            return
        if old is None and new is None:
            return
        if old is not None and new is not None:
            diff = int.from_bytes(old, "little") ^ int.from_bytes(new, "little")
            # Few changed chunks: update them one by one rather than rebuild every heap.
            if diff.bit_count() <= max(64, self._n >> 6):
                while diff:
                    low = diff & -diff
                    i = low.bit_length() - 1
                    diff ^= low
                    self._set_bit(p, i, bool(new[i >> 3] >> (i & 7) & 1))
                return
        self._contribute(p, -1)
        p.bitmap = new
        self._contribute(p, +1)

    def _set_bit(self, p: _Peer, i: int, has: bool) -> None:
        """Flip chunk i in usable partial peer p's bitmap, keeping rarity and heaps exact."""
        bm = p.bitmap
        assert bm is not None
        if bool(bm[i >> 3] >> (i & 7) & 1) == has:
            return
        bm[i >> 3] ^= 1 << (i & 7)
        r = self._rarity[i]
        nr = r + (1 if has else -1)
        self._rarity[i] = nr
        if self._state[i] == _POOL:
            if r == 0:
                self._orphans -= 1
            elif nr == 0:
                self._orphans += 1
            self._offer(i)

    def _forget_chunks(self, p: _Peer, lacked: set[int]) -> None:
        """The peer said it lacks these chunks: drop them from its bitmap."""
        if p.bitmap is None:
            n = self._n
            bm = bytearray(b"\xff" * ((n + 7) // 8))
            if n & 7:
                bm[-1] = (1 << (n & 7)) - 1
            for i in lacked:
                bm[i >> 3] &= ~(1 << (i & 7)) & 0xFF
            self._contribute(p, -1)
            p.bitmap = bm
            self._contribute(p, +1)
            return
        for i in lacked:
            self._set_bit(p, i, False)

    def _pos(self, i: int) -> int:
        """Chunk i's place in the hand-out order among chunks of equal rarity."""
        return (i - self._start) % self._stride

    def _rank(self, i: int) -> int:
        """Hand-out rank of pool chunk i: by rarity, an unclaimed chunk before a claimed
        one (its claimer will have it soon, and can pass it on; a chunk of a fellow's
        share of the partition counts as claimed)."""
        return 2 * self._rarity[i] + (self._claims[i] > 0 or self._elsewhere[i >> 3] >> (i & 7) & 1)

    def _partition(self) -> None:
        """Recompute which chunks belong to a fetching fellow (see "Swarm partition")."""
        own = self._own_weights
        if own is None:
            return
        mask = 0
        for q in self._partials.values():
            if not q.soon_count:
                continue
            if q.beats is None:
                theirs = _chunk_hashes(q.name, self._n)
                q.beats = int.from_bytes(
                    bitmap_of((i for i in range(self._n) if theirs[i] > own[i]), self._n),
                    "little",
                )
            mask |= q.beats
        self._elsewhere = mask.to_bytes((self._n + 7) // 8, "little")

    def _key(self, i: int) -> int:
        return self._rank(i) * self._stride + (i - self._start) % self._stride

    def _offer(self, i: int) -> None:
        """Push pool chunk i, at its current rarity, to every heap that may serve it."""
        if self._dirty:
            return  # the rebuild will place it
        key = self._key(i)
        heapq.heappush(self._full_heap, key)
        pushes = 1
        byte, bit = i >> 3, 1 << (i & 7)
        for q in self._partials.values():
            bm = q.bitmap
            assert bm is not None
            if bm[byte] & bit:
                heapq.heappush(q.heap, key)
                pushes += 1
        self._pushes += pushes
        # Lazy deletion leaves stale entries behind; rebuild once they could dominate.
        if self._pushes > 2 * self._n + 64:
            self._dirty = True

    def _rebuild(self) -> None:
        self._partition()
        state = self._state
        stride = self._stride
        pool = [i for i in range(self._n) if state[i] == _POOL]
        start = self._start
        rank = {i: self._rank(i) for i in pool}
        full = [rank[i] * stride + (i - start) % stride for i in pool]
        heapq.heapify(full)
        self._full_heap = full
        for p in self._partials.values():
            bm = p.bitmap
            assert bm is not None
            heap = [
                rank[i] * stride + (i - start) % stride for i in pool if bm[i >> 3] >> (i & 7) & 1
            ]
            heapq.heapify(heap)
            p.heap = heap
        self._dirty = False
        self._pushes = 0

    def _fetchable_pool(self) -> int:
        """Pool chunks that some usable peer holds."""
        return self._pool_count if self._full_usable else self._pool_count - self._orphans

    # Choosing chunks.

    def _inflight_limit(self, p: _Peer) -> int:
        cfg = self._cfg
        cap = cfg.max_inflight_requests_per_peer
        # A seeder shared with fellows (swarming, not alone) gets what its rate and the
        # path hold (below), not a request per connection: every request queued there is
        # seconds of a slow uplink that its other fetchers wait behind, and which they
        # may have to take from it again (three fetchers of a 32 MiB blob from a 100
        # Mbit/s seeder striped four ways: it sent 1.45-2.29x the blob, median 1.86).
        shared_seeder = cfg.defer_to_partial_holders and p.bitmap is None and not self._uncapped(p)
        if shared_seeder:
            want = 1
        elif p.connections > 1 and p.depth > 1:
            # Pipelined stripes: the requests queued behind each connection's current one
            # wait at the server for their turn, holding no stream and no send buffer there.
            cap = max(cap, p.depth * p.connections)
            want = p.depth * p.connections
        else:
            # Every connection carries a request, and half of them a second one (on a
            # stream of its own) that covers the round trip between two requests.
            want = p.connections + (p.connections + 1) // 2
        floor = min(cfg.min_inflight_requests_per_peer, cap)
        want = max(floor, want)
        if p.rate is not None and p.rtt is not None and self._n:
            # The bytes the path holds in flight, in requests of this peer's rate-scaled
            # batch, plus one: the measured rate is what the requests in flight achieved,
            # so the spare request is also how the limit finds a longer pipe.
            request_bytes = max(1, self._rate_batch(p)[0] * self._chunk_length(0))
            want = max(want, math.ceil(p.rate * p.rtt / request_bytes) + 1)
        if p.busy_limit is not None:
            want = min(want, p.busy_limit)
        if (
            cfg.defer_to_partial_holders
            and p.bitmap is None
            and p.rate is None
            and not self._uncapped(p)
        ):
            want = min(want, cfg.swarm_unmeasured_inflight_requests)
        return min(cap, want)

    def _rate_batch(self, p: _Peer) -> tuple[int, list[_Peer], list[float], float]:
        """The peer's batch scaled by its rate (and the usable peers, their rates, the
        best rate, which the tail rule below needs too)."""
        m = self._cfg.max_chunks_per_request
        usable = [q for q in self._peers.values() if q.usable]
        rates = [q.rate for q in usable if q.rate is not None]
        best = max(rates, default=0.0)
        if p.rate is None:
            size = max(1, m // 4) if rates else m
        elif best <= 0.0:
            size = m
        else:
            size = max(1, min(m, math.ceil(m * p.rate / best)))
        cfg = self._cfg
        chunk = max(1, self._chunk_length(0)) if self._n else 1
        if self._uncapped(p):
            pass
        elif p.rate is None and cfg.unmeasured_batch_bytes is not None:
            size = min(size, max(1, cfg.unmeasured_batch_bytes // chunk))
        elif p.rate is not None and cfg.max_request_seconds is not None:
            size = min(size, max(1, math.ceil(p.rate * cfg.max_request_seconds / chunk)))
        if p.rate is not None and p.rtt is not None and p.connections > 1:
            # Striped: a request need cover only a few round trips of its connection's
            # share of the rate. Full batches on every connection put most of a blob in
            # flight at once (12 x 16 MiB), so the pool emptied early and a second
            # provider's tail waited on the first one's queue.
            per_conn = p.rate / p.connections * p.rtt * STRIPED_REQUEST_RTTS
            size = min(size, max(2, math.ceil(per_conn / chunk)))
        return size, usable, rates, best

    def _batch_size(self, p: _Peer) -> int:
        size, usable, rates, best = self._rate_batch(p)
        fetchable = self._fetchable_pool()
        if 0 < fetchable < size * 2:
            # The tail of the pool: take only p's rate-weighted share of it next to the
            # idle peers that may still want some (a partial peer's heap may hold stale
            # entries, so this errs towards smaller shares). Unmeasured peers count as
            # the best one.
            def weight(q: _Peer) -> float:
                return q.rate if q.rate is not None else (best if rates else 1.0)

            mine = weight(p)
            total = mine + sum(
                weight(q)
                for q in usable
                if q is not p and not q.requests and (q.bitmap is None or q.heap)
            )
            if total > 0.0:
                size = min(size, max(1, math.ceil(fetchable * mine / total)))
        if p.connections > 1 and 0 < fetchable * self._chunk_length(0) < p.outstanding_bytes:
            # A striped peer's last chunks: what is left of the pool is less than it owes
            # already, so each of its connections gets an even part of it, not the first
            # to ask all of it (one connection then ran on alone after the others were
            # done, at a fraction of the link's rate).
            size = min(size, max(1, math.ceil(fetchable / p.connections)))
        return size

    def _defers(self, p: _Peer) -> bool:
        """Whether full peer ``p`` leaves chunks held or claimed by partial peers to them
        (config ``defer_to_partial_holders``): some usable partial peer holding a pool
        chunk, or claiming chunks, is at least ``DEFER_RATE_FRACTION`` as fast as ``p``,
        or either is not measured yet."""
        if not self._cfg.defer_to_partial_holders or p.bitmap is not None:
            return False
        return any(
            (q.heap or q.soon_count)
            and (q.rate is None or p.rate is None or q.rate >= p.rate * DEFER_RATE_FRACTION)
            for q in self._partials.values()
        )

    def _pick_pool(self, p: _Peer, limit: int) -> list[int]:
        heap = self._full_heap if p.bitmap is None else p.heap
        orphans_only = self._defers(p)
        bm = p.bitmap
        state = self._state
        stride = self._stride
        max_ranges = self._cfg.max_ranges_per_request
        picked: list[int] = []
        chosen: set[int] = set()
        ranges = 0
        start = self._start
        while heap and len(picked) < limit:
            key = heap[0]
            i = (key % stride + start) % stride
            if (
                state[i] != _POOL
                or key // stride != self._rank(i)
                or i in chosen
                or (bm is not None and not bm[i >> 3] >> (i & 7) & 1)
            ):
                heapq.heappop(heap)  # stale entry
                continue
            if orphans_only and key >= stride:
                break  # held or claimed by a partial peer: left to it (keys go by rank)
            after = ranges + 1 - ((i - 1) in chosen) - ((i + 1) in chosen)
            if after > max_ranges:
                break  # leave it for the next request
            heapq.heappop(heap)
            picked.append(i)
            chosen.add(i)
            ranges = after
        return picked

    def _late_at(self, r: _Request) -> float:
        """When ``r`` will have been out longer than its peer should need for it (see
        ENDGAME_PATIENCE_RTTS)."""
        q = r.peer
        patience = ENDGAME_PATIENCE_RTTS * (q.rtt or 0.0)
        if q.rate:
            # Counted in whole chunks of the first one's length: idle workers ask this of
            # every live request, and summing each chunk's span was ~2% of a 16-worker
            # swarm fetcher's CPU (cProfile).
            patience += len(r.unreceived) * self._chunk_length(0) / q.rate
        return r.issued_at + max(ENDGAME_MIN_PATIENCE_S, patience)

    def next_late_at(self, now: float) -> float | None:
        """The soonest time after ``now`` at which a live request becomes late, so an
        endgame copy of it may be handed out (None: none will, or the endgame has not
        begun). An idle worker sleeps until then at most, not a whole idle period."""
        if self._fetchable_pool():
            return None
        times = [t for r in self._requests.values() if (t := self._late_at(r)) > now]
        return min(times, default=None)

    def _pick_endgame(self, p: _Peer, limit: int, now: float) -> list[int]:
        if self._cfg.endgame_duplicates <= 0:
            return []
        copies = 1 + self._cfg.endgame_duplicates
        others = [r for r in self._requests.values() if r.peer is not p and now >= self._late_at(r)]
        if self._cfg.defer_to_partial_holders and p.bitmap is None:
            # A swarm's seeder copies a fellow's request only once it is overdue: the
            # fellow's link is the fast one, and each copy costs the seeder's uplink.
            others = [
                r
                for r in others
                if r.peer.bitmap is None or now - r.issued_at >= SWARM_ENDGAME_PATIENCE_S
            ]
        # Oldest first: the request most likely stuck; then the slowest peer's.
        others.sort(key=lambda r: (r.issued_at, r.peer.rate or 0.0, r.ticket.request_id))
        max_ranges = self._cfg.max_ranges_per_request
        picked: list[int] = []
        chosen: set[int] = set()
        ranges = 0
        for req in others:
            for i in sorted(req.unreceived):
                if len(picked) >= limit:
                    return picked
                if (
                    i in chosen
                    or self._state[i] != _INFLIGHT
                    or len(self._inflight[i]) >= copies
                    or not p.holds(i)
                ):
                    continue
                after = ranges + 1 - ((i - 1) in chosen) - ((i + 1) in chosen)
                if after > max_ranges:
                    return picked
                picked.append(i)
                chosen.add(i)
                ranges = after
        return picked

    def _issue(self, p: _Peer, picked: list[int], now: float, endgame: bool) -> RequestTicket:
        rid = self._next_id
        self._next_id += 1
        picked.sort()
        nbytes = 0
        state = self._state
        for i in picked:
            nbytes += self._chunk_length(i)
            if state[i] == _POOL:
                state[i] = _INFLIGHT
                self._pool_count -= 1
                if self._rarity[i] == 0:
                    self._orphans -= 1
            self._inflight.setdefault(i, set()).add(rid)
        if not p.requests:
            # The peer was idle: its rate clock starts now, not at its last chunk.
            p.mark = now
            p.unfolded_bytes = 0
        deadline = (
            now
            + self._cfg.request_timeout_base
            + (p.outstanding_bytes + nbytes) / self._cfg.min_rate_bytes_per_s
        )
        p.outstanding_bytes += nbytes
        ticket = RequestTicket(
            request_id=rid,
            peer=p.name,
            ranges=_to_ranges(picked),
            deadline=deadline,
            indices=frozenset(picked),
            endgame=endgame,
        )
        req = _Request(ticket, p, now, set(picked))
        self._requests[rid] = req
        p.requests[rid] = req
        self._request_peer[rid] = p.name
        heapq.heappush(self._deadlines, (deadline, rid))
        return ticket

    # Chunk and request state changes.

    def _mark_verified(self, i: int) -> bool:
        s = self._state[i]
        if s == _VERIFIED:
            return False
        if s == _POOL:
            self._pool_count -= 1
            if self._rarity[i] == 0:
                self._orphans -= 1
        else:
            # Other live requests still owe it (endgame copies); they will deliver a
            # duplicate that on_chunk reports as not new.
            del self._inflight[i]
        self._state[i] = _VERIFIED
        self._verified_count += 1
        return True

    def _release(self, req: _Request) -> None:
        rid = req.ticket.request_id
        p = req.peer
        del self._requests[rid]
        del p.requests[rid]
        self._overdue.discard(rid)
        state = self._state
        for i in sorted(req.unreceived):
            p.outstanding_bytes -= self._chunk_length(i)
            if state[i] != _INFLIGHT:
                continue
            owers = self._inflight[i]
            owers.discard(rid)
            if not owers:
                del self._inflight[i]
                state[i] = _POOL
                self._pool_count += 1
                if self._rarity[i] == 0:
                    self._orphans += 1
                self._offer(i)
        req.unreceived.clear()

    def _release_all(self, p: _Peer) -> None:
        for req in list(p.requests.values()):
            self._release(req)

    def _ban(self, name: str, reason: str) -> None:
        p = self._peers[name]
        if p.usable:
            self._contribute(p, -1)
        p.banned = True
        p.rate = 0.0
        p.last_error = reason
        self._release_all(p)

    def _observe(self, p: _Peer, nbytes: int, now: float) -> None:
        """Fold `nbytes` delivered at `now` into the peer's rate: a time-weighted EWMA of
        bytes/s over the time the peer has had requests in flight."""
        p.unfolded_bytes += nbytes
        dt = now - p.mark
        if dt <= 0.0:
            return
        sample = p.unfolded_bytes / dt
        if p.rate is None:
            p.rate = sample
        else:
            w = 1.0 - math.exp(-dt / self._cfg.rate_time_constant_s)
            p.rate += w * (sample - p.rate)
        p.unfolded_bytes = 0
        p.mark = now

    def _check_invariants(self) -> None:
        """Recount every derived quantity from scratch (tests only: O(num_chunks))."""
        state = self._state
        n = self._n
        assert self._verified_count == sum(1 for s in state if s == _VERIFIED)
        assert self._pool_count == sum(1 for s in state if s == _POOL)
        rarity = [0] * n
        claims = [0] * n
        for p in self._peers.values():
            if p.usable and p.bitmap is not None:
                assert self._partials.get(p.name) is p
                for i in _set_bits(p.bitmap):
                    rarity[i] += 1
                if p.soon is not None:
                    assert not int.from_bytes(p.soon, "little") & int.from_bytes(p.bitmap, "little")
                    for i in _set_bits(p.soon):
                        claims[i] += 1
            else:
                assert p.name not in self._partials
            if not p.usable:
                assert not p.requests
            owed = sum(self._chunk_length(i) for r in p.requests.values() for i in r.unreceived)
            assert p.outstanding_bytes == owed, (p.name, p.outstanding_bytes, owed)
            assert len(p.requests) <= max(
                self._cfg.max_inflight_requests_per_peer, p.depth * p.connections
            )
        assert rarity == self._rarity
        assert claims == self._claims
        assert self._full_usable == sum(
            1 for p in self._peers.values() if p.usable and p.bitmap is None
        )
        assert self._orphans == sum(1 for i in range(n) if state[i] == _POOL and rarity[i] == 0)
        owers: dict[int, set[int]] = {}
        for rid, r in self._requests.items():
            assert r.peer.requests.get(rid) is r
            for i in r.unreceived:
                if state[i] != _VERIFIED:
                    owers.setdefault(i, set()).add(rid)
        assert owers == self._inflight
        assert all(state[i] == _INFLIGHT for i in owers)
        assert all(s != _INFLIGHT or i in owers for i, s in enumerate(state))
        if not self._dirty:
            full = set(self._full_heap)
            for i in range(n):
                if state[i] == _POOL:
                    key = self._key(i)
                    assert key in full, i
                    for p in self._partials.values():
                        if p.holds(i):
                            assert key in p.heap, (p.name, i)


# --------------------------------------------------------------------------------------
# Striping one provider over several connections


@dataclass(frozen=True)
class StripeConfig:
    """When a download opens another TCP connection to one provider."""

    # A stock kernel caps one TCP connection's buffers at a few MiB (tcp_wmem 4 MiB), so at
    # 200 ms one connection carries ~13 MB/s and eight ~75 MB/s (research/update-2026-12):
    # eight fill a gigabit link across continents; more mostly add handshakes and state.
    max_connections: int = 8
    # A step is judged over at least this long, and over `settle_rtts` round trips: a new
    # TCP connection needs several RTTs of slow start before it carries its share.
    min_settle_s: float = 0.3
    # Eight RTTs: a new connection's slow start needs about six (from a 10-segment initial
    # window to a few MiB at a 9000-byte MTU) before it carries its share.
    settle_rtts: float = 8.0
    # The first step needs no new connection to ramp up: as soon as the one connection
    # holds `min_bytes_in_flight` (judged over this many RTTs), the path is long and fat.
    first_settle_rtts: float = 3.0
    # Each step multiplies the connections by this much (1 -> 4 -> 8): every step costs a
    # dial and a settle, ~2.5 s at 200 ms, so few steps matter more than a fine count.
    growth_factor: int = 4
    # A step's rate is judged over at least this many bytes, not a handful of chunks.
    min_window_bytes: int = 8 << 20
    # On a path this long (intercontinental: stock buffers cap one connection at ~4 MiB /
    # RTT, 84 MB/s at 50 ms) the first step is taken at once, before any rate is known:
    # dials cost ~5 RTTs each, so waiting to measure one connection first costs seconds.
    # What follows is judged as usual (an idle link's extra connections cost a handshake).
    predial_rtt_s: float = 0.05
    predial_connections: int = 4
    # On a path this long (200 ms eu-asia, 150 ms us-asia) the first step goes straight to
    # ``max_connections``: one connection carries ~4 MiB / RTT, 27 MB/s at 150 ms, and the
    # step 4 -> 8 cost a settle of 8 RTTs plus a dial, ~2.5 s at 200 ms, in which most of
    # a 256 MiB fetch was gone (WAN bench: 0.65x raw 8-conn). A long thin path pays a few
    # idle handshakes.
    predial_all_rtt_s: float = 0.15
    # The rate must grow by this fraction over the previous step's for another step: a
    # link already full (or a CPU-bound loopback) stops growing after one extra connection.
    min_gain: float = 0.15
    # Grow only while each connection holds at least this much in flight (its rate x RTT):
    # a connection limited by its socket buffers holds a few MiB (stock tcp_wmem max is
    # 4 MiB), while a LAN or loopback connection at full speed holds far less and gains
    # nothing from company but CPU cost.
    min_bytes_in_flight: int = 1 << 20

    def early_lanes(self, rtt: float | None) -> int:
        """Bulk connections worth opening at once to a provider ``rtt`` away, before any
        rate is measured: ``predial_connections`` from ``predial_rtt_s``,
        ``max_connections`` from ``predial_all_rtt_s``, else none (growth decides)."""
        if rtt is None or rtt < self.predial_rtt_s or self.max_connections < 2:
            return 0
        if rtt >= self.predial_all_rtt_s:
            return self.max_connections
        return min(self.max_connections, self.predial_connections)

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if not self.min_settle_s > 0 or self.settle_rtts < 0 or self.first_settle_rtts < 0:
            raise ValueError("min_settle_s must be positive and the settle RTTs not negative")
        if self.min_gain < 0:
            raise ValueError("min_gain must not be negative")
        if self.growth_factor < 2:
            raise ValueError("growth_factor must be at least 2")


class StripeGrowth:
    """Sans-IO: how many connections one download should stripe one provider over.

    The provider starts on one connection. After each step has settled (``min_settle_s``,
    and ``settle_rtts`` round trips; ``first_settle_rtts`` before the first step, when no
    new connection is ramping up), the rate measured over the second half of the step
    (the first half is the new connections' slow start) is compared with the previous
    step's: the first step multiplies the connections by ``growth_factor``, later ones
    do so again only if the rate grew by ``min_gain``, so 1 -> 4 -> 8 on a path limited
    by per-connection buffers, and 1 -> 4 and stop where the link is the limit. No step
    is taken while a connection holds less than ``min_bytes_in_flight`` (rate x RTT per
    connection): a LAN or a loopback, where one connection is never buffer-limited, keeps
    one connection. A step in which the provider ran out of work (``busy`` False) says
    nothing about the path and is measured again. A failed dial ends growth for this
    download. On a path of ``predial_rtt_s`` or more the first step, to
    ``predial_connections`` (``max_connections`` from ``predial_all_rtt_s``), is taken at
    once, before anything is measured.
    """

    def __init__(self, config: StripeConfig, now: float, connections: int = 1) -> None:
        self._cfg = config
        self.connections = max(1, connections)
        self.pending = 0  # dials asked for and not yet reported
        self.stopped = self.connections >= config.max_connections
        self._baseline: float | None = None  # rate of the previous step
        self._start = now
        self._marked = False
        self._mark = now
        self._bytes = 0
        self._rtt: float | None = None  # the last RTT `decide` was told
        self._predialled = False

    def _settle(self, rtt: float | None) -> float:
        rtts = self._cfg.first_settle_rtts if self._baseline is None else self._cfg.settle_rtts
        return max(self._cfg.min_settle_s, rtts * (rtt or 0.0))

    def on_bytes(self, nbytes: int, now: float, rtt: float | None = None) -> None:
        """`nbytes` of this provider's chunks arrived at `now`."""
        if rtt is None:
            rtt = self._rtt
        if not self._marked and now - self._start >= self._settle(rtt) / 2:
            self._marked = True
            self._mark = now
            self._bytes = 0
            return  # what arrived by the mark belongs to the ramp
        if self._marked:
            self._bytes += nbytes

    def decide(self, now: float, rtt: float | None, busy: bool) -> int:
        """How many connections to dial now (0 for none). `busy`: the provider had work
        queued the whole time (requests in flight and chunks left in the pool)."""
        self._rtt = rtt
        if self.stopped or self.pending:
            return 0
        if (
            not self._predialled
            and busy
            and rtt is not None
            and rtt >= self._cfg.predial_rtt_s
            and self.connections < self._cfg.predial_connections
        ):
            self._predialled = True
            self.pending = self._cfg.early_lanes(rtt) - self.connections
            return self.pending
        settle = self._settle(rtt)
        if now - self._start < settle:
            return 0
        if not busy or not self._marked or now <= self._mark:
            self._restart(now)
            return 0
        if self._bytes < self._cfg.min_window_bytes:
            return 0  # too few bytes yet to tell a rate from a burst
        rate = self._bytes / (now - self._mark)
        baseline = self._baseline
        if rate <= 0.0 or (baseline is not None and rate < baseline * (1 + self._cfg.min_gain)):
            self.stopped = True
            return 0
        if rate / self.connections * (rtt or 0.0) < self._cfg.min_bytes_in_flight:
            # Not buffer-limited (yet): measure again, the rate may still be ramping up.
            self._baseline = rate if baseline is not None else None
            self._restart(now)
            return 0
        self._baseline = rate
        want = (
            min(self._cfg.max_connections, self.connections * self._cfg.growth_factor)
            - self.connections
        )
        self.pending = want
        return want

    def on_dialled(self, ok: bool, now: float) -> None:
        """One dial asked for by `decide` ended (`ok`: the connection is usable)."""
        self.pending = max(0, self.pending - 1)
        if ok:
            self.connections += 1
        else:
            self.stopped = True
        if self.connections >= self._cfg.max_connections:
            self.stopped = True
        if not self.pending:
            self._restart(now)

    def next_check(self, now: float, rtt: float | None) -> float:
        """When `decide` may next say something new."""
        return max(now, self._start + self._settle(rtt))

    def _restart(self, now: float) -> None:
        self._start = now
        self._marked = False
        self._bytes = 0


# --------------------------------------------------------------------------------------
# Remembering peers across downloads


@dataclass(frozen=True)
class ScoreConfig:
    # A peer that sent one bad chunk is distrusted for about a day (score 1 decays below
    # the threshold 0.25 after two half-lives): long enough to outlast a training round's
    # many fetches, short enough that a provider whose disk was repaired is used again.
    half_life_s: float = 12 * 3600.0
    distrust_threshold: float = 0.25
    # Scores kept at most; the least-penalised entries are forgotten first. Identities are
    # free, so this bounds memory, not the number of liars one can meet.
    max_peers: int = 4096


class PeerScores:
    """Sans-IO: penalties for peers that sent bad data, decaying with ``half_life_s``.

    A download that bans a peer (bad chunk, protocol breach) reports it here; later
    downloads of the same node start distrusted peers last (``distrusted``)."""

    def __init__(self, config: ScoreConfig = ScoreConfig()) -> None:
        self._cfg = config
        self._scores: dict[str, tuple[float, float]] = {}  # peer -> (score, at time)

    def penalize(self, peer: str, now: float, amount: float = 1.0) -> None:
        self._scores[peer] = (self.score(peer, now) + amount, now)
        if len(self._scores) > self._cfg.max_peers:
            weakest = min(self._scores, key=lambda name: self.score(name, now))
            del self._scores[weakest]

    def score(self, peer: str, now: float) -> float:
        entry = self._scores.get(peer)
        if entry is None:
            return 0.0
        value, at = entry
        return float(value * 0.5 ** (max(0.0, now - at) / self._cfg.half_life_s))

    def distrusted(self, peer: str, now: float) -> bool:
        return self.score(peer, now) >= self._cfg.distrust_threshold

    def snapshot(self, now: float) -> dict[str, float]:
        """Every score as of ``now`` that still matters (above a tenth of the threshold),
        for keeping across processes (p2p.fetch.peer_memory)."""
        floor = self._cfg.distrust_threshold / 10
        return {p: v for p in self._scores if (v := self.score(p, now)) >= floor}

    def restore(self, scores: dict[str, float], now: float, elapsed_s: float) -> None:
        """Merge scores saved ``elapsed_s`` seconds ago (decayed by that much) into this
        table as of ``now``, keeping the larger of two scores for one peer."""
        decay = 0.5 ** (max(0.0, elapsed_s) / self._cfg.half_life_s)
        for peer, value in list(scores.items())[: self._cfg.max_peers]:
            carried = value * decay
            if carried > self.score(peer, now):
                self._scores[peer] = (carried, now)

    def __len__(self) -> int:
        return len(self._scores)
