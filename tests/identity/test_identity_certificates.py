"""Admission certificates: each failure has its own reason; decoding is strict."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from identity import (
    CERTIFICATE_DOMAIN,
    AdmissionCertificate,
    Authority,
    BadCertificate,
    BadRevocationList,
    CertificateRejected,
    MachineKey,
    Reason,
    RevocationList,
    SoftwareSigner,
    TrustStore,
    verify_certificate,
)

NOW = 1_800_000_000
DAY = 86_400
KERNEL_CLASS = "cuda-sm90-bf16"


def reason_of(cert: AdmissionCertificate | bytes, trust: TrustStore, **kw: Any) -> Reason:
    with pytest.raises(CertificateRejected) as info:
        verify_certificate(cert, trust=trust, **kw)
    assert info.value.exit_code in (1, 4)
    return info.value.reason


def test_valid_certificate_round_trips_and_verifies(world: Any) -> None:
    data = world.cert.encode()
    assert AdmissionCertificate.decode(data) == world.cert
    got = verify_certificate(
        data, trust=world.trust, now=NOW, peer_id=world.machine.peer_id, kernel_class=KERNEL_CLASS
    )
    assert got == world.cert
    assert (got.operator, got.serial, got.authority_kind) == ("alice", 42, "software")


def test_validity_window_edges(world: Any) -> None:
    cert = world.cert
    verify_certificate(cert, trust=world.trust, now=cert.not_before)
    verify_certificate(cert, trust=world.trust, now=cert.not_after - 1)
    assert reason_of(cert, world.trust, now=cert.not_before - 1) is Reason.NOT_YET_VALID
    assert reason_of(cert, world.trust, now=cert.not_after) is Reason.EXPIRED
    with pytest.raises(CertificateRejected, match="expired at"):
        verify_certificate(cert, trust=world.trust, now=cert.not_after + DAY)


def test_revoked_by_serial_or_by_peer_id(world: Any) -> None:
    by_serial = TrustStore(world.trust.authorities, RevocationList(serials=frozenset({42})))
    by_peer = TrustStore(
        world.trust.authorities, RevocationList(peer_ids=frozenset({world.machine.peer_id}))
    )
    others = TrustStore(
        world.trust.authorities,
        RevocationList(frozenset({41, 43}), frozenset({MachineKey.generate().peer_id})),
    )
    assert reason_of(world.cert, by_serial, now=NOW) is Reason.REVOKED
    assert reason_of(world.cert, by_peer, now=NOW) is Reason.REVOKED
    verify_certificate(world.cert, trust=others, now=NOW)


def test_unknown_authority(world: Any) -> None:
    stranger = TrustStore(frozenset({MachineKey.generate().public_key_bytes}))
    assert reason_of(world.cert, stranger, now=NOW) is Reason.UNKNOWN_AUTHORITY
    assert reason_of(world.cert, TrustStore(frozenset()), now=NOW) is Reason.UNKNOWN_AUTHORITY


def test_wrong_kernel_class_and_wrong_peer(world: Any) -> None:
    assert (
        reason_of(world.cert, world.trust, now=NOW, kernel_class="rocm-gfx942")
        is Reason.WRONG_KERNEL_CLASS
    )
    other = MachineKey.generate().peer_id
    assert reason_of(world.cert, world.trust, now=NOW, peer_id=other) is Reason.WRONG_PEER


@pytest.mark.parametrize(
    "change",
    [
        {"operator": "mallory"},
        {"kernel_class": "cpu"},
        {"not_after": NOW + 3650 * DAY},
        {"serial": 43},
        {"authority_kind": "tpm"},
    ],
)
def test_altered_certificate_has_a_bad_signature(world: Any, change: dict[str, Any]) -> None:
    forged = dataclasses.replace(world.cert, **change)
    assert reason_of(forged.encode(), world.trust, now=NOW) is Reason.BAD_SIGNATURE


def test_every_flipped_byte_is_rejected(world: Any) -> None:
    data = world.cert.encode()
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(CertificateRejected):
            verify_certificate(bytes(bad), trust=world.trust, now=NOW)


def test_certificate_claiming_a_trusted_authority_but_signed_by_another(world: Any) -> None:
    rogue = MachineKey.generate()
    forged = dataclasses.replace(world.cert, serial=7)
    forged = dataclasses.replace(forged, signature=rogue.sign(forged.signed_message()))
    assert forged.authority == world.authority_key.public_key_bytes
    assert reason_of(forged, world.trust, now=NOW) is Reason.BAD_SIGNATURE


@pytest.mark.parametrize(
    "prefix", [b"", b"blobnet-attestation-v1:", b"noise-libp2p-static-key:", b"blobnet-x:"]
)
def test_signature_under_another_domain_is_rejected(world: Any, prefix: bytes) -> None:
    body = world.cert.signed_message()[len(CERTIFICATE_DOMAIN) :]
    forged = dataclasses.replace(world.cert, signature=world.authority_key.sign(prefix + body))
    assert reason_of(forged, world.trust, now=NOW) is Reason.BAD_SIGNATURE


def test_authority_can_use_any_signer_kind(world: Any) -> None:
    class FakeTpmSigner(SoftwareSigner):
        @property
        def kind(self) -> str:
            return "tpm"

    authority = Authority(FakeTpmSigner(world.authority_key))
    cert = authority.admit(
        world.machine.peer_id,
        operator="alice",
        kernel_class=KERNEL_CLASS,
        not_before=NOW,
        not_after=NOW + 1,
        serial=1,
    )
    assert verify_certificate(cert.encode(), trust=world.trust, now=NOW).authority_kind == "tpm"


@pytest.mark.parametrize(
    "fields",
    [
        {"peer_id": "not-a-peer"},
        {"operator": ""},
        {"operator": "bad\nname"},
        {"kernel_class": "has space"},
        {"not_before": 10, "not_after": 10},
        {"serial": -1},
    ],
)
def test_admit_refuses_malformed_fields(world: Any, fields: dict[str, Any]) -> None:
    args: dict[str, Any] = {
        "peer_id": world.machine.peer_id,
        "operator": "alice",
        "kernel_class": KERNEL_CLASS,
        "not_before": NOW,
        "not_after": NOW + DAY,
        "serial": 1,
        **fields,
    }
    with pytest.raises(ValueError):  # noqa: PT011 - any local-misuse ValueError
        world.authority.admit(args.pop("peer_id"), **args)


def fields_of(cert: AdmissionCertificate) -> dict[str, Any]:
    fields: dict[str, Any] = msgpack.unpackb(cert.encode(), raw=False)
    return fields


def test_canonical_packer_sanity(world: Any, repack: Any) -> None:
    assert repack(fields_of(world.cert)) == world.cert.encode()


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda f: {**f, "extra": 1}, id="extra-key"),
        pytest.param(lambda f: {k: v for k, v in f.items() if k != "operator"}, id="missing-key"),
        pytest.param(lambda f: {**f, "serial": str(f["serial"])}, id="serial-as-str"),
        pytest.param(lambda f: {**f, "serial": float(f["serial"])}, id="serial-as-float"),
        pytest.param(lambda f: {**f, "serial": True}, id="serial-as-bool"),
        pytest.param(lambda f: {**f, "peer": f["peer"].encode()}, id="peer-as-bytes"),
        pytest.param(lambda f: {**f, "authority": f["authority"].hex()}, id="authority-as-str"),
        pytest.param(lambda f: {**f, "sig": f["sig"][:-1]}, id="short-sig"),
        pytest.param(lambda f: {**f, "v": 2}, id="version-2"),
        pytest.param(lambda f: dict(reversed(list(f.items()))), id="key-order"),
    ],
)
def test_strict_decoding_rejects(world: Any, repack: Any, mutate: Any) -> None:
    data = repack(mutate(fields_of(world.cert)))
    with pytest.raises(BadCertificate) as info:
        AdmissionCertificate.decode(data)
    assert info.value.reason is Reason.MALFORMED
    assert info.value.exit_code == 4


@pytest.mark.parametrize(
    ("wide", "str8"),
    [({"serial"}, set()), ({"not_before"}, set()), ({"v"}, set()), (set(), {"operator"})],
)
def test_non_canonical_spellings_are_rejected(
    world: Any, repack: Any, wide: set[str], str8: set[str]
) -> None:
    data = repack(fields_of(world.cert), wide=frozenset(wide), str8=frozenset(str8))
    assert msgpack.unpackb(data, raw=False) == fields_of(world.cert)  # same values...
    with pytest.raises(BadCertificate, match="canonical"):  # ...but not the one spelling
        AdmissionCertificate.decode(data)


def test_trailing_bytes_and_oversize_are_rejected(world: Any) -> None:
    with pytest.raises(BadCertificate):
        AdmissionCertificate.decode(world.cert.encode() + b"\x00")
    with pytest.raises(BadCertificate, match="limit"):
        AdmissionCertificate.decode(b"\x80" * 5000)


def test_revocation_list_parsing(world: Any) -> None:
    peer = world.machine.peer_id
    text = f"# revoked on 2027-01-01\n42\n\n  {peer}  # stolen laptop\n7\n"
    revoked = RevocationList.parse(text)
    assert revoked.serials == {42, 7}
    assert revoked.peer_ids == {peer}
    with pytest.raises(BadRevocationList, match="line 2"):
        RevocationList.parse("1\nnot-a-peer\n")
    with pytest.raises(BadRevocationList):
        RevocationList.parse("-5\n")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=600))
def test_random_bytes_raise_only_bad_certificate(data: bytes) -> None:
    try:
        cert = AdmissionCertificate.decode(data)
    except BadCertificate:
        return
    assert cert.encode() == data  # anything accepted is canonical


_leaf_values = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=70)
    | st.binary(max_size=70)
    | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3)
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_structured_garbage_raises_only_bad_certificate(world: Any, data: st.DataObject) -> None:
    """Well-formed msgpack with some fields of a real certificate swapped for random values
    (or removed, or joined by extra ones) gets past the msgpack layer into the field
    checks; only BadCertificate may come out."""
    fields = fields_of(world.cert)
    for key in data.draw(st.lists(st.sampled_from([*fields, "x"]), max_size=4)):
        if data.draw(st.booleans()):
            fields[key] = data.draw(_leaf_values)
        else:
            fields.pop(key, None)
    encoded = msgpack.packb(fields, use_bin_type=True)
    try:
        cert = AdmissionCertificate.decode(encoded)
    except BadCertificate:
        return
    assert cert.encode() == encoded


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(position=st.integers(min_value=0), value=st.integers(0, 255), data=st.data())
def test_mutated_certificates_raise_only_rejections(
    world: Any, position: int, value: int, data: st.DataObject
) -> None:
    raw = bytearray(world.cert.encode())
    raw[position % len(raw)] = value
    cut = data.draw(st.integers(0, len(raw)))
    for candidate in (bytes(raw), bytes(raw[:cut])):
        try:
            verify_certificate(candidate, trust=world.trust, now=NOW)
        except CertificateRejected:
            continue
        assert candidate == world.cert.encode()
