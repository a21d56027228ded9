"""Hardware co-signatures: what a TPM's attestation key (AK) signs, and how anyone checks it.

TPMs do not do Ed25519, so a machine's wire identity stays its Ed25519 key and a
TPM-resident ECDSA P-256 key vouches for it (DESIGN 7). This module is the part every
verifier needs, in plain ``cryptography`` with no TPM library:

1. An AK public key travels as its 65-byte uncompressed X9.62 point (:data:`AK_POINT_SIZE`);
   :func:`parse_ak_point` refuses anything that is not a point on P-256.
2. An AK signature travels as 64 bytes, ``r || s`` big-endian, the way a TPM returns an
   ECDSA signature (TPMS_SIGNATURE_ECDSA), so nothing is re-encoded on the machine.
3. The AK signs through the TPM's restricted-key path: the TPM hashes the message itself
   (TPM2_Hash) and signs only with the ticket that proves the message does not start with
   ``TPM_GENERATED_VALUE``, so the AK can never be made to forge a TPM-made structure (a
   quote, a certification). Its messages therefore stay short (under the TPM's 1024-byte
   hash buffer): :func:`cosign_message` is the domain prefix and the SHA-256 of the
   canonical bytes the Ed25519 key signed; :func:`binding_message` the domain prefix and
   the 32-byte Ed25519 public key the AK vouches for.
4. The domain prefixes differ from each other and from every Ed25519-signed object's, so
   an AK signature made for one purpose is never accepted for another.
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

AK_POINT_SIZE = 65
AK_SIGNATURE_SIZE = 64
COSIGN_DOMAIN = b"blobnet-ak-cosignature-v1:"
BINDING_DOMAIN = b"blobnet-tpm-binding-v1:"
TPM_SIGNER_KIND = "tpm"


def parse_ak_point(point: bytes) -> ec.EllipticCurvePublicKey:
    """The P-256 key of a 65-byte uncompressed point; ``ValueError`` when it is not one."""
    if type(point) is not bytes or len(point) != AK_POINT_SIZE or point[0] != 4:
        raise ValueError(f"an AK public key is a {AK_POINT_SIZE}-byte uncompressed P-256 point")
    return ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)


def cosign_message(signed_message: bytes) -> bytes:
    """What the AK signs for an object whose Ed25519 signature covers ``signed_message``."""
    return COSIGN_DOMAIN + hashlib.sha256(signed_message).digest()


def binding_message(ed25519_public_key: bytes) -> bytes:
    """What the AK signs to vouch for a machine's Ed25519 key."""
    return BINDING_DOMAIN + ed25519_public_key


def verify_ak_signature(point: bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` (``r || s``) is the AK ``point``'s ECDSA-SHA256 of ``message``."""
    if type(signature) is not bytes or len(signature) != AK_SIGNATURE_SIZE:
        return False
    try:
        key = parse_ak_point(point)
    except ValueError:
        return False
    half = AK_SIGNATURE_SIZE // 2
    der = encode_dss_signature(
        int.from_bytes(signature[:half], "big"), int.from_bytes(signature[half:], "big")
    )
    try:
        key.verify(der, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True
