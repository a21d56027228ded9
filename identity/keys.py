"""Ed25519 machine keys: one key is both the machine's libp2p identity and its signer.

Signing uses ``cryptography`` (OpenSSL); the same 32-byte seed is handed to py-libp2p as
its ``Ed25519PrivateKey`` (PyNaCl), so the host's peer ID and the attestation signer are
one identity. py-libp2p is imported only when a key pair is asked for, because importing
it costs about a second and most ``blob`` commands never need it.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from .errors import BadPublicKey
from .peerid import ED25519_PUBLIC_KEY_SIZE, peer_id_from_public_key

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair

ED25519_SEED_SIZE = 32
ED25519_SIGNATURE_SIZE = 64


class MachineKey:
    """An Ed25519 private key with its libp2p peer ID. The seed never appears in ``repr``."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != ED25519_SEED_SIZE:
            raise ValueError(f"an Ed25519 seed has 32 bytes, not {len(seed)}")
        self._seed = bytes(seed)
        self._private = ed25519.Ed25519PrivateKey.from_private_bytes(self._seed)

    @classmethod
    def generate(cls) -> MachineKey:
        """A fresh key from the operating system's random source."""
        return cls(ed25519.Ed25519PrivateKey.generate().private_bytes_raw())

    @property
    def seed(self) -> bytes:
        """The 32-byte private seed (what the key file protects)."""
        return self._seed

    @cached_property
    def public_key_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        return self._private.public_key().public_bytes_raw()

    @cached_property
    def peer_id(self) -> str:
        """The libp2p peer ID, ``12D3KooW...``."""
        return peer_id_from_public_key(self.public_key_bytes)

    def sign(self, message: bytes) -> bytes:
        """A 64-byte Ed25519 signature of ``message``."""
        return self._private.sign(message)

    def libp2p_keypair(self) -> KeyPair:
        """The same key as a py-libp2p ``KeyPair``, for ``new_host(key_pair=...)``."""
        # libp2p: about a second to import, and most commands never need it (module doc).
        from libp2p.crypto.ed25519 import Ed25519PrivateKey
        from libp2p.crypto.keys import KeyPair

        private = Ed25519PrivateKey.from_bytes(self._seed)
        return KeyPair(private, private.get_public_key())

    def __repr__(self) -> str:
        return f"MachineKey(peer_id={self.peer_id!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MachineKey):
            return NotImplemented
        return self._seed == other._seed

    def __hash__(self) -> int:
        return hash(self.public_key_bytes)


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``."""
    if len(public_key) != ED25519_PUBLIC_KEY_SIZE or len(signature) != ED25519_SIGNATURE_SIZE:
        return False
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def format_public_key(public_key: bytes) -> str:
    """The text form of a raw Ed25519 public key: 64 lowercase hex digits."""
    if len(public_key) != ED25519_PUBLIC_KEY_SIZE:
        raise ValueError(f"an Ed25519 public key has 32 bytes, not {len(public_key)}")
    return public_key.hex()


def parse_public_key(text: str) -> bytes:
    """Parse :func:`format_public_key` text (surrounding whitespace allowed)."""
    value = text.strip()
    if len(value) != 2 * ED25519_PUBLIC_KEY_SIZE:
        raise BadPublicKey(f"a public key is 64 hex digits, not {value!r:.80}")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise BadPublicKey(f"a public key is 64 hex digits, not {value!r:.80}") from None
