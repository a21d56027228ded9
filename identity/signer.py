"""The signer interface: who signs, and with what kind of key storage.

Callers (attestations, certificates, the node) sign through :class:`Signer` and never
touch key material. :class:`SoftwareSigner` keeps the key in process memory; a hardware
backend (TPM, TEE) implements the same four members with its own ``kind`` and plugs in
without any caller changing. Every signed object records the signer's ``kind`` so a
verifier can set policy on it. Until a hardware backend also carries evidence of its kind
(a TPM quote, a TEE report), the kind is the signer's own claim, covered by its signature
but not proven by it.
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
