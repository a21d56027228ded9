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
   provider that stalls past its deadline loses its ranges to the others. The providers
   the caller named come through a channel of their own as their dials succeed, closed
   once every dial has ended; while it is open neither the manifest phase nor the
   transfer gives up (``discovery_timeout`` bounds the search for others, not a named
   provider's dial, which its own timeout bounds): a named provider that holds the blob
   but connects late must not lose to another's "not held".
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

Where the code is
-----------------

This module holds :class:`Download`, a small owner: its providers' tasks (``have``, the
first chunk's stream, retries) and the parts it builds and hands each other, and the
fetch as a whole (:func:`download_blob`, the manifest from the store or the network,
lingering). From the bottom up: :mod:`p2p.fetch.download_parts` (bounds,
:class:`Progress`, the network protocols, ``Changes``), :mod:`p2p.fetch.download_probes`
(manifests, rule 11's speculation, :class:`HaveProbes`), :mod:`p2p.fetch.download_tally`
(bytes delivered and progress reports), :mod:`p2p.fetch.download_lanes` (each provider's
connections, pipelining depth and striping growth: rules 9 and 10),
:mod:`p2p.fetch.download_watch` (a provider's ``status``/``have`` refreshes and fetcher
counts: rule 8) and :mod:`p2p.fetch.download_requests` (stream workers, chunk
verification and writes: rules 4, 9 and 10).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import blake3
import trio

from blobstore import (
    BlobExists,
    Manifest,
    NoSpace,
    PartialBlob,
    Store,
)
from p2p.blob import messages
from p2p.blob.buffers import ChunkBuffers
from p2p.blob.shell import BlobClient, StreamLost, reset_quietly
from p2p.blob.swarm import LINGER_MAX, LINGER_QUIET, FetchingBoard
from p2p.errors import FetchFailed, NoProviders
from p2p.fetch.chunk_writer import ChunkWriter
from p2p.fetch.download_lanes import Lanes
from p2p.fetch.download_parts import (
    BUFFER_POOL_BYTES,
    CONTROL_TIMEOUT,
    DISTRUSTED_START_DELAY,
    FLUSH_INTERVAL,
    MANIFEST_FANOUT,
    MANIFEST_RETRY_PAUSES,
    MAX_REASONS_SAID,
    MIN_BUFFERS,
    NO_ANSWER,
    PEER_RETRY_PAUSES,
    SPECULATIVE_CHUNK,
    STALL_GRACE,
    Changes,
    Network,
    ProgressCallback,
    StripedNetwork,
    path_rtt,
)
from p2p.fetch.download_probes import (
    HaveProbes,
    fetch_manifest,
)
from p2p.fetch.download_requests import Requests
from p2p.fetch.download_tally import Tally
from p2p.fetch.download_watch import ProviderWatch
from p2p.fetch.sched_records import RequestTicket, SchedulerConfig
from p2p.fetch.scheduler import Scheduler
from p2p.fetch.scores import PeerScores
from p2p.fetch.striping import StripeConfig

log = logging.getLogger(__name__)


def chunk_lengths(manifest: Manifest) -> Callable[[int], int]:
    """The length of each chunk of ``manifest``, by index."""
    span = manifest.chunk_span

    def chunk_length(index: int) -> int:
        return span(index)[1]

    return chunk_length


class Download:
    """One blob's transfer: its providers' tasks, and the parts that do the work. Use
    :func:`download_blob`.

    Parts: ``scheduler`` (which chunks from whom), ``changes`` (what idle tasks wait on),
    ``tally`` (bytes delivered, progress), ``lanes`` (each provider's connections and
    striping), ``requests`` (the stream workers) and ``watch`` (a provider's control
    streams beside them)."""

    def __init__(
        self,
        network: Network,
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
        origins: set[str] | None = None,
    ) -> None:
        self.network = network
        self.probes = probes
        self.scores = scores
        self.manifest = manifest
        self.blob_id = blob_id = manifest.blob_id
        self.partial = partial
        self.config = config
        # Providers the caller named (the scheduler's origins, spared for finished fellows).
        self.origins: set[str] = set() if origins is None else origins
        # A chunk's length, for the parts and the streams (not a method: they hold no
        # pointer back to the owner).
        self.chunk_length = chunk_length = chunk_lengths(manifest)
        verified = set(range(manifest.num_chunks)) - set(partial.missing())
        # Fetchers of one blob start at different chunks (by peer ID), so a sole seeder
        # hands different chunks to each first and they can trade the rest.
        start = int.from_bytes(blake3.blake3(f"{own_peer}/{blob_id}".encode()).digest()[:8])
        self.scheduler = scheduler = Scheduler(
            manifest.num_chunks,
            chunk_length,
            verified,
            config,
            start=start if own_peer else 0,
            own=own_peer,
        )
        buffers = ChunkBuffers(
            manifest.chunk_size, max(MIN_BUFFERS, BUFFER_POOL_BYTES // manifest.chunk_size)
        )
        self.changes = changes = Changes()
        self.tally = tally = Tally(manifest, scheduler, progress, trio.current_time())
        striped = network if isinstance(network, StripedNetwork) else None
        self.lanes = lanes = Lanes(scheduler, changes, striped, stripe_config, probes)
        self.requests = Requests(
            network,
            blob_id,
            chunk_length,
            scheduler,
            config,
            lanes=lanes,
            changes=changes,
            tally=tally,
            buffers=buffers,
            writer=writer,
            partial=partial,
            scores=scores,
        )
        self.watch = ProviderWatch(
            network, blob_id, manifest.num_chunks, chunk_length, scheduler, changes, probes
        )
        self.peers_seen: set[str] = set()
        self.peer_tasks = 0

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
            self.changes.notify()

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
        except (StreamLost, messages.ProtocolError, trio.TooSlowError, OSError) as exc:
            log.info("provider %s unusable: %r", peer, exc)
            if stream is not None:
                await reset_quietly(stream)
            return not isinstance(exc, messages.RemoteProtocolError)
        if isinstance(have, messages.ErrorResponse):
            await reset_quietly(stream)
            return have.code in (messages.ErrorCode.BUSY, messages.ErrorCode.INTERNAL)
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
        self.scheduler.set_origin(peer, peer in self.origins)
        self.scheduler.on_rtt(peer, rtt)
        self.changes.notify()
        lanes, requests, watch = self.lanes, self.requests, self.watch
        lanes.start(peer)  # the first worker's stream, on lane 0
        client, first = await self._speculated(peer, client)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(requests.stream_worker, peer, client, 0, first)
            if not full:
                nursery.start_soon(watch.refresh_have, peer)
            elif self.config.defer_to_partial_holders:
                nursery.start_soon(watch.watch_alone, peer)
            # Only a provider with every chunk is striped: a partial one (a fellow in a
            # swarm) is one source among several, and eight fellows each dialled four
            # times cost a loaded machine ~200 handshakes for nothing.
            if full and lanes.grows:
                nursery.start_soon(lanes.grow, peer)
            # More workers as the peer's limit grows (rate x RTT, connections): each
            # holds at most one live request (or `Lanes.depth`), so the scheduler's limit
            # is the brake.
            while not self.scheduler.done and self.scheduler.still_used(peer):
                for _ in range(lanes.workers_wanted(peer)):
                    nursery.start_soon(requests.stream_worker, peer, None, lanes.take(peer))
                await self.changes.wait()
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
        self.changes.notify()
        return spec, [ticket]

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
    named_providers: trio.MemoryReceiveChannel[str] | None = None,
) -> None:
    """Fetch ``blob_id`` into ``store`` (no-op if complete). Raises NoProviders, FetchFailed,
    NoSpace. ``more_providers``: candidates found while the fetch runs (discovery), taken
    for ``discovery_timeout``. ``named_providers``: providers the caller named, each sent
    once its dial succeeded, the channel closed once every dial has ended (rule 5).
    ``scores``: peers' records of bad data, read and added to (PeerScores).
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
                named_providers,
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
    named: trio.MemoryReceiveChannel[str] | None = None,
) -> None:
    candidates = list(dict.fromkeys(providers))
    # The providers the caller named (the scheduler's origins): those given, and those
    # that come through ``named`` (the manifest phase reads some of them).
    origins = set(candidates)
    manifest = await _local_manifest(store, blob_id)
    asked: set[str] = set()
    if manifest is None:
        manifest = await _manifest_from_network(
            network,
            blob_id,
            candidates,
            asked,
            more_providers,
            discovery_timeout,
            probes,
            named=named,
            origins=origins,
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
                manifest,
                partial,
                writer,
                config=config,
                progress=progress,
                stripe_config=stripe_config,
                probes=probes,
                scores=scores,
                own_peer=own_peer,
                origins=origins,
            )
            # What this download has in flight is what the node's server calls `soon`.
            with board.posting(blob_id, download.scheduler.in_flight):
                await _run(download, candidates, more_providers, discovery_timeout, named)
        await download.flush()
        await trio.to_thread.run_sync(partial.publish)
        download.tally.report(trio.current_time(), force=True)
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
    *,
    named: trio.MemoryReceiveChannel[str] | None = None,
    origins: set[str] | None = None,
) -> Manifest:
    """The first valid manifest from the candidates, from peers that discovery sends
    within ``discovery_timeout``, and from the named providers whose dials succeed, however
    long that takes (``named`` closes once every dial has ended: rule 5); up to
    MANIFEST_FANOUT are asked at once, and each is asked ``have`` at the same time
    (``probes``). The named providers read from ``named`` go into ``origins``."""
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

        async def listen(channel: trio.MemoryReceiveChannel[str], named_here: bool = False) -> None:
            try:
                async for peer in channel:
                    candidates.append(peer)
                    if named_here and origins is not None:
                        origins.add(peer)
                    await start(peer)
            except trio.ClosedResourceError:
                pass

        async def listen_until_deadline(more: trio.MemoryReceiveChannel[str]) -> None:
            with trio.move_on_at(deadline):
                await listen(more)

        if more is not None:
            nursery.start_soon(listen_until_deadline, more)
        if named is not None:
            nursery.start_soon(listen, named, True)
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


log = logging.getLogger(__name__)


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
    named: trio.MemoryReceiveChannel[str] | None = None,
) -> None:
    scheduler = download.scheduler
    dialling = named is not None  # a named provider may yet connect (rule 5)

    async def join_named(named: trio.MemoryReceiveChannel[str]) -> None:
        nonlocal dialling
        await _join_late_providers(download, nursery, named, origins=True)
        dialling = False
        download.changes.notify()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(download.flusher)
        for peer in candidates:
            download.add_provider(nursery, peer)
        if more is not None:
            nursery.start_soon(_join_late_providers, download, nursery, more)
        if named is not None:
            nursery.start_soon(join_named, named)
        stalled_since: float | None = None
        while not scheduler.done:
            await download.changes.wait(0.5)
            download.tally.report(trio.current_time())
            idle = not dialling and (download.peer_tasks == 0 or scheduler.stalled())
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
    download: Download,
    nursery: trio.Nursery,
    more: trio.MemoryReceiveChannel[str],
    *,
    origins: bool = False,
) -> None:
    async for peer in more:
        if origins:
            download.origins.add(peer)
        download.add_provider(nursery, peer)
