"""The evidence check: two valid attestations over the round's digest from distinct
admitted operators of its kernel class, one of them a replay, and every way that can
fail."""

from __future__ import annotations

import dataclasses

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from identity import (
    AdmissionCertificate,
    Authority,
    HardwareRoot,
    MachineKey,
    RevocationList,
    SoftwareSigner,
    TrustStore,
    sign_attestation,
)
from training.errors import EvidenceRejected
from training.kernel_class import KERNEL_CLASS_SCHEMA, KernelClass
from training.rounds.commitment import REPLAY_KIND, ROUND_KIND, Commitment, RoundRecord
from training.rounds.recipe import Recipe, recipe_hash
from training.rounds.round import check_evidence

NOW = 1_800_000_000
KC = KernelClass.from_fields(
    {"schema": KERNEL_CLASS_SCHEMA, "device": "cpu", "cpu_capability": "AVX2", "threads": 1}
)
OTHER_KC = KernelClass.from_fields({**KC.fields, "cpu_capability": "AVX512"})
RECIPE = Recipe(steps=2)


def _commitment(kc: KernelClass = KC, seed: int = 1) -> Commitment:
    return Commitment(
        base_id="b" * 64,
        records_id="c" * 64,
        recipe_hash=recipe_hash(RECIPE),
        seed=seed,
        kernel_class=kc,
        steps=2,
        start_root=bytes(32),
        end_root=bytes(range(32)),
        step_log=(0x40B00000, 0x40A00000),
        adapter_id="d" * 64,
    )


class TpmSigner(SoftwareSigner):
    """Stands in for a TPM-bound signer: a P-256 key in memory plays the attestation key."""

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


class ClaimsTpmSigner(SoftwareSigner):
    """Says it is a TPM but has no attestation key to co-sign with."""

    @property
    def kind(self) -> str:
        return "tpm"


@dataclasses.dataclass
class Machine:
    signer: SoftwareSigner
    cert: AdmissionCertificate


class Setup:
    def __init__(self) -> None:
        self.authority = Authority(SoftwareSigner(MachineKey.generate()))
        self.trust = TrustStore(frozenset({self.authority.public_key_bytes}))
        self.serial = 0

    def machine(
        self,
        operator: str,
        kc: KernelClass = KC,
        *,
        not_after: int = NOW + 3600,
        signer_class: type[SoftwareSigner] = SoftwareSigner,
    ) -> Machine:
        signer = signer_class(MachineKey.generate())
        self.serial += 1
        cert = self.authority.admit(
            signer.peer_id,
            operator=operator,
            kernel_class=kc.id,
            not_before=NOW - 3600,
            not_after=not_after,
            serial=self.serial,
            hardware=HardwareRoot(signer.ak, bytes(32)) if isinstance(signer, TpmSigner) else None,
        )
        return Machine(signer, cert)


def _attest(m: Machine, c: Commitment, kc: KernelClass = KC, kind: str = REPLAY_KIND) -> bytes:
    return sign_attestation(
        m.signer,
        kind=kind,
        digest=c.digest,
        kernel_class=kc.id,
        subjects=(c.base_id, c.records_id, c.adapter_id),
        time=NOW,
        certificate=m.cert,
    ).encode()


@pytest.fixture
def setup() -> Setup:
    return Setup()


def _record(runner: Machine, c: Commitment | None = None) -> RoundRecord:
    c = c or _commitment()
    return RoundRecord(c, RECIPE, _attest(runner, c, kind=ROUND_KIND))


def test_two_operators_accept(setup: Setup) -> None:
    alice, bob = setup.machine("alice"), setup.machine("bob")
    record = _record(alice)
    evidence = check_evidence(record, [_attest(bob, record.commitment)], trust=setup.trust, now=NOW)
    assert evidence.operators == ("alice", "bob")
    assert evidence.digest == record.commitment.digest
    # the record round-trips through its canonical encoding
    assert RoundRecord.decode(record.encode()) == record


def test_same_operator_twice_rejects(setup: Setup) -> None:
    a1, a2 = setup.machine("alice"), setup.machine("alice")
    record = _record(a1)
    with pytest.raises(EvidenceRejected, match=r"1 distinct admitted operator"):
        check_evidence(record, [_attest(a2, record.commitment)], trust=setup.trust, now=NOW)
    with pytest.raises(EvidenceRejected, match=r"1 distinct"):
        check_evidence(record, [record.attestation], trust=setup.trust, now=NOW)


def test_different_digest_rejects(setup: Setup) -> None:
    alice, bob = setup.machine("alice"), setup.machine("bob")
    record = _record(alice)
    other = _attest(bob, _commitment(seed=2))
    with pytest.raises(EvidenceRejected, match="not the round's"):
        check_evidence(record, [other], trust=setup.trust, now=NOW)


