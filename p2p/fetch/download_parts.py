"""Download's building blocks: bounds, progress reports, the network protocols it needs,
and the small helpers every part of a transfer shares."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import trio

from blobstore import (
    DEFAULT_CHUNK_SIZE,
)
from p2p.blob import messages
from p2p.blob.pacing import Pacer
from p2p.fetch.chunk_writer import usable_cpus
from p2p.fetch.sched_records import SWARM_ENDGAME_PATIENCE_S, PeerStats
from p2p.transport.fast import kernel_rtt

log = logging.getLogger(__name__)

# Flush verified chunks to disk at least this often: bounds what a crash can lose.
FLUSH_INTERVAL = 2.0
# How long one provider may take to open a stream and answer a small request.
CONTROL_TIMEOUT = 15.0
# With no usable provider left, wait this long for discovery to find another.
STALL_GRACE = 10.0
# Providers asked for the manifest at the same time.
MANIFEST_FANOUT = 4
# The first provider asked for the manifest is asked for this chunk on the same stream
# (pipelined, before the manifest is in): at 200 ms the first chunk came a round trip
# sooner. The `get` is granted credit for a chunk of the default size (the manifest,
# which tells the real one, is not in yet).
SPECULATIVE_CHUNK = 0
SPECULATIVE_ANSWER_BYTES = DEFAULT_CHUNK_SIZE + messages.CHUNK_HEADER_ROOM
# Pauses before a provider that was unreachable, busy or dropped is tried again.
PEER_RETRY_PAUSES = (1.0, 3.0, 9.0)
# Pauses before a provider that did not answer a manifest request is asked again (behind
# the other candidates): a seeder whose uplink a fetch fills can hold a newcomer's answer
# past CONTROL_TIMEOUT (seen in the fan-out bench, behind a 2 Mbit/s uplink), and that
# is no reason to give up on it.
MANIFEST_RETRY_PAUSES = (1.0, 3.0)
# What a peer that sent no manifest did, when it let CONTROL_TIMEOUT pass without an answer
# (else what it did say: busy, or a stream it closed or reset unanswered).
NO_ANSWER = "no answer"
# Peers that answered no manifest for another reason, named one by one in a fetch's error;
# the rest are counted (a line, not a page).
MAX_REASONS_SAID = 3
# How much of a transport error one such reason quotes.
MAX_REASON_CHARS = 120


@dataclass(frozen=True)
class _Unanswered:
    """A manifest request that got no answer: ``why`` is NO_ANSWER after CONTROL_TIMEOUT,
    else what the transport said (a stream closed or reset at once is no wait)."""

    why: str


# A provider that sent bad data in an earlier download (PeerScores) starts this much later
# than the others: if they can serve the blob, it never gets a request; if they cannot,
# it still may (its bad chunks are refused one by one, as ever).
DISTRUSTED_START_DELAY = 5.0
# A partial provider (a fellow fetcher, p2p.blob.swarm) is asked `have` again this often while
# it lacks chunks we lack: its chunks arrive as it fetches them; one small request a
# second per partial peer is cheap next to the chunks.
HAVE_REFRESH_INTERVAL = 0.5
# A seeder must count nobody else this many times in a row, HAVE_REFRESH_INTERVAL apart,
# before its opening caps come off for good (ProviderWatch.watch_alone). Fetchers started
# together reach it tens to hundreds of milliseconds apart, so the first to ask hears 0:
# uncapped on that one answer, it asked for 16 MiB per request and took a 32 MiB blob
# nearly whole from a 100 Mbit/s seeder, which sent 1.7-3.0x the blob to three fetchers
# (8 runs; 1.5-1.8x without the rule). After the first answer only the seeder's share of
# the blob is capped (Scheduler.set_alone's ``once``): 1.5-1.8x again, and a lone
# eu->asia fetch keeps most of what the rule gained (49.9-50.9 MB/s against 52-55
# uncapped at once; 45-48 when the caps stayed until the second answer).
ALONE_ANSWERS = 2
# Requests a worker keeps outstanding on a striped provider's bulk stream (rule 10): the
# next is at the server before the current answer ends, so the connection does not idle
# a round trip between two requests (at 200 ms a lane with one request at a time, each
# covering 3 round trips, idled a quarter of the time). Two suffice: a request covers
# several round trips of its lane's share (p2p.fetch.scheduler.STRIPED_REQUEST_RTTS).
PIPELINE_DEPTH = 2
# An idle stream worker (no request to send) or worker spawner waits for the next change
# the downloader reports (`Changes.notify`: every request's end, chunk, claim and peer
# change), or at most this long: the scheduler's only condition that ripens with time
# alone is the swarm endgame's patience, so waking sooner finds nothing new. At 0.5 s the
# ~50 idle tasks of a 16-fellow swarm fetch woke ~6400 times per fetch, ~10% of its CPU
# (16-worker fan-out of 256 MiB: 2.89-3.06x one transfer -> 2.50-2.57x, CPU per get
# 5.0-5.4 s -> 4.7-4.8).
IDLE_WAKE_S = SWARM_ENDGAME_PATIENCE_S
# Progress callbacks are rate-limited so a fast transfer does not spend time reporting.
PROGRESS_INTERVAL = 0.25
# Chunk bodies in flight (received, or queued for hashing and the disk) share this much
# memory, but never fewer than MIN_BUFFERS chunks, so every stream can keep one body
# arriving while another is written.
BUFFER_POOL_BYTES = 32 * 1024 * 1024
MIN_BUFFERS = 4
# Hash each chunk on the event loop as it arrives, leaving only the write to a thread. On
# two vCPUs this made whole fetches faster in every alternating pair measured (figures in
# p2p.fetch.chunk_writer): the bytes are still in the receiving core's cache, and the writer
# thread takes the GIL once per chunk. With more cores, hashing in the writer threads
# keeps the event loop free for receiving.
HASH_ON_ARRIVAL = usable_cpus() <= 2


def path_rtt(timed: float, stream: Any) -> float:
    """A request's round trip on ``stream`` as the scheduler should see it: the time it
    took, less one kernel-measured RTT when that is what it took too long by. The first
    request on a new connection leaves before the muxer's answer (p2p.transport.fast.upgrade) and so
    waits out the listener's setup as well: about two round trips, where later ones take
    one plus the server's time. Never below the kernel's RTT."""
    kernel = kernel_rtt(stream)
    if kernel is None:
        return timed
    return min(timed, max(kernel, timed - kernel))


class BadChunk(Exception):
    """A peer sent a chunk that failed its hash (internal signal)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"chunk {index} failed its hash")
        self.index = index


