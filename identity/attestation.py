"""Attestations: a machine's signed statement about a digest.

An attestation says "I, peer P (key kept by a signer of kind K), state <kind> about
<digest> for kernel class C, concerning blobs S, at time T", optionally carrying the
admission certificate that makes P count. Anyone can verify it offline: the signer's
public key is inside its peer ID.

Wire form: one canonical msgpack map (see :mod:`identity._codec`)::

    {"v": 1, "kind": str, "digest": bin32, "kernel_class": str, "subjects": [blob ID...],
     "time": int, "signer": "12D3KooW...", "signer_kind": "software",
     "cert": bin (a canonical certificate) | nil, "sig": bin64}

``sig`` signs ``ATTESTATION_DOMAIN + kind + b"\\n" + <the map without "sig">``. The prefix
differs from the certificate prefix and from libp2p's (``noise-libp2p-static-key:``,
``libp2p-peer-record``...), and includes the statement kind, so a signature made for one
purpose or one kind of statement cannot be replayed as another.

A machine whose key a TPM vouches for (signer kind ``"tpm"``) adds its attestation key's
signature: version 2, the same map with ``"ak": bin65`` (the AK's P-256 point) after
``cert`` and ``"ak_sig": bin64`` after ``sig``. ``ak`` is part of the bytes both keys sign;
``ak_sig`` signs :func:`identity.hardware.cosign_message` of them.

Rules of :func:`verify_attestation`, beyond the Ed25519 signature:

1. A hardware signer kind is believed only with evidence this verifier checks. For
   ``"tpm"`` that is ``ak`` and ``ak_sig``, the AK's signature over the same bytes
   (BAD_HARDWARE_SIGNATURE otherwise); for the other hardware kinds no evidence format
   exists yet, so their claim is refused (HARDWARE_UNPROVEN). An AK travels only with
   signer kind ``"tpm"``.
2. With a trust store, a ``"tpm"`` attestation's certificate must record that same AK
   (the authority checked, by credential activation, that it lives in an endorsed TPM);
   an AK the certificate does not name proves nothing (HARDWARE_UNPROVEN).
3. ``signer_kinds`` restricted to hardware kinds (``--require-hardware``) therefore
   accepts exactly the attestations co-signed by an AK their certificate records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from typing import Any

from blobstore.canonical import CodecError, decode_map, require_canonical
from blobstore.schema import Field, Schema, select

from . import _codec
from .certificate import (
    MAX_CERTIFICATE_SIZE,
    MAX_KERNEL_CLASS_LENGTH,
    MAX_SIGNER_KIND_LENGTH,
    AdmissionCertificate,
    TrustStore,
    verify_certificate,
)
from .errors import (
    AttestationRejected,
    BadAttestation,
    BadCertificate,
    BadPeerId,
    CertificateRejected,
    Reason,
)
from .hardware import (
    AK_POINT_SIZE,
    AK_SIGNATURE_SIZE,
    TPM_SIGNER_KIND,
    cosign_message,
    parse_ak_point,
    verify_ak_signature,
)
from .keys import ED25519_SIGNATURE_SIZE, verify_signature
from .kinds import is_hardware_signer
from .peerid import parse_peer_id, public_key_from_peer_id
from .signer import HardwareSigner, Signer

ATTESTATION_DOMAIN = b"blobnet-attestation-v1:"
ATTESTATION_VERSION = 1
HARDWARE_ATTESTATION_VERSION = 2
DIGEST_SIZE = 32
MAX_KIND_LENGTH = 64
# Enough for a round's inputs and outputs; a larger set goes in a collection blob, whose
# one ID then stands for all of them.
MAX_SUBJECTS = 1024
_BLOB_ID_LENGTH = 64
# Fields, the subjects at 67 bytes each and an embedded certificate, with room to spare.
MAX_ATTESTATION_SIZE = 1024 + MAX_SUBJECTS * (_BLOB_ID_LENGTH + 3) + MAX_CERTIFICATE_SIZE


def _embedded_certificate(raw: bytes) -> AdmissionCertificate:
    try:
        return AdmissionCertificate.decode(raw)
    except BadCertificate as exc:
        raise CodecError(f"embedded {exc}") from None


_CLAIMS = (
    Field("kind", str),
    Field("digest", bytes),
    Field("kernel_class", str),
    Field("subjects", list, out=list, into=tuple),
    Field("time", int),
    Field("signer", str, attr="signer_peer_id"),
    Field("signer_kind", str),
    Field(
        "cert",
        bytes,
        attr="certificate",
        nullable=True,
        out=AdmissionCertificate.encode,
        into=_embedded_certificate,
    ),
)
_SIG = Field("sig", bytes, attr="signature")
_UNSIGNED = {
    ATTESTATION_VERSION: Schema(
        "attestation", Field("v", int, const=ATTESTATION_VERSION), *_CLAIMS
    ),
    HARDWARE_ATTESTATION_VERSION: Schema(
        "attestation",
        Field("v", int, const=HARDWARE_ATTESTATION_VERSION),
        *_CLAIMS,
        Field("ak", bytes, size=AK_POINT_SIZE),
    ),
}
_SIGNED = {
    ATTESTATION_VERSION: _UNSIGNED[ATTESTATION_VERSION].then(_SIG),
    HARDWARE_ATTESTATION_VERSION: _UNSIGNED[HARDWARE_ATTESTATION_VERSION].then(
        _SIG, Field("ak_sig", bytes, attr="ak_signature", size=AK_SIGNATURE_SIZE)
    ),
}
_HEX = frozenset("0123456789abcdef")


def _check_blob_id(value: object, what: str) -> None:
    if type(value) is not str or len(value) != _BLOB_ID_LENGTH or not set(value) <= _HEX:
        raise CodecError(f"{what} must be a blob ID (64 lowercase hex): {value!r:.80}")


@dataclasses.dataclass(frozen=True)
class Attestation:
    """The claims of an attestation and its signature.

    Constructing one checks field shapes (``ValueError``); only :func:`verify_attestation`
    says whether the claims can be believed.
    """

    kind: str
    digest: bytes
    kernel_class: str
    subjects: tuple[str, ...]
    time: int
    signer_peer_id: str
    signer_kind: str
    certificate: AdmissionCertificate | None
    signature: bytes
    # The TPM attestation key's point and its co-signature (signer kind "tpm" only).
    ak: bytes | None = None
    ak_signature: bytes | None = None

    def __post_init__(self) -> None:
        what = "attestation"
        _codec.check_name(self.kind, MAX_KIND_LENGTH, f"{what} kind")
        if type(self.digest) is not bytes or len(self.digest) != DIGEST_SIZE:
            raise CodecError(f"{what} digest must be {DIGEST_SIZE} bytes")
        _codec.check_name(self.kernel_class, MAX_KERNEL_CLASS_LENGTH, f"{what} kernel class")
        object.__setattr__(self, "subjects", tuple(self.subjects))
        if len(self.subjects) > MAX_SUBJECTS:
            raise CodecError(f"{what} has more than {MAX_SUBJECTS} subjects")
        for subject in self.subjects:
            _check_blob_id(subject, f"{what} subject")
        _codec.check_uint(self.time, f"{what} time")
        try:
            parse_peer_id(self.signer_peer_id)
        except BadPeerId as exc:
            raise CodecError(f"{what} signer: {exc}") from None
        _codec.check_name(self.signer_kind, MAX_SIGNER_KIND_LENGTH, f"{what} signer kind")
        if self.certificate is not None and not isinstance(self.certificate, AdmissionCertificate):
            raise CodecError(f"{what} certificate must be an AdmissionCertificate")
        if type(self.signature) is not bytes or len(self.signature) != ED25519_SIGNATURE_SIZE:
            raise CodecError(f"{what} signature must be {ED25519_SIGNATURE_SIZE} bytes")
        if (self.ak is None) != (self.ak_signature is None):
            raise CodecError(f"{what} carries an AK without its signature or vice versa")
        if self.ak is not None:
            if self.signer_kind != TPM_SIGNER_KIND:
                raise CodecError(f"{what} carries an AK but its signer kind is not 'tpm'")
            try:
                parse_ak_point(self.ak)
            except ValueError as exc:
                raise CodecError(f"{what} ak: {exc}") from None
            sig = self.ak_signature
            if type(sig) is not bytes or len(sig) != AK_SIGNATURE_SIZE:
                raise CodecError(f"{what} AK signature must be {AK_SIGNATURE_SIZE} bytes")

    @property
    def version(self) -> int:
        """1, or 2 when a TPM attestation key co-signs (``ak`` and ``ak_sig`` more)."""
        return ATTESTATION_VERSION if self.ak is None else HARDWARE_ATTESTATION_VERSION

    def signed_message(self) -> bytes:
        """The exact bytes the signer signs (domain prefix, kind, unsigned encoding)."""
        return (
            ATTESTATION_DOMAIN
            + self.kind.encode("ascii")
            + b"\n"
            + _UNSIGNED[self.version].encode(self)
        )

    def cosigned_message(self) -> bytes:
        """The exact bytes the AK signs (identity.hardware.cosign_message of the above)."""
        return cosign_message(self.signed_message())

    def encode(self) -> bytes:
        """Canonical bytes of the attestation, signatures included."""
        return _SIGNED[self.version].encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Attestation:
        """Strictly parse canonical attestation bytes; raises :class:`BadAttestation` only.

        Checks no signature: use :func:`verify_attestation` for that.
        """
        what = "attestation"
        try:
            fields = decode_map(data, max_size=MAX_ATTESTATION_SIZE, what=what)
            attestation = cls(**select(fields, _SIGNED, key="v", what=what).read(fields))
            require_canonical(data, attestation.encode(), what=what)
        except CodecError as exc:
            raise BadAttestation(f"bad attestation: {exc}") from None
        return attestation

    def describe(self) -> str:
        """One line for messages."""
        return f"{self.kind!r} attestation by {self.signer_peer_id}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready view of the claims (digest hex-encoded)."""
        return {
            "kind": self.kind,
            "digest": self.digest.hex(),
            "kernel_class": self.kernel_class,
            "subjects": list(self.subjects),
            "time": self.time,
            "signer_peer_id": self.signer_peer_id,
            "signer_kind": self.signer_kind,
            "certificate": None if self.certificate is None else self.certificate.to_json(),
            "ak": None if self.ak is None else self.ak.hex(),
        }


