"""A simulated fetch: the project's own ``Scheduler`` driven through a thin shell.

Each simulated fetcher runs ``p2p.fetch.scheduler.Scheduler`` (rarest first, swarming,
claims, the partition, rate-scaled batches, busy limits, deadlines, endgame, bans),
``p2p.fetch.striping.StripeGrowth`` (connections to a seeder), ``p2p.blob.swarm.PexBook``
(peer exchange) and ``p2p.fetch.scores.PeerScores`` (distrusted peers start last), with
the node's own swarming settings (``p2p.node.fetching``'s ``SWARM_*`` through
`swarm_config`). The shell calls only their public methods.

What the shell does by hand, mirroring ``p2p.fetch.downloader`` and ``p2p.node.fetching``
(their rule numbers in brackets):

1. The named provider is dialled (``Costs.dial_rtts`` round trips); the first answer it
   gives on one stream is the manifest and, riding with it, a `try_get` of chunk 0 [11];
   `have` and, when swarming, 1.4.0's fellow count are asked on streams of their own at
   the same time, and a far provider's extra connections are dialled at once (HaveProbes).
   A manifest answered `busy` is asked again after ``MANIFEST_RETRY_PAUSES``; with none
   the fetch fails (``NoProviders``), and one stalled for ``STALL_GRACE`` fails too.
2. Per provider: ``add_peer`` with its bitmap, ``set_origin`` if it was named,
   ``on_rtt`` with the `have` round trip,
   ``set_connections`` as lanes come up; stream workers as ``inflight_limit`` allows, one
   live request each, or ``PIPELINE_DEPTH`` on a striped provider's bulk lanes, where
   lane 0 is left to control streams [9, 10]. A request's answer: each chunk
   (``expects``, ``on_chunk``, a duplicate that makes it ``is_obsolete`` resets the
   stream), then ``End`` (``on_request_done`` with what the server lacks), or ``busy``
   (``on_request_busy``, the stream dropped, 0.2 s pause). A chunk that fails its hash
   (a liar's) bans the peer (``on_bad_chunk``) and penalises it in ``PeerScores``.
   A deadline passed, a stream closed under it, or a peer gone: ``on_request_failed``
   (requests queued behind on the same stream are cancelled). A dropped peer, or one whose
   `have` was answered `busy`, is tried again after ``PEER_RETRY_PAUSES``; one that said
   `not_found` is not.
3. A partial provider is asked `status` every ``HAVE_REFRESH_INTERVAL`` (its bitmap and
   claims to ``update_peer_bitmap``) until it holds everything; a full one, when swarming,
   is asked its fellow count (``set_alone``, ``ALONE_ANSWERS``) [8]; a full one is striped
   by ``StripeGrowth`` [9].
4. Peer exchange [node 4]: providers are asked `peers` when ``PexBook.due`` says, new
   fellows dialled (``PEX_DIAL_PARALLELISM`` at a time, ``MAX_SWARM_DIALS`` in all) and
   added as providers. Once the dial budget is spent the loop ends (the real one wakes
   every 0.05 s to no effect until the download ends).
5. Idle workers wake on every change, once everything that happens at that instant has
   (as trio runs the workers `Changes.notify` woke after the task that woke them), and at the
   scheduler's ``next_late_at`` (at most ``IDLE_WAKE_S`` apart) for endgame copies. After a
   partial provider's `status`, only its own and the full providers' workers ask (the
   downloader wakes every worker; the others' holdings did not change, and a simulated
   fan-out gave the same figures either way at 4-16 fetchers). Of one provider's idle
   workers, those after the first told None by ``next_request`` do not ask (nothing
   changed in between: they would be told None too). Deadlines: one timer per fetch, at
   the scheduler's earliest (``next_deadline``), reporting every request ``expired``.
6. When every chunk is verified the fetch's streams close; a one-shot fetch (`blob get`)
   lingers while fellows ask within ``LINGER_QUIET`` (at most ``LINGER_MAX``) and then its
   node leaves; a long-lived node serves on.

Not simulated: disk writes and hashing (instant), manifests from several providers, the
DHT, relays and hole punching.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import blake3

from bench.sim.fluid import call_later
from bench.sim.node import Blob, SimNode
from p2p.blob.swarm import LINGER_MAX, LINGER_QUIET, PEX_DIAL_PARALLELISM, PexBook
from p2p.fetch.download_parts import (
    ALONE_ANSWERS,
    DISTRUSTED_START_DELAY,
    HAVE_REFRESH_INTERVAL,
    IDLE_WAKE_S,
    MANIFEST_RETRY_PAUSES,
    PEER_RETRY_PAUSES,
    PIPELINE_DEPTH,
    SPECULATIVE_CHUNK,
    STALL_GRACE,
)
from p2p.fetch.sched_records import RequestTicket, SchedulerConfig
from p2p.fetch.scheduler import Scheduler
from p2p.fetch.scores import PeerScores
from p2p.fetch.striping import StripeConfig, StripeGrowth
from p2p.node.fetching import SWARM_REQUEST_SECONDS, SWARM_UNMEASURED_BATCH_BYTES

# Pause after a `busy` answer before the worker asks again (p2p.fetch.download_requests).
BUSY_PAUSE = 0.2
TARGET = True


def swarm_config(config: SchedulerConfig | None = None, *, linger: bool = False) -> SchedulerConfig:
    """The scheduler settings a node with peer exchange uses (``p2p.node.fetching``'s
    ``_scheduler_config``), ``linger``: a one-shot `blob get`'s."""
    config = config or SchedulerConfig()
    return replace(
        config,
        max_request_seconds=config.max_request_seconds or SWARM_REQUEST_SECONDS,
        unmeasured_batch_bytes=config.unmeasured_batch_bytes or SWARM_UNMEASURED_BATCH_BYTES,
        defer_to_partial_holders=True,
        linger_while_asked=linger,
    )


