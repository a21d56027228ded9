"""libp2p peer IDs for Ed25519 keys, derived exactly as libp2p does.

A peer ID is the multihash of the protobuf-encoded public key (libp2p
``peer-ids/peer-ids.md``). Encoded Ed25519 keys are 36 bytes, at most 42, so the
multihash is the *identity* multihash (code 0x00): the key itself is inside the ID,
and anyone can recover it to check a signature. The text form is base58btc, which for
Ed25519 always starts ``12D3KooW``.
"""

from __future__ import annotations

from .errors import BadPeerId

ED25519_PUBLIC_KEY_SIZE = 32

# protobuf ``PublicKey { KeyType Type = 1; bytes Data = 2; }``: field 1 varint Ed25519 (1),
# field 2 length-delimited, 32 bytes.
_PROTOBUF_ED25519_PREFIX = bytes([0x08, 0x01, 0x12, ED25519_PUBLIC_KEY_SIZE])
# identity multihash: code 0x00, digest length 36 (the protobuf above).
_MULTIHASH_PREFIX = bytes([0x00, len(_PROTOBUF_ED25519_PREFIX) + ED25519_PUBLIC_KEY_SIZE])
_PEER_ID_PREFIX = _MULTIHASH_PREFIX + _PROTOBUF_ED25519_PREFIX
PEER_ID_BYTES = len(_PEER_ID_PREFIX) + ED25519_PUBLIC_KEY_SIZE

# An Ed25519 peer ID is 52 base58 characters. The bound stops a hostile string from
# costing quadratic big-integer work before it is rejected.
MAX_PEER_ID_LENGTH = 64

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}


def _b58encode(data: bytes) -> str:
    zeros = len(data) - len(data.lstrip(b"\x00"))
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58_ALPHABET[r])
    return "1" * zeros + "".join(reversed(out))


def _b58decode(text: str) -> bytes:
    zeros = len(text) - len(text.lstrip("1"))
    n = 0
    for c in text:
        digit = _B58_INDEX.get(c)
        if digit is None:
            raise ValueError(f"{c!r} is not a base58 character")
        n = n * 58 + digit
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\x00" * zeros + body


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer ID (``12D3KooW...``) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != ED25519_PUBLIC_KEY_SIZE:
        raise ValueError(f"an Ed25519 public key has 32 bytes, not {len(public_key)}")
    return _b58encode(_PEER_ID_PREFIX + public_key)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The raw Ed25519 public key inside an identity-multihash peer ID.

    Raises :class:`BadPeerId` for anything else, including peer IDs of other key types
    (RSA ``Qm...``) and non-canonical spellings of a valid ID.
    """
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= MAX_PEER_ID_LENGTH:
        raise BadPeerId(f"not a peer ID: {peer_id!r:.80}; expected 12D3KooW... (52 characters)")
    try:
        raw = _b58decode(peer_id)
    except ValueError as exc:
        raise BadPeerId(f"not a peer ID: {peer_id!r}: {exc}") from None
    if len(raw) != PEER_ID_BYTES or not raw.startswith(_PEER_ID_PREFIX):
        raise BadPeerId(
            f"not an Ed25519 peer ID: {peer_id!r}; blobnet identities look like 12D3KooW..."
        )
    public_key = raw[len(_PEER_ID_PREFIX) :]
    if _b58encode(raw) != peer_id:  # pragma: no cover - base58 of fixed length is canonical
        raise BadPeerId(f"non-canonical peer ID: {peer_id!r}")
    return public_key


def parse_peer_id(peer_id: str) -> str:
    """Validate an Ed25519 peer ID and return it unchanged (raises :class:`BadPeerId`)."""
    public_key_from_peer_id(peer_id)
    return peer_id
