"""Deterministic LoRA training rounds (DESIGN section 8).

A round trains a LoRA adapter on a base model (a collection blob) over tokenised records
(a blob) with a recipe and a seed, deterministically and with every op audited; its
commitment folds every input and every step into one BLAKE3 digest that the machine
attests, and a replay on another machine of the same kernel class must reach the same
digest bit for bit.

Modules: ``records`` (byte tokenizer, records blob), ``recipe``, ``model`` (tiny Llama
base models), ``determinism``, ``kernel_class``, ``audit``, ``trainer`` (the loop),
``commitment`` (commitment, round record), ``round`` (run, replay, evidence check),
``net`` (fetching inputs), ``cli`` (``blob train``). Importing this package, or any
module but ``trainer``, ``audit``'s auditor and the model builders, does not import torch.
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
