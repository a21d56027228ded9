"""The three messages of a TPM admission, as canonical msgpack maps, each with one schema
(:mod:`blobstore.schema`: its keys, their types, the version).

1. :class:`Evidence` (machine to authority, from ``blob tpm bind``)::

       {"v": 1, "peer": "12D3KooW...", "ek_cert": DER, "ek_chain": [DER...],
        "ek_pub": TPM2B_PUBLIC, "ak_pub": TPM2B_PUBLIC, "binding": bin64}

   The EK certificate and any chain certificates are as the TPM holds them in its NV
   indices; the public areas are the TPM's own marshalling (tpm2-pytss), so the authority
   computes the AK's name from exactly what the TPM computed it from. ``binding`` is the
   AK's signature of :func:`identity.hardware.binding_message` of the peer's Ed25519 key.
2. :class:`Challenge` (authority to machine, from ``blob tpm challenge``)::

       {"v": 1, "nonce": bin16, "expires": int, "evidence": bin32, "authority": bin32,
        "credential": TPM2B_ID_OBJECT, "secret": TPM2B_ENCRYPTED_SECRET}

   TPM2_MakeCredential's output for the EK and the AK's name; only the TPM holding both
   can recover the credential. ``evidence`` is the SHA-256 of the evidence bytes.
3. :class:`Answer` (machine to authority, from ``blob tpm answer``)::

       {"v": 1, "nonce": bin16, "peer": "12D3KooW...", "credential": bin32, "sig": bin64}

   The activated credential, signed by the machine's Ed25519 key over
   ``ANSWER_DOMAIN + <the map without sig>``: the key being admitted shows it is held.

Every input is bounded before it is parsed (constants below, with their reasons).
"""

from __future__ import annotations

import dataclasses

from blobstore.canonical import CodecError, require_canonical
from blobstore.schema import Field, Schema

from .. import _codec
from ..errors import BadPeerId, BadTpmData
from ..keys import ED25519_SIGNATURE_SIZE, MachineKey, verify_signature
from ..peerid import parse_peer_id, public_key_from_peer_id

FORMAT_VERSION = 1
NONCE_SIZE = 16
CREDENTIAL_SIZE = 32
HASH_SIZE = 32
ANSWER_DOMAIN = b"blobnet-tpm-answer-v1:"
# TCG EK certificates are 1-2 KiB (an RSA-2048 key, a few TCG extensions); the TPM's NV
# indices that hold them rarely allow more than 2 KiB. 4 KiB each leaves room.
MAX_EK_CERT_SIZE = 4096
# Manufacturer chains are a root and one or two intermediates; the TPM holds fewer.
MAX_EK_CHAIN = 4
# A marshalled TPM2B_PUBLIC is at most about 600 bytes (RSA-4096 with a policy digest).
MAX_TPM_PUBLIC_SIZE = 1024
# TPM2B_ID_OBJECT (HMAC + encrypted 32-byte credential) and TPM2B_ENCRYPTED_SECRET (an
# RSA-4096 ciphertext or an ECC point) are both under 600 bytes.
MAX_CREDENTIAL_BLOB_SIZE = 1024
MAX_EVIDENCE_SIZE = (1 + MAX_EK_CHAIN) * MAX_EK_CERT_SIZE + 2 * MAX_TPM_PUBLIC_SIZE + 1024
MAX_CHALLENGE_SIZE = 2 * MAX_CREDENTIAL_BLOB_SIZE + 1024
MAX_ANSWER_SIZE = 1024

_VERSION = Field("v", int, const=FORMAT_VERSION)
_EVIDENCE = Schema(
    "TPM evidence",
    _VERSION,
    Field("peer", str, attr="peer_id"),
    Field("ek_cert", bytes),
    Field("ek_chain", list, out=list, into=tuple),
    Field("ek_pub", bytes, attr="ek_public"),
    Field("ak_pub", bytes, attr="ak_public"),
    Field("binding", bytes),
)
_CHALLENGE = Schema(
    "TPM challenge",
    _VERSION,
    Field("nonce", bytes),
    Field("expires", int),
    Field("evidence", bytes, attr="evidence_hash"),
    Field("authority", bytes),
    Field("credential", bytes, attr="credential_blob"),
    Field("secret", bytes, attr="encrypted_secret"),
)
_ANSWER_UNSIGNED = Schema(
    "TPM answer",
    _VERSION,
    Field("nonce", bytes),
    Field("peer", str, attr="peer_id"),
    Field("credential", bytes),
)
_ANSWER = _ANSWER_UNSIGNED.then(Field("sig", bytes, attr="signature"))


def _peer(value: str, what: str) -> None:
    try:
        parse_peer_id(value)
    except BadPeerId as exc:
        raise CodecError(f"{what} peer: {exc}") from None


