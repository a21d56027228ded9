"""The scheduler's theory-of-operation invariants under random event orders (Hypothesis).

A small independent model tracks what the shell knows: which chunks are verified, which
requests are live and what each still owes, which peers are usable and what they hold.
Every rule checks the scheduler's answer against the model; every step re-checks the
scheduler's own bookkeeping; each run ends by cancelling everything and draining the rest
of the blob from one fresh honest peer, which proves no released chunk was lost.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from p2p.fetch.sched_records import (
    ENDGAME_MIN_PATIENCE_S,
    ENDGAME_PATIENCE_RTTS,
    RequestTicket,
    SchedulerConfig,
    bitmap_of,
)
from p2p.fetch.scheduler import Scheduler

N = 10  # small, so that runs often reach the endgame and the drained tail
PEERS = ("a", "b", "c", "d")
CONFIG = SchedulerConfig(
    max_chunks_per_request=4,
    max_inflight_requests_per_peer=2,
    max_ranges_per_request=2,
    max_failures_before_drop=2,
    endgame_duplicates=1,
)


def length(index: int) -> int:
    return 1000 + index  # unequal lengths catch a mix-up of index and size


holdings = st.none() | st.sets(st.integers(0, N - 1), max_size=N)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(verified=st.sets(st.integers(0, N - 1), max_size=N // 2))
    def start(self, verified: set[int]) -> None:
        self.sched = Scheduler(N, length, verified=verified, config=CONFIG)
        self.initially_verified = frozenset(verified)
        self.now = 0.0
        self.verified = set(verified)
        self.live: dict[int, tuple[RequestTicket, set[int]]] = {}  # id -> ticket, owed
        self.issued: dict[int, float] = {}  # id -> when it was handed out
        self.released: dict[int, RequestTicket] = {}
        self.holds: dict[str, set[int]] = {}
        self.connected: set[str] = set()
        self.banned: set[str] = set()
        self.dropped: set[str] = set()
        self.streak: dict[str, int] = {}

    # ------------------------------------------------------------------ model

    def usable(self, peer: str) -> bool:
        return peer in self.connected and peer not in self.banned and peer not in self.dropped

    def release_peer(self, peer: str) -> None:
        for rid, (ticket, _) in list(self.live.items()):
            if ticket.peer == peer:
                self.released[rid] = self.live.pop(rid)[0]

    def owed(self) -> dict[int, set[int]]:
        """Unverified chunk -> live requests still owing it."""
        out: dict[int, set[int]] = {}
        for rid, (_, owe) in self.live.items():
            for i in owe - self.verified:
                out.setdefault(i, set()).add(rid)
        return out

    def late(self, rid: int) -> bool:
        """Invariant 2's patience: a request may be copied once it has been out for
        ENDGAME_PATIENCE_RTTS of its peer's round trips plus what the peer's measured rate
        needs for the chunks it still owes (each at chunk 0's length), and at least
        ENDGAME_MIN_PATIENCE_S."""
        ticket, owe = self.live[rid]
        stats = self.sched.peer_stats()[ticket.peer]
        patience = ENDGAME_PATIENCE_RTTS * (stats.rtt_s or 0.0)
        if stats.rate_bytes_per_s > 0:
            patience += len(owe) * length(0) / stats.rate_bytes_per_s
        return self.now - self.issued[rid] >= max(ENDGAME_MIN_PATIENCE_S, patience)

    def pool(self) -> set[int]:
        return set(range(N)) - self.verified - set(self.owed())

    def rarity(self, i: int) -> int:
        return sum(1 for q, h in self.holds.items() if self.usable(q) and len(h) < N and i in h)

    def set_holds(self, peer: str, holds: set[int] | None) -> None:
        self.holds[peer] = set(range(N)) if holds is None else set(holds)

    # ------------------------------------------------------------------ rules

    @rule(peer=st.sampled_from(PEERS), holds=holdings)
    def add_peer(self, peer: str, holds: set[int] | None) -> None:
        bitmap = None if holds is None else bitmap_of(holds, N)
        self.sched.add_peer(peer, self.now, bitmap)
        if not self.usable(peer):
            self.streak[peer] = 0
        self.connected.add(peer)
        self.dropped.discard(peer)
        self.set_holds(peer, holds)

    @precondition(lambda self: bool(self.holds))
    @rule(data=st.data(), holds=holdings)
    def update_bitmap(self, data: st.DataObject, holds: set[int] | None) -> None:
        peer = data.draw(st.sampled_from(sorted(self.holds)))
        self.sched.update_peer_bitmap(peer, None if holds is None else bitmap_of(holds, N))
        self.set_holds(peer, holds)

    @rule(peer=st.sampled_from(PEERS))
    def request(self, peer: str) -> None:
        live_here = sum(1 for t, _ in self.live.values() if t.peer == peer)
        pool = self.pool()
        owed = self.owed()
        usable = self.usable(peer)
        mine = {i for i in pool if i in self.holds.get(peer, ())}
        fetchable = {
            i for i in pool if any(i in self.holds[q] for q in self.holds if self.usable(q))
        }
        ticket = self.sched.next_request(peer, self.now)
        if not usable or live_here >= CONFIG.max_inflight_requests_per_peer:
            assert ticket is None  # invariants 3 and 5
            return
        if mine:
            assert ticket is not None, "a usable peer with work must get it"
        if not fetchable and live_here == 0 and CONFIG.endgame_duplicates:
            copyable = [
                i
                for i, rids in owed.items()
                if i in self.holds[peer]
                and len(rids) <= CONFIG.endgame_duplicates
                and any(self.late(rid) for rid in rids)
            ]
            if copyable:
                assert ticket is not None and ticket.endgame, "an idle peer joins the endgame"
        if ticket is None:
            return
        assert ticket.peer == peer
        # Invariant 5: limits, sorted merged ranges.
        assert 1 <= len(ticket.indices) <= CONFIG.max_chunks_per_request
        assert 1 <= len(ticket.ranges) <= CONFIG.max_ranges_per_request
        assert [i for a, b in ticket.ranges for i in range(a, b)] == sorted(ticket.indices)
        assert all(b < c for (_, b), (c, _) in zip(ticket.ranges, ticket.ranges[1:], strict=False))
        # Invariant 1, and never ask a peer for what it does not hold.
        assert not ticket.indices & self.verified
        assert ticket.indices <= self.holds[peer]
        assert ticket.deadline > self.now
        if ticket.endgame:
            # Invariant 2: duplicates only when no pool chunk is fetchable, only by an idle
            # peer, at most 1 + endgame_duplicates owers per chunk.
            assert not fetchable and live_here == 0
            for i in ticket.indices:
                assert 1 <= len(owed.get(i, ())) <= CONFIG.endgame_duplicates
                assert any(self.late(rid) for rid in owed[i]), "copies of late requests only"
        else:
            assert ticket.indices <= pool, "outside endgame only unowed chunks"
            # Rarest first: the (rarity, index)-least chunk this peer could take is taken.
            best = min(mine, key=lambda i: (self.rarity(i), i))
            assert best in ticket.indices
        self.live[ticket.request_id] = (ticket, set(ticket.indices))
        self.issued[ticket.request_id] = self.now

    @rule()
    def every_peer_asks(self) -> None:
        """Shells ask often; this makes full pipelines and endgames common."""
        for peer in PEERS:
            self.request(peer)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def chunk_arrives(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        ticket, owe = self.live[rid]
        if not owe:
            return
        i = data.draw(st.sampled_from(sorted(owe)))
        new = self.sched.on_chunk(rid, i, length(i), self.now)
        assert new == (i not in self.verified)
        self.verified.add(i)
        owe.discard(i)
        self.streak[ticket.peer] = 0

    @precondition(lambda self: bool(self.released))
    @rule(data=st.data())
    def late_chunk_arrives(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.released)))
        i = data.draw(st.sampled_from(sorted(self.released[rid].indices)))
        new = self.sched.on_chunk(rid, i, length(i), self.now)
        assert new == (i not in self.verified)
        self.verified.add(i)

    @precondition(lambda self: bool(self.live) or bool(self.released))
    @rule(data=st.data(), protocol=st.booleans())
    def peer_lies(self, data: st.DataObject, protocol: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live) + sorted(self.released)))
        ticket = self.live[rid][0] if rid in self.live else self.released[rid]
        if protocol:
            self.sched.on_protocol_error(rid, self.now, "oversized frame")
        else:
            i = data.draw(st.sampled_from(sorted(ticket.indices)))
            self.sched.on_bad_chunk(rid, i, self.now)
        self.banned.add(ticket.peer)
        self.release_peer(ticket.peer)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def request_done(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        ticket = self.live[rid][0]
        missing = data.draw(st.sets(st.sampled_from(sorted(ticket.indices))))
        self.sched.on_request_done(rid, self.now, missing)
        self.holds[ticket.peer] -= missing
        self.streak[ticket.peer] = 0
        self.released[rid] = self.live.pop(rid)[0]

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def request_fails(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        peer = self.live[rid][0].peer
        self.sched.on_request_failed(rid, self.now, "stream reset")
        self.released[rid] = self.live.pop(rid)[0]
        self.streak[peer] = self.streak.get(peer, 0) + 1
        if self.streak[peer] >= CONFIG.max_failures_before_drop:
            self.dropped.add(peer)
            self.release_peer(peer)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def shell_cancels(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.sched.cancel(rid, self.now)
        self.released[rid] = self.live.pop(rid)[0]

    @rule(peer=st.sampled_from(PEERS))
    def peer_leaves(self, peer: str) -> None:
        self.sched.remove_peer(peer, "connection lost")
        self.connected.discard(peer)
        self.release_peer(peer)

    @rule(dt=st.sampled_from([0.0, 0.5, 5.0, 30.0]), fail=st.booleans())
    def time_passes(self, dt: float, fail: bool) -> None:
        self.now += dt
        overdue = self.sched.expired(self.now)
        expected = sorted(
            (t.deadline, rid) for rid, (t, _) in self.live.items() if t.deadline <= self.now
        )
        assert [(t.deadline, t.request_id) for t in overdue] == expected
        if fail:
            for t in overdue:
                if t.request_id in self.live:
                    self.sched.on_request_failed(t.request_id, self.now, "timeout")
                    self.released[t.request_id] = self.live.pop(t.request_id)[0]
                    self.streak[t.peer] = self.streak.get(t.peer, 0) + 1
                    if self.streak[t.peer] >= CONFIG.max_failures_before_drop:
                        self.dropped.add(t.peer)
                        self.release_peer(t.peer)

    # ------------------------------------------------------------- invariants

    @invariant()
    def agrees_with_model(self) -> None:
        s = self.sched
        s._check_invariants()
        assert s.verified_count == len(self.verified)
        assert s.done == (len(self.verified) == N)  # invariant 6
        assert s.missing() == sorted(set(range(N)) - self.verified)
        assert s.banned_peers() == self.banned
        stats = s.peer_stats()
        for peer in self.holds:
            assert stats[peer].banned == (peer in self.banned)
            assert stats[peer].dropped == (peer in self.dropped)
            assert stats[peer].inflight == sum(1 for t, _ in self.live.values() if t.peer == peer)
        deadlines = [t.deadline for t, _ in self.live.values()]
        assert s.next_deadline() == (min(deadlines) if deadlines else None)
        progress_possible = any(
            self.usable(q) and (set(range(N)) - self.verified) & self.holds[q] for q in self.holds
        )
        assert s.stalled() == (not s.done and not progress_possible and not self.live)

    def teardown(self) -> None:
        """Invariant 4: cancel everything; one honest peer must then fetch every chunk."""
        s = self.sched
        for rid in list(self.live):
            s.cancel(rid, self.now)
        s.add_peer("drain", self.now)
        for _ in range(N + 1):
            t = s.next_request("drain", self.now)
            if t is None:
                break
            assert not t.indices & self.verified
            for i in sorted(t.indices):
                assert s.on_chunk(t.request_id, i, length(i), self.now)
                self.verified.add(i)
            s.on_request_done(t.request_id, self.now)
        assert s.done and not s.stalled()
        assert s.next_deadline() is None
        assert math.isfinite(self.now)


SchedulerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
