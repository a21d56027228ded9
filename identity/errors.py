"""Errors of the identity package.

Every class carries an ``exit_code`` (CONTRACTS): the ``blob`` program turns it into the
exit status and prints the message as one line. Messages say what happened and what to do.

Verification failures share one class, :class:`Rejected`, whose ``reason`` is a
:class:`Reason`, so policy code can switch on the reason while callers that only care
whether something is acceptable catch one type. A malformed certificate or attestation is
also a rejection (``Reason.MALFORMED``) but exits with "bad data" (4) when it is an input
to some other command.
"""

from __future__ import annotations

import enum

from blobstore.exitcodes import ExitCode


class IdentityError(Exception):
    """Base class of every error raised by the identity package."""

    exit_code: int = ExitCode.BAD_DATA


class NotFound(IdentityError):
    """An input file (key, public key, certificate, attestation) does not exist."""

    exit_code = ExitCode.NOT_FOUND


class KeyNotFound(NotFound):
    """No key file at the given path."""


class KeyExists(IdentityError):
    """A key file (or its public-key file) already exists; keys are never overwritten."""

    exit_code = ExitCode.USAGE


class KeyPermissionsTooOpen(IdentityError):
    """The key file can be read or written by group or others."""

    exit_code = ExitCode.LOCAL_IO


class KeyFileIOError(IdentityError):
    """The operating system refused a key-file operation (permissions, space, ...)."""

    exit_code = ExitCode.LOCAL_IO


class BadKeyFile(IdentityError):
    """The key file is not a valid blobnet key file."""

    exit_code = ExitCode.BAD_DATA


class WrongPassphrase(IdentityError):
    """The passphrase does not decrypt the key file (which is left untouched)."""

    exit_code = ExitCode.BAD_DATA


class PassphraseRequired(IdentityError):
    """The key file is encrypted and no passphrase was given."""

    exit_code = ExitCode.USAGE


class BadPeerId(IdentityError):
    """A string is not an Ed25519 libp2p peer ID (``12D3KooW...``)."""

    exit_code = ExitCode.USAGE


class ReservedKind(IdentityError):
    """``blob attest sign`` was asked for a kind only the code that computed it signs."""

    exit_code = ExitCode.USAGE


class BadPublicKey(IdentityError):
    """A public key (hex text or ``.pub`` file) is malformed."""

    exit_code = ExitCode.BAD_DATA


class BadRevocationList(IdentityError):
    """A revocation-list file has a line that is neither a serial nor a peer ID."""

    exit_code = ExitCode.BAD_DATA


class Reason(enum.Enum):
    """Why a certificate or an attestation was rejected."""

    MALFORMED = "malformed"
    BAD_SIGNATURE = "bad signature"
    UNKNOWN_AUTHORITY = "unknown authority"
    REVOKED = "revoked"
    NOT_YET_VALID = "not yet valid"
    EXPIRED = "expired"
    WRONG_PEER = "wrong peer"
    WRONG_KERNEL_CLASS = "wrong kernel class"
    WRONG_KIND = "wrong statement kind"
    SIGNER_KIND_NOT_ALLOWED = "signer kind not allowed"
    MISSING_CERTIFICATE = "missing certificate"
    BAD_HARDWARE_SIGNATURE = "bad hardware signature"
    HARDWARE_UNPROVEN = "hardware unproven"


class Rejected(IdentityError):
    """A certificate or attestation failed verification; ``reason`` says why."""

    exit_code = ExitCode.REJECTED

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class CertificateRejected(Rejected):
    """An admission certificate failed verification."""


class AttestationRejected(Rejected):
    """An attestation failed verification (its own signature or its certificate)."""


class BadCertificate(CertificateRejected):
    """Bytes that do not decode as a canonical admission certificate."""

    exit_code = ExitCode.BAD_DATA

    def __init__(self, message: str) -> None:
        super().__init__(Reason.MALFORMED, message)


class BadAttestation(AttestationRejected):
    """Bytes that do not decode as a canonical attestation."""

    exit_code = ExitCode.BAD_DATA

    def __init__(self, message: str) -> None:
        super().__init__(Reason.MALFORMED, message)


class BadTpmData(IdentityError):
    """TPM evidence, a challenge, an answer or an admission registry that does not decode."""

    exit_code = ExitCode.BAD_DATA


class TpmUnavailable(IdentityError):
    """No TPM can be used here: tpm2-pytss or the TCTI is missing, or the TPM is unreachable."""

    exit_code = ExitCode.LOCAL_IO


class TpmRefused(IdentityError):
    """The machine's TPM refused an operation (e.g. a credential made for another TPM)."""

    exit_code = ExitCode.REJECTED


class AdmissionReason(enum.Enum):
    """Why an authority refused to admit a machine on its TPM."""

    UNTRUSTED_EK = "untrusted endorsement key"
    EK_MISMATCH = "EK does not match its certificate"
    BAD_AK = "attestation key not acceptable"
    BAD_BINDING = "bad binding"
    UNKNOWN_CHALLENGE = "unknown or used challenge"
    EXPIRED_CHALLENGE = "expired challenge"
    ACTIVATION_FAILED = "credential activation failed"
    BAD_ANSWER = "bad answer"
    EK_ALREADY_ADMITTED = "EK already admitted"
    TOO_MANY_CHALLENGES = "too many open challenges"


class AdmissionRefused(IdentityError):
    """An authority refused a TPM admission; ``reason`` says why (the machine's fault)."""

    exit_code = ExitCode.REJECTED

    def __init__(self, reason: AdmissionReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