def sign_attestation(
    signer: Signer,
    *,
    kind: str,
    digest: bytes,
    kernel_class: str,
    subjects: Iterable[str] = (),
    time: int,
    certificate: AdmissionCertificate | None = None,
) -> Attestation:
    """Make and sign an attestation (``ValueError`` for malformed claims, or a certificate
    for another peer, kernel class or AK: that would only ever be rejected).

    A :class:`~identity.signer.HardwareSigner` adds its AK and the AK's co-signature.
    """
    hardware = signer if isinstance(signer, HardwareSigner) else None
    if certificate is not None:
        if hardware is not None and certificate.ak != hardware.ak:
            raise ValueError(
                "the certificate does not record this machine's TPM attestation key; "
                "admit the machine on its TPM (`blob tpm bind`, then the authority's "
                "`blob tpm challenge` and `blob tpm admit`)"
            )
        if certificate.peer_id != signer.peer_id:
            raise ValueError(
                f"the certificate admits {certificate.peer_id}, but the signer is {signer.peer_id}"
            )
        if certificate.kernel_class != kernel_class:
            raise ValueError(
                f"the certificate admits kernel class {certificate.kernel_class!r}, "
                f"not {kernel_class!r}"
            )
    unsigned = Attestation(
        kind=kind,
        digest=digest,
        kernel_class=kernel_class,
        subjects=tuple(subjects),
        time=time,
        signer_peer_id=signer.peer_id,
        signer_kind=signer.kind,
        certificate=certificate,
        signature=bytes(ED25519_SIGNATURE_SIZE),
        ak=None if hardware is None else hardware.ak,
        ak_signature=None if hardware is None else bytes(AK_SIGNATURE_SIZE),
    )
    signature = signer.sign(unsigned.signed_message())
    if hardware is None:
        return dataclasses.replace(unsigned, signature=signature)
    ak_signature = hardware.cosign(unsigned.cosigned_message())
    return dataclasses.replace(unsigned, signature=signature, ak_signature=ak_signature)


