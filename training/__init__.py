"""Training on blobnet: deterministic LoRA rounds and the decentralised outer loop (DESIGN
sections 8 and 9).

Layout, in import order (a room imports only what is below it; ``make lint`` checks it):

- ``rounds/`` and ``outer/``, the two jobs, side by side (neither imports the other):

  - ``rounds/``: a round trains a LoRA adapter on a base model (a collection blob) over
    tokenised records with a recipe and a seed, deterministically and with every op
    audited; its commitment folds every input and step into one BLAKE3 digest that the
    machine attests, and a replay on another machine of the same kernel class must reach
    the same digest bit for bit. ``blob train``.
  - ``outer/``: the DiLoCo / SparseLoCo outer loop: K admitted workers agree on a global
    state round after round over SparseLoCo-compressed updates, with milestones and
    sampled replay as evidence. ``blob outer``.

- what both use: ``determinism`` and ``kernel_class`` (the settings that fix CPU and CUDA
  math, and the class they name), ``model`` (loading any Hugging Face causal-LM
  directory; the built-in tiny Llamas), ``hf_model`` (GPT-2- and Llama-style directories
  built locally, with a trained tokenizer), ``records`` (byte tokenizer, tokenizer.json
  records, the records blob) and ``errors``.

Importing this package, or any module but the trainers, the auditor and the model
builders, does not import torch.
"""

from __future__ import annotations

from training.errors import (
    AuditViolation,
    BadModel,
    BadRecipe,
    BadRecords,
    BadRoundRecord,
    CertificateMismatch,
    CorruptInput,
    DeviceUnavailable,
    EvidenceRejected,
    MissingInput,
    NoKernelSet,
    ReplayMismatch,
    TrainingError,
    UnsafeSetting,
)

__all__ = [
    "AuditViolation",
    "BadModel",
    "BadRecipe",
    "BadRecords",
    "BadRoundRecord",
    "CertificateMismatch",
    "CorruptInput",
    "DeviceUnavailable",
    "EvidenceRejected",
    "MissingInput",
    "NoKernelSet",
    "ReplayMismatch",
    "TrainingError",
    "UnsafeSetting",
]
