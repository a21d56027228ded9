"""The records, tunables and helpers of :mod:`p2p.fetch.scheduler`: its config, the
tickets and stats it hands out, its per-peer and per-request records, the named bounds of
its policy, have-bitmap helpers and the rendezvous hashes of the swarm partition.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from p2p.blob.messages import MAX_CHUNKS_PER_REQUEST, MAX_RANGES_PER_REQUEST

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
    # Swarming: a measured peer's request holds at most this many seconds of
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
    # trips); left alone, each would queue a dozen chunks there at once (six requests over
    # four striped connections), most of them the same chunks as its fellows'. Two requests
    # of `unmeasured_batch_bytes` keep a 100 Mbit/s seeder's link busy meanwhile.
    swarm_unmeasured_inflight_requests: int = 2
    # Swarming: once the blob is complete the fetch stays while fellows still ask this
    # node for chunks (p2p.blob.swarm rule 5). For a one-shot `blob get`, whose node ends with
    # the fetch; a long-lived node serves on after its fetch returns anyway, and would
    # only wait longer for it.
    linger_while_asked: bool = False
    # Hash each chunk on the event loop as it arrives (True) or in the writer threads
    # (False); None: as p2p.fetch.download_parts.HASH_ON_ARRIVAL says for this machine.
    hash_on_arrival: bool | None = None

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
    origin: bool = False  # a provider the caller named (set_origin)

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
