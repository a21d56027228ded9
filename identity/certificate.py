"""Admission certificates: an authority binds a peer ID to an operator and a kernel class.

Keys are free to mint, so a key proves nothing about who runs it. An authority (a run's
organiser) signs a certificate for each machine it admits; verifiers count distinct
admitted operators, not keys (DESIGN 7).

Wire form: one canonical msgpack map (see :mod:`identity._codec`)::

    {"v": 1, "peer": "12D3KooW...", "operator": str, "kernel_class": str,
     "not_before": int, "not_after": int, "serial": int,
     "authority": bin32, "authority_kind": "software", "sig": bin64}

A machine admitted on its TPM's endorsement key (``identity.tpm``) gets version 2, the same
map with three more fields before ``sig``::

    {..., "authority_kind": "software", "machine_kind": "tpm", "ak": bin65, "ek": bin32,
     "sig": bin64}

``machine_kind`` is where the machine's attestation key lives, ``ak`` that key's P-256 point
(:mod:`identity.hardware`) and ``ek`` the SHA-256 of the DER SubjectPublicKeyInfo of the
TPM's endorsement key, the one admission per TPM being counted on it. A software-admitted
machine's certificate stays version 1, byte for byte.

``sig`` is the authority's Ed25519 signature over ``CERTIFICATE_DOMAIN`` followed by the
encoding of the same map without ``sig``. The domain prefix differs from every other
signed object's (attestations, libp2p's own), so a certificate signature can never be
replayed as anything else, nor anything else as a certificate.

Verification order (the first failing check is the reason): decoding (MALFORMED),
authority in the trust store (UNKNOWN_AUTHORITY), signature (BAD_SIGNATURE), revocation
by serial or peer ID (REVOKED), validity window at ``now`` (NOT_YET_VALID, EXPIRED),
then the caller's expectations (WRONG_PEER, WRONG_KERNEL_CLASS). Time is an argument.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from blobstore.canonical import CodecError, decode_map, require_canonical
from blobstore.schema import Field, Schema, select

from . import _codec
from .errors import (
    BadCertificate,
    BadPeerId,
    BadRevocationList,
    CertificateRejected,
    Reason,
)
from .hardware import AK_POINT_SIZE, TPM_SIGNER_KIND, parse_ak_point
from .keys import ED25519_SIGNATURE_SIZE, verify_signature
from .peerid import ED25519_PUBLIC_KEY_SIZE, parse_peer_id
from .signer import Signer

CERTIFICATE_DOMAIN = b"blobnet-admission-certificate-v1:"
CERTIFICATE_VERSION = 1
HARDWARE_CERTIFICATE_VERSION = 2
EK_HASH_SIZE = 32
# A certificate is about 250 bytes with the longest allowed names; 4 KiB leaves room for
# a future version while bounding what a peer can make us parse.
MAX_CERTIFICATE_SIZE = 4096
MAX_OPERATOR_LENGTH = 128
MAX_KERNEL_CLASS_LENGTH = 128
MAX_SIGNER_KIND_LENGTH = 32

_ADMISSION = (
    Field("peer", str, attr="peer_id"),
    Field("operator", str),
    Field("kernel_class", str),
    Field("not_before", int),
    Field("not_after", int),
    Field("serial", int),
    Field("authority", bytes),
    Field("authority_kind", str),
)
_UNSIGNED = {
    CERTIFICATE_VERSION: Schema(
        "certificate", Field("v", int, const=CERTIFICATE_VERSION), *_ADMISSION
    ),
    HARDWARE_CERTIFICATE_VERSION: Schema(
        "certificate",
        Field("v", int, const=HARDWARE_CERTIFICATE_VERSION),
        *_ADMISSION,
        Field("machine_kind", str),
        Field("ak", bytes, size=AK_POINT_SIZE),
        Field("ek", bytes, attr="ek_hash", size=EK_HASH_SIZE),
    ),
}
_SIGNED = {v: schema.then(Field("sig", bytes, attr="signature")) for v, schema in _UNSIGNED.items()}


def iso_time(t: float) -> str:
    try:
        return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return f"{t} (unix time)"


@dataclasses.dataclass(frozen=True)
class AdmissionCertificate:
    """A signed admission of ``peer_id``; validity is ``not_before <= now < not_after``.

    Constructing one checks field shapes (``ValueError``) but not the signature: use
    :func:`verify_certificate` for that.
    """

    peer_id: str
    operator: str
    kernel_class: str
    not_before: int
    not_after: int
    serial: int
    authority: bytes
    authority_kind: str
    signature: bytes
    # Where the machine's attestation key lives, that key and its TPM's EK hash (None, None
    # for a software-admitted machine).
    machine_kind: str = "software"
    ak: bytes | None = None
    ek_hash: bytes | None = None

    def __post_init__(self) -> None:
        what = "certificate"
        try:
            parse_peer_id(self.peer_id)
        except BadPeerId as exc:
            raise CodecError(f"{what} peer: {exc}") from None
        _codec.check_text(self.operator, MAX_OPERATOR_LENGTH, f"{what} operator")
        _codec.check_name(self.kernel_class, MAX_KERNEL_CLASS_LENGTH, f"{what} kernel class")
        _codec.check_uint(self.not_before, f"{what} not_before")
        _codec.check_uint(self.not_after, f"{what} not_after")
        if self.not_after <= self.not_before:
            raise CodecError(f"{what} validity window is empty (not_after <= not_before)")
        _codec.check_uint(self.serial, f"{what} serial", bits=64)
        if type(self.authority) is not bytes or len(self.authority) != ED25519_PUBLIC_KEY_SIZE:
            raise CodecError(f"{what} authority must be a 32-byte Ed25519 public key")
        _codec.check_name(self.authority_kind, MAX_SIGNER_KIND_LENGTH, f"{what} authority kind")
        if type(self.signature) is not bytes or len(self.signature) != ED25519_SIGNATURE_SIZE:
            raise CodecError(f"{what} signature must be {ED25519_SIGNATURE_SIZE} bytes")
        if self.machine_kind == "software":
            if self.ak is not None or self.ek_hash is not None:
                raise CodecError(f"{what} of a software machine carries no AK or EK")
        elif self.machine_kind == TPM_SIGNER_KIND:
            try:
                parse_ak_point(self.ak or b"")
            except ValueError as exc:
                raise CodecError(f"{what} ak: {exc}") from None
            if type(self.ek_hash) is not bytes or len(self.ek_hash) != EK_HASH_SIZE:
                raise CodecError(f"{what} ek must be a {EK_HASH_SIZE}-byte hash")
        else:
            raise CodecError(
                f"{what} machine kind must be 'software' or 'tpm', not {self.machine_kind!r:.40}"
            )

    @property
    def hardware(self) -> bool:
        """Whether the machine was admitted on a hardware root (its AK is recorded)."""
        return self.ak is not None

    @property
    def version(self) -> int:
        """1, or 2 for a machine admitted on a hardware root (three more fields)."""
        return HARDWARE_CERTIFICATE_VERSION if self.hardware else CERTIFICATE_VERSION

    def signed_message(self) -> bytes:
        """The exact bytes the authority signs (domain prefix + unsigned encoding)."""
        return CERTIFICATE_DOMAIN + _UNSIGNED[self.version].encode(self)

    def encode(self) -> bytes:
        """Canonical bytes of the certificate, signature included."""
        return _SIGNED[self.version].encode(self)

    @classmethod
    def decode(cls, data: bytes) -> AdmissionCertificate:
        """Strictly parse canonical certificate bytes; raises :class:`BadCertificate` only.

        Does not check the signature or anything else about trust.
        """
        what = "certificate"
        try:
            fields = decode_map(data, max_size=MAX_CERTIFICATE_SIZE, what=what)
            cert = cls(**select(fields, _SIGNED, key="v", what=what).read(fields))
            require_canonical(data, cert.encode(), what=what)
        except CodecError as exc:
            raise BadCertificate(f"bad admission certificate: {exc}") from None
        return cert

    def describe(self) -> str:
        """One line for messages: peer, operator, kernel class, serial."""
        return (
            f"certificate {self.serial} for {self.peer_id} "
            f"(operator {self.operator!r}, kernel class {self.kernel_class!r})"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready view (keys hex-encoded)."""
        return {
            "peer_id": self.peer_id,
            "operator": self.operator,
            "kernel_class": self.kernel_class,
            "not_before": self.not_before,
            "not_after": self.not_after,
            "serial": self.serial,
            "authority": self.authority.hex(),
            "authority_kind": self.authority_kind,
            "machine_kind": self.machine_kind,
            "ak": None if self.ak is None else self.ak.hex(),
            "ek_hash": None if self.ek_hash is None else self.ek_hash.hex(),
        }