@dataclass
class Req:
    """One request on a stream."""

    kind: str  # manifest, have, status, peers, get
    blob: Blob
    indices: tuple[int, ...] = ()
    tentative: bool = False
    fellows: bool = False
    ticket: RequestTicket | None = None


class Stream:
    """The client's side of one stream to ``server`` on connection ``lane``."""

    def __init__(
        self, fetch: SimFetch, server: SimNode, lane: int, on_answer: Callable[..., None]
    ) -> None:
        self.fetch = fetch
        self.owner = fetch.node.name
        self.server = server
        self.lane = lane
        self.on_answer = on_answer
        self.on_chunk: Callable[[Req, int, int, bool], None] | None = None
        self.on_closed: Callable[[], None] | None = None
        self.closed = False
        server.client_streams.add(self)  # closed under us if the server's node leaves
        # A `get` whose answer may come before anyone reads it (the first chunk's, asked
        # with the manifest): its chunks and answer wait here until a worker takes it.
        self.held_back: list[tuple[bool, tuple[Any, ...]]] | None = None

    def send(self, req: Req) -> bool:
        """Send ``req``; False (and nothing sent) where the peer is gone."""
        node = self.fetch.node
        if self.closed or not self.server.alive or self.server.name not in node.connected:
            return False
        self.fetch.world.net.message(
            node.host, self.server.host, self.server.request, self, req, lane=self.lane
        )
        return True

    def reset(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.server.client_streams.discard(self)
        node = self.fetch.node
        if self.server.alive and node.alive:
            self.fetch.world.net.message(
                node.host, self.server.host, self.server.client_closed, self
            )

    # Called by the server (through the network).
    def answer(self, req: Req, kind: str, *args: Any) -> None:
        if self.closed:
            return
        if self.held_back is not None and req.kind == "get":
            self.held_back.append((False, (req, kind, *args)))
            return
        self.on_answer(req, kind, *args)

    def chunk(self, req: Req, index: int, nbytes: int, bad: bool) -> None:
        if self.closed:
            return
        if self.held_back is not None:
            self.held_back.append((True, (req, index, nbytes, bad)))
        elif self.on_chunk is not None:
            self.on_chunk(req, index, nbytes, bad)

    def release(self) -> None:
        """A worker took this stream: what was held back reaches it, in order."""
        held, self.held_back = self.held_back or [], None
        for is_chunk, args in held:
            if self.closed:
                return
            if is_chunk:
                self.chunk(*args)
            else:
                self.answer(*args)

    def closed_by_server(self) -> None:
        if not self.closed:
            self.closed = True
            self.server.client_streams.discard(self)
            if self.on_closed is not None:
                self.on_closed()


@dataclass
class Worker:
    provider: Provider
    lane: int
    stream: Stream | None = None
    pending: list[Req] = field(default_factory=list)
    paused_until: float = 0.0
    gone: bool = False


@dataclass
class Provider:
    name: str
    node: SimNode
    full: bool = False
    running: bool = False
    have: bytes | None = None
    rtt: float = 0.0
    have_stream: Stream | None = None
    count: tuple[Stream, int | None] | None = None  # the fellow-count probe's stream, answer
    spec: tuple[Stream, Req] | None = None  # the first chunk's `get`, asked with the manifest
    named: bool = False  # named by the caller: dialled with early lanes
    lanes: int = 1  # connections (lane 0 and the bulk lanes)
    planned: int = 0  # bulk lanes being dialled at once (HaveProbes)
    dialling: int = 0  # of those, not up yet
    lane_load: list[int] = field(default_factory=lambda: [0])
    workers: list[Worker] = field(default_factory=list)
    growth: StripeGrowth | None = None
    retries: int = 0
    busy: bool = False  # its `have` was answered busy
    bytes: int = 0


class SimFetch:
    """One download of ``blob`` by ``node`` (see the module docstring)."""

    def __init__(
        self,
        node: SimNode,
        blob: Blob,
        named: list[str],
        *,
        config: SchedulerConfig,
        stripes: StripeConfig | None = StripeConfig(),  # noqa: B008 (frozen)
        scores: PeerScores | None = None,
        on_done: Callable[[SimFetch], None] | None = None,
        on_failed: Callable[[SimFetch], None] | None = None,
    ) -> None:
        self.node = node
        self.world = node.world
        self.blob = blob
        self.named = list(named)
        self.config = config
        self.stripes = stripes
        self.swarm = config.defer_to_partial_holders
        self.scores = scores if scores is not None else PeerScores()
        self.on_done = on_done
        self.on_failed = on_failed
        self.failed: str | None = None
        self.manifests_asked = 0
        self.stalled_since: float | None = None
        self.scheduler: Scheduler | None = None
        self.providers: dict[str, Provider] = {}
        self.book = PexBook(node.name) if self.swarm else None
        self.pex_dialling = 0
        self.pex_queue: list[tuple[str, tuple[str, ...]]] = []
        self.speculated = False
        self.started_at = self.world.now
        self.manifest_at: float | None = None
        self.first_chunk_at: float | None = None
        self.done_at: float | None = None
        self.left_at: float | None = None
        self.stopped = False
        self.duplicate_bytes = 0
        self.bad_chunks = 0
        self.wake_at = math.inf
        self.deadline_at = math.inf
        self.pex_wake_at = math.inf
        self.pump_due = False
        self.pump_all = False
        self.pump_some: set[str] = set()

    # --- start, providers -----------------------------------------------------------------

    def start(self) -> None:
        self.node.fetches[self.blob.blob_id] = self
        if self.node.complete(self.blob):
            self._finish()
            return
        for name in self.named:
            self.add_provider(name, named=True)

    def _dial(self, name: str, then: Callable[[], None]) -> None:
        node = self.node
        if name in node.connected:
            call_later(self.world.env, 0.0, then)
            return
        target = self.world.nodes.get(name)
        if target is None or not target.alive:
            return
        delay = self.world.dial_s(node.host, target.host)

        def dialled() -> None:
            if self.stopped or not node.alive or not target.alive:
                return
            node.connected.add(name)
            target.connected.add(node.name)
            then()

        call_later(self.world.env, delay, dialled)

    def add_provider(self, name: str, *, named: bool = False) -> None:
        if name in self.providers or name == self.node.name or self.stopped:
            return
        target = self.world.nodes[name]
        prov = self.providers[name] = Provider(name, target, named=named)
        prov.lanes = 1 + self.node.lanes.get(name, 0)  # connections an earlier fetch dialled
        delay = DISTRUSTED_START_DELAY if self.scores.distrusted(name, self.world.now) else 0.0

        def connected() -> None:
            if self.book is not None:
                self.book.add_source(name)
                self._pex_soon(0.0)
            self._probe(prov)

        call_later(self.world.env, delay, self._dial, name, connected)

    def _stream(self, prov: Provider, lane: int, on_answer: Callable[..., None]) -> Stream:
        return Stream(self, prov.node, lane, on_answer)

    def _probe(self, prov: Provider) -> None:
        """HaveProbes and the manifest request (rule 1): `have`, the fellow count, the
        manifest with the first chunk riding along, and a far provider's lanes."""
        blob = self.blob
        asked = self.world.now
        if self.scheduler is None:
            self._ask_manifest(prov)
        hs = prov.have_stream = self._stream(prov, 0, lambda req, kind, *a: None)

        def have(req: Req, kind: str, *args: Any) -> None:
            if kind in ("have", "status"):
                prov.have = args[0]
                prov.rtt = self.world.now - asked
            else:
                prov.have = b""
                prov.busy = kind == "busy"  # only a busy one is tried again (_run_peer)
            self._run(prov)

        hs.on_answer = have
        hs.send(Req("have", blob))
        if self.swarm:
            cs = self._stream(prov, 0, lambda req, kind, *a: None)
            prov.count = (cs, None)

            def count(req: Req, kind: str, *args: Any) -> None:
                prov.count = (cs, args[2] if kind == "status" else -1)

            cs.on_answer = count
            cs.send(Req("status", blob, fellows=True))
        rtt = self.world.net.rtt(self.node.host, prov.node.host)
        lanes = 0 if self.stripes is None or not prov.named else self.stripes.early_lanes(rtt)
        lanes -= prov.lanes - 1
        if lanes > 0 and not prov.planned:
            # Only a provider the caller named is dialled with its lanes at once
            # (p2p.node.fetching: connect(lanes=True)); fellows found later are not striped.
            prov.planned = prov.dialling = lanes
            for _ in range(lanes):
                self._add_lane(prov, None, early=True)

    def _ask_manifest(self, prov: Provider, attempt: int = 0) -> None:
        """The manifest, the fetch's first request of a provider carrying a `get` of the
        first chunk (rule 11); asked again after MANIFEST_RETRY_PAUSES when the provider
        does not answer it (busy), then given up on (`_manifest_failed`)."""
        blob = self.blob
        ms = self._stream(prov, 0, lambda req, kind, *a: None)
        spec = None
        if not self.speculated and self.stripes is not None:
            self.speculated = True
            spec = Req("get", blob, (SPECULATIVE_CHUNK,), tentative=self.swarm)
            prov.spec = (ms, spec)
            ms.held_back = []
        self.manifests_asked += 1

        def manifest(req: Req, kind: str, *args: Any) -> None:
            if req.kind != "manifest":
                return
            self.manifests_asked -= 1
            if spec is None:
                ms.reset()
            if self.scheduler is not None or self.stopped:
                return
            if kind == "manifest":
                self._got_manifest()
            elif kind == "busy" and attempt < len(MANIFEST_RETRY_PAUSES):
                self.manifests_asked += 1  # still asking

                def again() -> None:
                    self.manifests_asked -= 1
                    if self.scheduler is None and not self.stopped:
                        self._ask_manifest(prov, attempt + 1)

                call_later(self.world.env, MANIFEST_RETRY_PAUSES[attempt], again)
            else:
                self._manifest_failed()

        ms.on_answer = manifest
        ms.on_closed = lambda: manifest(Req("manifest", blob), "closed")
        if not ms.send(Req("manifest", blob)):
            manifest(Req("manifest", blob), "unreachable")
            return
        if spec is not None:
            ms.send(spec)

    def _manifest_failed(self) -> None:
        """No provider asked gave the manifest (``NoProviders``): the fetch fails."""
        if self.manifests_asked <= 0 and self.scheduler is None:
            self.fail("no provider sent the manifest")

    def fail(self, why: str) -> None:
        """The fetch gives up (``NoProviders``, ``FetchFailed``): its streams close."""
        if self.stopped or self.done_at is not None:
            return
        self.stopped = True
        self.failed = why
        for prov in self.providers.values():
            for w in prov.workers:
                if w.stream is not None:
                    w.stream.reset()
            prov.workers = []
        if self.node.fetches.get(self.blob.blob_id) is self:
            del self.node.fetches[self.blob.blob_id]
        if self.on_failed is not None:
            self.on_failed(self)

    def _got_manifest(self) -> None:
        blob = self.blob
        self.manifest_at = self.world.now
        # The partial blob exists from here (blobstore: begin_partial): fellows asking
        # `have` get an empty bitmap, not not_found.
        self.node.holds.setdefault(blob.blob_id, bytearray((blob.num_chunks + 7) // 8))
        own = self.node.name
        start = int.from_bytes(blake3.blake3(f"{own}/{blob.blob_id}".encode()).digest()[:8])
        have = self.node.holds.get(blob.blob_id)
        verified = (
            []
            if have is None
            else [i for i in range(blob.num_chunks) if have[i >> 3] >> (i & 7) & 1]
        )
        self.scheduler = Scheduler(
            blob.num_chunks, blob.length, verified, self.config, start=start, own=own
        )
        for prov in list(self.providers.values()):
            self._run(prov)
        self._wake()

    def _run(self, prov: Provider) -> None:
        """A provider's task (``_run_peer``), once the manifest and its `have` are in."""
        sched = self.scheduler
        if sched is None or prov.have is None or prov.running or self.stopped:
            return
        if not prov.have:  # busy: tried again later; not found: not used
            if prov.busy:
                self._retry(prov)
            return
        prov.running = True
        n = self.blob.num_chunks
        bits = int.from_bytes(prov.have, "little")
        prov.full = bits.bit_count() == n
        now = self.world.now
        sched.add_peer(prov.name, now, None if prov.full else prov.have)
        sched.set_origin(prov.name, prov.named)
        sched.on_rtt(prov.name, prov.rtt)
        prov.lane_load = [1] + [0] * (prov.lanes - 1)
        self._set_connections(prov)
        first = Worker(prov, 0)
        prov.workers.append(first)
        if prov.spec is not None:
            stream, req = prov.spec
            prov.spec = None
            ticket = None if stream.closed else sched.claim(prov.name, now, (SPECULATIVE_CHUNK,))
            if ticket is None:
                stream.reset()
            else:
                req.ticket = ticket
                self._attach(first, stream)
                first.pending.append(req)
                self._deadline(ticket)
                stream.release()
        if first.stream is None and prov.have_stream is not None:
            self._attach(first, prov.have_stream)
        prov.have_stream = None
        if not prov.full:
            self._refresh(prov, first=True)
        elif self.swarm:
            self._watch_alone(prov)
        if prov.full and self.stripes is not None and not prov.dialling:
            self._grow_start(prov)  # else once its early lanes are up (`lanes_dialled`)
        self._pump()

    def _retry(self, prov: Provider) -> None:
        if prov.retries >= len(PEER_RETRY_PAUSES) or self.stopped:
            return
        pause = PEER_RETRY_PAUSES[prov.retries]
        prov.retries += 1
        prov.running = False
        prov.have = None
        prov.workers = []

        def again() -> None:
            if self.stopped or (self.scheduler is not None and self.scheduler.done):
                return
            if self.scheduler is not None:
                stats = self.scheduler.stats_of(prov.name)
                if stats is not None and stats.banned:
                    return
            self._dial(prov.name, lambda: self._probe(prov))

        call_later(self.world.env, pause, again)

    # --- lanes and striping -----------------------------------------------------------------

    def _depth(self, prov: Provider) -> int:
        return 1 if self.stripes is None or prov.lanes <= 1 else PIPELINE_DEPTH

    def _set_connections(self, prov: Provider) -> None:
        prov.lane_load.extend([0] * (prov.lanes - len(prov.lane_load)))
        if self.scheduler is not None and prov.running:
            count = prov.lanes
            self.scheduler.set_connections(
                prov.name, count if count == 1 else count - 1, self._depth(prov)
            )

    def _lanes_coming(self, prov: Provider) -> bool:
        return prov.planned > 0 and prov.lanes == 1

    def _add_lane(self, prov: Provider, growth: StripeGrowth | None, early: bool = False) -> None:
        delay = self.world.dial_s(self.node.host, prov.node.host)

        def up() -> None:
            ok = prov.node.alive and not self.stopped
            if ok:
                prov.lanes += 1
                self.node.lanes[prov.name] = self.node.lanes.get(prov.name, 0) + 1
            if growth is not None:
                growth.on_dialled(ok, self.world.now)
            if early:
                prov.dialling -= 1
                if not prov.dialling and prov.growth is None and prov.running and prov.full:
                    self._grow_start(prov)
            self._set_connections(prov)
            self._pump()

        call_later(self.world.env, delay, up)

    def _grow_start(self, prov: Provider) -> None:
        assert self.stripes is not None
        count = prov.lanes
        prov.growth = StripeGrowth(self.stripes, self.world.now, count - 1 if count > 1 else 1)
        self._grow(prov)

    def _grow(self, prov: Provider) -> None:
        growth, sched = prov.growth, self.scheduler
        assert growth is not None and sched is not None and self.stripes is not None
        if growth.stopped or sched.done or self.stopped:
            return
        stats = sched.stats_of(prov.name)
        if stats is None or stats.banned or stats.dropped:
            return
        now = self.world.now
        busy = stats.inflight > 0 and sched.fetchable_count > 0
        more = growth.decide(now, stats.rtt_s, busy)
        if more and prov.lanes == 1:
            self._add_lane(prov, None)  # lane 0 becomes the control lane: one more
        for _ in range(more):
            self._add_lane(prov, growth)
        wake = growth.next_check(now, stats.rtt_s)
        call_later(self.world.env, max(wake - now, self.stripes.min_settle_s / 4), self._grow, prov)

    # --- status polls ---------------------------------------------------------------------

    def _refresh(self, prov: Provider, first: bool = False) -> None:
        """``ProviderWatch.refresh_have``: a partial provider's `status`, every
        HAVE_REFRESH_INTERVAL."""
        stream = self._stream(prov, 0, lambda req, kind, *a: None)
        last: list[tuple[bytes, bytes | None] | None] = [None]

        def ask() -> None:
            sched = self.scheduler
            if sched is None or sched.done or self.stopped or not sched.still_used(prov.name):
                stop()
                return
            if not stream.send(Req("status", self.blob)):
                stop()

        def stop() -> None:
            if self.scheduler is not None:
                self.scheduler.drop_claims(prov.name)
            stream.reset()

        def answer(req: Req, kind: str, *args: Any) -> None:
            sched = self.scheduler
            if sched is None or self.stopped:
                return
            if kind != "status" or not sched.still_used(prov.name):
                stop()
                return
            bitmap, soon = args[0], args[1]
            full = int.from_bytes(bitmap, "little").bit_count() == self.blob.num_chunks
            if full:
                sched.update_peer_bitmap(prov.name, None, soon)
                prov.full = True
                stop()
                self._pump()
                return
            call_later(self.world.env, HAVE_REFRESH_INTERVAL, ask)
            if (bitmap, soon) == last[0]:
                return  # the same answer again: update_peer_bitmap would change nothing
            last[0] = (bitmap, soon)
            sched.update_peer_bitmap(prov.name, bitmap, soon)
            self._pump((TARGET and prov) or None)

        def closed() -> None:
            if self.scheduler is not None:
                self.scheduler.drop_claims(prov.name)

        stream.on_answer = answer
        stream.on_closed = closed
        ask()

    def _watch_alone(self, prov: Provider) -> None:
        """A seeder's count of other fetchers (rule 8): ``set_alone`` while it says nobody."""
        probe = prov.count
        prov.count = None
        stream = probe[0] if probe is not None else self._stream(prov, 0, lambda r, k, *a: None)
        zeros = 0

        def judge(fellows: int | None) -> None:
            nonlocal zeros
            sched = self.scheduler
            if sched is None or sched.done or self.stopped or not sched.still_used(prov.name):
                stream.reset()
                return
            if fellows != 0:
                sched.set_alone(prov.name, False)
                stream.reset()
                self._pump()
                return
            zeros += 1
            if zeros <= ALONE_ANSWERS:
                sched.set_alone(prov.name, True, once=zeros < ALONE_ANSWERS)
                self._pump()
            call_later(self.world.env, HAVE_REFRESH_INTERVAL, ask)

        def ask() -> None:
            if not stream.send(Req("status", self.blob, fellows=True)):
                judge(-1)

        def answer(req: Req, kind: str, *args: Any) -> None:
            judge(args[2] if kind == "status" else -1)

        stream.on_answer = answer
        if probe is not None and probe[1] is not None:
            judge(probe[1])
        elif probe is None:
            ask()
        # else: the probe's answer is on its way and comes to `answer`

    # --- workers --------------------------------------------------------------------------

    def _wanted(self, prov: Provider, limit: int) -> int:
        lanes = prov.lane_load
        if self._lanes_coming(prov):
            return 1 - sum(lanes)
        if self._depth(prov) == 1:
            return limit - sum(lanes)
        return min(limit, len(lanes) - 1) - sum(lanes[1:])

    @staticmethod
    def _quiet_lane(lanes: list[int]) -> int:
        first = 1 if len(lanes) > 1 else 0
        lane = min(range(first, len(lanes)), key=lambda i: (lanes[i], i))
        lanes[lane] += 1
        return lane

    def _pump(self, only: Provider | None = None) -> None:
        """Every idle worker asks for work (the downloader's `Changes.notify`), once all that
        happens at this instant has happened. ``only``: a partial provider's status
        changed; its workers and the full providers' ask (the others' holdings did not
        change: what they could be given is what they were given before)."""
        if only is None:
            self.pump_all = True
        else:
            self.pump_some.add(only.name)
        if not self.pump_due:
            self.pump_due = True
            call_later(self.world.env, 0.0, self._pump_now)

    def _pump_now(self) -> None:
        self.pump_due = False
        some, self.pump_some = self.pump_some, set()
        every, self.pump_all = self.pump_all, False
        sched = self.scheduler
        if sched is None or self.stopped or sched.done:
            return
        now = self.world.now
        for prov in list(self.providers.values()):
            if not prov.running:
                continue
            if not every and not prov.full and prov.name not in some:
                continue
            if not sched.still_used(prov.name):
                self._drop_provider(prov)
                continue
            limit = sched.inflight_limit(prov.name)
            for _ in range(self._wanted(prov, limit)):
                prov.workers.append(Worker(prov, self._quiet_lane(prov.lane_load)))
            if sum(len(w.pending) for w in prov.workers) >= limit:
                continue  # next_request would say None to every one (its limit is met)
            for w in list(prov.workers):
                if not w.gone and w.paused_until <= now and not self._work(w):
                    # ``next_request(peer, now)`` said None and nothing changed since: it
                    # says None to this provider's other idle workers too (they would ask
                    # and be told so, as the downloader's do).
                    break
        self._wake()

    def _wake(self) -> None:
        """Idle workers sleep until the next request turns late, at most IDLE_WAKE_S."""
        sched = self.scheduler
        if sched is None or sched.done or self.stopped:
            return
        now = self.world.now
        late = sched.next_late_at(now)
        at = now + (IDLE_WAKE_S if late is None else min(IDLE_WAKE_S, max(late - now, 1e-3)))
        if at < self.wake_at - 1e-9 or self.wake_at <= now:
            self.wake_at = at
            call_later(self.world.env, at - now, self._woken, at)

    def _woken(self, at: float) -> None:
        if at == self.wake_at:
            self.wake_at = math.inf
            sched = self.scheduler
            if sched is not None and sched.stalled() and not self._retrying():
                # No usable provider can make progress (``FetchFailed`` after STALL_GRACE).
                now = self.world.now
                self.stalled_since = self.stalled_since or now
                if now - self.stalled_since >= STALL_GRACE:
                    self.fail("stalled: no usable provider holds what is missing")
                    return
            else:
                self.stalled_since = None
            self._pump()

    def _retrying(self) -> bool:
        return any(
            not p.running and p.retries < len(PEER_RETRY_PAUSES) and p.node.alive
            for p in self.providers.values()
        )

    def _work(self, w: Worker) -> bool:
        """``w`` asks for work until it holds its depth; False where the scheduler had
        nothing for its provider (or its stream was lost)."""
        sched = self.scheduler
        assert sched is not None
        prov = w.provider
        lanes = prov.lane_load
        if w.lane == 0 and len(lanes) > 1 and not w.pending:
            # Striped now: leave the control lane for a bulk lane that lacks a worker.
            if w.stream is not None:
                w.stream.reset()
                w.stream = None
            if self._depth(prov) > 1 and min(lanes[1:]) > 0:
                lanes[0] -= 1
                w.gone = True
                prov.workers.remove(w)
                return True
            lanes[0] -= 1
            w.lane = self._quiet_lane(lanes)
        depth = 1 if w.lane == 0 else self._depth(prov)
        most = 1 if w.lane == 0 and self._lanes_coming(prov) else None
        now = self.world.now
        while len(w.pending) < depth:
            ticket = sched.next_request(prov.name, now, max_chunks=most)
            if ticket is None:
                return False
            req = Req("get", self.blob, tuple(sorted(ticket.indices)), ticket=ticket)
            if w.stream is None or w.stream.closed:
                self._attach(w, self._stream(prov, w.lane, lambda *a: None))
            assert w.stream is not None
            if not w.stream.send(req):
                if w.pending:
                    sched.cancel(ticket.request_id, now)
                else:
                    sched.on_request_failed(ticket.request_id, now, "stream lost")
                w.stream.reset()
                w.stream = None
                self._pump()  # the downloader's notify: the other workers try (and fail) too
                return False
            w.pending.append(req)
            self._deadline(ticket)
        return True

    def _attach(self, w: Worker, stream: Stream) -> None:
        w.stream = stream
        stream.on_answer = lambda req, kind, *a: self._get_answer(w, req, kind, *a)
        stream.on_chunk = lambda req, i, n, bad: self._chunk(w, req, i, n, bad)
        stream.on_closed = lambda: self._stream_lost(w, stream, "closed by the peer")

    def _deadline(self, ticket: RequestTicket) -> None:
        """One timer per fetch, at the earliest deadline of a live request (the scheduler's
        ``next_deadline``), rather than one per request: most requests end before theirs,
        and a timer apiece filled SimPy's queue at 1,000 fetchers."""
        if ticket.deadline < self.deadline_at - 1e-9 or self.deadline_at <= self.world.now:
            self.deadline_at = at = ticket.deadline
            call_later(self.world.env, max(0.0, at - self.world.now), self._expire, at)

    def _expire(self, at: float) -> None:
        if at != self.deadline_at:
            return  # moved earlier since
        self.deadline_at = math.inf
        sched = self.scheduler
        if sched is None or sched.done or self.stopped:
            return
        now = self.world.now
        seen: set[int] = set()
        while True:
            late = [t for t in sched.expired(now) if t.request_id not in seen]
            if not late:
                break
            t = late[0]
            seen.add(t.request_id)
            w = self._worker_of(t)
            if w is not None and w.stream is not None:
                self._stream_lost(w, w.stream, "deadline")
            else:
                sched.on_request_failed(t.request_id, now, "deadline")
            self._pump()
        nxt = sched.next_deadline()
        if nxt is not None and nxt > now and nxt < self.deadline_at:
            self.deadline_at = nxt
            call_later(self.world.env, nxt - now, self._expire, nxt)

    def _worker_of(self, ticket: RequestTicket) -> Worker | None:
        prov = self.providers.get(ticket.peer)
        if prov is None:
            return None
        for w in prov.workers:
            if any(r.ticket is ticket for r in w.pending):
                return w
        return None

    def _stream_lost(self, w: Worker, stream: Stream, why: str) -> None:
        """The stream under ``w`` is gone: its first request failed, the rest cancelled."""
        if w.stream is not stream:
            return
        sched = self.scheduler
        stream.reset()
        w.stream = None
        pending, w.pending = w.pending, []
        if sched is None or self.stopped:
            return
        now = self.world.now
        for k, req in enumerate(pending):
            assert req.ticket is not None
            if k == 0:
                sched.on_request_failed(req.ticket.request_id, now, why)
            else:
                sched.cancel(req.ticket.request_id, now)
        self._pump()

    def _drop_provider(self, prov: Provider) -> None:
        """A dropped or banned peer: its workers end; a dropped one is tried again."""
        if not prov.running:
            return
        for w in prov.workers:
            if w.stream is not None:
                w.stream.reset()
            w.gone = True
        prov.workers = []
        prov.lane_load = [0] * len(prov.lane_load)
        sched = self.scheduler
        stats = None if sched is None else sched.stats_of(prov.name)
        prov.running = False
        if stats is not None and not stats.banned:
            self._retry(prov)

    # --- answers --------------------------------------------------------------------------

    def _get_answer(self, w: Worker, req: Req, kind: str, *args: Any) -> None:
        sched = self.scheduler
        if sched is None or self.stopped or req.kind != "get" or req not in w.pending:
            return
        assert req.ticket is not None
        rid = req.ticket.request_id
        now = self.world.now
        w.pending.remove(req)
        if kind == "end":
            sched.on_request_done(rid, now, args[0])
        elif kind == "busy":
            sched.on_request_busy(rid, now)
            if w.stream is not None:
                w.stream.reset()
                w.stream = None
            for other in w.pending:
                assert other.ticket is not None
                sched.cancel(other.ticket.request_id, now)
            w.pending = []
            w.paused_until = now + BUSY_PAUSE
            call_later(self.world.env, BUSY_PAUSE, self._pump)
        else:  # not_found: what it said it held is gone
            sched.on_request_done(rid, now, req.indices)
            if w.stream is not None:
                w.stream.reset()
                w.stream = None
        if sched.done:
            self._finish()
        else:
            self._pump()

    def _chunk(self, w: Worker, req: Req, index: int, nbytes: int, bad: bool) -> None:
        sched = self.scheduler
        if sched is None or self.stopped or req not in w.pending or w.stream is None:
            return
        assert req.ticket is not None
        rid = req.ticket.request_id
        now = self.world.now
        prov = w.provider
        if bad:
            self.bad_chunks += 1
            sched.on_bad_chunk(rid, index, now)
            self.scores.penalize(prov.name, now)
            self._obsolete(w)
            self._drop_provider(prov)
            self._pump()
            return
        if not sched.expects(rid, index):
            sched.cancel(rid, now)
            self._obsolete(w)
            self._pump()
            return
        new = sched.on_chunk(rid, index, nbytes, now)
        if new:
            if self.first_chunk_at is None:
                self.first_chunk_at = now
            self.node.add_chunk(self.blob, index)
            prov.bytes += nbytes
            if prov.growth is not None:
                prov.growth.on_bytes(nbytes, now)
            if sched.done:
                self._finish()
                return
        else:
            self.duplicate_bytes += nbytes
            if sched.is_obsolete(rid):
                sched.cancel(rid, now)
                self._obsolete(w)
                self._pump()

    def _obsolete(self, w: Worker) -> None:
        """Reset ``w``'s stream; requests queued behind on it are cancelled."""
        sched = self.scheduler
        assert sched is not None
        now = self.world.now
        if w.stream is not None:
            w.stream.reset()
            w.stream = None
        for req in w.pending:
            assert req.ticket is not None
            sched.cancel(req.ticket.request_id, now)
        w.pending = []

    # --- peer exchange --------------------------------------------------------------------

    def _pex_soon(self, delay: float) -> None:
        at = self.world.now + delay
        if at < self.pex_wake_at - 1e-9 or self.pex_wake_at <= self.world.now:
            self.pex_wake_at = at
            call_later(self.world.env, delay, self._pex, at)

    def _pex(self, at: float) -> None:
        book = self.book
        if book is None or at != self.pex_wake_at or self.stopped or self.done_at is not None:
            return
        self.pex_wake_at = math.inf
        now = self.world.now
        for source in book.due(now):
            prov = self.providers.get(source)
            if prov is None or not prov.node.alive:
                continue
            self._ask_peers(prov)
        if book.dialled >= book.max_dials:
            # ``due`` says nothing from now on (the dial budget only grows spent): the real
            # loop wakes every 0.05 s to no effect until the download ends; not simulated.
            return
        self._pex_soon(max(book.next_wake(now) - now, 0.05))

    def _ask_peers(self, prov: Provider) -> None:
        book = self.book
        assert book is not None
        stream = self._stream(prov, 0, lambda req, kind, *a: None)

        def answer(req: Req, kind: str, *args: Any) -> None:
            stream.reset()
            listed = args[0] if kind == "peers" else ()
            fresh = book.to_dial(listed)
            self.pex_queue.extend(fresh)
            book.answered(prov.name, len(fresh), len(listed))
            self._pex_dial()

        stream.on_answer = answer
        stream.send(Req("peers", self.blob))

    def _pex_dial(self) -> None:
        while self.pex_queue and self.pex_dialling < PEX_DIAL_PARALLELISM and not self.stopped:
            peer, _ = self.pex_queue.pop(0)
            self.pex_dialling += 1

            def dialled(peer: str = peer) -> None:
                self.pex_dialling -= 1
                self.add_provider(peer)
                self._pex_dial()

            target = self.world.nodes.get(peer)
            if target is None or not target.alive:
                self.pex_dialling -= 1
                continue
            self._dial(peer, dialled)

    # --- the end --------------------------------------------------------------------------

    def _finish(self) -> None:
        if self.done_at is not None:
            return
        self.done_at = self.world.now
        for prov in self.providers.values():
            for w in prov.workers:
                if w.stream is not None:
                    w.stream.reset()
                w.gone = True
            prov.workers = []
            for stream in (prov.have_stream, prov.count[0] if prov.count else None):
                if stream is not None:
                    stream.reset()
        if self.on_done is not None:
            self.on_done(self)
        if self.config.linger_while_asked:
            self._linger(self.world.now + LINGER_MAX)

    def _linger(self, deadline: float) -> None:
        """A one-shot fetch stays while fellows ask (p2p.blob.swarm rule 5), then leaves."""
        now = self.world.now
        last = self.node.asked.get(self.blob.blob_id)
        if now >= deadline - 1e-9 or last is None or now - last >= LINGER_QUIET - 1e-9:
            self.left_at = now
            self.node.leave()
            return
        wait = max(1e-6, min(deadline, last + LINGER_QUIET) - now)
        call_later(self.world.env, wait, self._linger, deadline)

    def stop(self, why: str) -> None:
        """The node left: nothing more happens in this fetch."""
        self.stopped = True
        if self.left_at is None:
            self.left_at = self.world.now

    @property
    def done(self) -> bool:
        return self.done_at is not None
