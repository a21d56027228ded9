"""Fetching one blob from many providers at once, every chunk verified before it is kept.

Theory of operation
1. The manifest is taken from a partial blob already in the store (resume) or asked of
   up to ``MANIFEST_FANOUT`` providers at once, the first good answer winning (a stale
   provider record costs nothing while another peer answers); it is accepted only if its
   BLAKE3 equals the blob ID, so a lying peer cannot change what "the blob" is.
2. Free disk space for the missing bytes is checked before the partial blob is created.
3. ``p2p.fetch.scheduler.Scheduler`` decides which chunk ranges go to which peer; this module
   only performs its decisions: one task per provider asks ``have`` and then runs a few
   stream workers, each sending one ``get`` at a time under the request's deadline.
4. A chunk body is received straight into a pooled, page-aligned buffer
   (``p2p.blob.buffers``) and written to the partial blob only through
   ``PartialBlob.write_chunk``, which checks its BLAKE3 against the manifest first. On a
   machine with two CPUs or fewer the hash is taken on arrival, on the event loop, while
   the bytes are still in cache (``HASH_ON_ARRIVAL``); the write (and elsewhere the hash)
   runs in one of the download's writer threads (``p2p.fetch.chunk_writer``) while the stream
   goes on receiving the next chunk into another buffer. A request's writes are awaited
   before its outcome reaches the scheduler. A mismatch bans the peer for this download,
   resets its stream and returns its ranges to the pool. Two copies of one chunk
   (endgame) are never written at once: the second waits for the first and is kept only
   if the first failed.
5. Providers may join at any time through a channel (DHT results, connected peers); a
   provider that stalls past its deadline loses its ranges to the others.
6. The partial blob is flushed (data fsync, then bitmap) every ``FLUSH_INTERVAL`` and at
   the end, so a killed fetcher resumes from what was verified; the blob is published by
   atomic rename once every chunk has verified.
7. Memory is bounded by the buffer pool (``BUFFER_POOL_BYTES``, at least
   ``MIN_BUFFERS`` chunks) plus one chunk per stream whose body outgrew it, whatever the
   blob's size.
8. Swarming (p2p.blob.swarm rules 4 to 6): the chunks in flight are posted on the store's
   fetching board for the node's server to call `soon`; a partial provider is asked
   ``status`` (1.3.0; ``have`` where it speaks only older versions) every
   ``HAVE_REFRESH_INTERVAL`` and its claims go to the scheduler, and dropped when that
   stops; only providers with every chunk are striped; a swarming fetch that completed
   stays while fellows still ask it for chunks (``linger_while_asked``: `blob get`). A
   provider with every chunk is asked 1.4.0's ``status`` for its count of other
   fetchers (rule 6), and while it says nobody the swarm's opening caps are off for it.
9. Control lane. A provider striped over several connections (``_grow``,
   ``p2p.fetch.striping.StripeGrowth``) gets its bulk ``get`` streams on the connections the
   fetch added (lanes 1..n), and its first connection (lane 0) is left to control
   streams: ``have``, ``status``, ``peers``, manifests (``p2p.node.node`` sends any stream
   with no chosen connection there). The stream worker that started on lane 0 moves to
   a bulk lane at its next request, and the first growth step dials one connection more
   than it counts. A busy seeder's kernel holds megabytes of chunks unsent in each bulk
   connection's send buffer; an answer queued behind them waits seconds (in a
   16-fetcher fan-out, fellows learnt of each other 9 s into a 15 s fetch).
10. Pipelining. On a striped provider's bulk lanes each worker keeps ``PIPELINE_DEPTH``
   requests outstanding on its ``/blobnet/blob/1.1.0`` stream (`_send_ticket`, then
   `_read_ticket` for the oldest), and there is one worker per bulk lane: the server
   reads the next request as soon as it has answered one, so no lane idles a round trip
   between two requests. A stream that fails takes the requests queued behind its first
   with it: those are cancelled (released without counting a failure against the peer).
   A provider that refuses 1.1.0 (``ProtocolRefused``) is served one request at a time
   from then on (``serial``), and the refused request goes out again.
11. The first chunk rides with the manifest request (`_ask_speculating`): the first
   provider asked gets `manifest` and a `get` of SPECULATIVE_CHUNK on one pipelined
   stream, and that provider's task claims the chunk (``Scheduler.claim``) and reads the
   answer on its first worker, verified against the manifest like any chunk. At 200 ms
   the first verified chunk came a round trip sooner. When swarming
   (``defer_to_partial_holders``) the `get` is a `try_get` on a 1.5.0 stream: a seeder
   that others fetch the blob from declines it (each of N fetchers would otherwise take
   that chunk from the seeder, whose uplink is what a swarm spares: 3 fetchers of 32 MiB,
   +0.09x each), and the chunk goes back to the pool as if never asked; a lone fetcher
   gets it a round trip sooner. A server before 1.5.0 refuses that proposal, and the
   manifest is asked the plain way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial as bind
from typing import Any, Protocol, TypeVar, runtime_checkable

import blake3
import trio
from libp2p.peer.id import ID

from blobstore import (
    DEFAULT_CHUNK_SIZE,
    BlobExists,
    CorruptChunk,
    Manifest,
    NoSpace,
    PartialBlob,
    Store,
)
from p2p.blob import protocol as proto
from p2p.blob.buffers import ChunkBuffers
from p2p.blob.pacing import Pacer
from p2p.blob.shell import BlobClient, ProtocolRefused, StreamLost, open_optimistic, reset_quietly
from p2p.blob.swarm import LINGER_MAX, LINGER_QUIET, FetchingBoard
from p2p.errors import FetchFailed, NoProviders
from p2p.fetch.chunk_writer import ChunkWriter, usable_cpus
from p2p.fetch.scheduler import (
    SWARM_ENDGAME_PATIENCE_S,
    PeerStats,
    RequestTicket,
    Scheduler,
    SchedulerConfig,
)
from p2p.fetch.scores import PeerScores
from p2p.fetch.striping import StripeConfig, StripeGrowth
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
SPECULATIVE_ANSWER_BYTES = DEFAULT_CHUNK_SIZE + proto.CHUNK_HEADER_ROOM
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
# before its opening caps come off for good (_watch_alone). Fetchers started together reach
# it tens to hundreds of milliseconds apart, so the first to ask hears 0: uncapped on that
# one answer, it asked for 16 MiB per request and took a 32 MiB blob nearly whole from a
# 100 Mbit/s seeder, which sent 1.7-3.0x the blob to three fetchers (8 runs; 1.5-1.8x
# without the rule). After the first answer only the seeder's share of the blob is capped
# (Scheduler.set_alone's ``once``): 1.5-1.8x again, and a lone eu->asia fetch keeps most
# of what the rule gained (49.9-50.9 MB/s against 52-55 uncapped at once; 45-48 when the
# caps stayed until the second answer).
ALONE_ANSWERS = 2
# Requests a worker keeps outstanding on a striped provider's bulk stream (rule 10): the
# next is at the server before the current answer ends, so the connection does not idle
# a round trip between two requests (at 200 ms a lane with one request at a time, each
# covering 3 round trips, idled a quarter of the time). Two suffice: a request covers
# several round trips of its lane's share (p2p.fetch.scheduler.STRIPED_REQUEST_RTTS).
PIPELINE_DEPTH = 2
# An idle stream worker (no request to send) or worker spawner waits for the next change
# the downloader reports (`_notify`: every request's end, chunk, claim and peer change), or
# at most this long: the scheduler's only condition that ripens with time alone is the
# swarm endgame's patience, so waking sooner finds nothing new. At 0.5 s the ~50 idle
# tasks of a 16-fellow swarm fetch woke ~6400 times per fetch, ~10% of its CPU (16-worker
# fan-out of 256 MiB: 2.89-3.06x one transfer -> 2.50-2.57x, CPU per get 5.0-5.4 s -> 4.7-4.8).
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


async def fetch_manifest(
    network: Network,
    blob_id: str,
    peer: str,
    unanswered: dict[str, str] | None = None,
    *,
    probes: HaveProbes | None = None,
) -> Manifest | None:
    """Ask one peer for the manifest; None if it has none or it does not match the ID.
    A peer that did not answer (timeout, lost stream, busy) is added to ``unanswered``,
    with what happened (``no_answer``, or the server's own busy reason).
    With ``probes``, the first peer a fetch asks is asked for the first chunk too, on the
    same stream (`_ask_speculating`); the stream goes to ``probes`` for that peer's task."""
    client = None
    try:
        if probes is not None and probes.may_speculate():
            try:
                reply, client = await _ask_speculating(network, blob_id, peer, probes.tentative)
            except ProtocolRefused as exc:
                # A server before 1.1.0 (or, for a `try_get`, before 1.5.0; whether it
                # pipelines, its bulk streams find out): ask the plain way.
                log.info("provider %s refused the first request's version: %s", peer, exc)
                if not probes.tentative:
                    probes.serial.add(peer)
                reply = await _ask_manifest(network, blob_id, peer)
        else:
            reply = await _ask_manifest(network, blob_id, peer)
        if isinstance(reply, proto.ErrorResponse) and isinstance(network, RefusalAware):
            network.refused(peer, reply.message)
        manifest = _checked_manifest(blob_id, peer, reply, unanswered)
        if client is not None and manifest is not None and manifest.num_chunks > 0:
            assert probes is not None
            probes.offer(peer, client)
            client = None
        return manifest
    except proto.ProtocolError as exc:
        log.info("manifest from %s failed: %r", peer, exc)
        return None
    finally:
        if client is not None:
            await reset_quietly(client.stream)


def _checked_manifest(
    blob_id: str,
    peer: str,
    reply: bytes | proto.ErrorResponse | _Unanswered,
    unanswered: dict[str, str] | None,
) -> Manifest | None:
    if isinstance(reply, _Unanswered):
        if unanswered is not None:
            unanswered[peer] = reply.why
        return None
    if isinstance(reply, proto.ErrorResponse) and reply.code == proto.ErrorCode.BUSY:
        if unanswered is not None:
            unanswered[peer] = f"was busy: {reply.message}"
        return None
    if isinstance(reply, proto.ErrorResponse):
        return None
    if blake3.blake3(reply).hexdigest() != blob_id:
        log.warning("peer %s sent a manifest that does not match %s", peer, blob_id)
        return None
    try:
        return Manifest.decode(reply)
    except Exception as exc:  # BadManifest: the ID matched, so the manifest is malformed
        log.warning("peer %s sent a malformed manifest: %s", peer, exc)
        return None


def _unanswered(exc: Exception) -> _Unanswered:
    """What a manifest request that ended in ``exc`` (a timeout or a transport error) says
    in a fetch's error."""
    if isinstance(exc, trio.TooSlowError):
        return _Unanswered(NO_ANSWER)
    said = f"{exc}"[:MAX_REASON_CHARS] or type(exc).__name__
    if isinstance(exc, StreamLost):
        return _Unanswered(f"closed or reset the stream unanswered ({said})")
    return _Unanswered(f"could not be asked ({type(exc).__name__}: {said})")


async def _ask_manifest(
    network: Network, blob_id: str, peer: str
) -> bytes | proto.ErrorResponse | _Unanswered:
    """One manifest request; `_Unanswered` if the peer did not answer it. A protocol
    breach is raised (ProtocolError): that peer is not asked again."""
    stream = None
    try:
        with trio.fail_after(CONTROL_TIMEOUT):
            stream = await network.open_blob_stream(peer)
            return await BlobClient(stream).manifest(blob_id)
    except (StreamLost, trio.TooSlowError, OSError) as exc:
        log.info("manifest from %s failed: %r", peer, exc)
        return _unanswered(exc)
    finally:
        if stream is not None:
            await reset_quietly(stream)


async def _ask_speculating(
    network: Network, blob_id: str, peer: str, tentative: bool = False
) -> tuple[bytes | proto.ErrorResponse | _Unanswered, BlobClient | None]:
    """The manifest request and a `get` of SPECULATIVE_CHUNK sent together on one
    ``/blobnet/blob/1.1.0`` stream (``tentative``: a `try_get` on a 1.5.0 one): the
    manifest's answer, and the client whose `get` is still to be read (None unless a
    manifest came). ProtocolRefused: the peer does not speak that version. The chunk is
    checked against the manifest when it is read, as any other."""
    assert isinstance(network, StripedNetwork)
    client = None
    try:
        with trio.fail_after(CONTROL_TIMEOUT):
            stream = await network.open_blob_stream_on(peer, 0, pipelined=True, tentative=tentative)
            version = proto.Version.V1_5 if tentative else proto.Version.V1_1
            client = BlobClient(stream, version=version, pipelined=True)
            await client.send_manifest(blob_id)
            span = ((SPECULATIVE_CHUNK, SPECULATIVE_CHUNK + 1),)
            await client.send_get(
                blob_id, span, answer_bytes=SPECULATIVE_ANSWER_BYTES, tentative=tentative
            )
            reply = await client.read_manifest()
        if not isinstance(reply, bytes):
            return reply, None
        kept, client = client, None
        return reply, kept
    except ProtocolRefused:
        raise
    except (StreamLost, trio.TooSlowError, OSError) as exc:
        if isinstance(exc, StreamLost) and client is not None and not client.negotiated:
            # A 1.0.0-only listener's reset can overtake its `na` (rule 10).
            raise ProtocolRefused(f"stream reset before the protocol echo: {exc}") from exc
        log.info("manifest from %s failed: %r", peer, exc)
        return _unanswered(exc), None
    finally:
        if client is not None:
            await reset_quietly(client.stream)


@dataclass
class _Asked:
    """A request sent to a provider before its task needs the answer (HaveProbes)."""

    done: trio.Event = field(default_factory=trio.Event)
    client: BlobClient | None = None  # the stream, kept for whoever takes the answer


@dataclass
class _Probe(_Asked):
    have: proto.HaveResponse | proto.ErrorResponse | None = None
    rtt: float = 0.0


@dataclass
class _CountProbe(_Asked):
    status: proto.StatusResponse | proto.ErrorResponse | None = None


_A = TypeVar("_A", bound=_Asked)


async def _take(table: dict[str, _A], peer: str) -> _A | None:
    """``peer``'s entry of ``table``, removed, once it has ended (None if there is none)."""
    asked = table.pop(peer, None)
    if asked is not None:
        await asked.done.wait()
    return asked


async def open_status_client(
    network: Network,
    peer: str,
    chunk_length: Callable[[int], int] | None = None,
    *,
    fellows: bool = False,
) -> BlobClient | None:
    """A ``/blobnet/blob/1.3.0`` stream to ``peer`` for ``status`` (1.4.0 with
    ``fellows``; proposed, not yet confirmed: the first answer tells), or None where the
    network has no libp2p host to open one on or the open fails."""
    host = getattr(network, "host", None)
    if host is None or not hasattr(host, "get_network"):
        return None
    version = proto.Version.V1_4 if fellows else proto.Version.V1_3
    try:
        stream = await open_optimistic(host, ID.from_base58(peer), version.protocol_id)
    except Exception as exc:  # libp2p raises many types for one failed open
        log.info("provider %s: no status stream: %r", peer, exc)
        return None
    return BlobClient(stream, chunk_length, version=version)


class HaveProbes:
    """``have`` asked of each provider while its manifest request is still out.

    Waiting for the manifest before asking ``have`` would cost one stream open and one
    round trip more before the first ``get``. A probe opens its own
    stream beside the manifest's and asks at once; the provider's task takes the answer,
    and the stream, for its first worker.

    With ``count_fellows`` (swarming), a probe also asks 1.4.0's ``status`` on a stream
    of its own, for the provider's count of other fetchers (p2p.blob.swarm rule 6): asked once
    the first ``get`` is out, the answer waited behind that request's chunks on a
    connection still in slow start (0.9 s at 200 ms, where a round trip is 0.2 s).

    With ``stripes`` (a striped network), a provider already connected across an ocean
    (``StripeConfig.early_lanes`` of its kernel RTT) gets its extra connections dialled
    now, beside the manifest, not once the manifest and ``have`` are in: the dials take
    two round trips, so the lanes are up about when the download starts."""

    def __init__(
        self,
        network: Network,
        blob_id: str,
        nursery: trio.Nursery,
        *,
        count_fellows: bool = False,
        stripes: StripeConfig | None = None,
    ) -> None:
        self._network = network
        self._blob_id = blob_id
        self._nursery = nursery
        self._count_fellows = count_fellows
        self._stripes = stripes if isinstance(network, StripedNetwork) else None
        self._probes: dict[str, _Probe] = {}
        self._counts: dict[str, _CountProbe] = {}
        self._dials: dict[str, trio.Event] = {}
        self._planned: dict[str, int] = {}  # bulk lanes being dialled, per provider
        # First-chunk `get`s sent with a manifest request, answers unread (fetch_manifest).
        # A `try_get` when swarming (count_fellows): a seeder that others fetch from
        # declines it, else it would send that one chunk N times (rule 11).
        self._speculations: dict[str, BlobClient] = {}
        self._speculated = not isinstance(network, StripedNetwork)
        self.tentative = count_fellows
        self.serial: set[str] = set()  # providers that refused 1.1.0 meanwhile

    def start(self, peer: str) -> None:
        if peer not in self._probes:
            probe = self._probes[peer] = _Probe()
            self._nursery.start_soon(self._ask, peer, probe)
        if self._count_fellows and peer not in self._counts:
            count = self._counts[peer] = _CountProbe()
            self._nursery.start_soon(self._ask_count, peer, count)
        if self._stripes is not None and peer not in self._dials:
            self._dials[peer] = trio.Event()
            self._nursery.start_soon(self._dial_lanes, peer, self._stripes, self._dials[peer])

    async def _dial_lanes(self, peer: str, config: StripeConfig, done: trio.Event) -> None:
        try:
            network = self._network
            assert isinstance(network, StripedNetwork)
            lanes = config.early_lanes(network.connection_rtt(peer))
            wait_lanes = getattr(network, "wait_lanes", None)
            if lanes and wait_lanes is not None and network.connection_count(peer) <= lanes:
                # Lanes the node began to dial when the first connection's TCP connect
                # showed a long path (p2p.node.node.Node.connect with ``lanes``).
                self._planned[peer] = lanes
                await wait_lanes(peer)
            more = lanes + 1 - network.connection_count(peer)  # and the control lane
            if lanes and more > 0:
                self._planned[peer] = lanes
                log.info("provider %s: %d connections at once (far away)", peer, more)
                async with trio.open_nursery() as dials:
                    for _ in range(more):
                        dials.start_soon(network.add_connection, peer)
        finally:
            done.set()

    def planned_lanes(self, peer: str) -> int:
        """Bulk lanes being dialled for ``peer`` at `start` (0: none)."""
        return self._planned.get(peer, 0)

    async def lanes_dialled(self, peer: str) -> None:
        """Until the extra connections dialled for ``peer`` at `start` are up or failed."""
        done = self._dials.get(peer)
        if done is not None:
            await done.wait()

    async def _ask_count(self, peer: str, count: _CountProbe) -> None:
        client = None
        try:
            with trio.fail_after(CONTROL_TIMEOUT):
                client = await open_status_client(self._network, peer, fellows=True)
                if client is not None:
                    count.status = await client.status(self._blob_id)
                    count.client = client
                    client = None
        except (StreamLost, proto.ProtocolError, trio.TooSlowError, OSError) as exc:
            log.info("fetcher count from %s failed: %r", peer, exc)
        finally:
            if client is not None:
                await reset_quietly(client.stream)
            count.done.set()

    async def take_count(self, peer: str) -> _CountProbe | None:
        """The count probe of ``peer``, once it has ended (None if none was started)."""
        return await _take(self._counts, peer)

    async def _ask(self, peer: str, probe: _Probe) -> None:
        stream = None
        try:
            with trio.fail_after(CONTROL_TIMEOUT):
                stream = await self._network.open_blob_stream(peer)
                client = BlobClient(stream)
                asked = trio.current_time()
                probe.have = await client.have(self._blob_id)
                probe.rtt = path_rtt(trio.current_time() - asked, stream)
                probe.client = client
                stream = None
        except (StreamLost, proto.ProtocolError, trio.TooSlowError, OSError) as exc:
            log.info("have from %s failed: %r", peer, exc)
        finally:
            if stream is not None:
                await reset_quietly(stream)
            probe.done.set()

    async def take(self, peer: str) -> _Probe | None:
        """The probe of ``peer``, once it has ended (None if none was started)."""
        return await _take(self._probes, peer)

    def may_speculate(self) -> bool:
        """Whether this manifest request may carry the first chunk's `get` (the first
        one of the fetch does, on a network that pipelines)."""
        if self._speculated:
            return False
        self._speculated = True
        return True

    def offer(self, peer: str, client: BlobClient) -> None:
        """A stream with a `get` of SPECULATIVE_CHUNK outstanding, for ``peer``'s task."""
        self._speculations[peer] = client

    def take_speculation(self, peer: str) -> BlobClient | None:
        return self._speculations.pop(peer, None)

    async def close(self) -> None:
        """Reset the streams of probes nobody took."""
        asked: list[_Asked] = [*self._probes.values(), *self._counts.values()]
        clients = [e.client for e in asked if e.client is not None]
        for client in [*clients, *self._speculations.values()]:
            await reset_quietly(client.stream)
        self._probes.clear()
        self._counts.clear()
        self._speculations.clear()


class Download:
    """One blob's transfer. Use :func:`download_blob`."""

    def __init__(
        self,
        network: Network,
        store: Store,
        manifest: Manifest,
        partial: PartialBlob,
        writer: ChunkWriter,
        *,
        config: SchedulerConfig,
        progress: ProgressCallback | None,
        stripe_config: StripeConfig | None = None,
        probes: HaveProbes | None = None,
        scores: PeerScores | None = None,
        own_peer: str = "",
    ) -> None:
        self.network = network
        self.probes = probes
        self.scores = scores
        self.pacer = network.download_pacer if isinstance(network, PacedNetwork) else None
        self.store = store
        self.manifest = manifest
        self.blob_id = manifest.blob_id
        self.partial = partial
        self.writer = writer
        self.config = config
        self.progress = progress
        verified = set(range(manifest.num_chunks)) - set(partial.missing())
        # Fetchers of one blob start at different chunks (by peer ID), so a sole seeder
        # hands different chunks to each first and they can trade the rest.
        start = int.from_bytes(blake3.blake3(f"{own_peer}/{self.blob_id}".encode()).digest()[:8])
        self.scheduler = Scheduler(
            manifest.num_chunks,
            self.chunk_length,
            verified,
            config,
            start=start if own_peer else 0,
            own=own_peer,
        )
        self.buffers = ChunkBuffers(
            manifest.chunk_size, max(MIN_BUFFERS, BUFFER_POOL_BYTES // manifest.chunk_size)
        )
        # Chunks being hashed and written now, each with an event set when its write ends.
        self.writing: dict[int, trio.Event] = {}
        self.changed = trio.Event()
        self.peers_seen: set[str] = set()
        self.peer_tasks = 0
        self.started = trio.current_time()
        self.first_body_at: float | None = None  # see Progress.transfer_rate_bytes_per_s
        self.start_bytes = self._done_bytes()
        self.last_progress = 0.0
        self.new_bytes: dict[str, int] = {}
        self.duplicate_bytes = 0
        self.penalized: set[str] = set()
        self.striped = network if isinstance(network, StripedNetwork) else None
        self.stripe_config = stripe_config
        self.growth: dict[str, StripeGrowth] = {}
        # Streams each provider's workers hold open, per connection (lane).
        self.lane_load: dict[str, list[int]] = {}
        # Providers that refused 1.1.0: their streams carry one request at a time.
        self.serial: set[str] = set()

    # --- helpers -------------------------------------------------------------------
    def chunk_length(self, index: int) -> int:
        return self.manifest.chunk_span(index)[1]

    def _done_bytes(self) -> int:
        missing = self.scheduler.missing()
        return self.manifest.size - sum(self.manifest.chunk_span(i)[1] for i in missing)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _idle_wait(self) -> float:
        """How long an idle worker may sleep: until the next request turns late (an
        endgame copy may be due then), at most IDLE_WAKE_S."""
        now = trio.current_time()
        late = self.scheduler.next_late_at(now)
        return IDLE_WAKE_S if late is None else min(IDLE_WAKE_S, late - now)

    async def _wait_change(self, seconds: float = IDLE_WAKE_S) -> None:
        with trio.move_on_after(seconds):
            await self.changed.wait()

    def _report(self, *, force: bool = False) -> None:
        if self.progress is None:
            return
        now = trio.current_time()
        if not force and now - self.last_progress < PROGRESS_INTERVAL:
            return
        self.last_progress = now
        elapsed = max(now - self.started, 1e-9)
        done = (
            self.manifest.size
            - sum(self.manifest.chunk_span(i)[1] for i in self.scheduler.missing())
            if force
            else self._approx_done()
        )
        receiving = 0.0 if self.first_body_at is None else now - self.first_body_at
        self.progress(
            Progress(
                blob_id=self.blob_id,
                total_bytes=self.manifest.size,
                done_bytes=done,
                rate_bytes_per_s=(done - self.start_bytes) / elapsed,
                transfer_rate_bytes_per_s=(
                    (done - self.start_bytes) / receiving if receiving > 0 else 0.0
                ),
                elapsed=elapsed,
                peers=self.scheduler.peer_stats(),
                new_bytes=dict(self.new_bytes),
                duplicate_bytes=self.duplicate_bytes,
                finished=self.scheduler.done,
            )
        )

    def _approx_done(self) -> int:
        return min(self.manifest.size, self.scheduler.verified_count * self.manifest.chunk_size)

    # --- providers -----------------------------------------------------------------
    def add_provider(self, nursery: trio.Nursery, peer: str) -> None:
        if peer in self.peers_seen:
            return
        self.peers_seen.add(peer)
        self.peer_tasks += 1
        distrusted = self.scores is not None and self.scores.distrusted(peer, trio.current_time())
        if distrusted:
            log.info("provider %s sent bad data before: it starts last", peer)
        nursery.start_soon(self._peer_task, peer, DISTRUSTED_START_DELAY if distrusted else 0.0)

    async def _peer_task(self, peer: str, delay: float = 0.0) -> None:
        """Run one provider; one that was unreachable, busy or dropped after failures in a
        row is tried again after a pause (a lost packet on a long link is not a verdict).
        A banned peer, or one without the blob, is not."""
        try:
            for pause in (delay, *PEER_RETRY_PAUSES):
                await trio.sleep(pause)
                retry = not self.scheduler.done and await self._run_peer(peer)
                # A first-chunk stream the run did not take (its `have` failed) is reset
                # now, not held open, its answer unread, until the download ends.
                await self._drop_speculation(peer)
                if not retry:
                    return
                stats = self.scheduler.stats_of(peer)
                if stats is not None and stats.banned:
                    return
                log.info("provider %s failed; trying it again in a moment", peer)
        finally:
            self.peer_tasks -= 1
            self._notify()

    async def _run_peer(self, peer: str) -> bool:
        """Use ``peer`` until the blob is done or the peer is lost; True if worth retrying."""
        stream = None
        try:
            with trio.fail_after(CONTROL_TIMEOUT):
                probe = None if self.probes is None else await self.probes.take(peer)
                if probe is not None and probe.client is not None and probe.have is not None:
                    client, have, rtt = probe.client, probe.have, probe.rtt
                    stream = client.stream
                    client.set_chunk_length(self.chunk_length)
                else:
                    stream = await self.network.open_blob_stream(peer)
                    client = BlobClient(stream, self.chunk_length)
                    asked = trio.current_time()
                    have = await client.have(self.blob_id)
                    rtt = path_rtt(trio.current_time() - asked, stream)
        except (StreamLost, proto.ProtocolError, trio.TooSlowError, OSError) as exc:
            log.info("provider %s unusable: %r", peer, exc)
            if stream is not None:
                await reset_quietly(stream)
            return not isinstance(exc, proto.RemoteProtocolError)
        if isinstance(have, proto.ErrorResponse):
            await reset_quietly(stream)
            return have.code in (proto.ErrorCode.BUSY, proto.ErrorCode.INTERNAL)
        if have.num_chunks != self.manifest.num_chunks:
            log.warning(
                "provider %s claims %d chunks, manifest has %d",
                peer,
                have.num_chunks,
                self.manifest.num_chunks,
            )
            await reset_quietly(stream)
            return False
        full = all(have.bitmap[i // 8] >> (i % 8) & 1 for i in range(have.num_chunks))
        self.scheduler.add_peer(peer, trio.current_time(), None if full else have.bitmap)
        self.scheduler.on_rtt(peer, rtt)
        self._notify()
        lanes = self.lane_load[peer] = [1]  # the first worker's stream, on lane 0
        if self.probes is not None and peer in self.probes.serial:
            self.serial.add(peer)  # it refused to pipeline the manifest request
        self._set_connections(peer)
        client, first = await self._speculated(peer, client)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stream_worker, peer, client, 0, first)
            if not full:
                nursery.start_soon(self._refresh_have, peer)
            elif self.config.defer_to_partial_holders:
                nursery.start_soon(self._watch_alone, peer)
            # Only a provider with every chunk is striped: a partial one (a fellow in a
            # swarm) is one source among several, and eight fellows each dialled four
            # times cost a loaded machine ~200 handshakes for nothing.
            if full and self.striped is not None and self.stripe_config is not None:
                nursery.start_soon(self._grow, peer)
            # More workers as the peer's limit grows (rate x RTT, connections): each
            # holds at most one live request (or `_depth`), so the scheduler's limit is
            # the brake.
            while not self.scheduler.done and self._peer_usable(peer):
                for _ in range(self._workers_wanted(peer)):
                    nursery.start_soon(self._stream_worker, peer, None, self._quiet_lane(lanes))
                await self._wait_change()
        return not self.scheduler.done

    async def _drop_speculation(self, peer: str) -> None:
        spec = None if self.probes is None else self.probes.take_speculation(peer)
        if spec is not None:
            await reset_quietly(spec.stream)

    async def _speculated(
        self, peer: str, client: BlobClient
    ) -> tuple[BlobClient, list[RequestTicket]]:
        """The first worker's stream and the requests already outstanding on it: the
        stream that asked ``peer`` for the manifest and SPECULATIVE_CHUNK together, if
        there is one and that chunk is still to fetch from it (the `have` stream is then
        closed), else the `have` stream with nothing outstanding."""
        spec = None if self.probes is None else self.probes.take_speculation(peer)
        if spec is None:
            return client, []
        ticket = self.scheduler.claim(peer, trio.current_time(), (SPECULATIVE_CHUNK,))
        if ticket is None:
            await reset_quietly(spec.stream)
            return client, []
        await reset_quietly(client.stream)
        spec.set_chunk_length(self.chunk_length)
        self._notify()
        return spec, [ticket]

    async def _refresh_have(self, peer: str) -> None:
        """Ask a partial provider what it holds every HAVE_REFRESH_INTERVAL while it may
        gain chunks we lack, on a stream of its own: 1.3.0's ``status`` (what it holds and
        what it is fetching now, p2p.blob.swarm rule 4) where the peer speaks it, else ``have``.
        Stops at the first failure (the peer's workers notice a lost peer by themselves)."""
        client = await open_status_client(self.network, peer, self.chunk_length)
        status = client is not None
        try:
            if client is None:
                client = BlobClient(await self.network.open_blob_stream(peer), self.chunk_length)
            answered = False
            while not self.scheduler.done and self._peer_usable(peer):
                if answered or not status:
                    await trio.sleep(HAVE_REFRESH_INTERVAL)
                soon = None
                have: proto.HaveResponse | proto.ErrorResponse
                with trio.fail_after(CONTROL_TIMEOUT):
                    if status:
                        try:
                            reply = await client.status(self.blob_id)
                        except StreamLost:
                            if answered:
                                raise
                            # A server before 1.3.0 refuses the proposal: ask `have`.
                            await reset_quietly(client.stream)
                            stream = await self.network.open_blob_stream(peer)
                            client = BlobClient(stream, self.chunk_length)
                            status = False
                            continue
                        if isinstance(reply, proto.StatusResponse):
                            soon = reply.soon
                            have = proto.HaveResponse(reply.num_chunks, reply.bitmap)
                        else:
                            have = reply
                    else:
                        have = await client.have(self.blob_id)
                answered = True
                if isinstance(have, proto.ErrorResponse):
                    return
                if have.num_chunks != self.manifest.num_chunks:
                    return
                if not self._peer_usable(peer):
                    return
                full = all(have.bitmap[i // 8] >> (i % 8) & 1 for i in range(have.num_chunks))
                self.scheduler.update_peer_bitmap(peer, None if full else have.bitmap, soon)
                self._notify()
                if full:
                    return
        except (StreamLost, proto.ProtocolError, trio.TooSlowError, OSError) as exc:
            log.info("provider %s: have refresh ended: %r", peer, exc)
        finally:
            # Claims nobody refreshes are void: a fellow that went away (or stopped
            # answering) must not keep chunks from the seeder; what it held stays, and
            # its workers find out by asking for it.
            self.scheduler.drop_claims(peer)
            self._notify()
            if client is not None:
                await reset_quietly(client.stream)

    async def _watch_alone(self, peer: str) -> None:
        """Ask a seeder whether anyone else fetches the blob from it (1.4.0's ``status``,
        p2p.blob.swarm rule 6), at once and then every HAVE_REFRESH_INTERVAL while it says
        nobody: meanwhile the swarm's opening caps are off for it (Scheduler.set_alone),
        within a share of the blob until the ALONE_ANSWERS-th such answer.
        The first answer that counts anyone, a server before 1.4.0, or any failure puts
        them back for the rest of the download."""
        probe = None if self.probes is None else await self.probes.take_count(peer)
        reply = None if probe is None else probe.status
        client = None if probe is None else probe.client
        if client is None:
            client = await open_status_client(self.network, peer, self.chunk_length, fellows=True)
        if client is None:
            return
        zeros = 0
        try:
            while not self.scheduler.done and self._peer_usable(peer):
                if reply is None:
                    with trio.fail_after(CONTROL_TIMEOUT):
                        reply = await client.status(self.blob_id)
                if not (isinstance(reply, proto.StatusResponse) and reply.fellows == 0):
                    self.scheduler.set_alone(peer, False)
                    self._notify()
                    return
                zeros += 1
                if zeros <= ALONE_ANSWERS:
                    self.scheduler.set_alone(peer, True, once=zeros < ALONE_ANSWERS)
                    self._notify()
                reply = None
                await trio.sleep(HAVE_REFRESH_INTERVAL)
        except (StreamLost, proto.ProtocolError, trio.TooSlowError, OSError) as exc:
            log.info("provider %s: no fetcher count: %r", peer, exc)
            self.scheduler.set_alone(peer, False)
            self._notify()
        finally:
            await reset_quietly(client.stream)

    def _set_connections(self, peer: str) -> None:
        count = 1 if self.striped is None else self.striped.connection_count(peer)
        lanes = self.lane_load.setdefault(peer, [0])
        lanes.extend([0] * (count - len(lanes)))
        # Once striped, lane 0 is the control lane (rule 9): no bulk there.
        self.scheduler.set_connections(peer, count if count == 1 else count - 1, self._depth(peer))

    def _workers_wanted(self, peer: str) -> int:
        """Stream workers ``peer`` lacks: it should have one per live request it may hold,
        or on a pipelined striped provider one per bulk lane (rule 10)."""
        limit = self.scheduler.inflight_limit(peer)
        lanes = self.lane_load[peer]
        if self._lanes_coming(peer):
            # One chunk on the control lane meanwhile: a second would halve the speed
            # of the first through a new connection's slow start.
            return 1 - sum(lanes)
        if self._depth(peer) == 1:
            return limit - sum(lanes)
        return min(limit, len(lanes) - 1) - sum(lanes[1:])

    @staticmethod
    def _quiet_lane(lanes: list[int]) -> int:
        """The bulk connection with the fewest workers' streams (the lowest on a tie),
        taken: lane 0 only while it is the only one."""
        first = 1 if len(lanes) > 1 else 0
        lane = min(range(first, len(lanes)), key=lambda i: (lanes[i], i))
        lanes[lane] += 1
        return lane

    async def _grow(self, peer: str) -> None:
        """Open more connections to ``peer`` while they raise its rate (StripeGrowth)."""
        assert self.striped is not None and self.stripe_config is not None
        striped = self.striped
        if self.probes is not None:
            await self.probes.lanes_dialled(peer)
            self._set_connections(peer)
            self._notify()
        now = trio.current_time()
        # Growth counts bulk lanes; the first connection is one until the first step.
        count = striped.connection_count(peer)
        growth = StripeGrowth(self.stripe_config, now, count - 1 if count > 1 else 1)
        self.growth[peer] = growth

        async def dial(counted: bool = True) -> None:
            ok = await striped.add_connection(peer)
            if counted:
                growth.on_dialled(ok, trio.current_time())
            self._set_connections(peer)
            self._notify()

        async with trio.open_nursery() as dials:
            while not growth.stopped and not self.scheduler.done:
                stats = self.scheduler.stats_of(peer)
                if stats is None or stats.banned or stats.dropped:
                    return
                now = trio.current_time()
                busy = stats.inflight > 0 and self.scheduler.fetchable_count > 0
                more = growth.decide(now, stats.rtt_s, busy)
                if more:
                    log.info(
                        "provider %s: %d more connection(s) at %.1f MB/s, RTT %.0f ms",
                        peer,
                        more,
                        stats.rate_bytes_per_s / 1e6,
                        (stats.rtt_s or 0.0) * 1e3,
                    )
                if more and striped.connection_count(peer) == 1:
                    # The first step: lane 0 becomes the control lane, so one more
                    # connection than the step's bulk ones (growth counts bulk lanes).
                    dials.start_soon(dial, False)
                for _ in range(more):
                    dials.start_soon(dial)
                wake = growth.next_check(now, stats.rtt_s)
                await trio.sleep(max(wake - now, self.stripe_config.min_settle_s / 4))

    def _peer_usable(self, peer: str) -> bool:
        return self.scheduler.still_used(peer)

    def _depth(self, peer: str) -> int:
        """Requests a stream worker keeps outstanding on its stream to ``peer`` (rule 10)."""
        lanes = self.lane_load.get(peer)
        if self.striped is None or lanes is None or len(lanes) <= 1 or peer in self.serial:
            return 1
        return PIPELINE_DEPTH

    async def _stream_worker(
        self,
        peer: str,
        client: BlobClient | None,
        lane: int,
        outstanding: list[RequestTicket] | None = None,
    ) -> None:
        """Send ``peer`` requests on a stream over connection ``lane`` and read the answers
        in order: one at a time, or on a striped provider's bulk lane `_depth` at once.
        ``outstanding``: requests already sent on ``client`` (oldest first)."""
        pending = list(outstanding or [])  # sent, answers not yet read (oldest first)
        try:
            # Chunk writes run in this nursery, alongside the requests that received them.
            async with trio.open_nursery() as writers:
                while not self.scheduler.done and self._peer_usable(peer):
                    lanes = self.lane_load.get(peer)
                    if lane == 0 and lanes is not None and len(lanes) > 1 and not pending:
                        # Striped now: leave the control lane to control streams, for a
                        # bulk lane that lacks a worker (pipelined lanes want one each).
                        if client is not None:
                            await reset_quietly(client.stream)
                            client = None
                        if self._depth(peer) > 1 and min(lanes[1:]) > 0:
                            return
                        lanes[0] -= 1
                        lane = self._quiet_lane(lanes)
                    depth = 1 if lane == 0 else self._depth(peer)
                    # While a far provider's lanes are being dialled, the control lane
                    # takes one chunk at a time: a full batch there would hold a share
                    # of the blob (the alone budget's, say) meant for all the lanes.
                    most = 1 if lane == 0 and self._lanes_coming(peer) else None
                    while len(pending) < depth:
                        ticket = self.scheduler.next_request(
                            peer, trio.current_time(), max_chunks=most
                        )
                        if ticket is None:
                            break
                        client, sent = await self._send_ticket(
                            peer, client, ticket, lane, bool(pending)
                        )
                        if not sent:
                            break
                        pending.append(ticket)
                    if not pending:
                        await self._wait_change(self._idle_wait())
                        continue
                    ticket = pending.pop(0)
                    assert client is not None  # a request is outstanding on it
                    client = await self._read_ticket(peer, client, ticket, writers)
                    if client is None and pending:
                        # The stream is gone with answers still owed on it: those requests
                        # were never answered, through no fault of the peer's beyond the
                        # one already counted.
                        self._cancel(pending)
        finally:
            self._cancel(pending)
            lanes = self.lane_load.get(peer)
            if lanes is not None:
                lanes[lane] -= 1
            if client is not None:
                await reset_quietly(client.stream)

    def _lanes_coming(self, peer: str) -> bool:
        """Extra connections to ``peer`` are being dialled and none is up yet."""
        lanes = self.lane_load.get(peer)
        planned = 0 if self.probes is None else self.probes.planned_lanes(peer)
        return planned > 0 and (lanes is None or len(lanes) == 1)

    def _cancel(self, tickets: list[RequestTicket]) -> None:
        now = trio.current_time()
        for ticket in tickets:
            self.scheduler.cancel(ticket.request_id, now)
        if tickets:
            tickets.clear()
            self._notify()

    async def _send_ticket(
        self,
        peer: str,
        client: BlobClient | None,
        ticket: RequestTicket,
        lane: int,
        behind: bool,
    ) -> tuple[BlobClient | None, bool]:
        """Send one request (opening the stream first if there is none); the client and
        whether the request went out. A request that did not is reported: as a failure
        when it was the stream's only one, else cancelled (``behind``: requests are
        outstanding on the stream, and reading their answers will tell what happened to
        it), and the stream is dropped only in the first case."""
        try:
            with trio.fail_at(ticket.deadline):
                if client is None:
                    pipelined = lane > 0 and self._depth(peer) > 1
                    if lane and self.striped is not None:
                        stream = await self.striped.open_blob_stream_on(
                            peer, lane, pipelined=pipelined
                        )
                    else:
                        stream = await self.network.open_blob_stream(peer)
                    version = proto.Version.V1_1 if pipelined else proto.Version.V1_0
                    client = BlobClient(
                        stream, self.chunk_length, version=version, pipelined=pipelined
                    )
                await client.send_get(self.blob_id, ticket.ranges)
        except (StreamLost, trio.TooSlowError, OSError) as exc:
            self._notify()
            if behind:
                self.scheduler.cancel(ticket.request_id, trio.current_time())
                return client, False
            log.info("request to %s failed: %r", peer, exc)
            self.scheduler.on_request_failed(ticket.request_id, trio.current_time(), repr(exc))
            await self._drop(client)
            return None, False
        return client, True

    async def _read_ticket(
        self,
        peer: str,
        client: BlobClient,
        ticket: RequestTicket,
        writers: trio.Nursery,
    ) -> BlobClient | None:
        """Read the answer to one request sent on ``client``; return the client to reuse,
        or None if its stream is gone."""
        now = trio.current_time
        writes = _RequestWrites()
        reply: tuple[int, ...] | proto.ErrorResponse | None = None
        failure: Exception | None = None
        try:
            with trio.fail_at(ticket.deadline):
                reply = await client.read_get(
                    bind(self._on_chunk, ticket, writes, writers), buffers=self.buffers
                )
        except (
            BadChunk,
            ObsoleteRequest,
            proto.RemoteProtocolError,
            StreamLost,
            trio.TooSlowError,
            OSError,
        ) as exc:
            failure = exc
        finally:
            self._note_first_body(client)
        # The scheduler hears of the request only once each chunk it carried is verified
        # and written (or failed): it must not re-offer a chunk still being written.
        await writes.wait()
        if writes.error is not None:
            raise writes.error  # the store failed (disk full, I/O error): fatal
        if writes.bad_index is not None:
            failure = BadChunk(writes.bad_index)
        if isinstance(failure, BadChunk):
            log.warning("peer %s sent a corrupt chunk: banned for %s", peer, self.blob_id[:12])
            if isinstance(self.network, BadDataAware):
                self.network.bad_chunk(peer)
            self.scheduler.on_bad_chunk(ticket.request_id, failure.index, now())
            self._penalize(peer)
            self._notify()
            await self._drop(client)
            return None
        if isinstance(failure, ObsoleteRequest):
            self.scheduler.cancel(ticket.request_id, now())
            self._notify()
            await self._drop(client)
            return None
        if client.pipelined and (
            isinstance(failure, ProtocolRefused)
            or (isinstance(failure, StreamLost) and not client.negotiated)
        ):
            # An older server that does not speak 1.1.0: no pipelining with it (rule 10),
            # and this request goes out again, one at a time, at no cost to the peer. Its
            # `na` may not be read: the listener takes the request that follows it for
            # another proposal and resets the stream, and the reset can overtake it.
            log.info("provider %s does not pipeline: %s", peer, failure)
            self.serial.add(peer)
            self._set_connections(peer)
            self.scheduler.cancel(ticket.request_id, now())
            self._notify()
            await self._drop(client)
            return None
        if isinstance(failure, proto.RemoteProtocolError):
            log.warning("peer %s broke the protocol: %s", peer, failure)
            self.scheduler.on_protocol_error(ticket.request_id, now(), str(failure))
            self._penalize(peer)
            self._notify()
            await self._drop(client)
            return None
        if failure is not None:
            log.info("request to %s failed: %r", peer, failure)
            self.scheduler.on_request_failed(ticket.request_id, now(), repr(failure))
            self._notify()
            await self._drop(client)
            return None
        assert reply is not None
        if isinstance(reply, proto.ErrorResponse):
            if reply.code == proto.ErrorCode.BUSY:
                self.scheduler.on_request_busy(ticket.request_id, now())
                await trio.sleep(0.2)
            else:
                self.scheduler.on_request_done(ticket.request_id, now(), ticket.indices)
            self._notify()
            await self._drop(client)
            return None
        self.scheduler.on_request_done(ticket.request_id, now(), reply)
        self._notify()
        return client

    def _penalize(self, peer: str) -> None:
        """Remember beyond this download that ``peer`` sent bad data (once per download:
        one liar's many bad chunks are one offence)."""
        if self.scores is not None and peer not in self.penalized:
            self.penalized.add(peer)
            self.scores.penalize(peer, trio.current_time())

    async def _drop(self, client: BlobClient | None) -> None:
        if client is not None:
            await reset_quietly(client.stream)

    async def _on_chunk(
        self,
        ticket: RequestTicket,
        writes: _RequestWrites,
        writers: trio.Nursery,
        index: int,
        data: memoryview,
    ) -> None:
        """A chunk body arrived (in a pooled buffer): start its write and return, so the
        stream receives the next one meanwhile. Raising leaves the buffer to the caller."""
        if writes.bad_index is not None:
            raise BadChunk(writes.bad_index)  # this peer already sent a corrupt chunk
        if self.pacer is not None:
            await trio.sleep(self.pacer.delay(len(data), trio.current_time()))
        if not self.scheduler.expects(ticket.request_id, index):
            # The request was released meanwhile (its peer banned or dropped on another
            # stream); the protocol core already checked the index against the request.
            raise ObsoleteRequest
        digest = blake3.blake3(data).digest() if HASH_ON_ARRIVAL else None
        while (busy := self.writing.get(index)) is not None:
            await busy.wait()  # another stream's copy is being written (endgame)
        if self.partial.has_chunk(index):
            self._count_chunk(ticket, index, len(data), duplicate=True)
            if self.scheduler.is_obsolete(ticket.request_id):
                raise ObsoleteRequest  # an endgame loser: stop this stream
            self.buffers.release(data)
            return
        self.writing[index] = trio.Event()
        writes.start()
        writers.start_soon(self._write, ticket, writes, index, data, digest)

    async def _write(
        self,
        ticket: RequestTicket,
        writes: _RequestWrites,
        index: int,
        data: memoryview,
        digest: bytes | None,
    ) -> None:
        try:
            # Not abandoned on cancel: the thread owns the buffer until it returns.
            await self.writer.write(index, data, digest)
        except CorruptChunk:
            writes.bad_index = index
        except Exception as exc:  # the store failed; _run_ticket re-raises it
            writes.error = exc
        else:
            self._count_chunk(ticket, index, len(data), duplicate=False)
        finally:
            self.buffers.release(data)
            self.writing.pop(index).set()
            writes.finish()

    def _note_first_body(self, client: BlobClient) -> None:
        at = client.first_body_at
        if at is not None and (self.first_body_at is None or at < self.first_body_at):
            self.first_body_at = at

    def _count_chunk(
        self, ticket: RequestTicket, index: int, length: int, *, duplicate: bool
    ) -> None:
        # Whoever wrote the chunk owns it: counting by the scheduler's answer instead
        # would let two racing streams both call it a duplicate.
        self.scheduler.on_chunk(ticket.request_id, index, length, trio.current_time())
        if duplicate:
            self.duplicate_bytes += length
            return
        self.new_bytes[ticket.peer] = self.new_bytes.get(ticket.peer, 0) + length
        growth = self.growth.get(ticket.peer)
        if growth is not None:
            growth.on_bytes(length, trio.current_time())
        self._report()

    async def flush(self) -> None:
        """Make what verified durable (the partial takes care of concurrent writes)."""
        await trio.to_thread.run_sync(self.partial.flush)

    async def flusher(self) -> None:
        while True:
            await trio.sleep(FLUSH_INTERVAL)
            await self.flush()


async def download_blob(
    network: Network,
    store: Store,
    blob_id: str,
    *,
    providers: Iterable[str] = (),
    more_providers: trio.MemoryReceiveChannel[str] | None = None,
    progress: ProgressCallback | None = None,
    config: SchedulerConfig | None = None,
    discovery_timeout: float = STALL_GRACE,
    stripe_config: StripeConfig | None = None,
    scores: PeerScores | None = None,
    own_peer: str = "",
    board: FetchingBoard | None = None,
) -> None:
    """Fetch ``blob_id`` into ``store`` (no-op if complete). Raises NoProviders, FetchFailed,
    NoSpace. ``scores``: peers' records of bad data, read and added to (PeerScores).
    ``own_peer``: this fetcher's peer ID, which picks where in the blob it starts.
    ``board``: where the download posts what it has in flight, for the node's server
    (the node owns it; None: a board of this download's own)."""
    board = board if board is not None else FetchingBoard()
    if await trio.to_thread.run_sync(store.has, blob_id):
        return
    async with trio.open_nursery() as nursery:
        config = config or SchedulerConfig()
        stripe_config = stripe_config or StripeConfig()
        probes = HaveProbes(
            network,
            blob_id,
            nursery,
            count_fellows=config.defer_to_partial_holders,
            stripes=stripe_config,
        )
        try:
            await _download(
                network,
                store,
                blob_id,
                providers,
                more_providers,
                progress,
                config,
                discovery_timeout,
                stripe_config,
                probes,
                scores,
                board,
                own_peer,
            )
        finally:
            nursery.cancel_scope.cancel()
            await probes.close()


async def _download(
    network: Network,
    store: Store,
    blob_id: str,
    providers: Iterable[str],
    more_providers: trio.MemoryReceiveChannel[str] | None,
    progress: ProgressCallback | None,
    config: SchedulerConfig,
    discovery_timeout: float,
    stripe_config: StripeConfig,
    probes: HaveProbes,
    scores: PeerScores | None,
    board: FetchingBoard,
    own_peer: str = "",
) -> None:
    candidates = list(dict.fromkeys(providers))
    manifest = await _local_manifest(store, blob_id)
    asked: set[str] = set()
    if manifest is None:
        manifest = await _manifest_from_network(
            network, blob_id, candidates, asked, more_providers, discovery_timeout, probes
        )
    missing_bytes = await trio.to_thread.run_sync(store.space_to_finish, manifest)
    free = await trio.to_thread.run_sync(store.free_bytes)
    if free < missing_bytes:
        raise NoSpace(
            f"need {missing_bytes} bytes for {blob_id[:12]} but only {free} are free "
            f"in {store.root}"
        )
    try:
        partial = await trio.to_thread.run_sync(store.begin_partial, manifest)
    except BlobExists:
        return  # completed meanwhile (by another task or process)
    try:
        async with ChunkWriter(partial) as writer:
            download = Download(
                network,
                store,
                manifest,
                partial,
                writer,
                config=config,
                progress=progress,
                stripe_config=stripe_config,
                probes=probes,
                scores=scores,
                own_peer=own_peer,
            )
            # What this download has in flight is what the node's server calls `soon`.
            with board.posting(blob_id, download.scheduler.in_flight):
                await _run(download, candidates, more_providers, discovery_timeout)
        await download.flush()
        await trio.to_thread.run_sync(partial.publish)
        download._report(force=True)
    finally:
        # Shielded: a cancelled or interrupted fetch still flushes what verified (data
        # fsync, then bitmap), so the next attempt resumes from it.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(partial.close)
    if config.defer_to_partial_holders and config.linger_while_asked:
        await _linger(board, blob_id)


async def _linger(board: FetchingBoard, blob_id: str) -> None:
    """Serve fellows a while after completion (p2p.blob.swarm rule 5)."""
    deadline = trio.current_time() + LINGER_MAX
    while True:
        now = trio.current_time()
        last = board.last_asked(blob_id)
        if now >= deadline or last is None or now - last >= LINGER_QUIET:
            return
        await trio.sleep(min(deadline, last + LINGER_QUIET) - now)


async def _local_manifest(store: Store, blob_id: str) -> Manifest | None:
    try:
        return await trio.to_thread.run_sync(store.manifest, blob_id)
    except Exception:  # BlobNotFound: nothing local yet
        return None


async def _manifest_from_network(
    network: Network,
    blob_id: str,
    candidates: list[str],
    asked: set[str],
    more: trio.MemoryReceiveChannel[str] | None,
    discovery_timeout: float,
    probes: HaveProbes | None = None,
) -> Manifest:
    """The first valid manifest from the candidates, and from peers that discovery sends
    within ``discovery_timeout``; up to MANIFEST_FANOUT are asked at once, and each is
    asked ``have`` at the same time (``probes``)."""
    found: list[Manifest] = []
    unanswered: dict[str, str] = {}
    fanout = trio.Semaphore(MANIFEST_FANOUT)
    deadline = trio.current_time() + discovery_timeout

    async with trio.open_nursery() as nursery:

        async def ask(peer: str, retries: tuple[float, ...] = MANIFEST_RETRY_PAUSES) -> None:
            unanswered.pop(peer, None)
            try:
                manifest = await fetch_manifest(network, blob_id, peer, unanswered, probes=probes)
            finally:
                fanout.release()
            if manifest is not None and not found:
                found.append(manifest)
                nursery.cancel_scope.cancel()
            elif peer in unanswered and retries:
                # Asked again once the others have had their turn (the slot is free).
                await trio.sleep(retries[0])
                await fanout.acquire()
                nursery.start_soon(ask, peer, retries[1:])

        async def start(peer: str) -> None:
            """Ask ``peer`` once a slot is free (candidates are asked in their order)."""
            if peer not in asked:
                await fanout.acquire()
                asked.add(peer)
                if probes is not None:
                    probes.start(peer)
                nursery.start_soon(ask, peer)

        async def listen(more: trio.MemoryReceiveChannel[str]) -> None:
            with trio.move_on_at(deadline):
                try:
                    async for peer in more:
                        candidates.append(peer)
                        await start(peer)
                except trio.ClosedResourceError:
                    pass

        if more is not None:
            nursery.start_soon(listen, more)
        for peer in list(candidates):
            await start(peer)
    if found:
        return found[0]
    if not asked:
        raise NoProviders(f"no provider found for {blob_id}")
    if unanswered:
        raise NoProviders(
            f"none of {len(asked)} peer(s) asked sent the manifest of {blob_id} "
            f"({1 + len(MANIFEST_RETRY_PAUSES)} tries each): " + _unanswered_summary(unanswered)
        )
    raise NoProviders(f"none of {len(asked)} peer(s) asked holds {blob_id}")


def _unanswered_summary(unanswered: dict[str, str]) -> str:
    """What the peers that sent no manifest did, by their last answer: those that let
    CONTROL_TIMEOUT pass, each busy one with the server's own reason, and each that closed
    or reset the stream with what the transport said (a saturated server answers at once,
    and a reset comes at once: "did not answer within 15 s" would misstate the wait)."""
    silent = sum(1 for why in unanswered.values() if why == NO_ANSWER)
    said = sorted((peer, why) for peer, why in unanswered.items() if why != NO_ANSWER)
    parts = [f"{silent} did not answer within {CONTROL_TIMEOUT:g} s"] if silent else []
    parts += [f"{peer} {why}" for peer, why in said[:MAX_REASONS_SAID]]
    if len(said) > MAX_REASONS_SAID:
        parts.append(f"{len(said) - MAX_REASONS_SAID} more were busy or dropped the stream")
    return "; ".join(parts)


async def _run(
    download: Download,
    candidates: list[str],
    more: trio.MemoryReceiveChannel[str] | None,
    discovery_timeout: float,
) -> None:
    scheduler = download.scheduler
    async with trio.open_nursery() as nursery:
        nursery.start_soon(download.flusher)
        for peer in candidates:
            download.add_provider(nursery, peer)
        if more is not None:
            nursery.start_soon(_join_late_providers, download, nursery, more)
        stalled_since: float | None = None
        while not scheduler.done:
            await download._wait_change(0.5)
            download._report()
            idle = download.peer_tasks == 0 or scheduler.stalled()
            if not idle:
                stalled_since = None
                continue
            stalled_since = stalled_since or trio.current_time()
            if trio.current_time() - stalled_since >= discovery_timeout:
                banned = sorted(scheduler.banned_peers())
                # Who left: a provider that died or lost its connection mid-fetch.
                gone = sorted(
                    peer
                    for peer, stats in scheduler.peer_stats().items()
                    if (stats.dropped or not stats.connected) and not stats.banned
                )
                raise FetchFailed(
                    f"{len(scheduler.missing())} of {download.manifest.num_chunks} chunks of "
                    f"{download.blob_id[:12]} could not be fetched from "
                    f"{len(download.peers_seen)} peer(s)"
                    + (f"; banned for bad data: {', '.join(banned)}" if banned else "")
                    + (
                        f"; disconnected or stopped answering mid-fetch: {', '.join(gone)} "
                        "(what arrived is kept: fetch again to resume)"
                        if gone
                        else ""
                    )
                )
        nursery.cancel_scope.cancel()


async def _join_late_providers(
    download: Download, nursery: trio.Nursery, more: trio.MemoryReceiveChannel[str]
) -> None:
    async for peer in more:
        download.add_provider(nursery, peer)
