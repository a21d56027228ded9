"""The download scheduler against simulated peers on a fake clock (no sockets, no sleeps).

`Swarm` plays the shell and the servers: each simulated peer serves its requests in order,
one chunk every `seconds_per_chunk`, skips chunks it lacks and reports them missing, sends a
corrupt chunk where told to, or never answers. Time jumps from event to event.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from p2p.fetch.sched_records import (
    ENDGAME_MIN_PATIENCE_S,
    PROTOCOL_MAX_CHUNKS_PER_REQUEST,
    RequestTicket,
    SchedulerConfig,
    bitmap_of,
)
from p2p.fetch.scheduler import Scheduler

CHUNK = 1 << 20


def length(_index: int) -> int:
    return CHUNK


@dataclass
class SimPeer:
    name: str
    seconds_per_chunk: float = 0.01
    holds: set[int] | None = None  # None: every chunk
    corrupts: frozenset[int] = frozenset()
    stalls: bool = False
    queue: list[tuple[RequestTicket, list[int], list[int]]] = field(default_factory=list)
    next_at: float = math.inf
    tickets: list[RequestTicket] = field(default_factory=list)
    active: bool = True


class Swarm:
    def __init__(self, sched: Scheduler, peers: list[SimPeer], now: float = 0.0) -> None:
        self.sched = sched
        self.now = now
        self.peers: dict[str, SimPeer] = {}
        self.writes: Counter[int] = Counter()
        self.duplicates = 0
        for p in peers:
            self.join(p)

    def join(self, p: SimPeer) -> None:
        self.peers[p.name] = p
        p.active = True
        bitmap = None if p.holds is None else bitmap_of(p.holds, self.sched.num_chunks)
        self.sched.add_peer(p.name, self.now, bitmap)

    def leave(self, name: str) -> None:
        p = self.peers[name]
        p.active = False
        p.queue.clear()
        p.next_at = math.inf
        self.sched.remove_peer(name, "killed")

    def _start_head(self, p: SimPeer) -> None:
        while p.queue:
            ticket, chunks, missing = p.queue[0]
            while chunks and p.holds is not None and chunks[0] not in p.holds:
                missing.append(chunks.pop(0))
            if chunks:
                p.next_at = math.inf if p.stalls else self.now + p.seconds_per_chunk
                return
            p.queue.pop(0)
            self.sched.on_request_done(ticket.request_id, self.now, missing)
        p.next_at = math.inf

    def _purge(self) -> None:
        """The shell resets the streams of banned/dropped peers and of endgame losers."""
        stats = self.sched.peer_stats()
        for p in self.peers.values():
            if not p.queue:
                continue
            st = stats[p.name]
            if st.banned or st.dropped:
                p.queue.clear()
                p.next_at = math.inf
                continue
            kept = []
            for item in p.queue:
                if self.sched.is_obsolete(item[0].request_id):
                    self.sched.cancel(item[0].request_id, self.now)
                else:
                    kept.append(item)
            if len(kept) != len(p.queue):
                head_changed = kept[:1] != p.queue[:1]
                p.queue[:] = kept
                if head_changed:
                    self._start_head(p)

    def pump(self) -> None:
        for p in self.peers.values():
            if not p.active:
                continue
            while (ticket := self.sched.next_request(p.name, self.now)) is not None:
                assert ticket.peer == p.name
                p.tickets.append(ticket)
                p.queue.append((ticket, sorted(ticket.indices), []))
                if len(p.queue) == 1:
                    self._start_head(p)

    def step(self) -> bool:
        """Advance to the next event and handle it; False when nothing can happen."""
        self.pump()
        t_chunk = min((p.next_at for p in self.peers.values() if p.active), default=math.inf)
        t_deadline = self.sched.next_deadline()
        t = min(t_chunk, math.inf if t_deadline is None else t_deadline)
        if t == math.inf:
            return False
        assert t >= self.now
        self.now = t
        for ticket in self.sched.expired(t):
            assert ticket.deadline <= t
            p = self.peers[ticket.peer]
            was_head = bool(p.queue) and p.queue[0][0] is ticket
            p.queue[:] = [item for item in p.queue if item[0] is not ticket]
            self.sched.on_request_failed(ticket.request_id, t, "timeout")
            if was_head:
                self._start_head(p)
        for p in self.peers.values():
            if p.active and p.next_at <= t and p.queue:
                self._deliver(p)
        self._purge()
        self.sched._check_invariants()
        return True

    def _deliver(self, p: SimPeer) -> None:
        ticket, chunks, missing = p.queue[0]
        i = chunks.pop(0)
        if i in p.corrupts:
            self.sched.on_bad_chunk(ticket.request_id, i, self.now)
            p.queue.clear()
            p.next_at = math.inf
            return
        if self.sched.on_chunk(ticket.request_id, i, length(i), self.now):
            self.writes[i] += 1
        else:
            self.duplicates += 1
        if not chunks:
            p.queue.pop(0)
            self.sched.on_request_done(ticket.request_id, self.now, missing)
        self._start_head(p)

    def run(self, max_steps: int = 200_000) -> None:
        for _ in range(max_steps):
            if self.sched.done or not self.step():
                return
        raise AssertionError("simulation did not settle")


def chunks_of(tickets: list[RequestTicket], *, endgame: bool | None = None) -> list[int]:
    return [
        i for t in tickets if endgame is None or t.endgame == endgame for i in sorted(t.indices)
    ]


def assert_well_formed(ticket: RequestTicket, config: SchedulerConfig) -> None:
    assert 1 <= len(ticket.indices) <= config.max_chunks_per_request
    assert 1 <= len(ticket.ranges) <= config.max_ranges_per_request
    covered = [i for a, b in ticket.ranges for i in range(a, b)]
    assert covered == sorted(ticket.indices)
    for (_, b), (c, _) in zip(ticket.ranges, ticket.ranges[1:], strict=False):
        assert b < c  # sorted, disjoint and merged


# ----------------------------------------------------------------------- stories


def test_single_peer_gets_everything_in_order() -> None:
    config = SchedulerConfig()
    sched = Scheduler(40, length, config=config)
    sched.add_peer("a", 0.0)
    first = sched.next_request("a", 0.0)
    second = sched.next_request("a", 0.0)
    assert first is not None and second is not None
    assert first.ranges == ((0, 16),)
    assert second.ranges == ((16, 32),)
    assert sched.next_request("a", 0.0) is None  # two in flight is the limit
    swarm = Swarm(sched, [])
    swarm.peers["a"] = peer = SimPeer("a", tickets=[first, second])
    peer.queue = [(first, list(range(16)), []), (second, list(range(16, 32)), [])]
    swarm._start_head(peer)
    swarm.run()
    assert sched.done and sched.missing() == []
    assert chunks_of(peer.tickets) == list(range(40))
    assert all(len(t.ranges) == 1 for t in peer.tickets)
    assert sorted(swarm.writes) == list(range(40)) and set(swarm.writes.values()) == {1}
    assert sched.peer_stats()["a"].chunks_received == 40


def test_two_equal_peers_split_the_work_without_overlap() -> None:
    config = SchedulerConfig(endgame_duplicates=0)
    sched = Scheduler(256, length, config=config)
    swarm = Swarm(sched, [SimPeer("a"), SimPeer("b")])
    swarm.run()
    assert sched.done
    a, b = chunks_of(swarm.peers["a"].tickets), chunks_of(swarm.peers["b"].tickets)
    assert not set(a) & set(b)
    assert sorted(a + b) == list(range(256))
    assert 96 <= len(a) <= 160, "equal peers get about equal shares"
    assert swarm.duplicates == 0


def test_fast_peer_gets_more_chunks_and_bigger_batches_than_slow_peer() -> None:
    config = SchedulerConfig()
    sched = Scheduler(600, length, config=config)
    fast = SimPeer("fast", seconds_per_chunk=0.01)
    slow = SimPeer("slow", seconds_per_chunk=0.1)
    swarm = Swarm(sched, [fast, slow])
    swarm.run()
    assert sched.done
    stats = sched.peer_stats()
    assert stats["fast"].chunks_received >= 5 * stats["slow"].chunks_received
    assert stats["fast"].rate_bytes_per_s > 5 * stats["slow"].rate_bytes_per_s
    # Once measured, the slow peer is handed small batches; the fast one full batches.
    late_slow = [len(t.indices) for t in slow.tickets[2:] if not t.endgame]
    assert late_slow and max(late_slow) <= 4
    assert max(len(t.indices) for t in fast.tickets) == config.max_chunks_per_request
    # The whole download takes about as long as the fast peer alone would need.
    assert swarm.now < 600 * 0.01


def test_partial_peers_are_served_rarest_first() -> None:
    config = SchedulerConfig(max_chunks_per_request=4)
    sched = Scheduler(16, length, config=config)
    sched.add_peer("full", 0.0)
    sched.add_peer("b", 0.0, bitmap_of(range(8), 16))  # 0-3 only b; 4-7 b and c
    sched.add_peer("c", 0.0, bitmap_of([4, 5, 6, 7, 12, 13, 14, 15], 16))  # 12-15 only c
    t_full = sched.next_request("full", 0.0)
    t_b = sched.next_request("b", 0.0)
    t_c = sched.next_request("c", 0.0)
    assert t_full is not None and t_b is not None and t_c is not None
    assert t_full.ranges == ((8, 12),), "no partial peer holds 8-11: only the full peer can"
    assert t_b.ranges == ((0, 4),), "b alone holds 0-3; c also holds 4-7"
    assert t_c.ranges == ((12, 16),), "c alone holds 12-15"
    again = sched.next_request("full", 0.0)
    assert again is not None and again.indices <= set(range(4, 8))


def test_lying_peer_is_banned_and_its_chunks_come_from_elsewhere() -> None:
    sched = Scheduler(64, length)
    liar = SimPeer("liar", seconds_per_chunk=0.001, corrupts=frozenset({3}))
    honest = SimPeer("honest", seconds_per_chunk=0.01)
    swarm = Swarm(sched, [liar, honest])
    swarm.run()
    assert sched.done
    assert sched.banned_peers() == {"liar"}
    stats = sched.peer_stats()["liar"]
    assert stats.banned and stats.inflight == 0 and stats.rate_bytes_per_s == 0.0
    assert sched.next_request("liar", swarm.now) is None
    sched.add_peer("liar", swarm.now)  # coming back does not lift the ban
    assert sched.banned_peers() == {"liar"}
    assert 3 in chunks_of(honest.tickets)
    assert max(swarm.writes.values()) == 1 and len(swarm.writes) == 64


def test_stalled_request_expires_at_its_deadline_and_moves_to_another_peer() -> None:
    config = SchedulerConfig(max_chunks_per_request=4, endgame_duplicates=0)
    sched = Scheduler(8, length, config=config)
    sched.add_peer("stuck", 0.0)
    sched.add_peer("good", 0.0)
    stuck = sched.next_request("stuck", 0.0)
    good = sched.next_request("good", 0.0)
    assert stuck is not None and good is not None
    assert stuck.indices == set(range(4)) and good.indices == set(range(4, 8))
    # 10 s base + 4 MiB at 256 KiB/s.
    assert stuck.deadline == pytest.approx(10.0 + 16.0)
    for i in range(4, 8):
        assert sched.on_chunk(good.request_id, i, CHUNK, 1.0 + i / 10)
    sched.on_request_done(good.request_id, 2.0)
    assert sched.next_deadline() == stuck.deadline
    assert sched.expired(stuck.deadline - 0.001) == []
    assert sched.next_request("good", 2.0) is None, "chunks 0-3 are in flight (no endgame)"
    assert sched.expired(stuck.deadline) == [stuck]
    sched.on_request_failed(stuck.request_id, stuck.deadline, "timeout")
    assert sched.next_deadline() is None
    retry = sched.next_request("good", stuck.deadline)
    assert retry is not None and retry.indices == stuck.indices
    stats = sched.peer_stats()["stuck"]
    assert stats.failures == 1 and not stats.dropped and stats.last_error == "timeout"


def test_peer_failing_repeatedly_is_dropped_and_may_come_back() -> None:
    config = SchedulerConfig(max_chunks_per_request=2, max_failures_before_drop=2)
    sched = Scheduler(8, length, config=config)
    sched.add_peer("flaky", 0.0)
    t1 = sched.next_request("flaky", 0.0)
    t2 = sched.next_request("flaky", 0.0)
    assert t1 is not None and t2 is not None
    sched.on_request_failed(t1.request_id, 1.0, "stream reset")
    assert not sched.peer_stats()["flaky"].dropped
    sched.on_request_failed(t2.request_id, 2.0, "stream reset")
    stats = sched.peer_stats()["flaky"]
    assert stats.dropped and not stats.banned and stats.failures == 2
    assert sched.next_request("flaky", 3.0) is None
    assert sched.stalled()
    sched.add_peer("flaky", 4.0)
    assert not sched.stalled()
    again = sched.next_request("flaky", 4.0)
    assert again is not None and again.indices == t1.indices


def test_only_failures_in_a_row_drop_a_peer() -> None:
    config = SchedulerConfig(max_chunks_per_request=1, max_failures_before_drop=2)
    sched = Scheduler(8, length, config=config)
    sched.add_peer("wobbly", 0.0)
    for k in range(3):
        t = sched.next_request("wobbly", float(k))
        assert t is not None
        sched.on_request_failed(t.request_id, float(k), "stream reset")
        ok = sched.next_request("wobbly", float(k))
        assert ok is not None, "one failure, then a success, is no streak"
        sched.on_request_done(ok.request_id, float(k), missing=ok.indices)
    stats = sched.peer_stats()["wobbly"]
    assert stats.failures == 3 and not stats.dropped


def test_peer_removed_mid_download_gives_its_chunks_to_the_others() -> None:
    sched = Scheduler(200, length)
    swarm = Swarm(sched, [SimPeer("a"), SimPeer("b"), SimPeer("c")])
    for _ in range(30):
        swarm.step()
    assert sched.peer_stats()["b"].inflight > 0
    held_by_b = set(chunks_of(swarm.peers["b"].tickets))
    swarm.leave("b")
    stats = sched.peer_stats()["b"]
    assert not stats.connected and stats.inflight == 0
    assert sched.next_request("b", swarm.now) is None
    swarm.run()
    assert sched.done
    unreceived_at_b = held_by_b - {i for i in held_by_b if swarm.writes[i]}
    assert not unreceived_at_b
    assert len(swarm.writes) == 200


def test_peer_joining_mid_download_gets_work() -> None:
    sched = Scheduler(300, length)
    swarm = Swarm(sched, [SimPeer("early", seconds_per_chunk=0.05)])
    for _ in range(40):
        swarm.step()
    assert not sched.done
    late = SimPeer("late", seconds_per_chunk=0.01)
    swarm.join(late)
    swarm.run()
    assert sched.done
    assert late.tickets, "the newcomer was handed requests"
    stats = sched.peer_stats()
    assert stats["late"].chunks_received > stats["early"].chunks_received


def test_endgame_duplicates_the_tail_and_reports_late_duplicates() -> None:
    config = SchedulerConfig(max_chunks_per_request=2)
    sched = Scheduler(4, length, config=config)
    for name in ("slow", "fast"):
        sched.add_peer(name, 0.0)
    slow = sched.next_request("slow", 0.0)
    fast = sched.next_request("fast", 0.0)
    assert slow is not None and fast is not None
    assert slow.indices == {0, 1} and fast.indices == {2, 3}
    sched.add_peer("third", 0.0)
    # Pool empty, "third" idle: a copy waits until the request it copies is late.
    assert sched.next_request("third", 0.0) is None
    assert sched.next_late_at(0.0) == pytest.approx(ENDGAME_MIN_PATIENCE_S)
    assert sched.next_request("third", ENDGAME_MIN_PATIENCE_S) is not None
    sched.remove_peer("third", "test")
    for i in (2, 3):
        assert sched.on_chunk(fast.request_id, i, CHUNK, 0.1)
    sched.on_request_done(fast.request_id, 0.1)
    # Pool empty: "fast" is idle and duplicates the slow peer's tail.
    dup = sched.next_request("fast", 0.1)
    assert dup is not None and dup.endgame and dup.indices == {0, 1}
    assert sched.next_request("third", 0.1) is None, "endgame_duplicates=1: two copies at most"
    sched.add_peer("fourth", 0.1)
    assert sched.next_request("fourth", 0.1) is None
    assert sched.on_chunk(dup.request_id, 0, CHUNK, 0.2) is True
    assert sched.on_chunk(slow.request_id, 0, CHUNK, 0.3) is False, "late duplicate"
    assert sched.on_chunk(dup.request_id, 1, CHUNK, 0.3) is True
    assert sched.done and sched.verified_count == 4
    assert sched.is_obsolete(slow.request_id)
    sched.cancel(slow.request_id, 0.3)
    sched.on_request_done(dup.request_id, 0.3)
    assert sched.next_deadline() is None
    assert sched.peer_stats()["slow"].failures == 0


def test_endgame_can_be_turned_off() -> None:
    config = SchedulerConfig(max_chunks_per_request=2, endgame_duplicates=0)
    sched = Scheduler(2, length, config=config)
    sched.add_peer("a", 0.0)
    t = sched.next_request("a", 0.0)
    assert t is not None and t.indices == {0, 1}
    sched.add_peer("b", 0.0)
    assert sched.next_request("b", 0.0) is None


def test_simulated_tail_with_a_slow_peer_finishes_through_endgame() -> None:
    sched = Scheduler(64, length)
    swarm = Swarm(sched, [SimPeer("fast", seconds_per_chunk=0.01), SimPeer("snail", 2.0)])
    swarm.run()
    assert sched.done
    assert swarm.now < 5.0, "the tail was not held hostage by the snail"
    assert max(swarm.writes.values()) == 1


def test_resume_never_requests_verified_chunks() -> None:
    verified = set(range(0, 100, 2)) | {99}
    sched = Scheduler(100, length, verified=verified)
    assert sched.verified_count == len(verified)
    assert sched.missing() == sorted(set(range(100)) - verified)
    swarm = Swarm(sched, [SimPeer("a"), SimPeer("b", holds=set(range(50)))])
    swarm.run()
    assert sched.done
    requested = chunks_of(swarm.peers["a"].tickets) + chunks_of(swarm.peers["b"].tickets)
    assert not set(requested) & verified
    assert set(swarm.writes) == set(range(100)) - verified


def test_fully_verified_blob_is_done_from_the_start() -> None:
    sched = Scheduler(3, length, verified=[0, 1, 2])
    sched.add_peer("a", 0.0)
    assert sched.done and not sched.stalled()
    assert sched.next_request("a", 0.0) is None
    empty = Scheduler(0, length)
    assert empty.done and empty.missing() == []
    empty.add_peer("a", 0.0, b"")


def test_stalled_when_the_only_holder_of_a_chunk_is_banned() -> None:
    sched = Scheduler(8, length)
    only = SimPeer("only", corrupts=frozenset({0}))  # the sole holder of chunk 7
    partial = SimPeer("partial", holds=set(range(7)))
    swarm = Swarm(sched, [only, partial])
    swarm.run()
    assert not sched.done
    assert sched.banned_peers() == {"only"}
    assert sched.stalled()
    assert sched.missing() == [7] and sched.unheld_count == 1
    assert sched.next_request("partial", swarm.now) is None
    swarm.join(SimPeer("rescuer", holds={7}))
    assert not sched.stalled()
    swarm.run()
    assert sched.done and not sched.stalled()


def test_not_stalled_while_some_peer_can_still_progress() -> None:
    sched = Scheduler(8, length)
    assert sched.stalled(), "no peers at all"
    sched.add_peer("p", 0.0, bitmap_of([1], 8))
    assert not sched.stalled()
    t = sched.next_request("p", 0.0)
    assert t is not None and t.indices == {1}
    assert not sched.stalled(), "a request is in flight"
    sched.on_request_done(t.request_id, 1.0, missing=[1])
    assert sched.stalled(), "the peer turned out not to have it"


def test_missing_chunks_are_cleared_from_the_bitmap_and_go_back_to_the_pool() -> None:
    config = SchedulerConfig(max_chunks_per_request=4)
    sched = Scheduler(8, length, config=config)
    sched.add_peer("claims-all", 0.0)
    t = sched.next_request("claims-all", 0.0)
    assert t is not None and t.indices == {0, 1, 2, 3}
    assert sched.on_chunk(t.request_id, 0, CHUNK, 0.5)
    sched.on_request_done(t.request_id, 1.0, missing=[1, 2])
    sched._check_invariants()
    seen: set[int] = set()
    while (nxt := sched.next_request("claims-all", 1.0)) is not None:
        seen |= nxt.indices
        for i in nxt.indices:
            sched.on_chunk(nxt.request_id, i, CHUNK, 1.0)
        sched.on_request_done(nxt.request_id, 1.0)
    assert seen == {3, 4, 5, 6, 7}, "chunks 1 and 2 are never asked of it again"
    assert sched.stalled() and sched.missing() == [1, 2]
    sched.add_peer("other", 1.0)
    got: set[int] = set()
    while (nxt := sched.next_request("other", 1.0)) is not None:
        got |= nxt.indices
    assert got == {1, 2}


def test_late_chunk_of_a_failed_request_is_still_accepted() -> None:
    sched = Scheduler(4, length, config=SchedulerConfig(max_chunks_per_request=4))
    sched.add_peer("a", 0.0)
    t = sched.next_request("a", 0.0)
    assert t is not None
    sched.on_request_failed(t.request_id, 30.0, "timeout")
    assert sched.on_chunk(t.request_id, 2, CHUNK, 30.5) is True
    assert sched.on_chunk(t.request_id, 2, CHUNK, 30.5) is False
    retry = sched.next_request("a", 31.0)
    assert retry is not None and retry.indices == {0, 1, 3}
    sched._check_invariants()


def test_bitmap_update_brings_new_chunks_to_a_partial_peer() -> None:
    sched = Scheduler(16, length, config=SchedulerConfig(max_chunks_per_request=16))
    sched.add_peer("p", 0.0, bitmap_of([0], 16))
    t = sched.next_request("p", 0.0)
    assert t is not None and t.indices == {0}
    assert sched.next_request("p", 0.0) is None
    sched.update_peer_bitmap("p", bitmap_of(range(6), 16))
    sched._check_invariants()
    t2 = sched.next_request("p", 0.0)
    assert t2 is not None and t2.indices == {1, 2, 3, 4, 5}
    sched.update_peer_bitmap("p", None)
    sched._check_invariants()
    t3 = sched.next_request("p", 0.0)
    assert t3 is None, "two requests already in flight"


def test_requests_respect_the_range_limit() -> None:
    config = SchedulerConfig(max_chunks_per_request=16, max_ranges_per_request=3)
    sched = Scheduler(64, length, config=config)
    sched.add_peer("evens", 0.0, bitmap_of(range(0, 64, 2), 64))
    t = sched.next_request("evens", 0.0)
    assert t is not None
    assert_well_formed(t, config)
    assert t.ranges == ((0, 1), (2, 3), (4, 5))


def test_malformed_input_is_a_local_error() -> None:
    with pytest.raises(ValueError, match="max_chunks_per_request"):
        SchedulerConfig(max_chunks_per_request=PROTOCOL_MAX_CHUNKS_PER_REQUEST + 1)
    with pytest.raises(ValueError, match="max_ranges_per_request"):
        SchedulerConfig(max_ranges_per_request=65)
    with pytest.raises(ValueError, match="endgame_duplicates"):
        SchedulerConfig(endgame_duplicates=-1)
    with pytest.raises(ValueError, match="out of range"):
        Scheduler(4, length, verified=[4])
    sched = Scheduler(9, length)
    with pytest.raises(ValueError, match="needs 2"):
        sched.add_peer("a", 0.0, b"\xff")
    sched.add_peer("a", 0.0)
    t = sched.next_request("a", 0.0)
    assert t is not None
    assert sched.expects(t.request_id, 0) and not sched.expects(t.request_id, 99)
    with pytest.raises(ValueError, match="never issued"):
        sched.on_request_failed(12345, 1.0, "x")
    with pytest.raises(KeyError, match="unknown peer"):
        sched.update_peer_bitmap("nobody", None)


def test_unknown_chunk_index_is_rejected() -> None:
    sched = Scheduler(9, length, config=SchedulerConfig(max_chunks_per_request=4))
    sched.add_peer("a", 0.0)
    t = sched.next_request("a", 0.0)
    assert t is not None
    with pytest.raises(ValueError, match="not part of request"):
        sched.on_chunk(t.request_id, 8, CHUNK, 1.0)
    with pytest.raises(ValueError, match="out of range"):
        sched.on_chunk(t.request_id, 9, CHUNK, 1.0)
    with pytest.raises(ValueError, match="did not ask"):
        sched.on_request_done(t.request_id, 1.0, missing=[8])
    sched._check_invariants()


def test_deadline_counts_bytes_still_owed_on_pipelined_requests() -> None:
    config = SchedulerConfig(max_chunks_per_request=4)
    sched = Scheduler(16, length, config=config)
    sched.add_peer("a", 0.0)
    first = sched.next_request("a", 0.0)
    second = sched.next_request("a", 0.0)
    assert first is not None and second is not None
    assert first.deadline == pytest.approx(10.0 + 4 * CHUNK / config.min_rate_bytes_per_s)
    assert second.deadline == pytest.approx(10.0 + 8 * CHUNK / config.min_rate_bytes_per_s)


# -------------------------------------------------------------- random swarms


@pytest.mark.parametrize("seed", range(25))
def test_random_swarm_keeps_the_invariants(seed: int) -> None:
    """Random mixes of fast, slow, partial, lying, stalling, leaving and late peers: every
    step re-checks the internal invariants; the download finishes whenever some honest
    peer set covers the blob, each chunk is written exactly once, and a banned peer is
    never asked again."""
    rng = random.Random(seed)
    n = rng.randint(1, 300)
    config = SchedulerConfig(
        max_chunks_per_request=rng.choice([1, 3, 16, 64]),
        max_inflight_requests_per_peer=rng.randint(1, 3),
        max_ranges_per_request=rng.choice([1, 2, 64]),
        max_failures_before_drop=rng.randint(1, 3),
        endgame_duplicates=rng.randint(0, 2),
    )
    verified = {i for i in range(n) if rng.random() < 0.2}
    sched = Scheduler(n, length, verified=verified, config=config)

    def random_peer(name: str) -> SimPeer:
        holds = None if rng.random() < 0.4 else {i for i in range(n) if rng.random() < 0.6}
        corrupts = frozenset(rng.sample(range(n), 1)) if rng.random() < 0.2 else frozenset()
        return SimPeer(
            name,
            seconds_per_chunk=rng.choice([0.001, 0.01, 0.1, 1.0]),
            holds=holds,
            corrupts=corrupts,
            stalls=rng.random() < 0.1,
        )

    swarm = Swarm(sched, [random_peer(f"p{k}") for k in range(rng.randint(1, 5))])
    late = [random_peer(f"late{k}") for k in range(rng.randint(0, 2))]
    issued: list[RequestTicket] = []
    for step in range(20_000):
        if sched.done:
            break
        if late and step == 20:
            swarm.join(late.pop())
        if step == 40 and len(swarm.peers) > 1 and rng.random() < 0.5:
            swarm.leave(rng.choice(sorted(swarm.peers)))
        if not swarm.step():
            if late:
                swarm.join(late.pop())
                continue
            break
        for p in swarm.peers.values():
            issued.extend(p.tickets)
            p.tickets.clear()
        # A stalled download gets a rescuer that serves everything honestly.
        if sched.stalled() and "rescuer" not in swarm.peers:
            swarm.join(SimPeer("rescuer"))
    assert sched.done, (seed, sched.missing()[:10])
    assert set(swarm.writes) == set(range(n)) - verified
    assert max(swarm.writes.values(), default=1) == 1
    banned = sched.banned_peers()
    for t in issued:
        assert_well_formed(t, config)
        assert not t.indices & verified
    for name in banned:
        assert sched.next_request(name, swarm.now) is None


def test_large_blob_costs_little_per_request() -> None:
    """Guards against O(num_chunks) work per call: a 70k-chunk checkpoint from several
    full and partial peers with instant delivery must schedule in well under a second per
    ten thousand chunks."""
    n = 70_000
    rng = random.Random(7)
    sched = Scheduler(n, length, config=SchedulerConfig(max_chunks_per_request=16))
    peers = [f"full{k}" for k in range(6)] + [f"part{k}" for k in range(4)]
    for name in peers:
        holds = None if name.startswith("full") else {i for i in range(n) if rng.random() < 0.7}
        sched.add_peer(name, 0.0, None if holds is None else bitmap_of(holds, n))
    start = time.perf_counter()
    now = 0.0
    requests = 0
    while not sched.done:
        progressed = False
        for name in peers:
            t = sched.next_request(name, now)
            if t is None:
                continue
            progressed = True
            requests += 1
            now += 0.001
            for i in sorted(t.indices):
                sched.on_chunk(t.request_id, i, CHUNK, now)
            sched.on_request_done(t.request_id, now)
        assert progressed
    elapsed = time.perf_counter() - start
    assert requests >= n // 16
    assert elapsed < 10.0, f"{elapsed:.2f} s for {requests} requests"


def test_a_claimed_chunk_is_in_flight_and_claimed_once() -> None:
    """The shell asks for the first chunk before the scheduler exists (with the manifest
    request) and claims it afterwards: it is then in flight like any request's, nobody
    else is offered it, and a second claim, or one for a chunk the peer lacks, is refused."""
    sched = Scheduler(8, length)
    sched.add_peer("seed", 0.0)
    sched.add_peer("partial", 0.0, bitmap_of([5], 8))
    assert sched.claim("partial", 0.0, [0]) is None  # it does not hold chunk 0
    ticket = sched.claim("seed", 0.0, [0])
    assert ticket is not None and ticket.ranges == ((0, 1),)
    assert sched.claim("seed", 0.0, [0]) is None
    assert sched.in_flight() == [0]
    other = sched.next_request("seed", 0.0)
    assert other is not None and 0 not in other.indices
    sched.on_chunk(ticket.request_id, 0, CHUNK, 1.0)
    sched.on_request_done(ticket.request_id, 1.0)
    assert sched.claim("seed", 1.0, [0]) is None  # verified: nothing to claim
