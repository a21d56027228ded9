"""Machine identities rooted in a TPM 2.0 (DESIGN 7, "Hardware root").

TPMs do not do Ed25519, so the Ed25519 key stays the machine's wire identity and a
TPM-resident attestation key (AK: ECC P-256, restricted, fixedTPM, never exportable)
vouches for it. The parts, in import order:

- :mod:`.formats`: the messages (evidence, challenge, answer), canonical and bounded.
- :mod:`.admission`: the authority's rules, without I/O (EK chain, EK and AK attributes,
  the binding, credential activation with a nonce and an expiry, one EK one live
  admission) and its registry.
- :mod:`.device`: the machine's TPM commands through tpm2-pytss (optional: the ``tpm``
  extra; without it these raise :class:`~identity.errors.TpmUnavailable`).
- :mod:`.registry`: the authority's registry file, under a lock, through the one durable
  write.
- :mod:`.signer`: :class:`TpmSigner` (Ed25519 signature plus the AK's co-signature) and
  :func:`machine_signer`, which picks it when the machine key is bound.
- :mod:`.cli`: ``blob tpm bind | challenge | answer | admit``.

What admission on a TPM proves: the admitted Ed25519 key is vouched for by an AK that
lives, unexportable, in a TPM whose endorsement key a trusted manufacturer certified, and
that TPM holds one live admission from this authority. What it does not prove: which code
ran on the machine (that needs measured boot and a quote over PCRs, or a TEE).
"""

from __future__ import annotations

from ._pytss import unavailable_reason
from .admission import (
    DEFAULT_CHALLENGE_LIFETIME_S,
    Admitted,
    BoundMachine,
    Pending,
    Registry,
    check_binding,
    make_challenge,
    parse_ek_cas,
)
from .formats import Answer, Challenge, Evidence
from .signer import MachineBinding, TpmSigner, binding_path, machine_signer, read_binding

__all__ = [
    "DEFAULT_CHALLENGE_LIFETIME_S",
    "Admitted",
    "Answer",
    "BoundMachine",
    "Challenge",
    "Evidence",
    "MachineBinding",
    "Pending",
    "Registry",
    "TpmSigner",
    "binding_path",
    "check_binding",
    "machine_signer",
    "make_challenge",
    "parse_ek_cas",
    "read_binding",
    "unavailable_reason",
]
