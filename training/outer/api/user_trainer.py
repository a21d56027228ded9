"""The worker's trainer for a loop the library does not drive (point 1 of
:mod:`training.outer.api`): it posts the round's state to the user's loop and waits for
the update the user's ``step()`` makes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from training.outer.api.handoff import HANDOFF_WAIT, Closed, Handoff, OuterLoopError
from training.outer.api.model import UserModel

if TYPE_CHECKING:
    from training.outer.api.scoring import Scorer
    from training.outer.codec import F32
    from training.outer.loop import OuterState
    from training.outer.params import RunParams
    from training.outer.trainer import Trained


class LoopTrainer:
    """The worker's trainer for a loop the library does not drive (point 1): ``train``
    runs in a worker thread of the node's loop and waits for the user's update."""

    def __init__(
        self,
        params: RunParams,
        model: UserModel,
        handoff: Handoff,
        scorer: Scorer | None,
        kernel_class: str = "",
    ) -> None:
        """``kernel_class``: what the worker's attestations name (the certificate's, set
        before the worker starts: nothing of a loop the library does not drive is
        replayed)."""
        from training.outer.codec import ErrorFeedback
        from training.outer.inner import encode_inner

        self.params = params
        self.model = model
        self.handoff = handoff
        self.kernel_class = kernel_class
        self.scorer = scorer
        self.feedback = ErrorFeedback(params.codec(), decay=params.ef_decay, schema_ref=True)
        self.no_inner = encode_inner([None] * len(self.model.layout.trainable), {})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.model.layout.trainable)

    def ready(self, state: OuterState, root: str) -> None:
        """The worker's next state, ahead of its adoption (``WorkerState._offer``): the
        user's loop may take it and start the round now."""
        self.handoff.post_state(state, root)

    def train(
        self, state: OuterState, root: str, author: str, *, cheat: bool = False
    ) -> Trained | None:
        """The user's update for the round of ``state`` (None: the user skipped it)."""
        self.handoff.post_state(state, root)
        try:
            return self.handoff.wait_trained(HANDOFF_WAIT, root)
        except Closed:
            raise OuterLoopError("the training loop was closed mid-round") from None

    def make(
        self,
        state: OuterState,
        root: str,
        author: str,
        losses: list[float],
        current: dict[str, F32] | None = None,
        current_buffers: dict[str, F32] | None = None,
    ) -> Trained:
        """The user's side of a round's end: the update from S_r to the model now
        (``current``: its parameters, where the caller gathered or copied them;
        ``current_buffers``: its floating buffers, copied with them)."""
        from training.outer.aggregate import wrap_update
        from training.outer.loop import make_update
        from training.outer.trainer import Trained

        # Read in place: the user's loop waits in step() until the update is made.
        now = self.model.views() if current is None else current
        payload = make_update(state.params, now, self.feedback)
        buffers = None
        if state.buffers:
            buffers = self.model.buffers() if current_buffers is None else current_buffers
        update = wrap_update(
            payload, round_=state.round, start_root=root, author=author, buffers=buffers
        )
        # A loop the library does not drive commits to no rows (zeros) and no inner state:
        # its updates are never sampled for replay (the run's replay rate is 0 below the
        # replayed level), and the residual is the model's size: encoding it twice,
        # hashing it and storing it would be a round's largest cost after the apply.
        rows = np.zeros((self.params.inner_steps, self.params.batch), dtype=np.int64)
        padded = (losses + [float("nan")] * self.params.inner_steps)[: self.params.inner_steps]
        return Trained(update, padded, rows, self.no_inner, self.no_inner)
