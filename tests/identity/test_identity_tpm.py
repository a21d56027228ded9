"""Machines rooted in a TPM, against two real swtpm processes standing in for two machines.

The fixture manufactures two software TPMs whose EK certificates come from one local CA
(which the test authority trusts), runs them on private 127.0.0.1 ports for this module and
stops them after. Everything skips, saying why, where swtpm or tpm2-pytss is missing. Each
forgery test names the check it guards; each was seen failing with that check removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from identity import (
    AdmissionCertificate,
    AdmissionReason,
    AdmissionRefused,
    Attestation,
    AttestationRejected,
    MachineKey,
    Reason,
    TpmRefused,
    create_key_file,
    machine_signer,
    sign_attestation,
    verify_attestation,
)
from identity.cli import register
from identity.tpm import Answer, Challenge, Evidence, Registry, check_binding, make_challenge
from identity.tpm import device as tpm_device
from identity.tpm.swtpm import Swtpm, local_ca_certificates, missing_tools, running_swtpm

MISSING = missing_tools()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"TPM tests cannot run here: {MISSING}")

KERNEL_CLASS = "cpu-test"
DIGEST = bytes(range(32))


@click.group()
@click.option("--key", "key_path", type=click.Path(path_type=Path), required=True)
@click.pass_context
def group(ctx: click.Context, key_path: Path) -> None:
    ctx.ensure_object(dict)["key_path"] = key_path


register(group)


@dataclass
class Run:
    code: int
    stdout: str
    error: BaseException | None


def blob(key: Path, *args: str) -> Run:
    """``blob --key KEY ARGS`` in-process; identity errors come back as their exit codes."""
    result = CliRunner().invoke(group, ["--key", str(key), *args])
    exc = result.exception
    if exc is None or isinstance(exc, SystemExit):
        return Run(result.exit_code, result.stdout, None)
    code = getattr(type(exc), "exit_code", None)
    if not isinstance(code, int):
        raise exc
    return Run(code, result.stdout, exc)


def ok(run: Run) -> Run:
    assert run.code == 0, (run.stdout, run.error)
    return run


def refused(run: Run, reason: AdmissionReason) -> None:
    assert run.code == 1, (run.stdout, run.error)
    assert isinstance(run.error, AdmissionRefused), run.error
    assert run.error.reason is reason, run.error


@dataclass
class Tpms:
    a: Swtpm
    b: Swtpm
    ca_files: list[Path]


@pytest.fixture(scope="module")
def tpms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tpms]:
    root = tmp_path_factory.mktemp("swtpm")
    ca = root / "ca"
    with running_swtpm(root / "a", ca) as a, running_swtpm(root / "b", ca) as b:
        yield Tpms(a, b, local_ca_certificates(ca))


@dataclass
class Authority:
    key: Path
    public: str
    registry: Path
    ca_args: list[str]

    def challenge(self, key: Path, evidence: Path, out: Path, *extra: str) -> Run:
        return blob(
            key, "tpm", "challenge", str(evidence), *self.ca_args, "--authority", str(self.key),
            "--registry", str(self.registry), "-o", str(out), *extra,
        )  # fmt: skip

    def admit(
        self,
        key: Path,
        answer: Path,
        out: Path,
        *extra: str,
        operator: str = "alice",
        kernel_class: str = KERNEL_CLASS,
    ) -> Run:
        return blob(
            key, "tpm", "admit", str(answer), "--operator", operator, "--kernel-class",
            kernel_class, "--authority", str(self.key), "--registry", str(self.registry),
            "-o", str(out), "--json", *extra,
        )  # fmt: skip


@pytest.fixture
def authority(tmp_path: Path, tpms: Tpms) -> Authority:
    key = tmp_path / "authority.key"
    public = ok(blob(key, "authority", "new", "-o", str(key))).stdout.strip()
    ca_args = [arg for ca in tpms.ca_files for arg in ("--ek-ca", str(ca))]
    return Authority(key, public, tmp_path / "registry", ca_args)


def machine_key(tmp_path: Path, name: str) -> Path:
    key = tmp_path / name / "machine.key"
    create_key_file(key)
    return key


def bind(key: Path, tpm: Swtpm) -> Path:
    evidence = key.with_name("evidence")
    ok(blob(key, "tpm", "bind", "--tcti", tpm.tcti, "-o", str(evidence)))
    return evidence


def admit_through_cli(
    authority: Authority, key: Path, tpm: Swtpm, *extra: str, **admit: str
) -> Run:
    """bind, challenge, answer, admit: the whole sequence of the README."""
    evidence = bind(key, tpm)
    challenge = key.with_name("challenge")
    ok(authority.challenge(key, evidence, challenge))
    answer = key.with_name("answer")
    ok(blob(key, "tpm", "answer", str(challenge), "-o", str(answer)))
    return authority.admit(key, answer, key.with_name("cert"), *extra, **admit)


def sign_as(key: Path, kind: str, cert: Path) -> Path:
    """An attestation of ``kind`` signed as the round and replay code sign theirs."""
    from identity import load_key_file

    signer = machine_signer(load_key_file(key), key)
    att = sign_attestation(
        signer,
        kind=kind,
        digest=DIGEST,
        kernel_class=KERNEL_CLASS,
        time=int(time.time()),
        certificate=AdmissionCertificate.decode(cert.read_bytes()),
    )
    out = key.with_name(kind.replace("/", "-") + ".att")
    out.write_bytes(att.encode())
    return out


def verify_hardware(key: Path, authority: Authority, att: Path) -> dict[str, object]:
    run = blob(
        key, "attest", "verify", str(att), "--authority", authority.public, "--json",
        "--require-hardware",
    )  # fmt: skip
    result: dict[str, object] = json.loads(run.stdout)
    assert run.code == (0 if result["valid"] else 1)
    return result


def test_a_swtpm_machine_is_admitted_end_to_end_and_its_attestations_pass_require_hardware(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    key = machine_key(tmp_path, "m")
    admitted = json.loads(ok(admit_through_cli(authority, key, tpms.a)).stdout)
    assert admitted["machine_kind"] == "tpm"
    cert = AdmissionCertificate.decode(key.with_name("cert").read_bytes())
    assert cert.machine_kind == "tpm" and cert.ak is not None and cert.ek_hash is not None
    info = json.loads(ok(blob(key, "id", "--json")).stdout)
    assert info["signer_kind"] == "tpm"
    for kind in ("round-result", "blobnet/round-replay"):
        result = verify_hardware(key, authority, sign_as(key, kind, key.with_name("cert")))
        assert result["valid"] is True, result
        assert result["signer_kind"] == "tpm"
        assert result["ak"] == cert.ak.hex()

    # a software key admitted by the same authority is refused there
    soft = machine_key(tmp_path, "soft")
    peer = json.loads(ok(blob(soft, "id", "--json")).stdout)["peer_id"]
    soft_cert = soft.with_name("cert")
    ok(blob(soft, "admit", peer, "--operator", "bob", "--kernel-class", KERNEL_CLASS,
            "--authority", str(authority.key), "-o", str(soft_cert)))  # fmt: skip
    result = verify_hardware(soft, authority, sign_as(soft, "round-result", soft_cert))
    assert result["valid"] is False
    assert result["reason"] == "signer_kind_not_allowed"


def test_an_ek_certificate_from_an_untrusted_ca_is_refused(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    """Guards the EK chain check (admission rule 1)."""
    other_ca = tmp_path / "other-ca.pem"
    other_ca.write_bytes(_self_signed_ca("not the TPM maker"))
    authority.ca_args = ["--ek-ca", str(other_ca)]
    key = machine_key(tmp_path, "m")
    run = authority.challenge(key, bind(key, tpms.a), tmp_path / "challenge")
    refused(run, AdmissionReason.UNTRUSTED_EK)


def test_an_ek_public_area_that_is_not_the_certified_key_is_refused(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    """Guards admission rule 2: the credential must be encrypted to the certified EK."""
    key = machine_key(tmp_path, "m")
    evidence = Evidence.decode(bind(key, tpms.a).read_bytes())
    other = machine_key(tmp_path, "other")
    other_ek = Evidence.decode(bind(other, tpms.b).read_bytes()).ek_public
    forged = key.with_name("forged")
    forged.write_bytes(dataclasses.replace(evidence, ek_public=other_ek).encode())
    refused(authority.challenge(key, forged, tmp_path / "c"), AdmissionReason.EK_MISMATCH)


def _without_attribute(public: bytes, attribute: str) -> bytes:
    from identity.tpm._pytss import pytss

    t = pytss()
    area, _ = t.TPM2B_PUBLIC.unmarshal(public)
    area.publicArea.objectAttributes &= ~getattr(t.TPMA_OBJECT, attribute)
    return bytes(area.marshal())


def test_public_areas_without_the_required_attributes_are_refused(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    """The certified EK key in a public area that is not restricted, and an AK that is not
    restricted (it could sign anything, a forged quote included). Guards the attribute
    checks of admission rules 2 and 3."""
    key = machine_key(tmp_path, "m")
    evidence = Evidence.decode(bind(key, tpms.a).read_bytes())
    cases = (
        ("ek_public", evidence.ek_public, AdmissionReason.EK_MISMATCH),
        ("ak_public", evidence.ak_public, AdmissionReason.BAD_AK),
    )
    for field, public, reason in cases:
        forged = key.with_name(f"forged-{field}")
        changed = {field: _without_attribute(public, "RESTRICTED")}
        forged.write_bytes(dataclasses.replace(evidence, **changed).encode())  # type: ignore[arg-type]
        refused(authority.challenge(key, forged, tmp_path / "c"), reason)


def test_an_ak_from_another_tpm_fails_activation(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    """TPM A's endorsement with TPM B's AK (and B's valid binding of the key): neither TPM
    can activate the credential, and a guessed credential is refused. Guards the
    credential comparison (admission rule 6)."""
    key = machine_key(tmp_path, "m")
    evidence_a = Evidence.decode(bind(key, tpms.a).read_bytes())
    evidence_b = Evidence.decode(bind(key, tpms.b).read_bytes())
    forged = key.with_name("forged")
    forged.write_bytes(
        dataclasses.replace(
            evidence_a, ak_public=evidence_b.ak_public, binding=evidence_b.binding
        ).encode()
    )
    challenge = key.with_name("challenge")
    ok(authority.challenge(key, forged, challenge))
    for tpm in (tpms.a, tpms.b):
        run = blob(key, "tpm", "answer", str(challenge), "--tcti", tpm.tcti, "-o", "x")
        assert isinstance(run.error, TpmRefused), run
    from identity import load_key_file

    nonce = Challenge.decode(challenge.read_bytes()).nonce
    guess = key.with_name("guess")
    guess.write_bytes(Answer.sign(load_key_file(key), nonce, bytes(32)).encode())
    refused(authority.admit(key, guess, tmp_path / "cert"), AdmissionReason.ACTIVATION_FAILED)


def test_a_binding_over_another_ed25519_key_is_refused(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    """The AK vouched for key X; the evidence names key Y. Guards admission rule 4."""
    x = machine_key(tmp_path, "x")
    y = MachineKey.generate()
    evidence = Evidence.decode(bind(x, tpms.a).read_bytes())
    forged = x.with_name("forged")
    forged.write_bytes(dataclasses.replace(evidence, peer_id=y.peer_id).encode())
    refused(authority.challenge(x, forged, tmp_path / "c"), AdmissionReason.BAD_BINDING)


def test_a_replayed_answer_is_refused_even_when_replacing(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    """Guards the single use of a challenge's nonce (admission rule 6): with --replace the
    one-EK rule lets the second admission through, so only the nonce stops the replay."""
    key = machine_key(tmp_path, "m")
    ok(admit_through_cli(authority, key, tpms.a))
    again = tmp_path / "again"
    run = authority.admit(
        key, key.with_name("answer"), again, "--replace", "--revoked", str(tmp_path / "rl")
    )
    refused(run, AdmissionReason.UNKNOWN_CHALLENGE)
    # --replace alone is refused: the replaced certificate must join a revocation list
    assert authority.admit(key, key.with_name("answer"), again, "--replace").code == 2


def test_an_expired_challenge_is_refused(tmp_path: Path, tpms: Tpms, authority: Authority) -> None:
    """Guards the challenge's expiry (admission rule 6), on the authority's clock."""
    from identity import load_key_file

    key = machine_key(tmp_path, "m")
    cas = [x509.load_pem_x509_certificate(p.read_bytes()) for p in tpms.ca_files]
    now = time.time()
    machine = check_binding(Evidence.decode(bind(key, tpms.a).read_bytes()), cas, now=now)
    credential = bytes(range(32))
    challenge = make_challenge(
        machine, credential=credential, nonce=bytes(16), expires=int(now) + 60, authority=bytes(32)
    )
    registry = Registry().with_challenge(machine, challenge, credential, now)
    answer = Answer.sign(
        load_key_file(key), challenge.nonce, tpm_device.activate(tpms.a.tcti, challenge)
    )
    registry.answer(answer, now=now + 59, replace=False)  # in time: accepted
    with pytest.raises(AdmissionRefused) as info:
        registry.answer(answer, now=now + 60, replace=False)
    assert info.value.reason is AdmissionReason.EXPIRED_CHALLENGE


def test_a_second_admission_of_the_same_ek_is_refused_or_replaces_explicitly(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    """Guards one EK, one live admission (admission rule 5) where it is decisive: at the
    answer, for two challenges issued before either was answered."""
    first, second = machine_key(tmp_path, "first"), machine_key(tmp_path, "second")
    answers = []
    for key in (first, second):
        challenge = key.with_name("challenge")
        ok(authority.challenge(key, bind(key, tpms.a), challenge))
        answer = key.with_name("answer")
        ok(blob(key, "tpm", "answer", str(challenge), "-o", str(answer)))
        answers.append(answer)
    serial = json.loads(ok(authority.admit(first, answers[0], tmp_path / "c1")).stdout)["serial"]
    refused(
        authority.admit(second, answers[1], tmp_path / "c2"), AdmissionReason.EK_ALREADY_ADMITTED
    )
    # a new challenge is refused at once
    refused(
        authority.challenge(second, second.with_name("evidence"), tmp_path / "c3"),
        AdmissionReason.EK_ALREADY_ADMITTED,
    )
    # the explicit replacement admits the second key and revokes the first
    revoked = tmp_path / "revoked.txt"
    replaced = authority.admit(
        second, answers[1], tmp_path / "c2", "--replace", "--revoked", str(revoked)
    )
    assert json.loads(ok(replaced).stdout)["replaced_serial"] == serial
    assert revoked.read_text().split()[0] == str(serial)


def test_an_ak_signature_over_other_bytes_is_refused(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    """Two attestations co-signed by the same TPM: one's AK signature moved onto the other.
    Guards the AK co-signature check (attestation rule 1)."""
    key = machine_key(tmp_path, "m")
    ok(admit_through_cli(authority, key, tpms.a))
    cert = key.with_name("cert")
    result = Attestation.decode(sign_as(key, "round-result", cert).read_bytes())
    replay = Attestation.decode(sign_as(key, "blobnet/round-replay", cert).read_bytes())
    moved = dataclasses.replace(result, ak_signature=replay.ak_signature)
    with pytest.raises(AttestationRejected) as info:
        verify_attestation(moved.encode())
    assert info.value.reason is Reason.BAD_HARDWARE_SIGNATURE


def test_the_signer_refuses_a_tpm_other_than_the_bound_one(tmp_path: Path, tpms: Tpms) -> None:
    """A key bound on TPM A whose binding file is pointed at TPM B: no co-signature."""
    from identity import load_key_file
    from identity.tpm import MachineBinding, binding_path, read_binding

    key = machine_key(tmp_path, "m")
    bind(key, tpms.a)
    binding = read_binding(key)
    assert binding is not None
    path = binding_path(key)
    path.unlink()
    path.write_bytes(dataclasses.replace(binding, tcti=tpms.b.tcti).encode())
    signer = machine_signer(load_key_file(key), key)
    assert isinstance(binding, MachineBinding)
    with pytest.raises(TpmRefused, match="not the one this key was bound to"):
        sign_attestation(signer, kind="round-result", digest=DIGEST, kernel_class="k", time=1)


def _self_signed_ca(name: str) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, name)])
    now = time.time()
    import datetime

    start = datetime.datetime.fromtimestamp(now - 3600, datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def test_train_check_require_hardware_accepts_two_admitted_tpms(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    """The round's evidence check with --require-hardware: the runner's round-result from
    the machine on TPM A and a replay from another operator's machine on TPM B pass; the
    same replay from a software key does not."""
    pytest.importorskip("torch", reason="training's evidence check needs the train extra")
    from identity import TrustStore, load_key_file, parse_public_key
    from training.errors import EvidenceRejected
    from training.kernel_class import KERNEL_CLASS_SCHEMA, KernelClass
    from training.rounds.commitment import REPLAY_KIND, ROUND_KIND, Commitment, RoundRecord
    from training.rounds.recipe import Recipe, recipe_hash
    from training.rounds.round import check_evidence

    kc = KernelClass.from_fields(
        {"schema": KERNEL_CLASS_SCHEMA, "device": "cpu", "cpu_capability": "AVX2", "threads": 1}
    )
    recipe = Recipe(steps=1)
    commitment = Commitment(
        base_id="b" * 64, records_id="c" * 64, recipe_hash=recipe_hash(recipe), seed=1,
        kernel_class=kc, steps=1, start_root=bytes(32), end_root=bytes(range(32)),
        step_log=(0x40B00000,), adapter_id="d" * 64,
    )  # fmt: skip

    def attest(key: Path, kind: str, operator: str, tpm: Swtpm | None) -> bytes:
        cert = key.with_name("cert")
        if tpm is not None:
            ok(admit_through_cli(authority, key, tpm, operator=operator, kernel_class=kc.id))
        else:
            peer = load_key_file(key).peer_id
            ok(blob(key, "admit", peer, "--operator", operator, "--kernel-class", kc.id,
                    "--authority", str(authority.key), "-o", str(cert)))  # fmt: skip
        return sign_attestation(
            machine_signer(load_key_file(key), key),
            kind=kind,
            digest=commitment.digest,
            kernel_class=kc.id,
            subjects=(commitment.base_id, commitment.records_id, commitment.adapter_id),
            time=int(time.time()),
            certificate=AdmissionCertificate.decode(cert.read_bytes()),
        ).encode()

    record = RoundRecord(
        commitment, recipe, attest(machine_key(tmp_path, "a"), ROUND_KIND, "alice", tpms.a)
    )
    replay = attest(machine_key(tmp_path, "b"), REPLAY_KIND, "bob", tpms.b)
    soft = attest(machine_key(tmp_path, "s"), REPLAY_KIND, "carol", None)
    trust = TrustStore(frozenset({parse_public_key(authority.public)}))
    now = time.time()
    evidence = check_evidence(record, [replay], trust=trust, now=now, require_hardware=True)
    assert evidence.signer_kinds == ("tpm", "tpm")
    with pytest.raises(EvidenceRejected, match="signer kind not allowed"):
        check_evidence(record, [soft], trust=trust, now=now, require_hardware=True)


def test_malformed_evidence_and_an_unreachable_tpm_are_one_line_errors(
    tmp_path: Path, tpms: Tpms, authority: Authority
) -> None:
    """Hostile or broken inputs end in the identity errors (exit 1, 4, 5), never a
    traceback from tpm2-pytss or cryptography."""
    key = machine_key(tmp_path, "m")
    evidence = Evidence.decode(bind(key, tpms.a).read_bytes())
    for name, changes, code in (
        ("cert", {"ek_cert": b"not a certificate"}, 1),
        ("ek", {"ek_public": b"\x00\x05garbage"}, 4),
        ("ak", {"ak_public": b"\xff" * 40}, 4),
    ):
        forged = key.with_name(name)
        forged.write_bytes(dataclasses.replace(evidence, **changes).encode())  # type: ignore[arg-type]
        assert authority.challenge(key, forged, tmp_path / "c").code == code, name
    with socket_closed_port() as port:
        run = blob(key, "tpm", "bind", "--tcti", f"swtpm:host=127.0.0.1,port={port}", "-o", "e")
    assert run.code == 5, run
    assert "cannot open the TPM" in str(run.error)


@contextlib.contextmanager
def socket_closed_port() -> Iterator[int]:
    """A 127.0.0.1 port nothing listens on (held bound, not listening, while in use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_a_bound_keys_tpm_address_is_the_bindings_or_blobnet_tcti_and_errors_say_which(
    tmp_path: Path, tpms: Tpms, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a TPM-bound key, `attest sign` said "cannot open the TPM at --tcti '...'", a
    flag it does not have (the address is KEY.tpm's), and ignored $BLOBNET_TCTI. The
    variable now overrides the binding's address (the AK check still guards against
    another TPM), and each error names where the address came from."""
    from identity import load_key_file
    from identity.tpm import binding_path, read_binding

    key = machine_key(tmp_path, "m")
    bind(key, tpms.a)
    sign = ("attest", "sign", "--kind", "reviewed", "--digest", "ab" * 32, "--kernel-class",
            "k", "-o", str(tmp_path / "a.att"))  # fmt: skip

    monkeypatch.setenv("BLOBNET_TCTI", tpms.b.tcti)  # honoured: B is not the bound TPM
    run = blob(key, *sign)
    assert isinstance(run.error, TpmRefused), run
    assert "$BLOBNET_TCTI" in str(run.error) and tpms.b.tcti in str(run.error)
    monkeypatch.setenv("BLOBNET_TCTI", tpms.a.tcti)
    ok(blob(key, *sign))

    monkeypatch.delenv("BLOBNET_TCTI")
    binding = read_binding(key)
    assert binding is not None
    with socket_closed_port() as port:
        moved = f"swtpm:host=127.0.0.1,port={port}"
        binding_path(key).unlink()
        binding_path(key).write_bytes(dataclasses.replace(binding, tcti=moved).encode())
        run = blob(key, *sign)
    assert run.code == 5, run
    said = str(run.error)
    assert "cannot open the TPM" in said and moved in said and str(binding_path(key)) in said
    assert "--tcti" not in said and "$BLOBNET_TCTI overrides it" in said
    assert machine_signer(load_key_file(key), key, environ={}).tcti == moved
