"""Attestations: signed claims that cannot be altered, re-signed or replayed."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from identity import (
    ATTESTATION_DOMAIN,
    CERTIFICATE_DOMAIN,
    HARDWARE_SIGNER_KINDS,
    AdmissionCertificate,
    Attestation,
    AttestationRejected,
    BadAttestation,
    BadCertificate,
    HardwareRoot,
    MachineKey,
    Reason,
    RevocationList,
    SoftwareSigner,
    TrustStore,
    sign_attestation,
    verify_attestation,
)

NOW = 1_800_000_000
DAY = 86_400
KERNEL_CLASS = "cuda-sm90-bf16"
DIGEST = bytes(range(32))
SUBJECTS = ("a" * 64, "0123456789abcdef" * 4)


def make(world: Any, **overrides: Any) -> Attestation:
    args: dict[str, Any] = {
        "kind": "round-result",
        "digest": DIGEST,
        "kernel_class": KERNEL_CLASS,
        "subjects": SUBJECTS,
        "time": NOW - 60,
        "certificate": world.cert,
        **overrides,
    }
    signer = args.pop("signer", world.signer)
    return sign_attestation(signer, **args)


def reason_of(data: bytes | Attestation, **kw: Any) -> Reason:
    with pytest.raises(AttestationRejected) as info:
        verify_attestation(data, **kw)
    return info.value.reason


def test_round_trip_returns_the_claims(world: Any) -> None:
    att = make(world)
    data = att.encode()
    assert Attestation.decode(data) == att
    claims = verify_attestation(data, trust=world.trust, now=NOW)
    assert claims == att
    assert claims.kind == "round-result"
    assert claims.digest == DIGEST
    assert claims.subjects == SUBJECTS
    assert claims.signer_peer_id == world.machine.peer_id
    assert claims.signer_kind == "software"
    assert claims.certificate == world.cert
    # signature only, no trust: no certificate needed
    bare = make(world, certificate=None)
    assert verify_attestation(bare.encode()).certificate is None


def test_every_flipped_byte_is_rejected(world: Any) -> None:
    """One flipped bit anywhere (claims, embedded certificate, signature) is caught."""
    data = make(world).encode()
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(AttestationRejected):
            verify_attestation(bytes(bad), trust=world.trust, now=NOW)
        bad[i] ^= 0x81  # now the top bit flipped instead
        with pytest.raises(AttestationRejected):
            verify_attestation(bytes(bad))


def test_signed_by_another_key_is_rejected(world: Any) -> None:
    att = make(world)
    other = MachineKey.generate()
    resigned = dataclasses.replace(att, signature=other.sign(att.signed_message()))
    assert reason_of(resigned.encode()) is Reason.BAD_SIGNATURE
    # claiming someone else's peer ID with our signature
    impostor = dataclasses.replace(att, signer_peer_id=other.peer_id)
    assert reason_of(impostor.encode()) is Reason.BAD_SIGNATURE


@pytest.mark.parametrize(
    "prefix",
    [
        b"",
        CERTIFICATE_DOMAIN,
        b"noise-libp2p-static-key:",
        ATTESTATION_DOMAIN + b"update-published\n",  # the same body under another kind
        b"blobnet-attestation-v2:round-result\n",
    ],
)
def test_signature_made_under_another_domain_is_rejected(world: Any, prefix: bytes) -> None:
    att = make(world)
    body = att.signed_message().split(b"\n", 1)[1]
    assert att.signed_message() == ATTESTATION_DOMAIN + b"round-result\n" + body
    replayed = dataclasses.replace(att, signature=world.machine.sign(prefix + body))
    assert reason_of(replayed.encode()) is Reason.BAD_SIGNATURE


def test_a_certificate_signature_cannot_pass_as_an_attestation(world: Any) -> None:
    """The authority's signature on a certificate is useless for attestations, even by
    the authority's own peer ID."""
    authority_signer = SoftwareSigner(world.authority_key)
    att = sign_attestation(
        authority_signer, kind="k", digest=DIGEST, kernel_class=KERNEL_CLASS, time=NOW
    )
    stolen = dataclasses.replace(att, signature=world.cert.signature)
    assert reason_of(stolen) is Reason.BAD_SIGNATURE


