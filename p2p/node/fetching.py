"""A node's fetches: where providers come from, and how one blob or collection is fetched.

1. Providers come from (a) peers the caller names (multiaddrs or a ticket), dialled at
   once, each joining the fetch as soon as it is connected (the fetch waits for them
   until their dials end, past its discovery timeout); (b) peers already connected,
   asked ``have``; (c) the DHT, searched in the background while the transfer runs. No
   step waits on a fixed delay.
2. The fetched blob is leased from the start, and a collection's children with it, so gc
   takes nothing a long fetch already has.
3. A local copy is hashed before it counts as done (``verify_local``): a rotten one is
   quarantined and fetched again from its good chunks.
4. Peer exchange (p2p.blob.swarm): providers are asked ``peers`` about once a second, and
   the fellows they name are dialled (bounded) and join as partial providers.
5. A provider known only by circuit addresses is hole-punched to before it joins; one
   reachable only through a relay is not fetched from unless ``relayed_fetch``.
6. Without a DHT, a fetch whose every provider refused us for want of admission ends at
   once, with each refusal's line.

:class:`Fetches` runs fetches on the node's other parts (its connections and provider
records, given to it); :class:`FetchRecords` keeps what they leave behind for the operator
and for later errors; :class:`NodeNetwork` is what a download sees of the node.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from blobstore import BlobNotFound, Store
from p2p.blob.pacing import Pacer
from p2p.blob.swarm import PEX_DIAL_PARALLELISM, FetchingBoard, PexBook
from p2p.errors import BadAddress, FetchFailed, NoProviders, PeerUnreachable, unwrap_single
from p2p.fetch.download_parts import Progress, ProgressCallback
from p2p.fetch.downloader import download_blob
from p2p.fetch.sched_records import SchedulerConfig
from p2p.fetch.scores import PeerScores
from p2p.fetch.striping import StripeConfig
from p2p.metrics import Metrics
from p2p.names.record import is_name_ref
from p2p.node.admission import UNADMITTED
from p2p.node.connections import Connections
from p2p.node.providing import ProviderRecords
from p2p.node.request import Reference

log = logging.getLogger(__name__)

# Connected peers asked "have" for each fetch; beyond this, rely on the DHT.
MAX_CONNECTED_CANDIDATES = 32
# Children of a collection fetched at once.
COLLECTION_PARALLELISM = 4
# Admission refusals remembered (p2p.node.admission): one line per provider that said no.
MAX_REFUSALS = 256
# Named providers' dial failures a "no provider" error lists (one line, not a page).
MAX_DIAL_ERRORS_SHOWN = 3
# Senders of bad chunks named in status (the total is counted beyond them).
MAX_BAD_PEERS = 1024
# With peer exchange on, requests to a peer hold at most ~1 s of its rate and 4 MiB before
# it is measured (SchedulerConfig.max_request_seconds): a 100 Mbit/s seeder shared by four
# fetchers is then asked for ~3 MiB at a time by each, not 16 MiB twice over, and the rest
# comes from whichever fellow has it by then.
SWARM_REQUEST_SECONDS = 0.25
SWARM_UNMEASURED_BATCH_BYTES = 2 * 1024 * 1024
# Peer exchange stops looking once, this long into a fetch, no manifest has been found, no
# dial or question is in flight and nobody named a fellow: otherwise its open channel keeps
# the provider search waiting out --discovery-timeout when every named peer said not_found.
PEX_QUIET_GRACE = 3.0
# NATed providers found on the DHT that one fetch punches to (each costs a relay dial and
# DCUtR's rounds; p2p.nat.punch.MAX_PUNCHES is the same cap for named ones), and relays tried
# per provider (its circuit addresses name one per relay).
MAX_DHT_PUNCHES = 16
MAX_RELAYS_PER_PROVIDER = 4
# The first DHT lookups of a fetch come this soon after each other, then ever less often
# (a provider may announce itself late), at most every MAX_DISCOVERY_PAUSE seconds.
FIRST_DISCOVERY_PAUSE = 0.25
MAX_DISCOVERY_PAUSE = 4.0

# Resolves a ``PUBLISHER/NAME`` reference to the blob ID its newest record names.
NameResolver = Callable[[str], Awaitable[str]]


@dataclass(frozen=True)
class FetchSettings:
    """The node's settings a fetch reads (their meaning: p2p.node.node.NodeConfig)."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    stripe: StripeConfig = field(default_factory=StripeConfig)
    discovery_timeout: float = 10.0
    verify_local: bool = True
    peer_exchange: bool = True

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's settings, with peer exchange's caps (SWARM_*) where they are
        not set."""
        config = self.scheduler
        if not self.peer_exchange:
            return config
        return replace(
            config,
            max_request_seconds=config.max_request_seconds or SWARM_REQUEST_SECONDS,
            unmeasured_batch_bytes=config.unmeasured_batch_bytes or SWARM_UNMEASURED_BATCH_BYTES,
            defer_to_partial_holders=True,
        )


class FetchRecords:
    """What a node's fetches leave for its operator (p2p.metrics, ``blob status``) and for
    the errors of later fetches: the latest progress of each fetch in flight, the chunks
    that failed their hash by sender, and the providers that refused us for want of
    admission (p2p.node.admission rule 3), each bounded."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.transfers: dict[str, Progress] = {}  # blob ID -> its latest progress
        self.refusals: dict[str, str] = {}  # peer -> its refusal's line
        # Chunks received that failed their hash, in all and by the latest senders (at most
        # MAX_BAD_PEERS named).
        self.bad_chunks_total = 0
        self.bad_chunks: dict[str, int] = {}
        self._refusal = trio.Event()

    def bad_chunk(self, peer: str) -> None:
        """``peer`` sent a chunk that failed its hash (the download bans it)."""
        self.bad_chunks_total += 1
        self.bad_chunks[peer] = self.bad_chunks.pop(peer, 0) + 1
        if len(self.bad_chunks) > MAX_BAD_PEERS:
            del self.bad_chunks[next(iter(self.bad_chunks))]

    def refused(self, peer: str, message: str) -> None:
        """A provider answered an error (p2p.fetch.download_parts.RefusalAware): remember an
        admission refusal (bounded: one line per peer, MAX_REFUSALS peers)."""
        if not message.startswith(UNADMITTED):
            return
        if peer not in self.refusals and len(self.refusals) >= MAX_REFUSALS:
            del self.refusals[next(iter(self.refusals))]
        self.refusals[peer] = message
        self._refusal.set()
        self._refusal = trio.Event()

    async def next_refusal(self) -> None:
        """Until one more provider refuses us."""
        await self._refusal.wait()

    def refusal_lines(self, providers: Sequence[str]) -> list[str]:
        """Why named providers refused us, if they did (admission rule 3): the one thing
        a user who forgot --certificate needs to read."""
        named = [a.rsplit("/p2p/", 1)[-1] for a in providers if "/p2p/" in a]
        return [f"{p} refused us: {self.refusals[p]}" for p in named if p in self.refusals]

    def counted(self, progress: ProgressCallback | None, tally: Tally) -> ProgressCallback:
        """``progress``, and the received-bytes counter, ``transfers`` and ``tally`` kept
        up to date."""

        def on_progress(update: Progress) -> None:
            fetched = sum(update.new_bytes.values())
            previous = tally.last.get(update.blob_id)
            grown = fetched - (sum(previous.new_bytes.values()) if previous else 0)
            tally.last[update.blob_id] = update
            if grown > 0:
                self.metrics.bytes_received.labels(protocol="blob").inc(grown)
            if update.finished:
                self.transfers.pop(update.blob_id, None)
            else:
                self.transfers[update.blob_id] = update
            if progress is not None:
                progress(update)

        return on_progress

    def ended(self, tally: Tally, outcome: str, seconds: float) -> None:
        """One fetch ended: counted, its transfers gone from the list, its lines logged."""
        self.metrics.fetch_ended(outcome, seconds)
        for seen in tally.last:
            self.transfers.pop(seen, None)
        for line in tally.lines(outcome, seconds):
            log.info("%s", line)


