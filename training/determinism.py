"""Deterministic mode for a round, and the device rule.

Invariants (see research/train.md for the measurements behind them):

1. CUDA is the default device. Without CUDA, a round is refused before anything is
   loaded (``DeviceUnavailable``); the CPU kernel class runs only when "cpu" is named.
2. ``enter`` runs before the model is built: deterministic algorithms on (an op without a
   deterministic implementation raises instead of varying), the thread count pinned (a
   reduction above ~16-32K elements changes bits with the thread count), seeds fixed,
   ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (needed by deterministic cuBLAS), TF32 off, cuDNN
   benchmarking off, float32 matmul precision "highest", subnormals not flushed. Settings
   no kernel class can pin (``training.kernel_class.REFUSED_ENV``) are refused here.
3. Rounds run eager (no torch.compile): the audit sees aten ops, and an audited round is
   an eager round anyway.

torch is imported inside the functions that use it: ``blob --help`` imports this module
(through ``training.rounds.cli``), and torch takes seconds to import and is absent
without the ``train`` extra.
"""

from __future__ import annotations

import os
import random

from training.errors import DeviceUnavailable
from training.kernel_class import check_environment

DEVICES = ("cuda", "cpu")
DEFAULT_DEVICE = "cuda"
DEFAULT_THREADS = 1
CUBLAS_WORKSPACE = ":4096:8"
# Above this a CPU round's reductions would depend on scheduling we do not control.
MAX_THREADS = 256


def resolve_device(device: str | None) -> str:
    """The device a round runs on; refuses when CUDA is absent and "cpu" was not named."""
    import torch  # heavy: see the module doc

    chosen = DEFAULT_DEVICE if device is None else device
    if chosen not in DEVICES:
        raise DeviceUnavailable(f"unknown device {chosen!r}; use one of {', '.join(DEVICES)}")
    if chosen == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(
            "CUDA is not available and rounds run on CUDA by default; "
            "pass --device cpu to run the CPU kernel class (tests, small jobs)"
        )
    return chosen


def enter(device: str, threads: int = DEFAULT_THREADS, seed: int = 0) -> None:
    """Put this process in deterministic mode for ``device``; idempotent."""
    if not 1 <= threads <= MAX_THREADS:
        raise DeviceUnavailable(f"thread count {threads} is outside 1..{MAX_THREADS}")
    check_environment()  # settings no kernel class can pin are refused first
    # Must be in the environment before the first cuBLAS handle is created.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    import torch  # heavy: see the module doc

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # only settable before the first inter-op work; rounds use none
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    # Subnormals computed, not flushed (FTZ/DAZ change results; the class records it).
    torch.set_flush_denormal(False)
    seed_all(seed)
    if device == "cuda" and os.environ.get("CUBLAS_WORKSPACE_CONFIG") != CUBLAS_WORKSPACE:
        raise DeviceUnavailable(
            f"CUBLAS_WORKSPACE_CONFIG must be {CUBLAS_WORKSPACE} for a deterministic CUDA round"
        )


def seed_all(seed: int) -> None:
    """Seed Python's and torch's generators (every device) with ``seed``."""
    import torch  # heavy: see the module doc

    random.seed(seed)
    torch.manual_seed(seed)