def verify_attestation(
    data: bytes | Attestation,
    *,
    trust: TrustStore | None = None,
    now: float | None = None,
    kind: str | None = None,
    kernel_class: str | None = None,
    signer_kinds: Collection[str] | None = None,
) -> Attestation:
    """Return the attestation's claims if they verify, else raise AttestationRejected.

    Always checked: canonical decoding (MALFORMED), the signature by the key inside
    the signer's peer ID (BAD_SIGNATURE), and a hardware signer kind's evidence (rules 1-2
    of the module: BAD_HARDWARE_SIGNATURE, HARDWARE_UNPROVEN). Optional expectations: the
    statement ``kind`` (WRONG_KIND), the ``kernel_class`` (WRONG_KERNEL_CLASS) and the allowed
    ``signer_kinds`` (SIGNER_KIND_NOT_ALLOWED). With ``trust`` (which needs ``now``), the
    attestation must carry a certificate (MISSING_CERTIFICATE) that is valid at ``now``
    and binds the signer's peer ID and the attestation's kernel class; its failure
    reason becomes the attestation's.
    """
    if trust is not None and now is None:
        raise TypeError("verify_attestation: checking a certificate needs `now`")
    attestation = data if isinstance(data, Attestation) else Attestation.decode(data)
    public_key = public_key_from_peer_id(attestation.signer_peer_id)
    if not verify_signature(public_key, attestation.signed_message(), attestation.signature):
        raise AttestationRejected(
            Reason.BAD_SIGNATURE,
            f"{attestation.describe()} has a bad signature: it was altered, signed by "
            "another key or signed for another purpose",
        )
    if attestation.ak is not None:
        assert attestation.ak_signature is not None  # __post_init__ pairs them
        if not verify_ak_signature(
            attestation.ak, attestation.cosigned_message(), attestation.ak_signature
        ):
            raise AttestationRejected(
                Reason.BAD_HARDWARE_SIGNATURE,
                f"{attestation.describe()} has a bad TPM attestation-key signature: it was "
                "made over other bytes or by another key",
            )
    elif is_hardware_signer(attestation.signer_kind):
        raise AttestationRejected(
            Reason.HARDWARE_UNPROVEN,
            f"{attestation.describe()} claims a {attestation.signer_kind!r} signer but carries "
            "no hardware evidence this verifier checks (only a TPM attestation key's "
            "co-signature is checked)",
        )
    if kind is not None and attestation.kind != kind:
        raise AttestationRejected(
            Reason.WRONG_KIND, f"{attestation.describe()} is not a {kind!r} attestation"
        )
    if kernel_class is not None and attestation.kernel_class != kernel_class:
        raise AttestationRejected(
            Reason.WRONG_KERNEL_CLASS,
            f"{attestation.describe()} is for kernel class {attestation.kernel_class!r}, "
            f"not {kernel_class!r}",
        )
    if signer_kinds is not None and attestation.signer_kind not in signer_kinds:
        raise AttestationRejected(
            Reason.SIGNER_KIND_NOT_ALLOWED,
            f"{attestation.describe()} was signed by a {attestation.signer_kind!r} signer; "
            f"this verifier accepts {', '.join(sorted(signer_kinds))}",
        )
    if trust is not None:
        assert now is not None
        if attestation.certificate is None:
            raise AttestationRejected(
                Reason.MISSING_CERTIFICATE,
                f"{attestation.describe()} carries no admission certificate; sign it with "
                "the machine's certificate",
            )
        try:
            verify_certificate(
                attestation.certificate,
                trust=trust,
                now=now,
                peer_id=attestation.signer_peer_id,
                kernel_class=attestation.kernel_class,
            )
        except CertificateRejected as exc:
            raise AttestationRejected(exc.reason, f"{attestation.describe()}: its {exc}") from exc
        if attestation.ak is not None and attestation.certificate.ak != attestation.ak:
            raise AttestationRejected(
                Reason.HARDWARE_UNPROVEN,
                f"{attestation.describe()} is co-signed by a TPM attestation key its admission "
                f"{attestation.certificate.describe()} does not record; only an AK the "
                "authority admitted proves the hardware",
            )
    return attestation
