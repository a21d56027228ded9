"""The user's loop's own clock (``timings``, point 9 of :mod:`training.outer.api`): the
honest utilisation, whatever made the loop wait.

1. **Two kinds of seconds.** From join on, every second of the user's thread is either
   inside one of the loop's calls that may wait (``step()``, ``skip()``, ``restore()``),
   or outside them, the user's own. The clock counts the first kind from each call's
   entry to its exit, so a second lost anywhere in a call (the round's closure, a state
   added at a step boundary, a copy, a lock, a thread that held the interpreter) is
   counted, not only the waits the loop knows it makes.
2. **Rounds.** A round's timing is taken at the exit of the call that ended it (its
   update sent, or skipped): ``compute`` is the user's seconds since the round before
   ended (since join, for the first), ``waited`` the seconds inside the loop's calls in
   that span. They add up to the round's wall time; utilisation is compute / (compute +
   waited).
3. A call that raises counts its seconds like any other; a round it did not end is timed
   with the next one that ends.
"""

from __future__ import annotations

from typing import NamedTuple


class RoundTiming(NamedTuple):
    """One round of a loop, in seconds (rule 2): ``compute``, the user's own time;
    ``waited``, its time inside the loop's calls; ``overlapped``, the previous round's
    communication that ran while this round's steps did (0 for blocking rounds)."""

    compute: float
    waited: float
    overlapped: float


class LoopClock:
    """The module's rules, with ``now`` (monotonic seconds) given by the caller."""

    def __init__(self) -> None:
        self.rounds: list[RoundTiming] = []
        self._began: float | None = None  # when the current round's span began
        self._inside = 0.0  # the span's seconds inside the loop's calls so far
        self._entered: float | None = None

    @property
    def started(self) -> bool:
        return self._began is not None

    def start(self, now: float) -> None:
        """The loop holds its first state (join): the first round's span begins."""
        self._began, self._inside = now, 0.0

    def enter(self, now: float) -> None:
        """A call that may wait began (rule 1)."""
        self._entered = now

    def leave(self, now: float, ended: bool, overlapped: float = 0.0) -> RoundTiming | None:
        """The call entered last returned (or raised); ``ended``: it ended a round, whose
        timing is kept and returned (rule 2)."""
        if self._entered is not None:
            self._inside += now - self._entered
            self._entered = None
        if not ended or self._began is None:
            return None
        total = now - self._began
        timing = RoundTiming(total - self._inside, self._inside, overlapped)
        self.rounds.append(timing)
        self._began, self._inside = now, 0.0
        return timing
