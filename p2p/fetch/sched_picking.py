"""Choosing requests for :mod:`p2p.fetch.scheduler`: how many requests and chunks each
peer may hold (its "Rate-scaled batches" and "Requests sized to the path"), its rate,
which pool chunks it is handed, endgame copies of late requests (invariant 2), and the
tickets issued.
"""

from __future__ import annotations

import heapq
import math

from p2p.fetch.sched_availability import Availability
from p2p.fetch.sched_records import (
    _INFLIGHT,
    _POOL,
    DEFER_RATE_FRACTION,
    ENDGAME_MIN_PATIENCE_S,
    ENDGAME_PATIENCE_RTTS,
    STRIPED_REQUEST_RTTS,
    SWARM_ENDGAME_PATIENCE_S,
    RequestTicket,
    _Peer,
    _Request,
    _to_ranges,
)


class Picking(Availability):
    """Request sizing, pacing and chunk choice per peer, on top of chunk availability."""

    def _uncapped(self, p: _Peer) -> bool:
        """The swarm's opening caps are off for `p` (see set_alone)."""
        return p.alone and p.bitmap is None and not self._partials

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

    def _usable_rates(self) -> tuple[list[_Peer], list[float], float]:
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
        usable, rates, best = self._usable_rates()
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

    def _pick_pool(self, p: _Peer, limit: int) -> list[int]:
        if self._spares(p):
            return []
        heap = self._full_heap if p.bitmap is None else p.heap
        orphans_only = self._defers(p)
        # A chunk of rank 1 is only claimed (or in a fellow's share of the partition): an
        # origin leaves it to the claimer, its uplink being the scarce one; a fellow that
        # finished gives it at once, rather than let a fetcher wait for the claimer to
        # fetch it, say so and serve it (a four-fetcher simulated fan-out's last chunk
        # waited 1.3 s so). With no origin known, every full peer leaves it, as an origin.
        after_rank = 1 if p.origin or not self._origins() else 2
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
            if orphans_only and key >= after_rank * stride:
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

    def _observe(self, p: _Peer, nbytes: int, now: float) -> None:
        """Fold `nbytes` delivered at `now` into the peer's rate: a time-weighted EWMA of
        bytes/s over the time the peer has had requests in flight."""
        p.unfolded_bytes += nbytes
        dt = now - p.mark
        if dt <= 0.0:
            return
        sample = p.unfolded_bytes / dt
        self._rates = None  # the rate moves (_usable_rates)
        if p.rate is None:
            p.rate = sample
        else:
            w = 1.0 - math.exp(-dt / self._cfg.rate_time_constant_s)
            p.rate += w * (sample - p.rate)
        p.unfolded_bytes = 0
        p.mark = now
