"""`Picking`, the scheduler's request part, built on its own over an `Availability` and
plain dictionaries of peers and live requests (no `Scheduler`)."""

from __future__ import annotations

import math

from p2p.fetch.sched_availability import Availability
from p2p.fetch.sched_picking import Picking
from p2p.fetch.sched_records import (
    ENDGAME_MIN_PATIENCE_S,
    RequestTicket,
    SchedulerConfig,
    _Peer,
    _Request,
    _to_ranges,
    bitmap_of,
)

CHUNK = 1 << 20
N = 64


def length(_index: int) -> int:
    return CHUNK


class Rig:
    """A `Picking` over chunks and peers, holding what the scheduler would hold."""

    def __init__(self, *peers: _Peer, config: SchedulerConfig | None = None, n: int = N) -> None:
        config = config or SchedulerConfig()
        self.chunks = Availability(n, length, config=config)
        self.peers = {p.name: p for p in peers}
        self.requests: dict[int, _Request] = {}
        self.picking = Picking(config, self.chunks, self.peers, self.requests, length)
        for p in peers:
            self.chunks.contribute(p, +1)
        self.chunks.refresh()

    def issue(self, rid: int, p: _Peer, picked: list[int], now: float) -> None:
        self.chunks.take(picked, rid)
        ticket = RequestTicket(rid, p.name, _to_ranges(picked), now + 10.0, frozenset(picked))
        req = _Request(ticket, p, now, set(picked))
        self.requests[rid] = req
        p.requests[rid] = req


def full(name: str, rate: float | None = None, rtt: float | None = None) -> _Peer:
    return _Peer(name, None, rate=rate, rtt=rtt)


def test_a_far_peer_may_hold_more_requests_than_a_near_one() -> None:
    rate = 32 * CHUNK  # bytes/s: two full batches (16 chunks each) a second
    near, far = full("near", rate, rtt=0.01), full("far", rate, rtt=2.0)
    picking = Rig(near, far).picking
    assert picking.inflight_limit(near) == 2  # the configured minimum
    # 64 MiB in flight on the path, in 16 MiB requests, plus one.
    assert picking.inflight_limit(far) == 5


def test_a_busy_reply_caps_the_requests_in_flight() -> None:
    far = full("far", 32 * CHUNK, rtt=2.0)
    far.busy_limit = 3
    assert Rig(far).picking.inflight_limit(far) == 3


def test_a_slow_peer_gets_a_batch_scaled_by_its_rate() -> None:
    fast, slow = full("fast", 100.0), full("slow", 25.0)
    picking = Rig(fast, slow).picking
    assert picking.batch_size(fast) == 16
    assert picking.batch_size(slow) == 4  # a quarter of the best rate
    newcomer = full("new")
    assert Rig(fast, newcomer).picking.batch_size(newcomer) == 4  # a probe


def test_the_pools_tail_is_shared_with_the_idle_peers() -> None:
    a, b = full("a", 100.0), full("b", 100.0)
    picking = Rig(a, b, n=10).picking
    assert picking.batch_size(a) == 5  # 10 chunks left, two equal peers idle


def test_observe_averages_the_rate_over_time_and_reranks() -> None:
    p = full("p")
    picking = Rig(p).picking
    assert picking.usable_rates()[2] == 0.0
    picking.observe(p, 1000, now=1.0)
    assert p.rate == 1000.0
    assert picking.usable_rates()[2] == 1000.0
    picking.observe(p, 3000, now=2.0)
    expected = 1000.0 + (1.0 - math.exp(-1.0 / 2.0)) * 2000.0
    assert p.rate == expected
    assert picking.usable_rates()[2] == expected  # the ranking follows the rate


def test_a_seeder_leaves_chunks_a_partial_peer_holds_to_it() -> None:
    config = SchedulerConfig(defer_to_partial_holders=True)
    seeder, fellow = full("seeder"), _Peer("fellow", bytearray(bitmap_of({0, 1}, 8)))
    rig = Rig(seeder, fellow, config=config, n=8)
    assert rig.picking.pick_pool(seeder, 8) == [2, 3, 4, 5, 6, 7]
    assert rig.picking.pick_pool(fellow, 8) == [0, 1]


def test_without_deferring_a_seeder_takes_every_chunk() -> None:
    seeder, fellow = full("seeder"), _Peer("fellow", bytearray(bitmap_of({0, 1}, 8)))
    rig = Rig(seeder, fellow, n=8)
    assert rig.picking.pick_pool(seeder, 8) == [2, 3, 4, 5, 6, 7, 0, 1]


def test_an_origin_is_spared_while_a_finished_fellow_can_serve() -> None:
    config = SchedulerConfig(defer_to_partial_holders=True)
    origin, fellow = full("origin"), full("fellow")
    origin.origin = True
    rig = Rig(origin, fellow, config=config, n=8)
    assert rig.picking.pick_pool(origin, 8) == []
    assert rig.picking.pick_pool(fellow, 8) == list(range(8))


def test_the_endgame_copies_only_late_requests() -> None:
    a, b = full("a"), full("b")
    rig = Rig(a, b, n=4)
    rig.issue(1, a, [0, 1, 2, 3], now=0.0)
    assert rig.chunks.fetchable_pool() == 0
    late = ENDGAME_MIN_PATIENCE_S  # a has no measured rate or round trip
    assert rig.picking.next_late_at(0.0) == late
    assert rig.picking.pick_endgame(b, 4, now=late / 2) == []
    assert rig.picking.pick_endgame(b, 4, now=late) == [0, 1, 2, 3]
    assert rig.picking.pick_endgame(a, 4, now=late) == []  # never a copy of its own
    assert rig.picking.next_late_at(late) is None