def test_changed_claims_are_rejected(world: Any) -> None:
    att = make(world)
    for change in (
        {"digest": bytes(32)},
        {"kind": "update-published"},
        {"subjects": SUBJECTS[:1]},
        {"time": NOW},
        {"signer_kind": "tpm"},
        {"certificate": None},
    ):
        assert reason_of(dataclasses.replace(att, **change).encode()) is Reason.BAD_SIGNATURE


def test_certificate_checks_become_attestation_reasons(world: Any) -> None:
    att = make(world)
    assert reason_of(att, trust=world.trust, now=NOW + 31 * DAY) is Reason.EXPIRED
    assert reason_of(att, trust=world.trust, now=NOW - 2 * DAY) is Reason.NOT_YET_VALID
    stranger = TrustStore(frozenset({MachineKey.generate().public_key_bytes}))
    assert reason_of(att, trust=stranger, now=NOW) is Reason.UNKNOWN_AUTHORITY
    for revoked in (
        RevocationList(serials=frozenset({world.cert.serial})),
        RevocationList(peer_ids=frozenset({world.machine.peer_id})),
    ):
        trust = TrustStore(world.trust.authorities, revoked)
        assert reason_of(att, trust=trust, now=NOW) is Reason.REVOKED
    bare = make(world, certificate=None)
    assert reason_of(bare, trust=world.trust, now=NOW) is Reason.MISSING_CERTIFICATE
    with pytest.raises(TypeError, match="now"):
        verify_attestation(att, trust=world.trust)


def test_certificate_must_bind_the_signer_and_its_kernel_class(world: Any) -> None:
    # Someone else's valid certificate, embedded in my attestation.
    other = MachineKey.generate()
    their_cert = world.authority.admit(
        other.peer_id,
        operator="bob",
        kernel_class=KERNEL_CLASS,
        not_before=NOW - DAY,
        not_after=NOW + DAY,
        serial=2,
    )
    with pytest.raises(ValueError, match="admits"):
        make(world, certificate=their_cert)  # the signing side refuses outright
    att = make(world, certificate=None)
    borrowed = dataclasses.replace(att, certificate=their_cert)
    borrowed = dataclasses.replace(
        borrowed, signature=world.machine.sign(borrowed.signed_message())
    )
    assert verify_attestation(borrowed).certificate == their_cert  # signature is fine...
    assert reason_of(borrowed, trust=world.trust, now=NOW) is Reason.WRONG_PEER  # ...binding not

    # My certificate, but the attestation claims another kernel class.
    att = make(world, kernel_class="rocm-gfx942", certificate=None)
    wrong = dataclasses.replace(att, certificate=world.cert)
    wrong = dataclasses.replace(wrong, signature=world.machine.sign(wrong.signed_message()))
    assert reason_of(wrong, trust=world.trust, now=NOW) is Reason.WRONG_KERNEL_CLASS


def test_verifier_expectations(world: Any) -> None:
    att = make(world)
    assert reason_of(att, kind="update-published") is Reason.WRONG_KIND
    assert reason_of(att, kernel_class="cpu") is Reason.WRONG_KERNEL_CLASS
    assert reason_of(att, signer_kinds={"tpm", "tee"}) is Reason.SIGNER_KIND_NOT_ALLOWED
    assert verify_attestation(att, kind="round-result", signer_kinds={"software"}) == att


def test_a_hardware_kind_claimed_without_evidence_is_refused(world: Any) -> None:
    """A signer that only *says* it is a TEE: before hardware kinds needed evidence, its
    claim passed a verifier that required hardware; now it is refused whatever is asked."""

    class EnclaveSigner:
        kind = "tee"

        def __init__(self, key: MachineKey) -> None:
            self._key = key
            self.peer_id = key.peer_id
            self.public_key_bytes = key.public_key_bytes

        def sign(self, message: bytes) -> bytes:
            return self._key.sign(message)

    att = sign_attestation(
        EnclaveSigner(world.machine),
        kind="round-result",
        digest=DIGEST,
        kernel_class=KERNEL_CLASS,
        time=NOW,
        certificate=world.cert,
    )
    assert att.signer_kind == "tee"
    assert reason_of(att, trust=world.trust, now=NOW, signer_kinds={"tee"}) is (
        Reason.HARDWARE_UNPROVEN
    )
    assert reason_of(att) is Reason.HARDWARE_UNPROVEN


def fields_of(att: Attestation) -> dict[str, Any]:
    fields: dict[str, Any] = msgpack.unpackb(att.encode(), raw=False)
    return fields


