"""Faults a test injects into a worker, kept out of the run's configuration.

``blob outer worker``'s hidden ``--stall-round``, ``--test-cheat-from-round`` and
``--test-pass-round`` build a :class:`Faults`; a production worker runs with none
(:data:`NO_FAULTS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Faults:
    # Sleep before training in this round (so a test can kill the worker in a known place
    # mid-round).
    stall_round: int | None = None
    # From this round on, train on other batch rows than the commitment names (an update
    # that does not match its commitment; replay must catch it), and never propose.
    cheat_from_round: int | None = None
    # In this round the worker's trainer has nothing to send (returns None, as a user's
    # loop that skips a round does): the worker passes.
    pass_round: int | None = None

    def trainer(self, trainer: Any) -> Any:
        """``trainer``, or one that skips ``pass_round`` and is ``trainer`` otherwise."""
        return trainer if self.pass_round is None else _Skipping(trainer, self.pass_round)

    def stalls(self, round_: int) -> bool:
        return self.stall_round == round_

    def cheats(self, round_: int) -> bool:
        return self.cheat_from_round is not None and round_ >= self.cheat_from_round

    @property
    def proposes(self) -> bool:
        """Whether the worker proposes closures (a cheater never does)."""
        return self.cheat_from_round is None


NO_FAULTS = Faults()


class _Skipping:
    """A trainer whose ``train`` returns None in one round (``Faults.pass_round``)."""

    def __init__(self, trainer: Any, round_: int) -> None:
        self._trainer = trainer
        self._round = round_

    def train(self, state: Any, root: str, author: str, *, cheat: bool = False) -> Any:
        if state.round == self._round:
            return None
        return self._trainer.train(state, root, author, cheat=cheat)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)
