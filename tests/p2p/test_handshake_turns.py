"""Turns to start an inbound handshake, per source address (p2p.transport.handshake_turns):
the pacer with plain values, its trio shell on virtual time.

Regression: a socket over its address's rate was held for a wait fixed when it arrived, so
more than a burst of handshakes at once from one address (peers behind one NAT, a fetch's
stripes) was served one a second past the burst even as the earlier ones connected and
gave their turns back: eight identities opening their connections at once from one
address took 30.6 s to connect instead of 2.6 s.
"""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel
import trio.testing

from p2p.transport.handshake_turns import Arrival, HandshakePacer, HandshakeTurns

GO = Arrival(go=True)
CLOSED = Arrival(go=False)


def test_handshakes_past_an_address_burst_are_held_and_released_by_the_rate() -> None:
    pacer = HandshakePacer(per_second=2.0, burst=3, max_held=10)
    assert [pacer.arrive("a", 0.0) for _ in range(3)] == [GO] * 3
    assert pacer.arrive("a", 0.0) == Arrival(go=False, ticket=1)
    assert pacer.arrive("a", 0.0) == Arrival(go=False, ticket=2)
    assert pacer.arrive("b", 0.0) == GO  # another address has its own burst
    assert pacer.held == 2
    assert pacer.turn_at("a") == 0.5
    assert pacer.release("a", 0.4) == []
    assert pacer.release("a", 0.5) == [1]
    assert (pacer.head("a"), pacer.turn_at("a")) == (2, 1.0)
    assert pacer.release("a", 1.0) == [2]
    assert pacer.held == 0
    # The rate refills the burst: at 2.5 the turns taken up to 1.0 are back.
    assert [pacer.arrive("a", 2.5) for _ in range(3)] == [GO] * 3
    assert pacer.arrive("a", 2.5).ticket is not None


def test_a_handshake_that_connects_releases_the_first_held_socket_at_once() -> None:
    """Many real peers behind one NAT connect as fast as their handshakes complete; only
    sockets that never handshake are held to the rate."""
    pacer = HandshakePacer(per_second=1.0, burst=2, max_held=10)
    assert [pacer.arrive("nat", 0.0) for _ in range(2)] == [GO, GO]
    tickets = [pacer.arrive("nat", 0.0).ticket for _ in range(3)]
    assert tickets == [1, 2, 3]
    assert pacer.give_back("nat", 0.1) == [1]
    assert pacer.give_back("nat", 0.1) == [2]
    assert pacer.give_back("nat", 0.2) == [3]
    assert pacer.arrive("nat", 0.2).ticket == 4  # 2 and 3 are handshaking: the burst's 2
    assert pacer.give_back("nat", 0.3) == [4]
    for _ in range(3):  # 2, 3 and 4 connect
        assert pacer.give_back("nat", 0.3) == []
    for _ in range(100):  # connected as fast as they come: never held
        assert pacer.arrive("nat", 0.3) == GO
        assert pacer.give_back("nat", 0.3) == []
    assert pacer.held == 0


def test_held_sockets_wait_first_come_first_served() -> None:
    pacer = HandshakePacer(per_second=1.0, burst=1, max_held=10)
    assert pacer.arrive("a", 0.0) == GO
    first, second = pacer.arrive("a", 0.0).ticket, pacer.arrive("a", 0.5).ticket
    assert second is not None
    # The rate's turn has come when a third arrives: it queues behind them, no jumping.
    assert pacer.arrive("a", 1.5).ticket is not None
    assert pacer.release("a", 1.5) == [first]
    assert pacer.head("a") == second


def test_a_held_socket_that_gives_up_takes_no_turn() -> None:
    pacer = HandshakePacer(per_second=1.0, burst=1, max_held=10)
    assert pacer.arrive("a", 0.0) == GO
    gone, waiting = pacer.arrive("a", 0.0).ticket, pacer.arrive("a", 0.0).ticket
    assert gone is not None and waiting is not None
    assert pacer.leave(gone)
    assert not pacer.leave(gone)
    assert (pacer.head("a"), pacer.held, pacer.paced_out) == (waiting, 1, 1)
    assert pacer.release("a", 1.0) == [waiting]
    assert not pacer.leave(waiting)  # released: not held any more


def test_held_sockets_are_capped_in_all_and_per_address() -> None:
    pacer = HandshakePacer(per_second=1.0, burst=1, max_held=3, max_held_per_ip=2)
    assert pacer.arrive("a", 0.0) == GO
    assert pacer.arrive("a", 0.0).ticket is not None
    assert pacer.arrive("a", 0.0).ticket is not None
    assert pacer.arrive("a", 0.0) == CLOSED  # the address's cap: closed at once
    assert pacer.arrive("b", 0.0) == GO
    assert pacer.arrive("b", 0.0).ticket is not None
    assert pacer.arrive("c", 0.0) == GO  # within its burst, whatever is held
    assert pacer.arrive("c", 0.0) == CLOSED  # the cap in all
    assert (pacer.held, pacer.refused) == (3, 2)


