"""The scored level (point 4 of :mod:`training.outer.api`): what one update does alone to the
model as the run holds it, on batches drawn from the round's root.

1. **What is scored.** The round's start state S_r in a copy of the user's model (its
   parameters, buffers and the run's fixed tensors: the model as every worker holds it),
   against the state one update alone would make (S_r stepped by that update at the run's
   outer learning rate, its buffers the update's own). ``eval_fn(model, batch) -> loss``
   runs under ``torch.no_grad()`` on that copy, which is in eval mode unless ``eval_fn``
   sets another (then dropout draws from torch's generator: scoring holds the lock every
   seeded draw of the library holds, ``training.outer.trainer.TORCH_RNG_LOCK``).
2. **On what.** :data:`SCORE_BATCHES` batches, the same for every update of the round and
   for S_r: drawn from the round's root, so every proposer scores alike and nobody knows
   them before the round closes. The evaluation data is any of: an array or tensor of any
   shape and dtype (a batch is ``batch_rows`` of its rows along the first dimension), a
   tuple, list or dict of such (rows taken alike from each), int64 rows of a records blob
   (its ID), or a function ``fn(seed) -> batch``, called with a seed per batch.
3. **The rule.** For each batch i, d_i = loss after - loss before (paired: the same batch).
   An update is left out only when the mean of the d_i exceeds :data:`SCORE_SIGMAS`
   standard errors of that mean (and is above zero): an honest update whose effect is
   within the noise of the batches stays in; one that makes the loss worse, clearly, goes
   out, with the figures in its reason. A loss that is not finite after the update is
   worse by definition.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np

from training.outer.api.model import UserModel

if TYPE_CHECKING:
    import torch

    from training.outer.loop import OuterState
    from training.outer.params import RunParams

# Point 2: batches an update is scored on. Sixteen paired differences give a standard error
# to within about a fifth of itself, so the rule's two standard errors are a real bar; they
# cost a proposer 16 forward passes for S_r and 16 per update.
SCORE_BATCHES = 16
# Point 3: how many standard errors of the mean paired difference an update must raise
# the loss by to be left out: two is a one-sided chance of about 2% that an update with no
# effect at all is left out by the batches' noise alone.
SCORE_SIGMAS = 2.0


class EvalBatches:
    """Point 2: the round's evaluation batches from data of any of the accepted forms."""

    def __init__(self, data: Any, batch_rows: int, device: Any) -> None:
        self.data = data
        self.batch_rows = batch_rows
        self.device = device
        self.rows = None if callable(data) else _row_count(data)

    def draw(self, root: str) -> list[Any]:
        """:data:`SCORE_BATCHES` batches for the round whose start root is ``root``."""
        seed = int.from_bytes(blake3.blake3(bytes.fromhex(root)).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        if self.rows is None:
            seeds = rng.integers(0, 1 << 62, size=SCORE_BATCHES)
            return [self.data(int(s)) for s in seeds]
        picks = rng.integers(0, self.rows, size=(SCORE_BATCHES, self.batch_rows))
        return [_take(self.data, pick, self.device) for pick in picks]


def _row_count(data: Any) -> int:
    parts = list(data.values()) if isinstance(data, Mapping) else data
    if isinstance(parts, (tuple, list)):
        counts = {_row_count(p) for p in parts}
        if len(counts) != 1:
            raise ValueError("evaluation data: its parts have different numbers of rows")
        return counts.pop()
    shape = getattr(parts, "shape", None)
    if shape is None or len(shape) < 1 or shape[0] < 1:
        raise ValueError(
            "evaluation data must be an array or tensor with rows along its first dimension, "
            "a tuple, list or dict of such, a records blob ID, or a function of a seed"
        )
    return int(shape[0])


def _take(data: Any, pick: np.ndarray[Any, Any], device: Any) -> Any:
    import torch

    if isinstance(data, Mapping):
        return {k: _take(v, pick, device) for k, v in data.items()}
    if isinstance(data, (tuple, list)):
        return type(data)(_take(v, pick, device) for v in data)
    if isinstance(data, torch.Tensor):
        return data[torch.from_numpy(pick)].to(device)
    return torch.from_numpy(np.ascontiguousarray(np.asarray(data)[pick])).to(device)


class Scorer:
    """Points 1-3: ``scorer(state, root, peer, update)`` is '' if the update stays in the
    round's closure, else the reason it is left out."""

    def __init__(
        self,
        model: torch.nn.Module,
        eval_fn: Callable[[Any, Any], Any],
        batches: EvalBatches,
        params: RunParams,
    ) -> None:
        """``model``: the user's; a copy of it (in eval mode) is what is scored."""
        twin = copy.deepcopy(model)
        twin.eval()
        self.model = UserModel(twin)
        self.eval_fn = eval_fn
        self.batches = batches
        self.params = params
        self._before: tuple[str, list[Any], list[float]] | None = None

    def losses(self, state: OuterState, batches: Sequence[Any]) -> list[float]:
        import torch

        from training.outer.trainer import TORCH_RNG_LOCK

        out = []
        with TORCH_RNG_LOCK, torch.no_grad():
            self.model.load(state)
            for batch in batches:
                out.append(float(self.eval_fn(self.model.module, batch)))
        return out

    def __call__(self, state: OuterState, root: str, peer: str, update: bytes) -> str:
        from training.outer.aggregate import unwrap_update
        from training.outer.codec import CodecError
        from training.outer.loop import apply_round, decode_update

        try:
            envelope = unwrap_update(update)
            grad = decode_update(envelope.payload, state)
            shapes = {n: tuple(v.shape) for n, v in state.buffers.items()}
            buffers = envelope.decoded_buffers(shapes)
        except CodecError as exc:
            return f"unscorable: {exc}"
        if self._before is None or self._before[0] != root:
            batches = self.batches.draw(root)
            self._before = (root, batches, self.losses(state, batches))
        _, batches, before = self._before
        alone = apply_round(state, {peer: grad}, self.params.outer_config(), {peer: buffers})
        after = self.losses(alone, batches)
        return verdict(before, after)


def verdict(before: Sequence[float], after: Sequence[float]) -> str:
    """Point 3 on paired losses: '' (kept) or why the update is left out."""
    was, now = float(np.mean(before)), float(np.mean(after))
    if not all(math.isfinite(x) for x in after):
        return f"scored worse: eval loss {was:.4f} -> not finite"
    diffs = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    mean = float(np.mean(diffs))
    error = float(np.std(diffs, ddof=1) / math.sqrt(len(diffs))) if len(diffs) > 1 else 0.0
    if mean > 0 and mean > SCORE_SIGMAS * error:
        sigmas = "all batches alike" if error == 0 else f"{mean / error:.1f} standard errors"
        return (
            f"scored worse: eval loss {was:.4f} -> {now:.4f} over {len(diffs)} batches of "
            f"the round ({sigmas})"
        )
    return ""


def eval_data_of(node_store: Any, eval_data: Any) -> Any:
    """Point 2: the evaluation data, a records blob's rows where it is a blob ID or tag."""
    if not isinstance(eval_data, str):
        return eval_data
    from training.records import decode_records

    blob = node_store.tags().get(eval_data, eval_data)
    return decode_records(node_store.path(blob).read_bytes()).tokens
