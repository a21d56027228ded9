"""A fetch that knows it is alone is no swarm (p2p.swarm rule 6, issue 15): the caps that
keep fetchers starting together from each queueing much of a blob at one seeder are off
for a lone fetch, which needs every striped connection busy from its first round trip on
a long path; and a fetch that learns of a fellow after all sheds what it queued beyond
them, so the fellow need not wait on that queue."""

from __future__ import annotations

from p2p.downloader import Download
from p2p.scheduler import RequestTicket, Scheduler, SchedulerConfig
from p2p.swarm import PexBook

ADDR = "/ip4/10.0.0.1/tcp/4001"
SWARM = SchedulerConfig(
    max_chunks_per_request=16,
    defer_to_partial_holders=True,
    unmeasured_batch_bytes=2,
    max_request_seconds=0.25,
)


def _chunks(ticket: RequestTicket) -> set[int]:
    return {i for a, b in ticket.ranges for i in range(a, b)}


def _fill(s: Scheduler, peer: str, now: float = 0.0) -> list[RequestTicket]:
    out: list[RequestTicket] = []
    for _ in range(64):  # bounded: the limit is at most 12
        ticket = s.next_request(peer, now)
        if ticket is None:
            return out
        out.append(ticket)
    raise AssertionError("the scheduler never stopped handing out requests")


def test_a_lone_fetch_fills_every_striped_connection_with_full_batches() -> None:
    capped = Scheduler(1024, lambda i: 1, config=SWARM)
    capped.add_peer("seed", 0.0)
    capped.set_connections("seed", 8)
    tickets = _fill(capped, "seed")
    assert [len(_chunks(t)) for t in tickets] == [2, 2]  # the swarm's opening caps

    alone = Scheduler(1024, lambda i: 1, config=SWARM)
    assert alone.set_alone(True) == []
    alone.add_peer("seed", 0.0)
    alone.set_connections("seed", 8)
    tickets = _fill(alone, "seed")
    assert len(tickets) == 12  # 8 connections and half as many again
    assert all(len(_chunks(t)) == 16 for t in tickets)


def test_a_fetch_that_learns_of_a_fellow_sheds_its_queue_at_the_seeder() -> None:
    s = Scheduler(1024, lambda i: 1, config=SWARM)
    s.set_alone(True)
    s.add_peer("seed", 0.0)
    s.set_connections("seed", 8)
    tickets = _fill(s, "seed")
    first = tickets[0]
    s.on_chunk(first.request_id, min(_chunks(first)), 1, 0.5)  # one chunk of the oldest arrived
    shed = s.set_alone(False)
    # The oldest two stay (the swarm's unmeasured count); the other ten go.
    assert shed == [t.request_id for t in tickets[2:]]
    assert s.set_alone(False) == []  # only on the change
    for request_id in shed:
        s.cancel(request_id, 1.0)
    # What they held is in the pool again, for a fellow to take; the first chunk stays.
    back = set().union(*(_chunks(t) for t in tickets[2:]))
    assert back.isdisjoint(s.in_flight())
    assert back <= set(s.missing())
    assert min(_chunks(first)) not in s.missing()
    assert s.peer_stats()["seed"].inflight == 2


def test_without_swarming_there_is_nothing_to_shed() -> None:
    s = Scheduler(1024, lambda i: 1, config=SchedulerConfig())
    s.set_alone(True)
    s.add_peer("seed", 0.0)
    s.set_connections("seed", 8)
    _fill(s, "seed")
    assert s.set_alone(False) == []


def test_alone_means_a_source_answered_and_no_fellow_is_dialled_or_reached() -> None:
    pex = PexBook("me")
    pex.add_source("seed")
    assert not pex.alone()  # nobody has answered yet
    assert pex.to_dial([("seed", (ADDR,))]) == []
    pex.answered("seed", 0)
    assert pex.alone()  # the seeder named nobody new
    assert [p for p, _ in pex.to_dial([("a", (ADDR,)), ("b", (ADDR,))])] == ["a", "b"]
    pex.answered("seed", 2)
    assert not pex.alone()  # two fellows being dialled
    pex.dial_ended(False)
    assert not pex.alone()
    pex.dial_ended(False)
    assert pex.alone()  # both gone (a finished fetch the seeder still remembered)
    pex.to_dial([("c", (ADDR,))])
    pex.dial_ended(True)
    assert not pex.alone()  # a fellow is there


def test_bulk_streams_leave_the_first_connection_to_control_streams() -> None:
    lanes = [1]
    assert Download._quiet_lane(lanes) == 0  # one connection: it carries everything
    lanes = [1, 0, 0, 0]
    picked = [Download._quiet_lane(lanes) for _ in range(6)]
    assert picked == [1, 2, 3, 1, 2, 3]
    assert lanes[0] == 1  # nothing more on lane 0
