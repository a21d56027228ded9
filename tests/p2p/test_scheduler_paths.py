"""Sizing a download to its path, on a fake clock: requests in flight per provider follow its
rate x RTT, connections to one provider grow while they raise the rate, and peers that sent
bad data are remembered across downloads with decay. No sockets, no sleeps."""

from __future__ import annotations

import heapq
import math
from typing import Any

import pytest

from p2p.fetch.sched_records import SchedulerConfig
from p2p.fetch.scheduler import Scheduler
from p2p.fetch.scores import PeerScores, ScoreConfig
from p2p.fetch.striping import StripeConfig, StripeGrowth

CHUNK = 1 << 20
CONFIG = SchedulerConfig(max_chunks_per_request=4)  # 4 MiB requests
REQUEST = CONFIG.max_chunks_per_request * CHUNK


def length(_index: int) -> int:
    return CHUNK


def measured(rate: float, rtt: float, n: int = 4096) -> Scheduler:
    """A scheduler whose peer "p" has delivered at `rate` bytes/s and answered in `rtt`."""
    sched = Scheduler(n, length, config=CONFIG)
    sched.add_peer("p", 0.0)
    sched.on_rtt("p", rtt)
    ticket = sched.next_request("p", 0.0)
    assert ticket is not None
    now = 0.0
    for index in sorted(ticket.indices):
        now += CHUNK / rate
        assert sched.on_chunk(ticket.request_id, index, CHUNK, now)
    sched.on_request_done(ticket.request_id, now)
    return sched


def live_requests_granted(sched: Scheduler, peer: str, now: float) -> int:
    count = 0
    while sched.next_request(peer, now) is not None:
        count += 1
        assert count <= 64, "next_request never said no"
    return count


def test_an_unmeasured_peer_gets_the_minimum() -> None:
    sched = Scheduler(64, length, config=CONFIG)
    sched.add_peer("p", 0.0)
    assert sched.inflight_limit("p") == CONFIG.min_inflight_requests_per_peer
    assert live_requests_granted(sched, "p", 0.0) == CONFIG.min_inflight_requests_per_peer


@pytest.mark.parametrize(
    ("rate", "rtt"),
    [(50e6, 0.2), (50e6, 0.05), (100e6, 0.15), (5e6, 0.2)],
)
def test_requests_in_flight_cover_rate_times_rtt(rate: float, rtt: float) -> None:
    sched = measured(rate, rtt)
    expected = math.ceil(rate * rtt / REQUEST) + 1
    expected = min(CONFIG.max_inflight_requests_per_peer, max(2, expected))
    assert sched.inflight_limit("p") == expected
    # next_request honours it: exactly that many live requests, then None.
    assert live_requests_granted(sched, "p", 10.0) == expected
    sched._check_invariants()


def test_a_far_peer_gets_more_and_a_slow_one_less_but_never_none() -> None:
    far = measured(50e6, 0.2).inflight_limit("p")
    near = measured(50e6, 0.001).inflight_limit("p")
    slow_far = measured(2e6, 0.2).inflight_limit("p")
    assert far > near
    assert far > slow_far >= CONFIG.min_inflight_requests_per_peer


def test_the_limit_is_capped_by_the_server_stream_budget() -> None:
    sched = measured(1e9, 1.0)  # a BDP of 1 GB
    assert sched.inflight_limit("p") == CONFIG.max_inflight_requests_per_peer
    assert live_requests_granted(sched, "p", 10.0) == CONFIG.max_inflight_requests_per_peer


def test_each_connection_gets_a_request_at_least() -> None:
    sched = Scheduler(256, length, config=CONFIG)
    sched.add_peer("p", 0.0)
    sched.set_connections("p", 6)
    assert sched.inflight_limit("p") == 9  # one per connection, and a second for half
    assert sched.peer_stats()["p"].connections == 6


def test_pipelined_stripes_hold_depth_requests_per_connection_beyond_the_stream_cap() -> None:
    """p2p.fetch.downloader rule 10: queued requests hold no server stream, so eight pipelined
    lanes two deep may hold sixteen live requests (the stream budget caps twelve)."""
    sched = Scheduler(256, length, config=CONFIG)
    sched.add_peer("p", 0.0)
    sched.set_connections("p", 8, depth=2)
    assert sched.inflight_limit("p") == 16 > CONFIG.max_inflight_requests_per_peer
    assert live_requests_granted(sched, "p", 0.0) == 16
    sched.set_connections("p", 8, depth=1)  # a provider that refused 1.1.0
    assert sched.inflight_limit("p") == 12