class NodeNetwork:
    """What a download sees of its node (p2p.fetch.download_parts' network protocols): the
    connections' streams and lanes, the node's download limit (``pacer``), and the records
    where bad chunks and refusals are counted."""

    def __init__(
        self, connections: Connections, records: FetchRecords, pacer: Pacer | None
    ) -> None:
        self._connections = connections
        self._records = records
        self.download_pacer = pacer

    async def open_blob_stream(
        self, peer: str, *, pipelined: bool = False, tentative: bool = False
    ) -> Any:
        return await self._connections.open_blob_stream(
            peer, pipelined=pipelined, tentative=tentative
        )

    async def open_blob_stream_on(
        self, peer: str, lane: int, *, pipelined: bool = False, tentative: bool = False
    ) -> Any:
        return await self._connections.open_blob_stream_on(
            peer, lane, pipelined=pipelined, tentative=tentative
        )

    async def add_connection(self, peer: str) -> bool:
        return await self._connections.add_connection(peer)

    def connection_count(self, peer: str) -> int:
        return self._connections.connection_count(peer)

    def connection_rtt(self, peer: str) -> float | None:
        return self._connections.connection_rtt(peer)

    async def wait_lanes(self, peer: str) -> None:
        await self._connections.wait_lanes(peer)

    def bad_chunk(self, peer: str) -> None:
        self._records.bad_chunk(peer)

    def refused(self, peer: str, message: str) -> None:
        self._records.refused(peer, message)