@dataclasses.dataclass(frozen=True)
class HardwareRoot:
    """What an authority records of a machine admitted on its TPM: the AK and EK hash."""

    ak: bytes
    ek_hash: bytes
    kind: str = TPM_SIGNER_KIND


@dataclasses.dataclass(frozen=True)
class RevocationList:
    """Revoked certificate serials and peer IDs.

    Serials are revoked whichever trusted authority issued them, so authorities that share
    a trust store should draw serials at random (``blob admit`` does) rather than count.
    """

    serials: frozenset[int] = frozenset()
    peer_ids: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "serials", frozenset(self.serials))
        object.__setattr__(self, "peer_ids", frozenset(self.peer_ids))

    @classmethod
    def parse(cls, text: str, *, name: str = "revocation list") -> RevocationList:
        """One entry a line: a decimal serial or a peer ID; ``#`` starts a comment."""
        serials: set[int] = set()
        peers: set[str] = set()
        for lineno, raw in enumerate(text.splitlines(), 1):
            entry = raw.split("#", 1)[0].strip()
            if not entry:
                continue
            if entry.isdecimal() and entry.isascii():
                serials.add(int(entry))
                continue
            try:
                peers.add(parse_peer_id(entry))
            except BadPeerId:
                raise BadRevocationList(
                    f"{name} line {lineno}: {entry!r:.80} is neither a certificate serial "
                    "(decimal) nor a peer ID (12D3KooW...)"
                ) from None
        return cls(frozenset(serials), frozenset(peers))

    def revocation_of(self, cert: AdmissionCertificate) -> str | None:
        """Why ``cert`` is revoked, or None."""
        if cert.serial in self.serials:
            return "its serial is on the revocation list"
        if cert.peer_id in self.peer_ids:
            return "its peer ID is on the revocation list"
        return None