def test_the_smallest_rtt_sample_is_kept() -> None:
    sched = Scheduler(8, length, config=CONFIG)
    sched.add_peer("p", 0.0)
    for rtt in (0.25, 0.2, 0.3):
        sched.on_rtt("p", rtt)
    assert sched.peer_stats()["p"].rtt_s == 0.2


# --- striping over connections --------------------------------------------------------


def run_growth(
    per_connection: float, link: float, rtt: float, *, seconds: float = 30.0
) -> list[tuple[float, int]]:
    """Drive StripeGrowth against a path where each connection carries `per_connection`
    bytes/s (its socket buffers over the RTT) and all together at most `link`; dials take
    four round trips. Returns (time, connections) at each change."""
    cfg = StripeConfig()
    growth = StripeGrowth(cfg, 0.0)
    history = [(0.0, 1)]
    now, step = 0.0, 0.01
    dials: list[float] = []  # completion times
    while now < seconds:
        now += step
        rate = min(link, growth.connections * per_connection)
        growth.on_bytes(int(rate * step), now, rtt)
        for done in [t for t in dials if t <= now]:
            dials.remove(done)
            growth.on_dialled(True, now)
            history.append((now, growth.connections))
        for _ in range(growth.decide(now, rtt, busy=True)):
            dials.append(now + 4 * rtt)
    return history


def test_connections_grow_while_the_rate_keeps_growing() -> None:
    # 200 ms, stock buffers: 13 MB/s per connection on a 125 MB/s link.
    history = run_growth(13e6, 125e6, 0.2)
    assert [count for _, count in history] == [1, 2, 3, 4, 5, 6, 7, 8]
    # Steps of three and eight RTTs plus two dials of four: eight connections within ~4 s.
    assert history[-1][0] < (3 + 8) * 0.2 + 2 * 4 * 0.2 + 0.5


def test_growth_stops_when_the_link_is_full() -> None:
    # One connection nearly fills the link: the step to four brings too little gain.
    history = run_growth(60e6, 65e6, 0.05)
    counts = [count for _, count in history]
    assert max(counts) == 4  # tried 4 once, never 8


def test_a_near_provider_keeps_one_connection() -> None:
    """Loopback and LAN: one connection is not buffer-limited (rate x RTT is far below a
    socket buffer), so extra connections would only add CPU cost."""
    assert run_growth(300e6, 300e6, 0.0005) == [(0.0, 1)]
    assert run_growth(125e6, 125e6, 0.002) == [(0.0, 1)]


MEASURED = StripeConfig(predial_rtt_s=math.inf)  # every step judged by measurement


def test_an_idle_provider_does_not_grow() -> None:
    growth = StripeGrowth(StripeConfig(), 0.0)
    for i in range(1, 200):
        now = i * 0.05
        growth.on_bytes(1 << 20, now, 0.2)
        assert growth.decide(now, 0.2, busy=False) == 0
    assert growth.connections == 1 and not growth.stopped


def test_a_far_provider_gets_its_first_connections_at_once() -> None:
    """80 ms: four connections are dialled before anything is measured (a dial costs
    ~5 RTTs; measuring one connection first would cost seconds); 200 ms: all eight (the
    step 4 -> 8 took ~2.5 s there, most of a 256 MiB fetch); near, none."""
    far = StripeGrowth(StripeConfig(), 0.0)
    assert far.decide(0.0, 0.08, busy=False) == 0  # nothing to fetch yet: no dials
    assert far.decide(0.01, 0.08, busy=True) == 3
    farthest = StripeGrowth(StripeConfig(), 0.0)
    assert farthest.decide(0.01, 0.2, busy=True) == 7
    for _ in range(7):
        farthest.on_dialled(True, 0.5)
    assert farthest.stopped and farthest.connections == 8
    near = StripeGrowth(StripeConfig(), 0.0)
    assert near.decide(0.01, 0.001, busy=True) == 0