def test_bad_signature_rejects(setup: Setup) -> None:
    alice, bob = setup.machine("alice"), setup.machine("bob")
    record = _record(alice)
    good = _attest(bob, record.commitment)
    # flip a byte of the signature (the last bytes of the canonical map)
    forged = good[:-1] + bytes([good[-1] ^ 1])
    with pytest.raises(EvidenceRejected, match="bad signature"):
        check_evidence(record, [forged], trust=setup.trust, now=NOW)


def test_wrong_kernel_class_rejects(setup: Setup) -> None:
    alice = setup.machine("alice")
    bob_other = setup.machine("bob", OTHER_KC)
    record = _record(alice)
    with pytest.raises(EvidenceRejected, match="wrong kernel class"):
        check_evidence(
            record, [_attest(bob_other, record.commitment, OTHER_KC)], trust=setup.trust, now=NOW
        )


def test_revoked_certificate_rejects(setup: Setup) -> None:
    alice, bob = setup.machine("alice"), setup.machine("bob")
    record = _record(alice)
    trust = TrustStore(
        setup.trust.authorities, RevocationList(serials=frozenset({bob.cert.serial}))
    )
    with pytest.raises(EvidenceRejected, match="revoked"):
        check_evidence(record, [_attest(bob, record.commitment)], trust=trust, now=NOW)


def test_expired_certificate_rejects(setup: Setup) -> None:
    alice, bob = setup.machine("alice"), setup.machine("bob", not_after=NOW - 1)
    record = _record(alice)
    with pytest.raises(EvidenceRejected, match="expired"):
        check_evidence(record, [_attest(bob, record.commitment)], trust=setup.trust, now=NOW)


def test_unknown_authority_rejects(setup: Setup) -> None:
    alice = setup.machine("alice")
    stranger = Setup().machine("bob")
    record = _record(alice)
    with pytest.raises(EvidenceRejected, match="unknown authority"):
        check_evidence(record, [_attest(stranger, record.commitment)], trust=setup.trust, now=NOW)


def test_a_second_round_result_is_not_a_replay(setup: Setup) -> None:
    """A `round-result` attestation signed by hand (`blob attest sign --kind round-result`)
    by a second operator vouches for nothing: it says "I ran it", not "I replayed it"."""
    alice, bob = setup.machine("alice"), setup.machine("bob")
    record = _record(alice)
    by_hand = _attest(bob, record.commitment, kind=ROUND_KIND)
    with pytest.raises(EvidenceRejected, match=r"wrong statement kind.*blob train replay"):
        check_evidence(record, [by_hand], trust=setup.trust, now=NOW)
    # a replay without the runner still needs two operators who both replayed
    carol = setup.machine("carol")
    replays = [_attest(bob, record.commitment), _attest(carol, record.commitment)]
    evidence = check_evidence(record, replays, trust=setup.trust, now=NOW, include_runner=False)
    assert evidence.operators == ("bob", "carol")
    with pytest.raises(EvidenceRejected, match="1 replay"):
        check_evidence(record, replays[:1], trust=setup.trust, now=NOW, include_runner=False)


def test_require_hardware_accepts_only_hardware_signers(setup: Setup) -> None:
    alice, bob = setup.machine("alice"), setup.machine("bob")
    record = _record(alice)
    replay = _attest(bob, record.commitment)
    evidence = check_evidence(record, [replay], trust=setup.trust, now=NOW)
    assert evidence.signer_kinds == ("software", "software")
    with pytest.raises(EvidenceRejected, match="signer kind not allowed"):
        check_evidence(record, [replay], trust=setup.trust, now=NOW, require_hardware=True)
    hw_alice = setup.machine("alice", signer_class=TpmSigner)
    hw_bob = setup.machine("bob", signer_class=TpmSigner)
    hw_record = _record(hw_alice)
    hw_replay = _attest(hw_bob, hw_record.commitment)
    accepted = check_evidence(
        hw_record, [hw_replay], trust=setup.trust, now=NOW, require_hardware=True
    )
    assert accepted.signer_kinds == ("tpm", "tpm")
    # one software signer among them is enough to refuse
    mixed = _record(alice, hw_record.commitment)
    with pytest.raises(EvidenceRejected, match="'software' signer"):
        check_evidence(mixed, [hw_replay], trust=setup.trust, now=NOW, require_hardware=True)
    # a signer that only claims a TPM, with no attestation key's co-signature, is refused
    claimed = _attest(setup.machine("bob", signer_class=ClaimsTpmSigner), hw_record.commitment)
    with pytest.raises(EvidenceRejected, match="hardware unproven"):
        check_evidence(hw_record, [claimed], trust=setup.trust, now=NOW, require_hardware=True)
