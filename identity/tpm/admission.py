"""The authority's side of a TPM admission, without I/O: time and randomness are arguments.

Rules, in the order they are checked (the first that fails is the refusal's reason):

1. **The EK is endorsed** (UNTRUSTED_EK): the EK certificate chains, through the
   certificates the TPM holds, to one of the manufacturers' CA certificates the authority
   was given, each signature checked and each certificate valid at ``now``.
2. **The EK public area is that certificate's key** (EK_MISMATCH), with the attributes of
   an endorsement key (restricted decryption, fixedTPM, fixedParent). Otherwise the
   credential of rule 6 would be encrypted to a key the machine chose, not to the TPM.
3. **The AK can only be a TPM-resident signing key** (BAD_AK): ECC P-256, ECDSA-SHA256,
   restricted, fixedTPM, fixedParent, sensitiveDataOrigin, no decryption. These attributes
   are hashed into the AK's name, so the TPM enforces what the name promises.
4. **The binding** (BAD_BINDING): the AK signed ``identity.hardware.binding_message`` of
   exactly the Ed25519 key inside the evidence's peer ID.
5. **One EK, one live admission** (EK_ALREADY_ADMITTED): the registry holds, per EK hash,
   the admission that is live (not expired). A second one is refused, or replaces the
   first when the authority says so explicitly (the first's serial is then revoked).
6. **The AK is in that TPM** (ACTIVATION_FAILED): TPM2_MakeCredential to the EK, naming the
   AK; only a TPM holding both the EK's private key and a loaded object of exactly that
   name returns the credential (TPM2_ActivateCredential). The challenge carries a nonce
   and an expiry: an unknown or already answered nonce is UNKNOWN_CHALLENGE, a late answer
   EXPIRED_CHALLENGE, and the answer must be signed by the Ed25519 key being admitted
   (BAD_ANSWER). The registry keeps the credential's hash, never the credential.

Rules 1-4 run when the challenge is issued and rule 5 again when it is answered, where
it is decisive. Parsing TPM structures and MakeCredential use tpm2-pytss (no hand-rolled
marshalling); chain checks use ``cryptography``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from blobstore.canonical import CodecError, decode_map
from blobstore.canonical import encode as encode_canonical

from .. import _codec
from ..errors import AdmissionReason, AdmissionRefused, BadTpmData
from ..hardware import AK_POINT_SIZE, binding_message, verify_ak_signature
from ..peerid import public_key_from_peer_id
from ._pytss import pytss
from .formats import (
    CREDENTIAL_SIZE,
    HASH_SIZE,
    MAX_EK_CERT_SIZE,
    NONCE_SIZE,
    Answer,
    Challenge,
    Evidence,
)

# An answer needs one TPM command on the machine and a file carried back: five minutes is
# ample, and short enough that a leaked challenge is soon useless.
DEFAULT_CHALLENGE_LIFETIME_S = 300
# Open challenges an authority keeps (expired ones are dropped at every write): a fleet
# admitted at once, with room; it bounds what unanswered challenges can cost.
MAX_PENDING = 4096
# One entry per admitted TPM (about 150 bytes): 64 MiB is some 400 000 machines.
MAX_REGISTRY_SIZE = 64 << 20
# Trust anchors one authority is given (--ek-ca): every TPM vendor's roots and more; a CA
# certificate is bounded like an EK certificate.
MAX_EK_CAS = 256
MAX_EK_CA_FILE_SIZE = MAX_EK_CAS * MAX_EK_CERT_SIZE
REGISTRY_VERSION = 1


def _refuse(reason: AdmissionReason, message: str) -> AdmissionRefused:
    return AdmissionRefused(reason, message)


@dataclasses.dataclass(frozen=True)
class BoundMachine:
    """A machine whose evidence passed rules 1-4: its key, AK and EK."""

    peer_id: str
    ak: bytes
    ak_name: bytes
    ek_hash: bytes
    ek_public: bytes
    evidence_hash: bytes


def parse_ek_cas(data: bytes, source: str) -> list[x509.Certificate]:
    """The CA certificates in a PEM (one or more) or DER file; ``BadTpmData`` otherwise."""
    try:
        if b"-----BEGIN" in data:
            certs = x509.load_pem_x509_certificates(data)
        else:
            certs = [x509.load_der_x509_certificate(data)]
    except ValueError as exc:
        raise BadTpmData(f"{source} is not a PEM or DER certificate file: {exc}") from None
    if len(certs) > MAX_EK_CAS:
        raise BadTpmData(f"{source} holds more than {MAX_EK_CAS} certificates")
    return certs


def _valid_at(cert: x509.Certificate, now: float) -> bool:
    return cert.not_valid_before_utc.timestamp() <= now < cert.not_valid_after_utc.timestamp()


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return False
    return constraints.ca


def _check_chain(
    ek_cert: x509.Certificate,
    chain: Sequence[x509.Certificate],
    anchors: Sequence[x509.Certificate],
    now: float,
) -> None:
    """Rule 1: a path from the EK certificate to an anchor, every link valid at ``now``."""
    untrusted = AdmissionReason.UNTRUSTED_EK
    current = ek_cert
    if not _valid_at(current, now):
        raise _refuse(untrusted, "the EK certificate is not valid now")
    for _ in range(len(chain) + 1):
        for anchor in anchors:
            if _issued_by(current, anchor):
                if not _valid_at(anchor, now):
                    raise _refuse(
                        untrusted, f"the EK CA {anchor.subject.rfc4514_string()} is not valid now"
                    )
                return
        issuer = next((c for c in chain if _is_ca(c) and _issued_by(current, c)), None)
        if issuer is None:
            raise _refuse(
                untrusted,
                f"the EK certificate (issuer {ek_cert.issuer.rfc4514_string()!r}) does not "
                "chain to any EK CA this authority trusts (--ek-ca)",
            )
        if not _valid_at(issuer, now):
            raise _refuse(untrusted, "a certificate of the EK's chain is not valid now")
        current = issuer
    raise _refuse(untrusted, "the EK certificate chain loops without reaching a trusted CA")


def _unmarshal_public(data: bytes, what: str) -> Any:
    t = pytss()
    try:
        public, used = t.TPM2B_PUBLIC.unmarshal(data)
    except Exception as exc:  # tpm2-pytss raises TSS2_Exception, ValueError...: one boundary
        raise BadTpmData(f"the {what} public area does not unmarshal: {exc}") from None
    if used != len(data):
        raise BadTpmData(f"the {what} public area has {len(data) - used} trailing bytes")
    return public


def _spki(public: Any, what: str) -> bytes:
    try:
        key = serialization.load_pem_public_key(public.publicArea.to_pem())
    except Exception as exc:  # unsupported key types surface here
        raise BadTpmData(f"the {what} public area holds no usable key: {exc}") from None
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _has(attributes: int, *flags: int) -> bool:
    return all(attributes & flag == flag for flag in flags)


def check_binding(
    evidence: Evidence, ek_cas: Sequence[x509.Certificate], *, now: float
) -> BoundMachine:
    """Rules 1-4 on ``evidence``; ``AdmissionRefused`` with the first failing rule."""
    t = pytss()
    obj = t.TPMA_OBJECT
    try:
        ek_cert = x509.load_der_x509_certificate(evidence.ek_cert)
        chain = [x509.load_der_x509_certificate(c) for c in evidence.ek_chain]
        cert_spki = ek_cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise _refuse(
            AdmissionReason.UNTRUSTED_EK, f"the EK certificate does not parse: {exc}"
        ) from None
    _check_chain(ek_cert, chain, ek_cas, now)

    ek = _unmarshal_public(evidence.ek_public, "EK")
    if _spki(ek, "EK") != cert_spki:
        raise _refuse(
            AdmissionReason.EK_MISMATCH,
            "the EK public area is not the key of the EK certificate: the credential would "
            "not be encrypted to the endorsed TPM",
        )
    ek_attrs = int(ek.publicArea.objectAttributes)
    if not _has(ek_attrs, obj.RESTRICTED, obj.DECRYPT, obj.FIXEDTPM, obj.FIXEDPARENT) or (
        ek_attrs & obj.SIGN_ENCRYPT
    ):
        raise _refuse(
            AdmissionReason.EK_MISMATCH,
            "the EK public area lacks an endorsement key's attributes (restricted "
            "decryption, fixedTPM, fixedParent)",
        )

    ak = _unmarshal_public(evidence.ak_public, "AK")
    area = ak.publicArea
    ak_attrs = int(area.objectAttributes)
    required = (obj.RESTRICTED, obj.SIGN_ENCRYPT, obj.FIXEDTPM, obj.FIXEDPARENT)
    ecc = area.parameters.eccDetail if area.type == t.TPM2_ALG.ECC else None
    if (
        ecc is None
        or ecc.curveID != t.TPM2_ECC.NIST_P256
        or ecc.scheme.scheme != t.TPM2_ALG.ECDSA
        or ecc.scheme.details.ecdsa.hashAlg != t.TPM2_ALG.SHA256
        or area.nameAlg != t.TPM2_ALG.SHA256
        or not _has(ak_attrs, *required, obj.SENSITIVEDATAORIGIN)
        or ak_attrs & obj.DECRYPT
    ):
        raise _refuse(
            AdmissionReason.BAD_AK,
            "the AK is not a restricted, fixedTPM, fixedParent, TPM-generated ECDSA P-256 "
            "signing key with a SHA-256 name",
        )
    point = serialization.load_pem_public_key(area.to_pem())
    assert isinstance(point, ec.EllipticCurvePublicKey)
    ak_point = point.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    assert len(ak_point) == AK_POINT_SIZE

    ed25519 = public_key_from_peer_id(evidence.peer_id)
    if not verify_ak_signature(ak_point, binding_message(ed25519), evidence.binding):
        raise _refuse(
            AdmissionReason.BAD_BINDING,
            f"the AK's binding signature does not cover the key of {evidence.peer_id}: the "
            "TPM vouched for another key, or the evidence was altered",
        )
    return BoundMachine(
        peer_id=evidence.peer_id,
        ak=ak_point,
        ak_name=bytes(ak.get_name()),
        ek_hash=hashlib.sha256(cert_spki).digest(),
        ek_public=evidence.ek_public,
        evidence_hash=hashlib.sha256(evidence.encode()).digest(),
    )


def make_challenge(
    machine: BoundMachine, *, credential: bytes, nonce: bytes, expires: int, authority: bytes
) -> Challenge:
    """TPM2_MakeCredential of ``credential`` to the machine's EK, naming its AK."""
    if len(credential) != CREDENTIAL_SIZE or len(nonce) != NONCE_SIZE:
        raise ValueError("make_challenge: a 32-byte credential and a 16-byte nonce")
    t = pytss()
    ek = _unmarshal_public(machine.ek_public, "EK")
    try:
        blob, secret = t.utils.make_credential(ek, credential, t.TPM2B_NAME(machine.ak_name))
    except ValueError as exc:  # an EK type tpm2-pytss cannot encrypt to
        raise BadTpmData(f"cannot make a credential for this EK: {exc}") from None
    return Challenge(
        nonce=nonce,
        expires=expires,
        evidence_hash=machine.evidence_hash,
        authority=authority,
        credential_blob=bytes(blob.marshal()),
        encrypted_secret=bytes(secret.marshal()),
    )