@dataclasses.dataclass(frozen=True)
class TrustStore:
    """What a verifier trusts: authority public keys (raw 32 bytes) and revocations."""

    authorities: frozenset[bytes]
    revoked: RevocationList = RevocationList()

    def __post_init__(self) -> None:
        authorities = frozenset(self.authorities)
        for key in authorities:
            if type(key) is not bytes or len(key) != ED25519_PUBLIC_KEY_SIZE:
                raise ValueError("trusted authorities must be raw 32-byte Ed25519 public keys")
        object.__setattr__(self, "authorities", authorities)


class Authority:
    """Issues admission certificates with a signer's key."""

    def __init__(self, signer: Signer) -> None:
        self._signer = signer

    @property
    def public_key_bytes(self) -> bytes:
        """The raw public key verifiers put in their :class:`TrustStore`."""
        return self._signer.public_key_bytes

    def admit(
        self,
        peer_id: str,
        *,
        operator: str,
        kernel_class: str,
        not_before: int,
        not_after: int,
        serial: int,
        hardware: HardwareRoot | None = None,
    ) -> AdmissionCertificate:
        """Sign a certificate (``ValueError`` for malformed fields, e.g. a bad peer ID).

        ``hardware`` records the machine's TPM root; only an admission that checked it (the
        credential activation of ``identity.tpm``) passes one.
        """
        unsigned = AdmissionCertificate(
            peer_id=peer_id,
            operator=operator,
            kernel_class=kernel_class,
            not_before=not_before,
            not_after=not_after,
            serial=serial,
            authority=self._signer.public_key_bytes,
            authority_kind=self._signer.kind,
            signature=bytes(ED25519_SIGNATURE_SIZE),
        )
        if hardware is not None:
            unsigned = dataclasses.replace(
                unsigned, machine_kind=hardware.kind, ak=hardware.ak, ek_hash=hardware.ek_hash
            )
        signature = self._signer.sign(unsigned.signed_message())
        return dataclasses.replace(unsigned, signature=signature)


def verify_certificate(
    cert: AdmissionCertificate | bytes,
    *,
    trust: TrustStore,
    now: float,
    peer_id: str | None = None,
    kernel_class: str | None = None,
) -> AdmissionCertificate:
    """Return the certificate if it is valid at ``now``; else raise CertificateRejected.

    ``peer_id`` and ``kernel_class``, when given, must match the certificate's.
    """
    if not isinstance(cert, AdmissionCertificate):
        cert = AdmissionCertificate.decode(cert)
    if cert.authority not in trust.authorities:
        raise CertificateRejected(
            Reason.UNKNOWN_AUTHORITY,
            f"{cert.describe()} was issued by an authority this verifier does not trust "
            f"({cert.authority.hex()}); add its public key to the trusted authorities",
        )
    if not verify_signature(cert.authority, cert.signed_message(), cert.signature):
        raise CertificateRejected(
            Reason.BAD_SIGNATURE,
            f"{cert.describe()} has a bad signature: it was altered or not made by its authority",
        )
    revocation = trust.revoked.revocation_of(cert)
    if revocation is not None:
        raise CertificateRejected(Reason.REVOKED, f"{cert.describe()} is revoked ({revocation})")
    if now < cert.not_before:
        raise CertificateRejected(
            Reason.NOT_YET_VALID,
            f"{cert.describe()} is not valid before {iso_time(cert.not_before)} "
            f"(now {iso_time(now)}); check the clocks",
        )
    if now >= cert.not_after:
        raise CertificateRejected(
            Reason.EXPIRED,
            f"{cert.describe()} expired at {iso_time(cert.not_after)} (now {iso_time(now)}); "
            "ask the authority for a new one",
        )
    if peer_id is not None and cert.peer_id != peer_id:
        raise CertificateRejected(
            Reason.WRONG_PEER, f"{cert.describe()} does not admit peer {peer_id}"
        )
    if kernel_class is not None and cert.kernel_class != kernel_class:
        raise CertificateRejected(
            Reason.WRONG_KERNEL_CLASS,
            f"{cert.describe()} admits kernel class {cert.kernel_class!r}, not {kernel_class!r}",
        )
    return cert
