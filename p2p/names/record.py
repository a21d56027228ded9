"""Signed name records: ``PUBLISHER/NAME`` -> blob ID, newest by sequence number.

A name record says "I, peer P, name blob B ``NAME`` (version ``seq``, made at ``time``,
good until ``expires``)". The publisher is a peer ID, whose Ed25519 public key is inside
it, so anyone can check a record offline, from any peer, without trusting whoever passed
it on. A record may carry the publisher's admission certificate (identity/certificate.py):
a verifier with a trust store can then demand that the publisher be an admitted operator.

Wire form: one canonical msgpack map (keys in this order, smallest encodings)::

    {"v": 1, "publisher": "12D3KooW...", "name": str, "blob": 64 lowercase hex,
     "seq": int, "time": int, "expires": int | nil, "signer_kind": str,
     "cert": bin (a canonical certificate) | nil, "sig": bin64}

``sig`` is the publisher's Ed25519 signature over ``NAME_RECORD_DOMAIN`` followed by the
encoding of the same map without ``sig``. The prefix differs from every other signed
object's (attestations, certificates, libp2p's), so no other signature can be replayed as
a name record nor a name record as anything else.

Rules, each a check below:

1. Decoding is strict and bounded (``MAX_NAME_RECORD_SIZE``): a map with other keys, order
   or wider encodings is MALFORMED; a map without a signature is UNSIGNED.
2. The signature must verify under the key inside ``publisher`` (BAD_SIGNATURE).
3. A resolver asking for ``P/N`` accepts only records whose publisher is P
   (WRONG_PUBLISHER) and whose name is N (WRONG_NAME).
4. ``now >= expires`` is EXPIRED. Time is an argument, never read here.
5. With a trust store, the record must carry a certificate (MISSING_CERTIFICATE) valid at
   ``now`` for the publisher's peer ID (CERTIFICATE, with the certificate's own reason).
6. Among valid records for one name, the newest wins: highest ``seq``, then highest
   ``time``, then the greatest encoding, so every node picks the same one. A holder
   refuses a record older than the one it holds (OLDER).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable
from typing import Any

from blake3 import blake3

from blobstore.canonical import encode as encode_canonical
from blobstore.exitcodes import ExitCode
from identity import (
    MAX_CERTIFICATE_SIZE,
    AdmissionCertificate,
    BadCertificate,
    BadPeerId,
    CertificateRejected,
    Signer,
    TrustStore,
    decode_msgpack_map,
    public_key_from_peer_id,
    verify_certificate,
    verify_signature,
)
from p2p.errors import P2PError

NAME_RECORD_DOMAIN = b"blobnet-name-record-v1:"
NAME_RECORD_VERSION = 1
# The DHT namespace of name records: keys are "/blobnet-name/<64 hex>".
DHT_NAMESPACE = "blobnet-name"
# Hashing publisher and name into the key gives every name a fixed-size DHT key. py-libp2p
# 0.8.1 resets a FIND_NODE whose key is neither a multihash nor at most 50 bytes (and the
# key must be UTF-8 text for its PUT_VALUE handler), so the key is 46 ASCII bytes: the
# namespace and 32 hex digits (128 bits of the BLAKE3 hash: finding another name with the
# same key is a 2**128 second-preimage search, and resolvers check the name anyway).
_KEY_DOMAIN = b"blobnet-name-key-v1:"
DHT_KEY_HASH_BYTES = 16
MAX_DHT_KEY_LENGTH = 50
# Names are path-like (``run-x/adapter``), like Hugging Face repo ids; 128 characters
# is twice the longest repo id in common use and keeps a record small.
MAX_NAME_LENGTH = 128
# Short identifiers: "software", later "tpm", "tee".
MAX_SIGNER_KIND_LENGTH = 32
# A record is about 300 bytes; the embedded certificate dominates the bound.
MAX_NAME_RECORD_SIZE = 1024 + MAX_CERTIFICATE_SIZE
ED25519_SIGNATURE_SIZE = 64
_BLOB_ID_LENGTH = 64
_UINT_LIMIT = 1 << 63

_FIELDS = (
    "v",
    "publisher",
    "name",
    "blob",
    "seq",
    "time",
    "expires",
    "signer_kind",
    "cert",
    "sig",
)
_NAME_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HEX = frozenset("0123456789abcdef")
_KIND = re.compile(r"[a-z0-9][a-z0-9._-]*")


class NameReason(enum.StrEnum):
    """Why a name record was refused."""

    MALFORMED = "malformed"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad signature"
    WRONG_PUBLISHER = "wrong publisher"
    WRONG_NAME = "wrong name"
    EXPIRED = "expired"
    MISSING_CERTIFICATE = "missing certificate"
    CERTIFICATE = "certificate rejected"
    OLDER = "older"


class CatalogError(P2PError):
    """Base of the catalog's user-facing errors."""


