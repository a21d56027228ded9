"""The scored level (point 4 of :mod:`training.outer.api`): the loss change one update
makes alone on rows drawn from the round's root."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np

from training.outer.api.model import load_state

if TYPE_CHECKING:
    import torch

    from training.outer.codec import F32
    from training.outer.loop import OuterState
    from training.outer.params import RunParams

# Rows an update is scored on (point 4): enough that one row's noise does not decide, few
# enough that scoring K updates costs a proposer about K small forward passes.
SCORE_ROWS = 8


@dataclass
class Scorer:
    """Point 4: the loss change one update makes alone on rows drawn from the round's root."""

    model: torch.nn.Module
    eval_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    rows: np.ndarray[Any, np.dtype[np.int64]]
    params: RunParams
    device: Any

    def batch(self, root: str) -> torch.Tensor:
        import torch

        seed = int.from_bytes(blake3.blake3(bytes.fromhex(root)).digest()[:8], "little")
        pick = np.random.default_rng(seed).integers(0, self.rows.shape[0], size=SCORE_ROWS)
        return torch.from_numpy(self.rows[pick]).to(self.device)

    def loss(self, params: dict[str, F32], batch: torch.Tensor) -> float:
        import torch

        load_state(self.model, params)
        self.model.eval()  # no dropout: a score must not draw from the user's generator
        with torch.no_grad():
            return float(self.eval_fn(self.model, batch))

    def __call__(self, state: OuterState, root: str, peer: str, update: bytes) -> str:
        """'' if the update alone does not make the loss worse, else the reason."""
        from training.outer.aggregate import unwrap_update
        from training.outer.codec import CodecError
        from training.outer.loop import apply_round, decode_update

        try:
            grad = decode_update(unwrap_update(update).payload, state)
        except CodecError as exc:
            return f"unscorable: {exc}"
        batch = self.batch(root)
        before = self.loss(state.params, batch)
        after = self.loss(
            apply_round(state, {peer: grad}, self.params.outer_config()).params, batch
        )
        if not after <= before:
            return f"scored worse: eval loss {before:.4f} -> {after:.4f} on the round's rows"
        return ""


def eval_rows(node_store: Any, eval_data: Any) -> np.ndarray[Any, np.dtype[np.int64]]:
    if isinstance(eval_data, np.ndarray):
        return eval_data.astype(np.int64)
    from training.records import decode_records

    return decode_records(node_store.path(eval_data).read_bytes()).tokens
