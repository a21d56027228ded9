"""Statement kinds reserved for the code that computed them, and signer kinds.

Reserved statement kinds (DESIGN 7-8): an attestation whose kind asserts a *computed*
result (a round's result, a replay's agreement, an outer-loop update or state) is made
only by the command that computed it; ``blob attest sign``, the generic signer, refuses
them. The rule: a kind is reserved when it is one of :data:`RESERVED_KINDS` or starts
with :data:`RESERVED_PREFIX` (``"blobnet/"``). New computed kinds take that prefix, so
they are reserved from the start without touching this module.

What the reservation does and does not do: it keeps the stock tool from vouching for
a result nobody computed, so an honest operator cannot be talked into it by a one-line
command. It is *not* a cryptographic barrier. With a software key (the key sits in a
file the operator can read) anyone holding it can sign any kind with a few lines of
Python; a verifier cannot tell a replay that ran from a signature that claims one.
With software keys, two matching attestations from distinct admitted operators prove
only that two admitted operators *signed* that digest: that a dishonest operator who
replays nothing can be found out afterwards (anyone can replay the round from its
blobs and contradict them), not that the replay happened.

A TPM-bound machine (:mod:`identity.tpm`) adds a co-signature by an attestation key that
never leaves its TPM, and the authority admits each TPM once: its attestations prove that
one admitted TPM's owner signed them, so a dishonest operator's signatures are as scarce
as its TPMs. They still do not prove which code ran: that needs a quote over measured boot
(PCRs) or a TEE report travelling with the attestation.

Signer kinds: ``"software"`` (:data:`identity.signer.SOFTWARE`) or one of
:data:`HARDWARE_SIGNER_KINDS`. A hardware kind counts only with evidence a verifier checks
(today the TPM co-signature, ``identity.attestation`` rules 1-3); a verifier that requires
hardware accepts only those.
"""

from __future__ import annotations

RESERVED_PREFIX = "blobnet/"
# Kinds that predate the prefix; the training round's result kind is one.
RESERVED_KINDS = frozenset({"round-result", "replay", "round-replay"})
# Where the key is kept in hardware: a TPM, a trusted execution environment, a
# hardware security module or a security key.
HARDWARE_SIGNER_KINDS = frozenset({"tpm", "tee", "hsm", "security-key"})


def is_reserved_kind(kind: str) -> bool:
    """Whether only the code that computed it may sign a statement of ``kind``."""
    return kind in RESERVED_KINDS or kind.startswith(RESERVED_PREFIX)


def is_hardware_signer(signer_kind: str) -> bool:
    """Whether ``signer_kind`` names a hardware-backed key store."""
    return signer_kind in HARDWARE_SIGNER_KINDS
