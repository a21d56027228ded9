"""The round a trainer trains ahead (training.outer.ahead): the state offered mid-round is
taken at the next step boundary, once; a claim for any other state drops the round, whose
steps stop at their next boundary. Steps here are plain Python, paced by events."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from training.outer.ahead import Ahead
from training.outer.loop import OuterState

H = 4
WAIT = 10.0  # seconds any event here may take, on a loaded machine


def _state(round_: int) -> OuterState:
    return OuterState(round_, {"w": np.zeros(2, np.float32)}, {"w": np.zeros(2, np.float32)})


class Paced:
    """Steps that wait, before step ``hold``, until the test lets them go on; what each
    boundary returned is kept."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.reached = threading.Event()
        self.go = threading.Event()
        self.taken: list[tuple[int, OuterState | None]] = []

    def __call__(self, ahead: Ahead) -> list[float]:
        for step in range(H):
            if step == self.hold:
                self.reached.set()
                assert self.go.wait(WAIT)
            self.taken.append((step, ahead.at_boundary(step)))
        return [float(i) for i in range(H)]


def test_a_state_offered_mid_round_is_taken_at_the_next_boundary_once() -> None:
    steps = Paced(hold=2)
    ahead = Ahead(5, steps)
    ahead.start()
    assert steps.reached.wait(WAIT)
    ahead.offer(_state(4), "r4")  # another round's: ignored
    state = _state(5)
    ahead.offer(_state(5), "first")
    ahead.offer(state, "r5")  # a later offer replaces one not yet taken
    steps.go.set()
    assert ahead.claim(5, "r5")
    assert ahead.result() == [0.0, 1.0, 2.0, 3.0]
    assert [s for _, s in steps.taken] == [None, None, state, None]
    assert ahead.moved_at() == 2
    assert ahead.at_boundary(H) is None  # taken once


def test_a_round_whose_state_came_after_its_steps_moves_at_h_once_claimed() -> None:
    steps = Paced(hold=H)  # never held
    finished = threading.Event()

    def run(ahead: Ahead) -> list[float]:
        losses = steps(ahead)
        finished.set()
        return losses

    ahead = Ahead(1, run)
    ahead.start()
    assert finished.wait(WAIT)
    state = _state(1)
    ahead.offer(state, "r1")
    assert ahead.claim(1, "r1")
    assert ahead.result() is not None
    assert ahead.moved_at() is None
    assert ahead.at_boundary(H) is state
    assert ahead.moved_at() == H


@pytest.mark.parametrize("claimed", [(2, "r2"), (3, "other"), (3, "unoffered")])
def test_a_claim_for_another_state_drops_the_round_at_its_next_boundary(
    claimed: tuple[int, str],
) -> None:
    """Another round, another root than the one moved to, or a state never offered (one
    the worker caught up to): the round ahead does not serve it."""
    steps = Paced(hold=1)
    ahead = Ahead(3, steps)
    ahead.start()
    assert steps.reached.wait(WAIT)
    if claimed[1] == "other":
        ahead.offer(_state(3), "r3")
    assert not ahead.claim(*claimed)
    ahead.offer(_state(3), claimed[1])  # after the claim: ignored
    steps.go.set()
    assert ahead.result() is None
    assert steps.taken == [(0, None)]  # stopped at boundary 1, the first after the drop
    assert ahead.moved_at() is None


def test_an_error_in_the_steps_is_raised_to_the_claimant_unless_the_round_was_dropped() -> None:
    def failing(ahead: Ahead) -> list[float]:
        raise RuntimeError("step 0 failed")

    ahead = Ahead(1, failing)
    ahead.start()
    ahead.offer(_state(1), "r1")
    assert ahead.claim(1, "r1")
    with pytest.raises(RuntimeError, match="step 0 failed"):
        ahead.result()
    dropped = Ahead(1, failing)
    dropped.start()
    dropped.drop()
    assert dropped.result() is None