def test_a_failed_dial_stops_growth() -> None:
    growth = StripeGrowth(MEASURED, 0.0)
    growth.on_bytes(1 << 20, 0.9, 0.2)
    growth.on_bytes(10 << 20, 1.65, 0.2)
    assert growth.decide(1.65, 0.2, busy=True) == 3
    assert growth.decide(1.7, 0.2, busy=True) == 0  # dials are pending
    growth.on_dialled(False, 1.9)
    assert growth.stopped and growth.connections == 1
    assert growth.decide(10.0, 0.2, busy=True) == 0


def test_no_decision_before_the_step_settles_and_a_window_has_enough_bytes() -> None:
    growth = StripeGrowth(MEASURED, 0.0)
    rtt = 0.2
    assert growth.next_check(0.0, rtt) == pytest.approx(3 * rtt)  # the first step
    now = 0.0
    for _ in range(10):  # 1 MiB each 0.1 s: 7 MiB after the mark (0.3 s) by 1.0 s
        now += 0.1
        growth.on_bytes(1 << 20, now, rtt)
        assert growth.decide(now, rtt, busy=True) == 0
    for _ in range(2):
        now += 0.1
        growth.on_bytes(1 << 20, now, rtt)
    assert growth.decide(now, rtt, busy=True) == 3  # 1 -> 4
    for _ in range(3):
        growth.on_dialled(True, now)
    # Later steps wait out the new connections' slow start.
    assert growth.next_check(now, rtt) == pytest.approx(now + 8 * rtt)


# --- scores across downloads ----------------------------------------------------------


def test_a_liar_is_distrusted_then_forgiven() -> None:
    cfg = ScoreConfig(half_life_s=100.0, distrust_threshold=0.25)
    scores = PeerScores(cfg)
    scores.penalize("liar", now=0.0)
    assert scores.distrusted("liar", 0.0)
    assert scores.distrusted("liar", 199.0)
    assert not scores.distrusted("liar", 201.0)
    assert not scores.distrusted("honest", 0.0)
    # Penalties add up: a repeat offender stays distrusted longer.
    scores.penalize("liar", 0.0)
    scores.penalize("liar", 0.0)
    assert scores.score("liar", 0.0) == pytest.approx(3.0)
    assert scores.distrusted("liar", 300.0)


def test_scores_are_bounded_in_memory() -> None:
    scores = PeerScores(ScoreConfig(max_peers=8))
    for i in range(100):
        scores.penalize(f"id{i}", now=float(i))
    assert len(scores) == 8
    assert scores.distrusted("id99", 99.0)  # the newest penalties are kept


# --- two far providers stay busy --------------------------------------------------------


def simulate(
    peers: dict[str, tuple[float, float]], config: SchedulerConfig, n: int
) -> dict[str, Any]:
    """Fetch `n` chunks from peers given as name -> (rate bytes/s, RTT s): a request
    reaches its server RTT/2 after it is sent, the server sends its requests' chunks one
    after another at its rate, and each chunk lands RTT/2 after it was sent. Returns each
    peer's busy fraction (time spent sending over the whole fetch) and the fetch time."""
    sched = Scheduler(n, length, config=config)
    free_at = dict.fromkeys(peers, 0.0)  # when each server finishes what it was given
    sent = dict.fromkeys(peers, 0)
    events: list[tuple[float, int, str, int, int, bool]] = []
    seq = 0
    for name, (_rate, rtt) in peers.items():
        sched.add_peer(name, 0.0)
        sched.on_rtt(name, rtt)

    def issue(now: float) -> None:
        nonlocal seq
        for name, (rate, rtt) in peers.items():
            while (ticket := sched.next_request(name, now)) is not None:
                t = max(now + rtt / 2, free_at[name])
                indices = sorted(ticket.indices)
                for k, index in enumerate(indices):
                    t += CHUNK / rate
                    seq += 1
                    last = k == len(indices) - 1
                    heapq.heappush(events, (t + rtt / 2, seq, name, ticket.request_id, index, last))
                free_at[name] = t
                sent[name] += len(indices)

    issue(0.0)
    now = 0.0
    while not sched.done:
        assert events, "stalled"
        now, _, name, rid, index, last = heapq.heappop(events)
        sched.on_chunk(rid, index, CHUNK, now)
        if last:
            sched.on_request_done(rid, now)
        issue(now)
    busy = {name: sent[name] * CHUNK / peers[name][0] / now for name in peers}
    return {"seconds": now, "busy": busy}


