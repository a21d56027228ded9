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
  one seeder take different chunks from it first.
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
  Claims bind the origins (below; every peer with every chunk while no origin is known): a
  fellow that finished leaves to partial peers only the chunks they hold, and gives a
  claimed one at once rather than let the fetcher wait for the claimer.
- Origins last (with ``defer_to_partial_holders``): a provider the caller named
  (``set_origin``: a ticket's seeder) that has every chunk is handed no pool chunk while a
  usable peer with every chunk that was not named (a fellow that finished, or one found
  holding the blob) is at least ``DEFER_RATE_FRACTION`` as fast as it, or either is not
  measured yet; endgame copies still go to it. A seeder's uplink then carries the blob
  about once and its finished fellows carry the rest: left to rate-scaled batches, every
  later fetcher kept asking it for its share, and a seeder shared by hundreds of
  fetchers sent the blob several times over (bench/sim's fan-outs).
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

Where the code is
-----------------

:class:`Scheduler` (this module) owns the peers, the live requests and their deadlines,
and answers the shell's events, timers and questions; it holds two parts, each an object
with its own state and its own tests:

- :class:`~p2p.fetch.sched_availability.Availability` owns the chunks: each chunk's state
  and the live requests that owe it, rarity, claims, the swarm partition and the hand-out
  heaps ("Rarest first", "Swarm partition", "Cost"). The scheduler tells it which peers
  become usable and what they hold, and which chunks each request takes and releases.
- :class:`~p2p.fetch.sched_picking.Picking` owns the rates and decides per peer: how many
  requests and chunks it may hold, which pool chunks it is handed and which endgame
  copies ("Rate-scaled batches", "Requests sized to the path", "Swarming", "Origins last",
  invariant 2). It reads the scheduler's peers and live requests and the `Availability`.

:mod:`p2p.fetch.sched_records` holds what all three share: the config, tickets, stats,
per-peer and per-request records, named bounds, bitmap and partition-hash helpers; callers
import those names from there.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from p2p.fetch.sched_availability import Availability
from p2p.fetch.sched_picking import Picking
from p2p.fetch.sched_records import (
    _POOL,
    _VERIFIED,
    ALONE_ONCE_SHARE,
    PeerStats,
    RequestTicket,
    SchedulerConfig,
    _Peer,
    _Request,
    _to_ranges,
)

__all__ = ["Scheduler"]


class Scheduler:
    """Chunk scheduling for one blob of `num_chunks` chunks, chunk i `chunk_length(i)`
    bytes long, `verified` ones held already (resume); `start`: where equal rarity begins
    (see "Rarest first"), `own`: this fetcher's peer name (see "Swarm partition"). See
    the module docstring."""

    def __init__(
        self,
        num_chunks: int,
        chunk_length: Callable[[int], int],
        verified: Iterable[int] = (),
        config: SchedulerConfig = SchedulerConfig(),  # noqa: B008 (frozen: safe to share)
        start: int = 0,
        own: str = "",
    ) -> None:
        self._chunks = chunks = Availability(num_chunks, chunk_length, verified, config, start, own)
        self._n = num_chunks
        self._cfg = config
        self._chunk_length = chunk_length
        self._peers: dict[str, _Peer] = {}
        self._requests: dict[int, _Request] = {}  # live requests by id
        self._request_peer: dict[int, str] = {}  # every id ever issued -> its peer
        self._deadlines: list[tuple[float, int]] = []  # (deadline, id), a min-heap
        self._overdue: set[int] = set()  # live ids past their deadline (`expired`)
        self._next_id = 1
        self._picking = Picking(config, chunks, self._peers, self._requests, chunk_length)
        # Called once per chunk (on_chunk): bound here, so that a chunk costs no more
        # attribute lookups than a method of the scheduler's own.
        self._check_index = chunks.check_index
        self._verify = chunks.verify
        self._observe = self._picking.observe

    # ----------------------------------------------------------------- peers

    def add_peer(
        self, peer: str, now: float, bitmap: bytes | None = None, soon: bytes | None = None
    ) -> None:
        """Add a provider (or update a known one); `bitmap` None means it has every chunk;
        `soon`: the chunks it is fetching now (a partial peer's claims, see the policy).

        A dropped or removed peer becomes usable again; a banned one stays banned.
        """
        parsed = self._chunks.parse_bitmap(bitmap)
        claims = self._chunks.parse_soon(soon, parsed)
        p = self._peers.get(peer)
        if p is None:
            p = _Peer(peer, parsed, mark=now)
            self._chunks.set_soon_unused(p, claims)
            self._peers[peer] = p
            self._contribute(p, +1)
            return
        if not p.usable:
            p.bitmap = parsed
            self._chunks.set_soon_unused(p, claims)
            p.connected = True
            p.dropped = False
            p.streak = 0
            if p.usable:
                self._contribute(p, +1)
            return
        self._chunks.replace_bitmap(p, parsed)
        self._chunks.replace_soon(p, claims)

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

    def set_origin(self, peer: str, origin: bool = True) -> None:
        """`peer` is a provider the caller named (a ticket's, a worker's author of an
        update): with every chunk it is the blob's origin, spared while a fellow that
        finished can serve (the policy's "Origins last")."""
        self._peer(peer).origin = origin

    def inflight_limit(self, peer: str) -> int:
        """Live requests `peer` may hold now: enough to cover its rate x RTT (see the
        module docstring), at least one per connection, within the configured bounds."""
        return self._picking.inflight_limit(self._peer(peer))

    def update_peer_bitmap(
        self, peer: str, bitmap: bytes | None, soon: bytes | None = None
    ) -> None:
        """The peer's have-bitmap changed (a partial peer fetched more chunks); `soon`:
        what it is fetching now (None: nothing, or it does not say)."""
        p = self._peer(peer)
        parsed = self._chunks.parse_bitmap(bitmap)
        self._chunks.replace_bitmap(p, parsed)
        self._chunks.replace_soon(p, self._chunks.parse_soon(soon, parsed))

    def drop_claims(self, peer: str) -> None:
        """Forget what `peer` said it is fetching (its status is no longer refreshed)."""
        p = self._peers.get(peer)
        if p is not None:
            self._chunks.replace_soon(p, None)

    def in_flight(self) -> list[int]:
        """Chunks requested and not verified yet (what a ``status`` answer calls soon)."""
        return list(self._chunks.inflight)

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
        picking = self._picking
        if len(p.requests) >= picking.inflight_limit(p):
            return None
        chunks = self._chunks
        if chunks.dirty:
            chunks.refresh()
        limit = picking.batch_size(p)
        if max_chunks is not None:
            limit = min(limit, max(1, max_chunks))
        if p.alone_once and picking.uncapped(p):
            chunk = max(1, self._chunk_length(0))
            room = self._n * chunk // ALONE_ONCE_SHARE - p.outstanding_bytes
            if room < chunk and p.requests:
                return None
            # Spread over every request the peer may hold (each lane's, pipelined), so
            # that all its connections ramp up together rather than two of them.
            spread = self._n // ALONE_ONCE_SHARE // max(1, p.connections * p.depth)
            limit = min(limit, max(1, room // chunk), max(1, spread))
        picked = picking.pick_pool(p, limit)
        endgame = False
        if not picked and not p.requests and chunks.fetchable_pool() == 0:
            picked = picking.pick_endgame(p, limit, now)
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
        state = self._chunks.state
        if any(not 0 <= i < self._n or state[i] != _POOL or not p.holds(i) for i in picked):
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
        state = self._chunks.state
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
            return self._verify(index)
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
        return self._verify(index)

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
            self._chunks.forget_chunks(p, lacked)
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

    def next_late_at(self, now: float) -> float | None:
        """The soonest time after ``now`` at which a live request becomes late, so an
        endgame copy of it may be handed out (None: none will, or the endgame has not
        begun). An idle worker sleeps until then at most, not a whole idle period."""
        return self._picking.next_late_at(now)

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
        return self._chunks.verified_count == self._n

    @property
    def verified_count(self) -> int:
        return self._chunks.verified_count

    @property
    def num_chunks(self) -> int:
        return self._n

    @property
    def unheld_count(self) -> int:
        """Unrequested chunks that no usable peer holds (waiting for a new provider)."""
        return 0 if self._chunks.full_usable else self._chunks.orphans

    def missing(self) -> list[int]:
        """Indices not yet verified, ascending (O(num_chunks): for reports, not hot paths)."""
        state = self._chunks.state
        return [i for i in range(self._n) if state[i] != _VERIFIED]

    @property
    def fetchable_count(self) -> int:
        """Unrequested chunks that some usable peer holds (work still to hand out)."""
        return self._chunks.fetchable_pool()

    def stalled(self) -> bool:
        """Not done, and no usable peer can make progress: nothing is in flight and no
        usable peer holds a missing chunk (every holder banned, dropped or gone)."""
        if self.done or self._requests or self._chunks.full_usable:
            return False
        return self._chunks.pool_count == self._chunks.orphans

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
            inflight_limit=self._picking.inflight_limit(p) if p.usable else 0,
            connections=p.connections,
        )

    def banned_peers(self) -> set[str]:
        return {name for name, p in self._peers.items() if p.banned}

    # ----------------------------------------------------------- internals

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

    # Request state changes.

    def _contribute(self, p: _Peer, sign: int) -> None:
        """`p` becomes usable (+1) or stops being so (-1)."""
        self._chunks.contribute(p, sign)
        self._picking.forget_rates()

    def _issue(self, p: _Peer, picked: list[int], now: float, endgame: bool) -> RequestTicket:
        rid = self._next_id
        self._next_id += 1
        picked.sort()
        nbytes = self._chunks.take(picked, rid)
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

    def _release(self, req: _Request) -> None:
        rid = req.ticket.request_id
        p = req.peer
        del self._requests[rid]
        del p.requests[rid]
        self._overdue.discard(rid)
        p.outstanding_bytes -= self._chunks.release(rid, req.unreceived)
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
        self._picking.forget_rates()
        p.last_error = reason
        self._release_all(p)

    def _check_invariants(self) -> None:
        """Recount every derived quantity from scratch (tests only: O(num_chunks))."""
        peers = self._peers.values()
        cached = self._picking.cached_rates()
        if cached is not None:
            usable = [q for q in peers if q.usable]
            rates = [q.rate for q in usable if q.rate is not None]
            assert cached == (usable, rates, max(rates, default=0.0))
        state = self._chunks.state
        for p in peers:
            if not p.usable:
                assert not p.requests
            owed = sum(self._chunk_length(i) for r in p.requests.values() for i in r.unreceived)
            assert p.outstanding_bytes == owed, (p.name, p.outstanding_bytes, owed)
            assert len(p.requests) <= max(
                self._cfg.max_inflight_requests_per_peer, p.depth * p.connections
            )
        owers: dict[int, set[int]] = {}
        for rid, r in self._requests.items():
            assert r.peer.requests.get(rid) is r
            for i in r.unreceived:
                if state[i] != _VERIFIED:
                    owers.setdefault(i, set()).add(rid)
        self._chunks.check_invariants(peers, owers)
