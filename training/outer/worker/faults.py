"""Faults a test injects into a worker, kept out of the run's configuration.

``blob outer worker``'s hidden ``--stall-round`` and ``--test-cheat-from-round`` build a
:class:`Faults`; a production worker runs with none (:data:`NO_FAULTS`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Faults:
    # Sleep before training in this round (so a test can kill the worker in a known place
    # mid-round).
    stall_round: int | None = None
    # From this round on, train on other batch rows than the commitment names (an update
    # that does not match its commitment; replay must catch it), and never propose.
    cheat_from_round: int | None = None

    def stalls(self, round_: int) -> bool:
        return self.stall_round == round_

    def cheats(self, round_: int) -> bool:
        return self.cheat_from_round is not None and round_ >= self.cheat_from_round

    @property
    def proposes(self) -> bool:
        """Whether the worker proposes closures (a cheater never does)."""
        return self.cheat_from_round is None


NO_FAULTS = Faults()