def test_canonical_packer_sanity(world: Any, repack: Any) -> None:
    att = make(world)
    assert repack(fields_of(att)) == att.encode()


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda f: {**f, "extra": 1}, id="extra-key"),
        pytest.param(lambda f: {k: v for k, v in f.items() if k != "time"}, id="missing-key"),
        pytest.param(lambda f: {**f, "digest": f["digest"].hex()}, id="digest-as-str"),
        pytest.param(lambda f: {**f, "digest": f["digest"][:31]}, id="short-digest"),
        pytest.param(lambda f: {**f, "time": float(f["time"])}, id="time-as-float"),
        pytest.param(lambda f: {**f, "time": -1}, id="negative-time"),
        pytest.param(lambda f: {**f, "subjects": ["A" * 64]}, id="uppercase-subject"),
        pytest.param(lambda f: {**f, "subjects": [b"a" * 64]}, id="subject-as-bytes"),
        pytest.param(lambda f: {**f, "subjects": ["a" * 64] * 1025}, id="too-many-subjects"),
        pytest.param(lambda f: {**f, "cert": "x"}, id="cert-as-str"),
        pytest.param(lambda f: {**f, "cert": f["cert"][:-1]}, id="truncated-cert"),
        pytest.param(lambda f: {**f, "signer": "QmNotOurs"}, id="bad-signer"),
        pytest.param(lambda f: {**f, "kind": "bad kind"}, id="bad-kind"),
        pytest.param(lambda f: {**f, "v": 0}, id="version-0"),
        pytest.param(lambda f: dict(sorted(f.items())), id="key-order"),
    ],
)
def test_strict_decoding_rejects(world: Any, mutate: Any) -> None:
    data = msgpack.packb(mutate(fields_of(make(world))), use_bin_type=True)
    with pytest.raises(BadAttestation) as info:
        verify_attestation(data)
    assert info.value.reason is Reason.MALFORMED
    assert info.value.exit_code == 4


@pytest.mark.parametrize(("wide", "str8"), [({"time"}, set()), (set(), {"kind"}), ({"v"}, set())])
def test_non_canonical_spellings_are_rejected(
    world: Any, repack: Any, wide: set[str], str8: set[str]
) -> None:
    att = make(world)
    data = repack(fields_of(att), wide=frozenset(wide), str8=frozenset(str8))
    assert msgpack.unpackb(data, raw=False) == fields_of(att)
    with pytest.raises(BadAttestation, match="canonical"):
        Attestation.decode(data)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=1000))
