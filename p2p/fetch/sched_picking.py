"""Choosing requests, a part of :class:`p2p.fetch.scheduler.Scheduler`: how many
requests and chunks each peer may hold (the scheduler's "Rate-scaled batches" and
"Requests sized to the path"), each peer's rate, which pool chunks a peer is handed
("Swarming", "Origins last") and endgame copies of late requests (invariant 2).

It reads the scheduler's peers and live requests (mappings the scheduler owns and hands
it) and the chunks' `Availability`, and owns the rates: each peer's average
(`observe`) and the usable peers' ranking, kept until a rate or the usable set changes
(`forget_rates`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from p2p.fetch.sched_availability import Availability
from p2p.fetch.sched_records import (
    _INFLIGHT,
    DEFER_RATE_FRACTION,
    ENDGAME_MIN_PATIENCE_S,
    ENDGAME_PATIENCE_RTTS,
    STRIPED_REQUEST_RTTS,
    SWARM_ENDGAME_PATIENCE_S,
    SchedulerConfig,
    _Peer,
    _Request,
)


class Picking:
    """Request sizing, pacing and chunk choice per peer, over the `chunks` of one blob
    (chunk i `chunk_length(i)` bytes long), the known `peers` by name and the live
    `requests` by id."""

    def __init__(
        self,
        config: SchedulerConfig,
        chunks: Availability,
        peers: Mapping[str, _Peer],
        requests: Mapping[int, _Request],
        chunk_length: Callable[[int], int],
    ) -> None:
        self._cfg = config
        self._chunks = chunks
        self._peers = peers
        self._requests = requests
        self._chunk_length = chunk_length
        self._n = chunks.n
        # The usable peers, their rates and the best rate, until one changes.
        self._rates: tuple[list[_Peer], list[float], float] | None = None

    def forget_rates(self) -> None:
        """A peer became usable or stopped being so: rank the usable peers afresh."""
        self._rates = None

    def cached_rates(self) -> tuple[list[_Peer], list[float], float] | None:
        """The usable peers' ranking as kept now (None: to be made afresh); for checks."""
        return self._rates

    def uncapped(self, p: _Peer) -> bool:
        """The swarm's opening caps are off for `p` (see set_alone)."""
        return p.alone and p.bitmap is None and not self._chunks.partials

    def inflight_limit(self, p: _Peer) -> int:
        cfg = self._cfg
        cap = cfg.max_inflight_requests_per_peer
        # A seeder shared with fellows (swarming, not alone) gets what its rate and the
        # path hold (below), not a request per connection: every request queued there is
        # seconds of a slow uplink that its other fetchers wait behind, and which they
        # may have to take from it again (three fetchers of a 32 MiB blob from a 100
        # Mbit/s seeder striped four ways: it sent 1.45-2.29x the blob, median 1.86).
        shared_seeder = cfg.defer_to_partial_holders and p.bitmap is None and not self.uncapped(p)
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
            and not self.uncapped(p)
        ):
            want = min(want, cfg.swarm_unmeasured_inflight_requests)
        return min(cap, want)

    def usable_rates(self) -> tuple[list[_Peer], list[float], float]:
        """The usable peers, their measured rates and the best one, kept until a peer's
        rate or usability changes: every worker of every peer asks for them at each change
        of the download (rebuilding them each time cost a third of the CPU of bench/sim's
        60-fetcher swarm)."""
        cached = self._rates
        if cached is None:
            usable = [q for q in self._peers.values() if q.usable]
            rates = [q.rate for q in usable if q.rate is not None]
            cached = self._rates = (usable, rates, max(rates, default=0.0))
        return cached

    def _rate_batch(self, p: _Peer) -> tuple[int, list[_Peer], list[float], float]:
        """The peer's batch scaled by its rate (and the usable peers, their rates, the
        best rate, which the tail rule below needs too)."""
        m = self._cfg.max_chunks_per_request
        usable, rates, best = self.usable_rates()
        if p.rate is None:
            size = max(1, m // 4) if rates else m
        elif best <= 0.0:
            size = m
        else:
            size = max(1, min(m, math.ceil(m * p.rate / best)))
        cfg = self._cfg
        chunk = max(1, self._chunk_length(0)) if self._n else 1
        if self.uncapped(p):
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

    def batch_size(self, p: _Peer) -> int:
        size, usable, rates, best = self._rate_batch(p)
        fetchable = self._chunks.fetchable_pool()
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
            for q in self._chunks.partials.values()
        )

    def _spares(self, p: _Peer) -> bool:
        """Whether origin ``p`` is spared ("Origins last"): swarming, ``p`` has every chunk
        and some other usable peer with every chunk that is no origin (a fellow that
        finished) is at least ``DEFER_RATE_FRACTION`` as fast, or either is not measured."""
        if not (self._cfg.defer_to_partial_holders and p.origin and p.bitmap is None):
            return False
        return any(
            q.bitmap is None
            and not q.origin
            and q.usable
            and (q.rate is None or p.rate is None or q.rate >= p.rate * DEFER_RATE_FRACTION)
            for q in self._peers.values()
        )

    def _origins(self) -> bool:
        """Whether any usable peer is an origin (set_origin)."""
        return any(q.origin and q.usable for q in self._peers.values())

    def pick_pool(self, p: _Peer, limit: int) -> list[int]:
        """Up to `limit` pool chunks for `p`, best first, as the policy leaves them to it."""
        if self._spares(p):
            return []
        chunks = self._chunks
        heap = chunks.full_heap if p.bitmap is None else p.heap
        orphans_only = self._defers(p)
        # A chunk of rank 1 is only claimed (or in a fellow's share of the partition): an
        # origin leaves it to the claimer, its uplink being the scarce one; a fellow that
        # finished gives it at once, rather than let a fetcher wait for the claimer to
        # fetch it, say so and serve it (a four-fetcher simulated fan-out's last chunk
        # waited 1.3 s so). With no origin known, every full peer leaves it, as an origin.
        after_rank = 1 if p.origin or not self._origins() else 2
        return chunks.pick(heap, p.bitmap, limit, after_rank if orphans_only else None)

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
        """The soonest time after ``now`` at which a live request becomes late (None: none
        will, or the endgame has not begun: some pool chunk is still fetchable)."""
        if self._chunks.fetchable_pool():
            return None
        times = [t for r in self._requests.values() if (t := self._late_at(r)) > now]
        return min(times, default=None)

    def pick_endgame(self, p: _Peer, limit: int, now: float) -> list[int]:
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
        state = self._chunks.state
        inflight = self._chunks.inflight
        picked: list[int] = []
        chosen: set[int] = set()
        ranges = 0
        for req in others:
            for i in sorted(req.unreceived):
                if len(picked) >= limit:
                    return picked
                if (
                    i in chosen
                    or state[i] != _INFLIGHT
                    or len(inflight[i]) >= copies
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

    def observe(self, p: _Peer, nbytes: int, now: float) -> None:
        """Fold `nbytes` delivered at `now` into the peer's rate: a time-weighted EWMA of
        bytes/s over the time the peer has had requests in flight."""
        p.unfolded_bytes += nbytes
        dt = now - p.mark
        if dt <= 0.0:
            return
        sample = p.unfolded_bytes / dt
        self._rates = None  # the rate moves (usable_rates)
        if p.rate is None:
            p.rate = sample
        else:
            w = 1.0 - math.exp(-dt / self._cfg.rate_time_constant_s)
            p.rate += w * (sample - p.rate)
        p.unfolded_bytes = 0
        p.mark = now
