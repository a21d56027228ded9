"""Errors of the training package; each carries the ``exit_code`` the ``blob`` CLI uses."""

from __future__ import annotations

from blobstore.exitcodes import ExitCode


class TrainingError(Exception):
    """Base class of training errors."""

    exit_code = ExitCode.REJECTED


class BadRecords(TrainingError):
    """A records blob or records input is malformed."""

    exit_code = ExitCode.BAD_DATA


class BadRecipe(TrainingError):
    """A recipe file is malformed or not canonical."""

    exit_code = ExitCode.BAD_DATA


class BadModel(TrainingError):
    """A base-model or adapter collection is malformed."""

    exit_code = ExitCode.BAD_DATA


class BadRoundRecord(TrainingError):
    """A round record or commitment blob is malformed."""

    exit_code = ExitCode.BAD_DATA


class DeviceUnavailable(TrainingError):
    """The requested device (CUDA by default) is absent; the round is refused."""

    exit_code = ExitCode.USAGE


class AuditViolation(TrainingError):
    """An op outside the audited kernel set, or a tensor on another device: round refused."""

    exit_code = ExitCode.REJECTED


class NoKernelSet(TrainingError):
    """No audited kernel set exists for this kernel class family."""

    exit_code = ExitCode.NOT_FOUND


class ReplayMismatch(TrainingError):
    """A replay reached another digest than the round record's."""

    exit_code = ExitCode.REJECTED


class EvidenceRejected(TrainingError):
    """The evidence check said no."""

    exit_code = ExitCode.REJECTED


class MissingInput(TrainingError):
    """A round input is neither in the store nor fetchable from the given peers."""

    exit_code = ExitCode.NOT_FOUND


class CertificateMismatch(TrainingError):
    """The admission certificate given does not admit this machine's key or kernel class:
    found before any training, since an attestation carrying it would only be rejected."""

    exit_code = ExitCode.USAGE


class CorruptInput(TrainingError):
    """A round input blob in the local store does not match its ID (the local disk's
    fault, not the round's): remove it and fetch it again."""

    exit_code = ExitCode.BAD_DATA


class UnsafeSetting(TrainingError):
    """A setting known to change CPU math is in a state no kernel class can pin."""

    exit_code = ExitCode.USAGE