def test_random_bytes_raise_only_bad_attestation(data: bytes) -> None:
    try:
        att = Attestation.decode(data)
    except BadAttestation:
        return
    assert att.encode() == data


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_mutated_attestations_raise_only_rejections(world: Any, data: st.DataObject) -> None:
    """Random overwrites, truncations and insertions of a valid attestation: the verifier
    either accepts the original bytes or raises AttestationRejected, nothing else."""
    good = make(world).encode()
    raw = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw)))
        op = data.draw(st.sampled_from(["set", "insert", "cut"]))
        if op == "set" and pos < len(raw):
            raw[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del raw[pos:]
    try:
        verify_attestation(bytes(raw), trust=world.trust, now=NOW)
    except AttestationRejected:
        return
    assert bytes(raw) == good


class FakeTpmSigner(SoftwareSigner):
    """A TPM-bound signer without a TPM: a P-256 key in memory plays the attestation key."""

    def __init__(self, key: MachineKey) -> None:
        super().__init__(key)
        self._ak = ec.generate_private_key(ec.SECP256R1())

    @property
    def kind(self) -> str:
        return "tpm"

    @property
    def ak(self) -> bytes:
        return self._ak.public_key().public_bytes(Encoding.X962, PublicFormat.UncompressedPoint)

    def cosign(self, message: bytes) -> bytes:
        r, s = decode_dss_signature(self._ak.sign(message, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def hardware_world(world: Any) -> tuple[FakeTpmSigner, AdmissionCertificate]:
    signer = FakeTpmSigner(world.machine)
    cert = world.authority.admit(
        world.machine.peer_id,
        operator="alice",
        kernel_class=KERNEL_CLASS,
        not_before=NOW - DAY,
        not_after=NOW + DAY,
        serial=7,
        hardware=HardwareRoot(ak=signer.ak, ek_hash=bytes(range(32))),
    )
    return signer, cert


def test_a_cosigned_attestation_passes_require_hardware(world: Any) -> None:
    signer, cert = hardware_world(world)
    att = make(world, signer=signer, certificate=cert)
    assert att.ak == signer.ak
    assert Attestation.decode(att.encode()) == att
    claims = verify_attestation(
        att.encode(), trust=world.trust, now=NOW, signer_kinds=HARDWARE_SIGNER_KINDS
    )
    assert claims.signer_kind == "tpm"
    # the certificate round-trips as version 2 with what the authority recorded
    assert AdmissionCertificate.decode(cert.encode()) == cert
    assert msgpack.unpackb(cert.encode())["v"] == 2


def test_an_ak_the_certificate_does_not_record_proves_nothing(world: Any) -> None:
    """A software key holder makes up a P-256 "AK" and co-signs with it, carrying a real
    certificate of the machine: the AK is not the admitted one. Guards the check that the
    certificate records the attestation's AK (attestation rule 2)."""
    _signer, cert = hardware_world(world)
    impostor = FakeTpmSigner(world.machine)

    def forged(certificate: AdmissionCertificate) -> Attestation:
        # sign_attestation refuses a certificate for another AK: the forger signs by hand
        unsigned = dataclasses.replace(
            make(world, signer=impostor, certificate=None), certificate=certificate
        )
        return dataclasses.replace(
            unsigned,
            signature=world.machine.sign(unsigned.signed_message()),
            ak_signature=impostor.cosign(unsigned.cosigned_message()),
        )

    assert reason_of(forged(cert), trust=world.trust, now=NOW) is Reason.HARDWARE_UNPROVEN
    # and a software-admitted machine's certificate records no AK at all
    assert reason_of(forged(world.cert), trust=world.trust, now=NOW) is Reason.HARDWARE_UNPROVEN
    with pytest.raises(ValueError, match="does not record this machine's TPM attestation key"):
        make(world, signer=impostor, certificate=cert)


def test_an_ak_cosignature_over_other_bytes_is_refused(world: Any) -> None:
    """Guards the AK co-signature check (attestation rule 1) without a TPM."""
    signer, cert = hardware_world(world)
    att = make(world, signer=signer, certificate=cert)
    other = make(world, signer=signer, certificate=cert, digest=bytes(32))
    moved = dataclasses.replace(att, ak_signature=other.ak_signature)
    assert reason_of(moved.encode()) is Reason.BAD_HARDWARE_SIGNATURE
    # the AK travels inside the Ed25519-signed bytes: swapping it breaks that signature
    swapped = dataclasses.replace(att, ak=FakeTpmSigner(world.machine).ak)
    assert reason_of(swapped.encode()) is Reason.BAD_SIGNATURE


def test_a_software_certificate_stays_version_1(world: Any) -> None:
    assert msgpack.unpackb(world.cert.encode())["v"] == 1
    assert world.cert.machine_kind == "software" and world.cert.ak is None


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda f: {k: v for k, v in f.items() if k != "ek"}, id="missing-ek"),
        pytest.param(lambda f: {**f, "machine_kind": "software"}, id="software-with-ak"),
        pytest.param(lambda f: {**f, "machine_kind": "tee"}, id="unknown-machine-kind"),
        pytest.param(lambda f: {**f, "v": 1}, id="version-1-with-ak"),
        pytest.param(lambda f: {**f, "ak": b"\x04" + bytes(64)}, id="ak-not-on-the-curve"),
        pytest.param(lambda f: {**f, "ek": f["ek"][:31]}, id="short-ek"),
    ],
)
def test_hardware_certificates_decode_strictly(world: Any, repack: Any, mutate: Any) -> None:
    _signer, cert = hardware_world(world)
    fields = msgpack.unpackb(cert.encode(), raw=False)
    assert repack(fields) == cert.encode()
    with pytest.raises(BadCertificate):
        AdmissionCertificate.decode(repack(mutate(fields)))


def test_hardware_attestations_decode_strictly(world: Any, repack: Any) -> None:
    signer, cert = hardware_world(world)
    att = make(world, signer=signer, certificate=cert)
    fields = fields_of(att)
    assert fields["v"] == 2 and repack(fields) == att.encode()
    for broken in (
        {k: v for k, v in fields.items() if k != "ak_sig"},
        {**fields, "signer_kind": "software"},
        {**fields, "v": 1},
        {**fields, "ak_sig": fields["ak_sig"][:63]},
    ):
        with pytest.raises(BadAttestation):
            Attestation.decode(repack(broken))