def test_two_far_providers_both_stay_busy() -> None:
    """At 150 and 200 ms, requests sized to rate x RTT keep both
    providers sending most of the time; two fixed requests in flight leave them idle
    for a third to a half of it."""
    peers = {"us": (100e6, 0.15), "eu": (100e6, 0.2)}
    sized = simulate(peers, SchedulerConfig(max_chunks_per_request=8), 2048)
    fixed = simulate(
        peers, SchedulerConfig(max_chunks_per_request=8, max_inflight_requests_per_peer=2), 2048
    )
    ideal = 2048 * CHUNK / 200e6
    assert min(sized["busy"].values()) > 0.8, sized
    assert max(fixed["busy"].values()) < 0.75, fixed
    assert sized["seconds"] < 1.2 * ideal, (sized, ideal)


def test_a_slow_far_provider_gets_less_not_a_stall() -> None:
    peers = {"fast": (100e6, 0.15), "slow": (2.5e6, 0.2)}
    result = simulate(peers, SchedulerConfig(max_chunks_per_request=4), 512)
    alone = simulate({"fast": (100e6, 0.15)}, SchedulerConfig(max_chunks_per_request=4), 512)
    # The slow one may slow the fetch a little at the end, never hold it up.
    assert result["seconds"] <= 1.1 * alone["seconds"], (result, alone)


def test_busy_replies_cap_the_peer_instead_of_dropping_it() -> None:
    """A server whose per-peer stream budget is spent (by this fetch's many requests, or
    other downloads from the same node) answers busy: the peer keeps the requests it
    took and grows back one per success; it is not dropped as after failures."""
    sched = Scheduler(256, length, config=CONFIG)
    sched.add_peer("p", 0.0)
    sched.set_connections("p", 6)
    tickets = [sched.next_request("p", 0.0) for _ in range(9)]
    assert all(t is not None for t in tickets) and sched.next_request("p", 0.0) is None
    for ticket in tickets[5:]:  # the server took five
        assert ticket is not None
        sched.on_request_busy(ticket.request_id, 0.1)
    stats = sched.peer_stats()["p"]
    assert not stats.dropped and stats.failures == 0
    assert stats.inflight == 5 and sched.inflight_limit("p") == 5
    assert sched.next_request("p", 0.2) is None
    first = tickets[0]
    assert first is not None
    for index in sorted(first.indices):
        sched.on_chunk(first.request_id, index, CHUNK, 0.3)
    sched.on_request_done(first.request_id, 0.3)
    assert sched.inflight_limit("p") == 6  # one more after a success
    sched._check_invariants()


def test_busy_with_nothing_else_in_flight_is_a_failure() -> None:
    sched = Scheduler(64, length, config=SchedulerConfig(max_failures_before_drop=2))
    sched.add_peer("p", 0.0)
    for now in (0.0, 1.0):
        ticket = sched.next_request("p", now)
        assert ticket is not None
        sched.on_request_busy(ticket.request_id, now)  # alone in flight: a failure
    stats = sched.peer_stats()["p"]
    assert stats.failures == 2 and stats.dropped


def test_a_striped_providers_last_chunks_are_spread_over_its_connections() -> None:
    """Once what is left of the pool is less than a striped provider owes already, each
    of its connections gets an even part of it: handed to the first connection to ask,
    the last chunks of a lone 200 ms fetch ran on one connection after the others were
    done (bench/figures/wan-opening-caps.md: 49 -> 53 MB/s)."""
    s = Scheduler(40, lambda i: 1, config=SchedulerConfig(max_chunks_per_request=16))
    s.add_peer("seed", 0.0)
    s.set_connections("seed", 4)
    sizes = []
    while (ticket := s.next_request("seed", 0.0)) is not None:
        sizes.append(len(ticket.indices))
    # 8 chunks were left for four connections that owed 32: a few each, not 8 to one.
    assert sizes[:2] == [16, 16]
    assert len(sizes) == 6  # the limit: 1.5 requests per connection
    assert max(sizes[2:]) <= 2
    s._check_invariants()
