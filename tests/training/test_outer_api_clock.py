"""The user's loop's own clock (training.outer.api.clock): every second inside the loop's
calls is waited, whatever the call did with it, and a round's compute and waited add up to
its wall time."""

from __future__ import annotations

from training.outer.api.clock import LoopClock, RoundTiming


def test_every_second_inside_a_call_is_waited_and_a_round_adds_up_to_its_wall_time() -> None:
    clock = LoopClock()
    clock.start(100.0)  # join
    # Step 1: the user computes 2 s; step() polls and loses 0.25 s (a state added, a
    # thread holding the interpreter: the clock does not ask which).
    clock.enter(102.0)
    assert clock.leave(102.25, ended=False) is None
    # Step 2 (the H-th): 2 s of the user's, then 3 s inside step(), which ends the round.
    clock.enter(104.25)
    got = clock.leave(107.25, ended=True, overlapped=1.5)
    assert got == RoundTiming(compute=4.0, waited=3.25, overlapped=1.5)
    assert sum(got[:2]) == 107.25 - 100.0
    # The next round's span begins where that call returned.
    clock.enter(110.0)
    clock.leave(110.5, ended=True)
    assert clock.rounds[1] == RoundTiming(compute=2.75, waited=0.5, overlapped=0.0)


def test_a_call_that_ends_no_round_is_timed_with_the_round_that_ends_next() -> None:
    clock = LoopClock()
    clock.start(0.0)
    clock.enter(1.0)  # restore(), or a step() that raised: no round ended
    clock.leave(3.0, ended=False)
    clock.enter(4.0)
    clock.leave(4.5, ended=True)
    assert clock.rounds == [RoundTiming(compute=2.0, waited=2.5, overlapped=0.0)]


def test_nothing_is_timed_before_join() -> None:
    clock = LoopClock()
    clock.enter(1.0)
    assert clock.leave(2.0, ended=True) is None and not clock.started
    clock.start(2.0)
    clock.enter(3.0)
    assert clock.leave(3.5, ended=True) == RoundTiming(1.0, 0.5, 0.0)
