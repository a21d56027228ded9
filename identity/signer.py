"""The signer interface: who signs, and with what kind of key storage.

Callers (attestations, certificates, the node) sign through :class:`Signer` and never
touch key material. :class:`SoftwareSigner` keeps the key in process memory. Every signed
object records the signer's ``kind`` so a verifier can set policy on it.

A :class:`HardwareSigner` is a :class:`Signer` whose Ed25519 key a hardware-resident key
vouches for (``identity.tpm.TpmSigner``: a TPM attestation key, AK). It adds the AK's
public point and :meth:`HardwareSigner.cosign`, and attestations it signs carry the AK's
co-signature, which is what makes its ``kind`` evidence rather than a claim
(``identity.attestation``, rules 1-3).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .keys import MachineKey

SOFTWARE = "software"


@runtime_checkable
class Signer(Protocol):
    """Signs messages with an Ed25519 key whose peer ID is ``peer_id``."""

    @property
    def kind(self) -> str:
        """Where the key lives: ``"software"``, later e.g. ``"tpm"``, ``"tee"``."""
        ...

    @property
    def peer_id(self) -> str:
        """The libp2p peer ID of the signing key."""
        ...

    @property
    def public_key_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        ...

    def sign(self, message: bytes) -> bytes:
        """A 64-byte Ed25519 signature of ``message``."""
        ...


@runtime_checkable
class HardwareSigner(Signer, Protocol):
    """A signer whose Ed25519 key is vouched for by a hardware attestation key (AK)."""

    @property
    def ak(self) -> bytes:
        """The AK's 65-byte uncompressed P-256 point."""
        ...

    def cosign(self, message: bytes) -> bytes:
        """The AK's 64-byte ``r || s`` ECDSA-SHA256 signature of ``message``."""
        ...


class SoftwareSigner:
    """A signer whose key is a :class:`MachineKey` in this process's memory."""

    def __init__(self, key: MachineKey) -> None:
        self._key = key

    @property
    def kind(self) -> str:
        return SOFTWARE

    @property
    def peer_id(self) -> str:
        return self._key.peer_id

    @property
    def public_key_bytes(self) -> bytes:
        return self._key.public_key_bytes

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def __repr__(self) -> str:
        return f"SoftwareSigner(peer_id={self.peer_id!r})"