class Fetches:
    """A node's fetches (see :mod:`p2p.node.fetching`). It finds providers through
    ``connections`` (named and connected peers, peer exchange, hole punches) and
    ``providers`` (the DHT), fetches into ``store`` with the download's ``network``, and
    counts in ``records``. ``resolve_name``: how a ``PUBLISHER/NAME`` reference becomes a
    blob ID. ``board``: where the downloads post what they have in flight (the node's
    server answers fellows from it)."""

    def __init__(
        self,
        store: Store,
        connections: Connections,
        providers: ProviderRecords,
        records: FetchRecords,
        *,
        settings: FetchSettings,
        scores: PeerScores,
        board: FetchingBoard,
        resolve_name: NameResolver,
        pacer: Pacer | None = None,
    ) -> None:
        self.store = store
        self.connections = connections
        self.providers = providers
        self.records = records
        self.settings = settings
        self.scores = scores
        self.board = board
        self.resolve_name = resolve_name
        self.network = NodeNetwork(connections, records, pacer)

    async def fetch(
        self,
        ref: str | Reference,
        *,
        providers: Sequence[str] = (),
        progress: ProgressCallback | None = None,
        recursive: bool = True,
        announce: bool = True,
    ) -> str:
        """Fetch a blob (by ID, ticket or published name, or a Reference already parsed)
        and, for a collection, its children.

        ``providers`` are multiaddrs ending in ``/p2p/<id>``; connected peers and the DHT
        are asked as well. With ``announce`` the blob is then provided on the DHT.
        Returns the blob ID.
        """
        started = trio.current_time()
        outcome = "failed"
        tally = Tally()
        try:
            blob_id = await self._fetch_unwrapped(ref, providers, progress, tally, recursive)
            outcome = "ok"
        except (NoProviders, FetchFailed) as exc:
            outcome = "not_found" if isinstance(exc, NoProviders) else "failed"
            reasons = self.records.refusal_lines(providers)
            if reasons:
                raise type(exc)(f"{exc}; " + "; ".join(reasons)) from None
            raise
        except trio.Cancelled:
            outcome = "cancelled"
            raise
        finally:
            self.records.ended(tally, outcome, trio.current_time() - started)
        if announce:
            await self.providers.announce(blob_id)
        return blob_id

    async def _fetch_unwrapped(
        self,
        ref: str | Reference,
        providers: Sequence[str],
        progress: ProgressCallback | None,
        tally: Tally,
        recursive: bool,
    ) -> str:
        try:
            counted = self.records.counted(progress, tally)
            return await self._fetch(ref, providers, counted, recursive)
        except BaseExceptionGroup as group:
            raise unwrap_single(group) from None

    async def _end_when_all_refuse(self, dials: Dials, blob_id: str) -> None:
        """Without a DHT to find others, a fetch whose every provider refused us for want
        of admission is over: say so now rather than after the discovery timeout."""
        if self.providers.dht is not None:
            return
        while True:
            await self.records.next_refusal()
            peers = set(self.connections.connected_peers()) | set(dials.peers)
            if dials.pending == 0 and peers and peers <= set(self.records.refusals):
                raise NoProviders(f"no provider of {blob_id} would serve us")

    async def _reference(self, ref: str | Reference) -> Reference:
        """``ref`` parsed, unless it is already (p2p.node.request rule 1)."""
        if isinstance(ref, Reference):
            return ref
        if is_name_ref(ref):
            return Reference.named(ref, await self.resolve_name(ref))
        return Reference.parse(ref)

    async def _fetch(
        self,
        ref: str | Reference,
        providers: Sequence[str],
        progress: ProgressCallback | None,
        recursive: bool,
    ) -> str:
        reference = await self._reference(ref)
        blob_id = reference.blob_id
        addrs = [*providers, *reference.ticket_addrs]
        dials = Dials()
        # The lease keeps gc off the parent and, once it is here, its children, however long
        # the fetch runs (gc's grace period alone would not).
        lease = await trio.to_thread.run_sync(self.store.lease, [blob_id])
        try:
            await self._fetch_leased(blob_id, addrs, dials, progress, recursive)
        except BaseExceptionGroup as group:
            leaf = unwrap_single(group)
            if not isinstance(leaf, NoProviders) or not dials.errors:
                raise
            # A named provider that could not be reached may be the one that holds it.
            unreached = "; ".join(dials.errors[:MAX_DIAL_ERRORS_SHOWN])
            raise NoProviders(f"{leaf}; not reached: {unreached}") from None
        finally:
            await trio.to_thread.run_sync(lease.release)
        return blob_id

    async def _fetch_leased(
        self,
        blob_id: str,
        addrs: list[str],
        dials: Dials,
        progress: ProgressCallback | None,
        recursive: bool,
    ) -> None:
        async with trio.open_nursery() as nursery:
            # Named providers are dialled at once and each joins the fetch as soon as it
            # is connected: one that accepts TCP and never handshakes delays nobody.
            for addr in dict.fromkeys(addrs):
                dials.pending += 1
                nursery.start_soon(self._dial_into, addr, dials)
            nursery.start_soon(self._end_when_all_refuse, dials, blob_id)
            await self._fetch_one(blob_id, dials, progress)
            entries = (
                await trio.to_thread.run_sync(self.store.collection_entries, blob_id)
                if recursive
                else None
            )
            if entries is not None:
                limiter = trio.CapacityLimiter(COLLECTION_PARALLELISM)

                async def child(child_id: str) -> None:
                    async with limiter:
                        await self._fetch_one(child_id, dials, progress)

                async with trio.open_nursery() as children:
                    # Identical files (two empty ones, say) share one blob: fetch it once.
                    for child_id in dict.fromkeys(entry.blob_id for entry in entries):
                        children.start_soon(child, child_id)
            nursery.cancel_scope.cancel()

    async def _dial_into(self, addr: str, dials: Dials) -> None:
        try:
            dials.add(await self.connections.connect(addr, lanes=True))
        except PeerUnreachable as exc:
            log.info("%s", exc)
            dials.errors.append(str(exc))
        finally:
            dials.pending -= 1
            dials.wake()

    async def _fetch_one(
        self, blob_id: str, dials: Dials, progress: ProgressCallback | None
    ) -> None:
        if await trio.to_thread.run_sync(self._intact, blob_id):
            return
        send, receive = trio.open_memory_channel[str](256)
        # Named providers come apart from discovery's: the download waits for them past its
        # discovery timeout, until their dials end (p2p.fetch.downloader rule 5).
        send_named, receive_named = trio.open_memory_channel[str](256)
        providers = list(dials.peers)
        async with trio.open_nursery() as nursery:
            # From the count taken with ``providers``: a dial that ends before the feed's
            # first step is then handed on, not taken for one of them.
            nursery.start_soon(feed_dialled, dials, send_named, len(providers))
            if self.settings.peer_exchange:
                nursery.start_soon(self._exchange, blob_id, dials, send.clone())
            nursery.start_soon(self._discover, blob_id, set(dials.peers), send)
            await download_blob(
                self.network,
                self.store,
                blob_id,
                providers=providers,
                more_providers=receive,
                named_providers=receive_named,
                progress=progress,
                config=self.settings.scheduler_config(),
                discovery_timeout=self.settings.discovery_timeout,
                stripe_config=self.settings.stripe,
                scores=self.scores,
                own_peer=self.connections.peer_id,
                board=self.board,
            )
            nursery.cancel_scope.cancel()

    async def _exchange(
        self, blob_id: str, dials: Dials, send: trio.MemorySendChannel[str]
    ) -> None:
        """Peer exchange for one fetch (p2p.blob.swarm): ask its providers ``peers`` (each at
        most once per PEX_INTERVAL, backing off: `PexBook`), dial the new fellows they name
        (bounded), and hand each one reached to the download."""
        book = PexBook(self.connections.peer_id)
        dialling = trio.Semaphore(PEX_DIAL_PARALLELISM)

        async def dial(peer: str, addrs: tuple[str, ...]) -> None:
            async with dialling:
                if not await self.connections.dial_listed(peer, addrs):
                    return
            book.add_source(peer)
            try:
                await send.send(peer)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the download is over

        async def ask(source: str) -> None:
            listed = await self.connections.ask_peers(source, blob_id)
            fresh = book.to_dial(listed)
            for peer, addrs in fresh:
                nursery.start_soon(dial, peer, addrs)
            book.answered(source, len(fresh), len(listed))

        started = trio.current_time()
        async with send, trio.open_nursery() as nursery:
            while True:
                for peer in dials.peers:
                    book.add_source(peer)
                now = trio.current_time()
                if (
                    now - started >= PEX_QUIET_GRACE
                    and dials.pending == 0
                    and not nursery.child_tasks
                    and not await trio.to_thread.run_sync(self._manifest_known, blob_id)
                ):
                    return  # nothing anywhere: let the search end now
                for source in book.due(now):
                    nursery.start_soon(ask, source)
                # A named provider that connects is asked at once.
                with trio.move_on_after(max(book.next_wake(now) - now, 0.05)):
                    await dials.changed.wait()

    def _manifest_known(self, blob_id: str) -> bool:
        try:
            self.store.manifest(blob_id)
        except BlobNotFound:
            return False
        return True

    def _intact(self, blob_id: str) -> bool:
        """Whether the store holds ``blob_id`` whole and sound. With ``verify_local`` a
        local copy is hashed first: a rotten one is quarantined (``Store.verify``) and the
        fetch goes on, from its good chunks, rather than trusting it."""
        if not self.store.has(blob_id):
            return False
        if not self.settings.verify_local:
            return True
        bad = self.store.verify(blob_id)
        if bad:
            log.warning(
                "local copy of %s is damaged (%d chunk(s)): quarantined, fetching it again",
                blob_id[:12],
                len(bad),
            )
        return not bad

    async def _discover(
        self, blob_id: str, seen: set[str], send: trio.MemorySendChannel[str]
    ) -> None:
        """Feed candidate providers: connected peers at once, then the DHT's answers,
        asked again with growing pauses (a provider may announce itself late) until the
        discovery timeout."""
        async with send:
            for peer in self.connections.connected_peers()[:MAX_CONNECTED_CANDIDATES]:
                if peer not in seen and self.connections.may_fetch_from(peer):
                    seen.add(peer)
                    await send.send(peer)
            if self.providers.dht is None:
                return
            pause = FIRST_DISCOVERY_PAUSE
            # A NATed provider may first be found by a record from before its reservation
            # (its own addresses only), then by one naming its circuit: punch it then.
            punched: set[str] = set()
            async with trio.open_nursery() as punching:
                with trio.move_on_after(self.settings.discovery_timeout):
                    while True:
                        for peer in await self.providers.find_providers(blob_id):
                            circuits = (
                                [] if peer in punched else self.connections.circuit_addrs(peer)
                            )
                            if circuits and len(punched) < MAX_DHT_PUNCHES:
                                punched.add(peer)
                                seen.add(peer)
                                punching.start_soon(self._punch_into, circuits, send.clone())
                            elif peer not in seen and self.connections.may_fetch_from(peer):
                                seen.add(peer)
                                await send.send(peer)
                        await trio.sleep(pause)
                        pause = min(pause * 2, MAX_DISCOVERY_PAUSE)

    async def _punch_into(self, circuits: list[str], send: trio.MemorySendChannel[str]) -> None:
        """Reach a NATed provider through the first of its relays that works and hand it
        to the download; a failure is in ``connections.punches.failures``."""
        async with send:
            for addr in circuits[:MAX_RELAYS_PER_PROVIDER]:
                try:
                    peer = await self.connections.connect(addr)
                except (PeerUnreachable, BadAddress) as exc:
                    log.info("%s", exc)
                    continue
                try:
                    await send.send(peer)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the download is over
                return


