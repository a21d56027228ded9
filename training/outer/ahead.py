"""The round a worker's trainer trains ahead of its state (overlapped rounds, a run's
``overlap`` 1): where the trainer's own thread, at each inner-step boundary, and the worker,
offering each next state, meet (``training.outer.trainer`` rule 5 says what it trains).

1. After its update of round r a trainer trains round r+1 on from its own end of round r,
   E_r, in a thread of its own: an :class:`Ahead` for round r+1 runs the steps it is given.
2. The worker offers S_{r+1} as soon as it has computed it and checked its root
   (:meth:`Ahead.offer`; a later offer of the round replaces one not yet taken). At the
   first step boundary after, the steps take it (:meth:`Ahead.at_boundary` returns it once
   and records that step and the state's root) and the model moves by S_{r+1} - E_r. A
   boundary that finds no offer returns None at once: the steps never wait.
3. The worker adopts a state of round r+1 and asks for its update (:meth:`Ahead.claim`):
   the round ahead serves it only if it moved, or is to move, to that very state (one
   offered with that root). Anything else (another round, another root, a state caught up
   to rather than computed here) drops it: its steps stop at their next boundary
   (:class:`Dropped`), and the trainer trains the round anew from the state adopted, with
   no correction pending. A drop is final; offers after a claim are ignored.
4. The boundary after the last step is H: a round whose steps ended before its state came
   moves there, once claimed (the worker claims only a state it holds, so at most one round
   is ever trained ahead of the state its update is taken against).

Nothing here knows torch: the steps are a function of this object.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.outer.loop import OuterState


class Dropped(Exception):
    """Rule 3: the round ahead was dropped; its steps stop at this boundary."""


class Ahead:
    """One round trained ahead (see the module's rules). ``steps(ahead)`` runs the round's
    inner steps in the thread :meth:`start` makes, calling :meth:`at_boundary` before each
    step, and returns their losses."""

    def __init__(self, round_: int, steps: Callable[[Ahead], list[float]]) -> None:
        self.round = round_
        self._steps = steps
        self._lock = threading.Lock()
        self._offered: tuple[OuterState, str] | None = None
        self._moved: tuple[int, str] | None = None  # (step boundary, root) it moved at
        self._claimed = False
        self._dropped = False
        self._losses: list[float] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"blobnet-outer-ahead-{round_}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self._losses = self._steps(self)
        except Dropped:
            pass
        except BaseException as exc:  # handed to whoever asks for the result
            self._error = exc

    def offer(self, state: OuterState, root: str) -> None:
        """Rule 2: the worker's next state (any thread)."""
        with self._lock:
            taken = self._moved is not None or self._claimed or self._dropped
            if state.round == self.round and not taken:
                self._offered = (state, root)

    def at_boundary(self, step: int) -> OuterState | None:
        """Rules 2 and 4: the state to move to before step ``step`` (once), or None;
        :class:`Dropped` once the round is dropped."""
        with self._lock:
            if self._dropped:
                raise Dropped
            if self._moved is not None or self._offered is None:
                return None
            state, root = self._offered
            self._moved, self._offered = (step, root), None
            return state

    def claim(self, round_: int, root: str) -> bool:
        """Rule 3: the worker adopted the state of round ``round_`` and root ``root``:
        True if this round moved or is to move to it; else it is dropped."""
        with self._lock:
            self._claimed = True
            to = self._moved or self._offered
            ok = not self._dropped and round_ == self.round and to is not None and to[1] == root
            if not ok:
                self._dropped = True
            return ok

    def drop(self) -> None:
        """Rule 3: stop the steps at their next boundary (the worker is leaving)."""
        with self._lock:
            self._dropped = True

    def moved_at(self) -> int | None:
        """The boundary the steps moved at (H: after the last), or None."""
        with self._lock:
            return None if self._moved is None else self._moved[0]

    def result(self) -> list[float] | None:
        """Wait for the steps: their losses, or None if the round was dropped; an error
        they raised is raised here, unless the round was dropped (its work is moot)."""
        self._thread.join()
        with self._lock:
            dropped = self._dropped
        if dropped:
            return None
        if self._error is not None:
            raise self._error
        return self._losses