def _bounded(value: bytes, limit: int, what: str) -> None:
    if type(value) is not bytes or not 0 < len(value) <= limit:
        raise CodecError(f"{what} must be 1 to {limit} bytes")


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What a TPM-bound machine shows the authority (see the module's rule 1)."""

    peer_id: str
    ek_cert: bytes
    ek_chain: tuple[bytes, ...]
    ek_public: bytes
    ak_public: bytes
    binding: bytes

    def __post_init__(self) -> None:
        what = "TPM evidence"
        _peer(self.peer_id, what)
        _bounded(self.ek_cert, MAX_EK_CERT_SIZE, f"{what} EK certificate")
        object.__setattr__(self, "ek_chain", tuple(self.ek_chain))
        if len(self.ek_chain) > MAX_EK_CHAIN:
            raise CodecError(f"{what} has more than {MAX_EK_CHAIN} chain certificates")
        for cert in self.ek_chain:
            _bounded(cert, MAX_EK_CERT_SIZE, f"{what} chain certificate")
        _bounded(self.ek_public, MAX_TPM_PUBLIC_SIZE, f"{what} EK public area")
        _bounded(self.ak_public, MAX_TPM_PUBLIC_SIZE, f"{what} AK public area")
        _bounded(self.binding, 64, f"{what} binding signature")

    def encode(self) -> bytes:
        return _EVIDENCE.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Evidence:
        try:
            evidence = cls(**_EVIDENCE.decode(data, max_size=MAX_EVIDENCE_SIZE))
            require_canonical(data, evidence.encode(), what=_EVIDENCE.what)
        except CodecError as exc:
            raise BadTpmData(f"bad TPM evidence: {exc}") from None
        return evidence


@dataclasses.dataclass(frozen=True)
class Challenge:
    """A credential only the TPM holding the evidence's EK and AK can activate."""

    nonce: bytes
    expires: int
    evidence_hash: bytes
    authority: bytes
    credential_blob: bytes
    encrypted_secret: bytes

    def __post_init__(self) -> None:
        what = "TPM challenge"
        if type(self.nonce) is not bytes or len(self.nonce) != NONCE_SIZE:
            raise CodecError(f"{what} nonce must be {NONCE_SIZE} bytes")
        _codec.check_uint(self.expires, f"{what} expiry")
        for value, name in ((self.evidence_hash, "evidence hash"), (self.authority, "authority")):
            if type(value) is not bytes or len(value) != HASH_SIZE:
                raise CodecError(f"{what} {name} must be {HASH_SIZE} bytes")
        _bounded(self.credential_blob, MAX_CREDENTIAL_BLOB_SIZE, f"{what} credential")
        _bounded(self.encrypted_secret, MAX_CREDENTIAL_BLOB_SIZE, f"{what} secret")

    def encode(self) -> bytes:
        return _CHALLENGE.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Challenge:
        try:
            challenge = cls(**_CHALLENGE.decode(data, max_size=MAX_CHALLENGE_SIZE))
            require_canonical(data, challenge.encode(), what=_CHALLENGE.what)
        except CodecError as exc:
            raise BadTpmData(f"bad TPM challenge: {exc}") from None
        return challenge


@dataclasses.dataclass(frozen=True)
class Answer:
    """The activated credential, signed by the Ed25519 key being admitted."""

    nonce: bytes
    peer_id: str
    credential: bytes
    signature: bytes

    def __post_init__(self) -> None:
        what = "TPM answer"
        if type(self.nonce) is not bytes or len(self.nonce) != NONCE_SIZE:
            raise CodecError(f"{what} nonce must be {NONCE_SIZE} bytes")
        _peer(self.peer_id, what)
        if type(self.credential) is not bytes or len(self.credential) != CREDENTIAL_SIZE:
            raise CodecError(f"{what} credential must be {CREDENTIAL_SIZE} bytes")
        if type(self.signature) is not bytes or len(self.signature) != ED25519_SIGNATURE_SIZE:
            raise CodecError(f"{what} signature must be {ED25519_SIGNATURE_SIZE} bytes")

    def signed_message(self) -> bytes:
        return ANSWER_DOMAIN + _ANSWER_UNSIGNED.encode(self)

    @classmethod
    def sign(cls, key: MachineKey, nonce: bytes, credential: bytes) -> Answer:
        unsigned = cls(nonce, key.peer_id, credential, bytes(ED25519_SIGNATURE_SIZE))
        return dataclasses.replace(unsigned, signature=key.sign(unsigned.signed_message()))

    def signature_valid(self) -> bool:
        public_key = public_key_from_peer_id(self.peer_id)
        return verify_signature(public_key, self.signed_message(), self.signature)

    def encode(self) -> bytes:
        return _ANSWER.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Answer:
        try:
            answer = cls(**_ANSWER.decode(data, max_size=MAX_ANSWER_SIZE))
            require_canonical(data, answer.encode(), what=_ANSWER.what)
        except CodecError as exc:
            raise BadTpmData(f"bad TPM answer: {exc}") from None
        return answer