class _RequestWrites:
    """The chunk writes one request has running in worker threads, and how they ended."""

    def __init__(self) -> None:
        self.running = 0
        self._idle = trio.Event()
        self._idle.set()
        self.bad_index: int | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        if self.running == 0:
            self._idle = trio.Event()
        self.running += 1

    def finish(self) -> None:
        self.running -= 1
        if self.running == 0:
            self._idle.set()

    async def wait(self) -> None:
        """Until every write has ended; shielded, since a write cannot be called back
        from its thread and its outcome must be accounted for either way."""
        with trio.CancelScope(shield=True):
            await self._idle.wait()


class ObsoleteRequest(Exception):
    """Every chunk of an endgame request has verified elsewhere (internal signal)."""


@dataclass(frozen=True)
class Progress:
    blob_id: str
    total_bytes: int
    done_bytes: int
    rate_bytes_per_s: float
    elapsed: float
    peers: dict[str, PeerStats] = field(default_factory=dict)
    # Bytes of chunks each peer delivered first (what was kept), and bytes that arrived
    # after the same chunk had verified from another peer (endgame duplicates).
    new_bytes: dict[str, int] = field(default_factory=dict)
    duplicate_bytes: int = 0
    finished: bool = False
    # Bytes fetched over the time since the first chunk's first byte arrived (0.0 until
    # then): the figure raw TCP's rate is (first byte to last), without the round trip
    # that a request costs before anything can arrive.
    transfer_rate_bytes_per_s: float = 0.0


ProgressCallback = Callable[[Progress], None]


class Network(Protocol):
    """What the downloader needs from a node."""

    async def open_blob_stream(self, peer: str) -> Any: ...


@runtime_checkable
class StripedNetwork(Protocol):
    """A network that can open several connections to one peer (``p2p.node.node.Node``)."""

    async def open_blob_stream_on(
        self, peer: str, lane: int, *, pipelined: bool = False, tentative: bool = False
    ) -> Any: ...

    async def add_connection(self, peer: str) -> bool: ...

    def connection_count(self, peer: str) -> int: ...

    def connection_rtt(self, peer: str) -> float | None: ...


@runtime_checkable
class PacedNetwork(Protocol):
    """A network whose fetches share a download limit (``p2p.node.node.Node``): a token
    bucket (p2p.blob.pacing) that each arriving chunk draws on before the next is read, so
    TCP's flow control slows the senders."""

    download_pacer: Pacer | None


@runtime_checkable
class BadDataAware(Protocol):
    """A network that counts chunks failing verification, by sender (``p2p.node.node.Node``:
    its metrics and status)."""

    def bad_chunk(self, peer: str) -> None: ...


@runtime_checkable
class RefusalAware(Protocol):
    """A network that wants to hear a provider's error answers (``p2p.node.node.Node``:
    a provider that serves admitted peers only says so in its ``not_found``)."""

    def refused(self, peer: str, message: str) -> None: ...


class Changes:
    """What a download's idle tasks wait on: every request's end, chunk, claim and peer
    change is announced here (`notify`) and wakes them all (an event per generation)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self, seconds: float = IDLE_WAKE_S) -> None:
        """Until the next `notify`, or ``seconds`` at most."""
        with trio.move_on_after(seconds):
            await self._event.wait()


def idle_wait(late_at: float | None, now: float) -> float:
    """How long an idle worker may sleep: until the next request turns late (``late_at``,
    the scheduler's; an endgame copy may be due then), at most IDLE_WAKE_S."""
    return IDLE_WAKE_S if late_at is None else min(IDLE_WAKE_S, late_at - now)