class BadName(CatalogError):
    """A name or ``PUBLISHER/NAME`` reference given by the user is malformed."""

    exit_code = ExitCode.USAGE


class NameNotFound(CatalogError):
    """No valid record for the name was found (locally or on any peer asked)."""

    exit_code = ExitCode.NOT_FOUND


class NameRejected(CatalogError):
    """A record failed verification; ``reason`` says why (a remote peer's fault)."""

    exit_code = ExitCode.BAD_DATA

    def __init__(self, reason: NameReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_name(name: object) -> str:
    """``name`` if it is a valid record name, else :class:`BadName`.

    1 to ``MAX_NAME_LENGTH`` characters; ``/``-separated segments of letters, digits and
    ``._-`` that start with a letter or digit (so no empty, ``.`` or ``..`` segments)."""
    if type(name) is not str or not 0 < len(name) <= MAX_NAME_LENGTH:
        raise BadName(f"a name is 1 to {MAX_NAME_LENGTH} characters: {name!r:.80}")
    if not all(_NAME_SEGMENT.fullmatch(seg) for seg in name.split("/")):
        raise BadName(
            f"bad name {name!r}: use /-separated parts of letters, digits and ._- "
            "that start with a letter or digit"
        )
    return name


@dataclasses.dataclass(frozen=True)
class NameRef:
    """A parsed ``PUBLISHER/NAME``."""

    publisher: str
    name: str

    def __str__(self) -> str:
        return f"{self.publisher}/{self.name}"


def parse_ref(text: str) -> NameRef:
    """Parse ``PUBLISHER/NAME`` (publisher: a ``12D3KooW...`` peer ID); :class:`BadName`."""
    publisher, sep, name = text.partition("/")
    if not sep:
        raise BadName(f"a name reference is PUBLISHER/NAME (peer ID / name), not {text!r:.80}")
    try:
        public_key_from_peer_id(publisher)
    except BadPeerId:
        raise BadName(
            f"the publisher in {text!r:.120} is not a peer ID (12D3KooW..., 52 characters)"
        ) from None
    return NameRef(publisher, check_name(name))


def is_name_ref(text: str) -> bool:
    """Whether ``text`` reads as ``PUBLISHER/NAME`` (for commands that also take IDs)."""
    try:
        parse_ref(text)
    except BadName:
        return False
    return True


def record_key(publisher: str, name: str) -> bytes:
    """The 32-byte key of a name: BLAKE3 of the domain, publisher, ``/`` and name."""
    return blake3(_KEY_DOMAIN + publisher.encode() + b"/" + name.encode()).digest()


def dht_key(publisher: str, name: str) -> str:
    """The DHT key of a name: ``/blobnet-name/<hex of the first 16 bytes of its key>``."""
    return dht_key_of(record_key(publisher, name))


def dht_key_of(key: bytes) -> str:
    """The DHT key for a 32-byte :func:`record_key`."""
    return f"/{DHT_NAMESPACE}/{key[:DHT_KEY_HASH_BYTES].hex()}"


class _Malformed(ValueError):
    pass


def _check_uint(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value < _UINT_LIMIT:
        raise _Malformed(f"{what} must be an integer from 0 to 2**63-1: {value!r:.80}")
    return value


@dataclasses.dataclass(frozen=True)
class NameRecord:
    """The claims of a name record and its signature.

    Constructing one checks field shapes (:class:`NameRejected` MALFORMED); only
    :func:`verify` says whether it can be believed."""

    publisher: str
    name: str
    blob_id: str
    seq: int
    time: int
    expires: int | None
    signer_kind: str
    certificate: AdmissionCertificate | None
    signature: bytes

    def __post_init__(self) -> None:
        try:
            if type(self.publisher) is not str:
                raise _Malformed("publisher must be a peer ID")
            try:
                public_key_from_peer_id(self.publisher)
            except BadPeerId as exc:
                raise _Malformed(f"publisher: {exc}") from None
            try:
                check_name(self.name)
            except BadName as exc:
                raise _Malformed(str(exc)) from None
            blob = self.blob_id
            if type(blob) is not str or len(blob) != _BLOB_ID_LENGTH or not set(blob) <= _HEX:
                raise _Malformed(f"blob must be a blob ID (64 lowercase hex): {blob!r:.80}")
            _check_uint(self.seq, "seq")
            _check_uint(self.time, "time")
            if self.expires is not None:
                _check_uint(self.expires, "expires")
                if self.expires <= self.time:
                    raise _Malformed("expires must be after time")
            kind = self.signer_kind
            if (
                type(kind) is not str
                or len(kind) > MAX_SIGNER_KIND_LENGTH
                or not _KIND.fullmatch(kind)
            ):
                raise _Malformed(f"signer_kind must be a short identifier: {kind!r:.80}")
            cert = self.certificate
            if cert is not None and not isinstance(cert, AdmissionCertificate):
                raise _Malformed("cert must be an admission certificate")
            if cert is not None and cert.peer_id != self.publisher:
                raise _Malformed(f"the certificate admits {cert.peer_id}, not the publisher")
            sig = self.signature
            if type(sig) is not bytes or len(sig) != ED25519_SIGNATURE_SIZE:
                raise _Malformed(f"sig must be {ED25519_SIGNATURE_SIZE} bytes")
        except _Malformed as exc:
            raise NameRejected(NameReason.MALFORMED, f"malformed name record: {exc}") from None

    @property
    def ref(self) -> NameRef:
        return NameRef(self.publisher, self.name)

    @property
    def key(self) -> bytes:
        return record_key(self.publisher, self.name)

    def _unsigned_fields(self) -> dict[str, Any]:
        return {
            "v": NAME_RECORD_VERSION,
            "publisher": self.publisher,
            "name": self.name,
            "blob": self.blob_id,
            "seq": self.seq,
            "time": self.time,
            "expires": self.expires,
            "signer_kind": self.signer_kind,
            "cert": None if self.certificate is None else self.certificate.encode(),
        }

    def signed_message(self) -> bytes:
        """The exact bytes the publisher signs (domain prefix + unsigned encoding)."""
        return NAME_RECORD_DOMAIN + _pack(self._unsigned_fields())

    def encode(self) -> bytes:
        """Canonical bytes of the record, signature included."""
        return _pack({**self._unsigned_fields(), "sig": self.signature})

    @classmethod
    def decode(cls, data: bytes) -> NameRecord:
        """Strictly parse canonical record bytes (:class:`NameRejected` MALFORMED or
        UNSIGNED only). Checks no signature: :func:`verify` does."""
        fields = decode_msgpack_map(
            data, max_size=MAX_NAME_RECORD_SIZE, what="name record", error=_malformed
        )
        if fields.get("sig") in (None, b""):
            raise NameRejected(NameReason.UNSIGNED, "the name record carries no signature")
        if set(fields) != set(_FIELDS):
            extra = sorted(map(str, set(fields) - set(_FIELDS)))
            missing = [k for k in _FIELDS if k not in fields]
            raise _malformed(f"fields differ (unknown: {extra}, missing: {missing})")
        if fields["v"] != NAME_RECORD_VERSION or type(fields["v"]) is not int:
            raise _malformed(f"unknown version {fields['v']!r:.20}")
        raw_cert = fields["cert"]
        certificate: AdmissionCertificate | None = None
        if raw_cert is not None:
            if type(raw_cert) is not bytes:
                raise _malformed("cert must be bytes or nil")
            try:
                certificate = AdmissionCertificate.decode(raw_cert)
            except BadCertificate as exc:
                raise _malformed(f"embedded {exc}") from None
        record = cls(
            publisher=fields["publisher"],
            name=fields["name"],
            blob_id=fields["blob"],
            seq=fields["seq"],
            time=fields["time"],
            expires=fields["expires"],
            signer_kind=fields["signer_kind"],
            certificate=certificate,
            signature=fields["sig"],
        )
        if record.encode() != bytes(data):
            raise _malformed("not canonically encoded (other key order or wider types)")
        return record

    def describe(self) -> str:
        return f"name record {self.publisher}/{self.name} seq {self.seq}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready view: what ``blob resolve --json`` prints."""
        return {
            "ref": str(self.ref),
            "publisher": self.publisher,
            "name": self.name,
            "id": self.blob_id,
            "seq": self.seq,
            "time": self.time,
            "expires": self.expires,
            "signer_kind": self.signer_kind,
            "certificate": None if self.certificate is None else self.certificate.to_json(),
            "record": self.encode().hex(),
        }


def _pack(fields: dict[str, Any]) -> bytes:
    data: bytes = encode_canonical(fields)
    return data


def _malformed(message: str) -> NameRejected:
    return NameRejected(NameReason.MALFORMED, f"malformed name record: {message}")


def sign_record(
    signer: Signer,
    *,
    name: str,
    blob_id: str,
    seq: int,
    time: int,
    expires: int | None = None,
    certificate: AdmissionCertificate | None = None,
) -> NameRecord:
    """Make and sign a record as ``signer.peer_id`` (:class:`BadName` for a bad name,
    :class:`NameRejected` MALFORMED for other bad fields)."""
    check_name(name)
    unsigned = NameRecord(
        publisher=signer.peer_id,
        name=name,
        blob_id=blob_id,
        seq=seq,
        time=time,
        expires=expires,
        signer_kind=signer.kind,
        certificate=certificate,
        signature=bytes(ED25519_SIGNATURE_SIZE),
    )
    return dataclasses.replace(unsigned, signature=signer.sign(unsigned.signed_message()))


def verify(
    data: bytes | NameRecord,
    *,
    now: float,
    publisher: str | None = None,
    name: str | None = None,
    trust: TrustStore | None = None,
) -> NameRecord:
    """The record if it can be believed at ``now``; else :class:`NameRejected` with the
    first failing rule's reason (module docstring, rules 1 to 5)."""
    record = data if isinstance(data, NameRecord) else NameRecord.decode(data)
    public_key = public_key_from_peer_id(record.publisher)
    if not verify_signature(public_key, record.signed_message(), record.signature):
        raise NameRejected(
            NameReason.BAD_SIGNATURE,
            f"{record.describe()} has a bad signature: altered, or not signed by its publisher",
        )
    if publisher is not None and record.publisher != publisher:
        raise NameRejected(
            NameReason.WRONG_PUBLISHER,
            f"{record.describe()} was asked for under publisher {publisher}",
        )
    if name is not None and record.name != name:
        raise NameRejected(
            NameReason.WRONG_NAME, f"{record.describe()} was asked for under name {name!r}"
        )
    if record.expires is not None and now >= record.expires:
        raise NameRejected(
            NameReason.EXPIRED,
            f"{record.describe()} expired at {record.expires} (now {int(now)}); "
            "ask its publisher to publish it again",
        )
    if trust is not None:
        if record.certificate is None:
            raise NameRejected(
                NameReason.MISSING_CERTIFICATE,
                f"{record.describe()} carries no admission certificate, and this resolver "
                "trusts only admitted publishers",
            )
        try:
            verify_certificate(record.certificate, trust=trust, now=now, peer_id=record.publisher)
        except CertificateRejected as exc:
            raise NameRejected(
                NameReason.CERTIFICATE, f"{record.describe()}: its {exc} ({exc.reason.value})"
            ) from exc
    return record


def order_key(record: NameRecord) -> tuple[int, int, bytes]:
    """Sort key of rule 6: the greatest is the newest."""
    return (record.seq, record.time, record.encode())


def newest(records: Iterable[NameRecord]) -> NameRecord | None:
    """The record every node selects among ``records`` (all for one name, all valid)."""
    return max(records, key=order_key, default=None)


def supersedes(new: NameRecord, old: NameRecord) -> bool:
    """Whether ``new`` replaces ``old`` (strictly newer by rule 6)."""
    return order_key(new) > order_key(old)