def test_addresses_tracked_are_bounded_and_a_queue_is_never_forgotten() -> None:
    pacer = HandshakePacer(per_second=1.0, burst=1, max_held=10, max_tracked=8)
    assert pacer.arrive("q", 0.0) == GO
    held = pacer.arrive("q", 0.0).ticket
    for n in range(100):
        assert pacer.arrive(f"10.0.0.{n}", 0.0) == GO
    assert len(pacer._tat) <= 8
    assert pacer.head("q") == held
    assert pacer.release("q", 0.5) == []  # its rate kept: not a fresh burst
    assert pacer.release("q", 1.0) == [held]


# --- The trio shell, on virtual time --------------------------------------------------


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_held_sockets_go_as_soon_as_their_address_connects(
    clock: trio.testing.MockClock,
) -> None:
    """Twenty handshakes at once from one address, burst 4, one a second: as each of the
    first connects it lets a held one go at once, so all twenty start at t=0 (waiting
    for the rate, the last would start at t=16)."""
    turns = HandshakeTurns(HandshakePacer(per_second=1.0, burst=4, max_held=100))
    started: list[float] = []

    async def handshake() -> None:
        assert await turns.wait_turn("nat")
        started.append(trio.current_time())
        await trio.lowlevel.checkpoint()  # the handshake's round trips
        turns.give_back("nat")

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(handshake)
    assert started == [0.0] * 20
    assert turns.pacer.held == 0


async def test_held_sockets_that_never_handshake_go_at_the_rate_then_give_up(
    clock: trio.testing.MockClock,
) -> None:
    turns = HandshakeTurns(HandshakePacer(per_second=2.0, burst=2, max_held=100), max_wait=2.0)
    outcome: list[tuple[float, bool]] = []

    async def silent() -> None:
        went = await turns.wait_turn("flood")
        outcome.append((trio.current_time(), went))

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(silent)
    assert sorted(outcome) == [
        (0.0, True),
        (0.0, True),
        (0.5, True),
        (1.0, True),
        (1.5, True),
        *[(2.0, False)] * 4,  # held their 2 s: closed without a turn
        (2.0, True),  # its turn came with its deadline: the turn wins
    ]
    assert (turns.pacer.held, turns.pacer.paced_out) == (0, 4)


async def test_a_held_socket_that_gives_up_lets_the_next_in_line_wait_for_the_rate(
    clock: trio.testing.MockClock,
) -> None:
    """The first in line is cancelled (its socket gone); the one behind it becomes the
    first and is woken to wait for the rate's turn, not its own deadline 30 s off."""
    turns = HandshakeTurns(HandshakePacer(per_second=1.0, burst=1, max_held=100), max_wait=30)
    assert await turns.wait_turn("a")
    went: list[float] = []

    async def first_in_line(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await turns.wait_turn("a")

    async def second_in_line() -> None:
        assert await turns.wait_turn("a")
        went.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        first = await nursery.start(first_in_line)
        nursery.start_soon(second_in_line)
        await trio.sleep(0.5)
        first.cancel()
    assert went == [1.0]
    assert turns.pacer.paced_out == 1


async def test_a_held_socket_whose_peer_left_is_let_go_within_the_check_interval(
    clock: trio.testing.MockClock,
) -> None:
    """A flooder that hangs up while its socket is held: the socket goes within
    GONE_CHECK_INTERVAL (the node's descriptors back soon after a flood), not after
    MAX_TURN_WAIT, and takes no turn from the one behind it."""
    from p2p.transport.handshake_turns import GONE_CHECK_INTERVAL

    turns = HandshakeTurns(HandshakePacer(per_second=0.01, burst=1, max_held=100), max_wait=30)
    assert await turns.wait_turn("a")
    left_at = 1.0
    ended: dict[str, tuple[bool, float]] = {}

    async def held(name: str, gone: bool) -> None:
        went = await turns.wait_turn("a", lambda: gone and trio.current_time() >= left_at)
        ended[name] = (went, trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(held, "hung up", True)
        nursery.start_soon(held, "stays", False)
    went, at = ended["hung up"]
    assert not went
    assert left_at <= at <= left_at + GONE_CHECK_INTERVAL
    assert ended["stays"] == (False, 30.0)  # no turn at 1 a 100 s: its own wait ran out
    assert turns.pacer.held == 0