class Tally:
    """What one fetch received, by blob: the latest progress of each (its log lines)."""

    def __init__(self) -> None:
        self.last: dict[str, Progress] = {}

    def lines(self, outcome: str, seconds: float) -> list[str]:
        """One line per blob fetched (at INFO, ``-v``): peers, bytes, time, outcome."""
        out = []
        for blob_id, progress in self.last.items():
            peers = ", ".join(
                f"{peer} ({count} B)" for peer, count in progress.new_bytes.items() if count
            )
            out.append(
                f"fetched {blob_id[:12]}: {sum(progress.new_bytes.values())} bytes "
                f"from {peers or 'nobody'} in {progress.elapsed:.2f} s "
                f"({outcome if not progress.finished else 'ok'})"
            )
        if not out and outcome != "ok":
            out.append(f"fetch ended {outcome} after {seconds:.2f} s, nothing received")
        return out


class Dials:
    """The named providers of one fetch, dialled at once (``Fetches._dial_into``)."""

    def __init__(self) -> None:
        self.peers: list[str] = []  # connected, in the order they answered
        self.errors: list[str] = []
        self.pending = 0
        self.changed = trio.Event()

    def add(self, peer: str) -> None:
        if peer not in self.peers:
            self.peers.append(peer)

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


async def feed_dialled(dials: Dials, send: trio.MemorySendChannel[str], sent: int) -> None:
    """Hand a download each named provider as its dial succeeds, until all dials ended;
    the first ``sent`` of ``dials.peers`` went in as its providers already."""
    async with send:
        while True:
            while sent < len(dials.peers):  # a send is a checkpoint: more may come meanwhile
                await send.send(dials.peers[sent])
                sent += 1
            if dials.pending == 0:
                return
            await dials.changed.wait()
