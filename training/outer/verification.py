"""Verification levels (``training.outer.spec`` point 3), weakest first.

1. :class:`Level` names each level once. It is a ``str`` enum: a level's value is the
   string a run spec, an update commitment, a JSON report and the CLI spell it with, so
   a level written as a member and one written as its string encode to the same bytes.
2. The members' order is their strength: ``bounded`` (norm and direction bounds only),
   ``scored`` (as well, the loss change on the round's rows), ``replayed`` (as well, a
   sampled recomputation). :meth:`Level.at_least` compares by it; ``<`` on members is
   ``str``'s, alphabetical, and says nothing of strength.

Standard library only: ``blob --help`` loads the ``blob outer`` command group, whose
choices come from here, and must not load numpy (tests/p2p/test_cli_imports.py).
"""

from __future__ import annotations

from enum import StrEnum


class Level(StrEnum):
    """A verification level; declared weakest first (rule 2)."""

    BOUNDED = "bounded"
    SCORED = "scored"
    REPLAYED = "replayed"

    def at_least(self, minimum: Level) -> bool:
        """Whether this level is ``minimum`` or stronger (rule 2)."""
        order = list(Level)
        return order.index(self) >= order.index(minimum)

    @classmethod
    def names(cls) -> str:
        """The levels' values, weakest first, for a message: "bounded, scored, replayed"."""
        return ", ".join(cls)
