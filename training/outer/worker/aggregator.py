"""A worker's aggregates: the next state from a closure's updates, and one computed ahead
of the closure (point 2b of :mod:`training.outer.worker`).

1. The aggregate of the named updates on the current state is a pure function of the
   state and the named blobs (``training.outer.aggregate``), computed in a thread.
2. Ahead of the closure: once the worker's own update is out, every update a closure
   could name is fetched and another worker ranks first to propose, the worker aggregates
   those updates while the proposer does the same, so a closure naming exactly them is
   applied without aggregating again. One such aggregate a round, and a second state is
   never made while it runs (each is a whole state in memory).
3. An aggregate made ahead for a state the worker has moved on from is for nobody: it is
   dropped when done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from training.outer.aggregate import Aggregate, aggregate, rooted
from training.outer.loop import OuterConfig, OuterState
from training.outer.worker.signals import Tasks


@dataclass
class Ahead:
    """An aggregate started before its closure came (rule 2): of ``entries`` (peer, blob;
    ascending peer order) on the state of ``(round, root)``, and that state's root, once
    ``done`` is set (None: it failed, or is for nobody)."""

    round: int
    root: str
    entries: tuple[tuple[str, str], ...]
    done: trio.Event
    result: tuple[Aggregate, str] | None = None


class Aggregator:
    """Aggregates of one worker (see the module's rules); ``load`` reads a held blob."""

    def __init__(self, config: OuterConfig, load: Callable[[str], bytes], tasks: Tasks) -> None:
        self.config = config
        self.load = load
        self.tasks = tasks
        self.ahead: Ahead | None = None  # this round's, started early
        self._at = (-1, "")  # the (round, root) the worker holds

    def entered(self, round_: int, root: str) -> None:
        """The worker now holds the state of ``(round_, root)``."""
        self._at = (round_, root)

    async def aggregate(
        self, state: OuterState, root: str, entries: Sequence[tuple[str, str]]
    ) -> tuple[Aggregate, str, bool]:
        """The aggregate of ``entries`` on ``state`` (of root ``root``), its root, and
        whether it was computed ahead (used if it is of exactly these; else computed now,
        after any still running, so one extra state at a time)."""
        ahead = self.ahead
        if ahead is not None:
            await ahead.done.wait()
            result, ahead.result = ahead.result, None  # taken once; the round's mark stays
            named = tuple(sorted(entries, key=lambda e: e[0].encode()))
            if result is not None and (ahead.round, ahead.root, ahead.entries) == (
                state.round,
                root,
                named,
            ):
                return (*result, True)
            del result
        agg, result_root = await self._compute(state, root, entries)
        return agg, result_root, False

    async def _compute(
        self, state: OuterState, root: str, entries: Sequence[tuple[str, str]]
    ) -> tuple[Aggregate, str]:
        config = self.config
        return await trio.to_thread.run_sync(
            lambda: rooted(aggregate(state, entries, self.load, config, start_root=root))
        )

    def may_start_ahead(self, round_: int, root: str) -> bool:
        """Whether an aggregate ahead may start for ``(round_, root)``: none started for it
        yet, none still running, and the run's tasks start."""
        last = self.ahead
        if last is not None and (
            (last.round, last.root) == (round_, root) or not last.done.is_set()
        ):
            return False
        return self.tasks.running

    def start_ahead(
        self, state: OuterState, root: str, entries: tuple[tuple[str, str], ...]
    ) -> None:
        """Start the aggregate of ``entries`` (ascending peer order) on ``state`` ahead of
        its closure (rule 2); the caller asked :meth:`may_start_ahead`."""
        self.ahead = ahead = Ahead(state.round, root, entries, trio.Event())
        self.tasks.start(self._ahead, ahead, state)

    async def _ahead(self, ahead: Ahead, state: OuterState) -> None:
        try:
            ahead.result = await self._compute(state, ahead.root, ahead.entries)
        except OSError:  # a blob gone: the apply, should it come, fetches and says so
            ahead.result = None
        finally:
            if self._at != (ahead.round, ahead.root):
                ahead.result = None  # rule 3: the state moved on meanwhile
            ahead.done.set()
