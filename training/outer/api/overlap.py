"""Point 9 of :mod:`training.outer.api`: an overlapped round's end, off the user's thread.

With a spec's ``overlap`` the user's loop trains round r+1 from its own end of round r,
E_r, while round r is agreed; when S_{r+1} comes the model moves by S_{r+1} - E_r, keeping
its drift since. What the user's thread does of a round's end is what only it can do:
copy the model, and move it.

1. **At the H-th step** the user's thread copies the model's trainable parameters and
   floating buffers (float32: E_r) and, where the loop keeps one, the inner optimizer's
   state, starts a :class:`RoundEnd` and returns to its steps.
2. **The round's end's thread**, in order: waits until the worker asks for the round's
   update (it has kept the state the user's thread just took: stored, signed; at most
   ``KEEP_WAIT``), so the two do not run side by side, each taking the interpreter lock
   from the other at every array operation; makes the update from S_r and that copy (the
   error feedback's residual changes here only) and hands it to the worker; writes this
   worker's resume checkpoint (``training.outer.api.resume`` point 2); takes the next
   state the worker posts; and, unless it is the run's final state, turns the copy into
   the shift S_{r+1} - E_r in place (float32, elementwise: no second model-sized buffer).
3. **The user's thread adds the shift** at the first step boundary after the round's end
   ended, or waits for it where the next round's update is due first: that wait, the copy
   and the add are what an overlapped loop spends outside its steps (``RoundTiming``).
4. **One at a time.** A round's end starts only after the previous one's result was
   taken, so the residual, the checkpoint and the hand-off's update slot each have one
   writer at a time, and at most one round is ever agreed behind the user's steps.
5. **Errors** on the thread (an update refused, the store failing, the worker stopped)
   are raised in the user's thread where it takes the result, as they were raised; a loop
   closed while the thread waits ends the thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from training.outer.api.handoff import HANDOFF_WAIT, Closed, Handoff, OuterLoopError

if TYPE_CHECKING:
    from training.outer.codec import F32
    from training.outer.loop import OuterState
    from training.outer.trainer import Trained

Snapshot = tuple[dict[str, "F32"], dict[str, "F32"]]

# The longest a round's end waits for the worker to ask for its update (point 2) before
# making it anyway: the worker keeps a state in well under this (it stores one state blob
# and signs a milestone); past it, it is busy with something else, not keeping.
KEEP_WAIT = 30.0


def into_shift(state: OuterState, snapshot: Snapshot) -> None:
    """Point 2: ``snapshot`` (E_r's parameters and buffers) becomes S_{r+1} - E_r, in
    place, with the same float32 roundings as ``UserModel.shift``."""
    params, buffers = snapshot
    for name, held in params.items():
        np.subtract(state.params[name], held, out=held, dtype=np.float32)
    for name, held in buffers.items():
        np.subtract(state.buffers[name], held, out=held, dtype=np.float32)


class RoundEnd:
    """Point 2: one overlapped round's end on a thread of its own. ``make`` makes the
    round's update (from the round's start state and ``snapshot``), ``keep`` writes the
    checkpoint; ``root`` is the round's start root the update is made from."""

    def __init__(
        self,
        handoff: Handoff,
        root: str,
        make: Callable[[], Trained],
        keep: Callable[[], object],
        snapshot: Snapshot,
    ) -> None:
        self.handoff = handoff
        self.root = root
        self.make = make
        self.keep = keep
        self.snapshot = snapshot
        self.done = threading.Event()
        self.got: tuple[OuterState, str] | None = None
        self.final = False  # the run's final state: taken whole, not shifted
        self.arrived_at = 0.0  # when the next state was taken (monotonic)
        self.error: BaseException | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="blobnet-round-end", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            # Point 2: made once the worker asks for it, not while it still keeps the state
            # just taken (hashing, storing, signing): the two, side by side in one process,
            # take the interpreter lock from each other at every array operation.
            self.handoff.wait_wanted(self.root, KEEP_WAIT)
            self.handoff.post_trained(self.make(), self.root)
            self.keep()
            got = self.handoff.wait_state(HANDOFF_WAIT)
            self.arrived_at = time.monotonic()
            if got is not None:
                with self.handoff.cond:
                    self.final = self.handoff.finished and self.handoff.taken
                if not self.final:
                    into_shift(got[0], self.snapshot)
            self.got = got
        except Closed:
            self.closed = True
        except BaseException as exc:  # point 5: raised in the user's thread
            self.error = exc
        finally:
            self.done.set()

    def result(self, timeout: float) -> tuple[OuterState, str] | None:
        """The next state (None: the run finished with nothing new), once the thread
        ended (waiting at most ``timeout``); the thread's error, raised."""
        if not self.done.wait(timeout):
            raise OuterLoopError(f"no outer state within {timeout:.0f}s")
        if self.error is not None:
            raise self.error
        if self.closed:
            raise OuterLoopError("the training loop was closed mid-round")
        return self.got

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