@dataclasses.dataclass(frozen=True)
class Pending:
    """An issued challenge: what its answer must show, and for which machine."""

    nonce: bytes
    expires: int
    credential_hash: bytes
    peer_id: str
    ak: bytes
    ek_hash: bytes


@dataclasses.dataclass(frozen=True)
class Admitted:
    """The live admission of one EK."""

    ek_hash: bytes
    peer_id: str
    serial: int
    not_after: int


_PENDING_FIELDS = ("nonce", "expires", "credential", "peer", "ak", "ek")
_ADMITTED_FIELDS = ("ek", "peer", "serial", "not_after")


@dataclasses.dataclass(frozen=True)
class Registry:
    """The authority's TPM state: open challenges and, per EK, its live admission."""

    pending: tuple[Pending, ...] = ()
    admitted: tuple[Admitted, ...] = ()

    def live_admission(self, ek_hash: bytes, now: float) -> Admitted | None:
        return next((a for a in self.admitted if a.ek_hash == ek_hash and now < a.not_after), None)

    def check_not_admitted(self, ek_hash: bytes, peer_id: str, now: float) -> Admitted | None:
        """Rule 5 before a challenge: refuse when ``ek_hash`` has a live admission."""
        live = self.live_admission(ek_hash, now)
        if live is not None:
            raise _already(live, peer_id)
        return live

    def with_challenge(
        self, machine: BoundMachine, challenge: Challenge, credential: bytes, now: float
    ) -> Registry:
        pending = tuple(p for p in self.pending if now < p.expires)
        if len(pending) >= MAX_PENDING:
            raise _refuse(
                AdmissionReason.TOO_MANY_CHALLENGES,
                f"{len(pending)} challenges are open (at most {MAX_PENDING}); wait for "
                "answers or for them to expire",
            )
        entry = Pending(
            nonce=challenge.nonce,
            expires=challenge.expires,
            credential_hash=hashlib.sha256(credential).digest(),
            peer_id=machine.peer_id,
            ak=machine.ak,
            ek_hash=machine.ek_hash,
        )
        return dataclasses.replace(self, pending=(*pending, entry))

    def answer(
        self, answer: Answer, *, now: float, replace: bool
    ) -> tuple[Registry, Pending, Admitted | None]:
        """Rules 6 and 5 on ``answer``: the registry without its challenge (and without the
        EK's live admission when ``replace``), the challenge, and the admission replaced."""
        pending = next((p for p in self.pending if p.nonce == answer.nonce), None)
        if pending is None:
            raise _refuse(
                AdmissionReason.UNKNOWN_CHALLENGE,
                "no open challenge has this answer's nonce: it was answered already (a "
                "replay) or never issued by this authority",
            )
        if now >= pending.expires:
            raise _refuse(
                AdmissionReason.EXPIRED_CHALLENGE,
                "the challenge expired before it was answered; ask for a new one",
            )
        if answer.peer_id != pending.peer_id or not answer.signature_valid():
            raise _refuse(
                AdmissionReason.BAD_ANSWER,
                f"the answer is not signed by the key the challenge was issued for "
                f"({pending.peer_id})",
            )
        if not hmac.compare_digest(
            hashlib.sha256(answer.credential).digest(), pending.credential_hash
        ):
            raise _refuse(
                AdmissionReason.ACTIVATION_FAILED,
                "the answer's credential is not the one made for this EK and AK: the AK does "
                "not live in the endorsed TPM",
            )
        live = self.live_admission(pending.ek_hash, now)
        if live is not None and not replace:
            raise _already(live, pending.peer_id)
        rest = tuple(p for p in self.pending if p.nonce != answer.nonce)
        admitted = tuple(a for a in self.admitted if a is not live and now < a.not_after)
        return Registry(rest, admitted), pending, live

    def with_admission(self, admitted: Admitted) -> Registry:
        return dataclasses.replace(self, admitted=(*self.admitted, admitted))

    def encode(self) -> bytes:
        return encode_canonical(
            {
                "v": REGISTRY_VERSION,
                "pending": [
                    {
                        "nonce": p.nonce,
                        "expires": p.expires,
                        "credential": p.credential_hash,
                        "peer": p.peer_id,
                        "ak": p.ak,
                        "ek": p.ek_hash,
                    }
                    for p in self.pending
                ],
                "admitted": [
                    {
                        "ek": a.ek_hash,
                        "peer": a.peer_id,
                        "serial": a.serial,
                        "not_after": a.not_after,
                    }
                    for a in self.admitted
                ],
            }
        )

    @classmethod
    def decode(cls, data: bytes, *, source: str = "TPM registry") -> Registry:
        what = source
        try:
            fields = decode_map(data, max_size=MAX_REGISTRY_SIZE, what=what)
            _codec.check_keys(fields, ("v", "pending", "admitted"), what=what)
            if _codec.take(fields, "v", int, what=what) != REGISTRY_VERSION:
                raise CodecError(f"{what} has an unknown version")
            pending = []
            for raw in _codec.take(fields, "pending", list, what=what):
                entry = _entry(raw, _PENDING_FIELDS, what)
                pending.append(
                    Pending(
                        nonce=_codec.take_bytes(entry, "nonce", NONCE_SIZE, what=what),
                        expires=_codec.take(entry, "expires", int, what=what),
                        credential_hash=_codec.take_bytes(
                            entry, "credential", HASH_SIZE, what=what
                        ),
                        peer_id=_codec.take(entry, "peer", str, what=what),
                        ak=_codec.take_bytes(entry, "ak", AK_POINT_SIZE, what=what),
                        ek_hash=_codec.take_bytes(entry, "ek", HASH_SIZE, what=what),
                    )
                )
            admitted = []
            for raw in _codec.take(fields, "admitted", list, what=what):
                entry = _entry(raw, _ADMITTED_FIELDS, what)
                admitted.append(
                    Admitted(
                        ek_hash=_codec.take_bytes(entry, "ek", HASH_SIZE, what=what),
                        peer_id=_codec.take(entry, "peer", str, what=what),
                        serial=_codec.take(entry, "serial", int, what=what),
                        not_after=_codec.take(entry, "not_after", int, what=what),
                    )
                )
        except CodecError as exc:
            raise BadTpmData(f"bad {what}: {exc}") from None
        return cls(tuple(pending), tuple(admitted))


def _entry(raw: object, expected: tuple[str, ...], what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise CodecError(f"{what} entries must be maps")
    _codec.check_keys(raw, expected, what=what)
    return raw


def _already(live: Admitted, peer_id: str) -> AdmissionRefused:
    same = " (this same key: renew with --replace)" if live.peer_id == peer_id else ""
    return _refuse(
        AdmissionReason.EK_ALREADY_ADMITTED,
        f"this TPM's endorsement key is already admitted as {live.peer_id}{same}, serial "
        f"{live.serial}; one TPM is one live admission (--replace revokes that one)",
    )
