"""Deterministic LoRA training rounds (DESIGN section 8).

A round trains a LoRA adapter on a base model (a collection blob) over tokenised records
(a blob) with a recipe and a seed, deterministically and with every op audited; its
commitment folds every input and every step into one BLAKE3 digest that the machine
attests, and a replay on another machine of the same kernel class must reach the same
digest bit for bit.

Modules: ``records`` (byte tokenizer, tokenizer.json records, records blob), ``recipe``,
``model`` (loading any Hugging Face causal-LM directory; the built-in tiny Llamas),
``hf_model`` (GPT-2- and Llama-style directories built locally, with a trained
tokenizer), ``determinism``, ``kernel_class`` (with every setting known to change CPU
math), ``audit``, ``trainer`` (the loop), ``commitment`` (commitment, round record),
``round`` (input verification, run, replay, evidence check), ``gpu_check`` (the one-
command check for a machine with a GPU), ``net`` (fetching inputs), ``cli``
(``blob train``). Importing this package, or any module but ``trainer``, ``audit``'s
auditor and the model builders, does not import torch.
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
