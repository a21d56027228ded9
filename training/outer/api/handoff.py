"""Point 1 of :mod:`training.outer.api`: the hand-off between the worker (in the node's
trio loop) and the user's loop (in the user's thread), and the errors the user sees."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from blobstore.exitcodes import ExitCode
from training.errors import TrainingError

if TYPE_CHECKING:
    from training.outer.loop import OuterState
    from training.outer.trainer import Trained

# The longest the worker waits for the user's H inner steps, and the user's step() for
# the round to close: a day covers a 70B model's round on slow links; past it the
# other side is taken for dead.
HANDOFF_WAIT = 24 * 3600.0
# Rows an update is scored on (point 4): enough that one row's noise does not decide, few


class OuterLoopError(TrainingError):
    """The outer loop cannot go on (the worker failed, the run ended, a bound passed)."""

    exit_code = ExitCode.REJECTED


def describe(exc: BaseException) -> str:
    """One line for the user's thread: the one exception inside nested trio groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


class Closed(Exception):
    pass


class Handoff:
    """Point 1: the state the worker posts and the update the user posts, under one lock."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.state: tuple[OuterState, str] | None = None
        self.taken = True  # the posted state was taken by the user
        self.trained: tuple[Trained | None, str] | None = None
        self.finished = False
        self.error: str | None = None
        self.closed = False
        self.wanted: str | None = None  # the root the worker waits for an update from

    def post_state(self, state: OuterState, root: str) -> None:
        """Offer ``state`` to the user's loop, once: a state of the root posted last (ahead
        of its adoption, then for its round) is not taken twice."""
        with self.cond:
            if self.state is not None and self.state[1] == root:
                return
            self.state, self.taken = (state, root), False
            self.cond.notify_all()

    def wait_state(self, timeout: float) -> tuple[OuterState, str] | None:
        """The next state not yet taken (None: the run finished; :class:`Closed`: the loop
        was closed first)."""
        give_up = time.monotonic() + timeout
        with self.cond:
            while self.taken and not self.finished and self.error is None and not self.closed:
                left = give_up - time.monotonic()
                if left <= 0:
                    raise OuterLoopError(f"no outer state within {timeout:.0f}s")
                self.cond.wait(left)
            if self.error is not None:
                raise OuterLoopError(f"the outer-loop worker stopped: {self.error}")
            if self.taken and not self.finished:
                raise Closed
            if self.taken:
                return None
            assert self.state is not None
            self.taken = True
            return self.state

    def poll_state(self) -> tuple[OuterState, str] | None:
        """The next state if one is posted and not taken yet, without waiting (None: not
        yet, or the run finished with nothing new)."""
        with self.cond:
            if self.error is not None:
                raise OuterLoopError(f"the outer-loop worker stopped: {self.error}")
            if self.taken:
                return None
            assert self.state is not None
            self.taken = True
            return self.state

    def post_trained(self, trained: Trained | None, root: str) -> None:
        """The user's update, made from the state of root ``root`` (None: this worker
        sends nothing this round)."""
        with self.cond:
            self.trained = (trained, root)
            self.cond.notify_all()

    def wait_trained(self, timeout: float, root: str) -> Trained | None:
        """The user's update from the state of root ``root`` (None: none this round); one
        from another state (one posted ahead that the worker did not adopt) is for nobody,
        and dropped."""
        give_up = time.monotonic() + timeout
        with self.cond:
            self.wanted = root
            self.cond.notify_all()
            try:
                while True:
                    if self.trained is not None:
                        (trained, made_from), self.trained = self.trained, None
                        if made_from == root:
                            return trained
                        continue
                    if self.closed:
                        raise Closed
                    left = give_up - time.monotonic()
                    if left <= 0:
                        raise OuterLoopError(
                            f"the user's loop sent no update within {timeout:.0f}s"
                        )
                    self.cond.wait(left)
            finally:
                self.wanted = None

    def wait_wanted(self, root: str, timeout: float) -> None:
        """Until the worker waits for an update from the state of root ``root`` (it has
        kept that state and is ready for the round), or cannot (it waits for another, it
        ended, the loop closed), or ``timeout`` passed: whichever first."""
        give_up = time.monotonic() + timeout
        with self.cond:
            while self.wanted is None and not (self.finished or self.closed):
                left = give_up - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)

    def end(self, error: str | None, final: tuple[OuterState, str] | None = None) -> None:
        """The worker left: its final state (if any) is the last one posted."""
        with self.cond:
            if final is not None:
                self.state, self.taken = final, False
            self.finished = True
            self.error = error
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
