"""The identity commands.

Most tests run the commands in-process (``click.testing.CliRunner``) on a small group
that sets ``ctx.obj["key_path"]`` as the ``blob`` program does, and map errors to exit
statuses as its ``main`` does: starting the real program costs seconds because of the
libp2p import. One test runs the real ``blob`` program in subprocesses end to end.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from identity import (
    Authority,
    MachineKey,
    SoftwareSigner,
    format_public_key,
    load_key_file,
    sign_attestation,
)
from identity.cli import register
from identity.keyfile import ScryptCost

REPO = Path(__file__).resolve().parents[2]

FAST = ScryptCost(log_n=12)  # new key files quick to seal; the file records the cost


@click.group()
@click.option("--key", "key_path", type=click.Path(path_type=Path), required=True)
@click.pass_context
def group(ctx: click.Context, key_path: Path) -> None:
    ctx.ensure_object(dict)["key_path"] = key_path


register(group)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def blob(tmp: Path, *args: str, key: Path | None = None, passphrase: str | None = None) -> Result:
    """Run ``blob --key KEY ARGS`` in-process, with ``blob``'s error-to-exit-status rule."""
    key = key if key is not None else tmp / "cfg" / "machine.key"
    result = CliRunner().invoke(
        group,
        ["--key", str(key), *args],
        env={"BLOBNET_PASSPHRASE": passphrase},
        obj={"scrypt_cost": FAST},  # sealed keys stay quick to make and open
    )
    exc = result.exception
    if exc is None or isinstance(exc, SystemExit):
        return Result(result.exit_code, result.stdout, result.stderr)
    code = getattr(type(exc), "exit_code", None)
    if not isinstance(code, int):
        raise exc  # a bug: blob's main would show the traceback too
    return Result(code, result.stdout, f"blob: error: {exc}\n")


def ok(result: Result) -> Result:
    assert result.returncode == 0, result.stderr
    return result


def one_line_error(result: Result, code: int) -> str:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_id_creates_the_key_on_first_use_and_says_so(tmp_path: Path) -> None:
    key = tmp_path / "cfg" / "machine.key"
    first = ok(blob(tmp_path, "id", "--json"))
    info = json.loads(first.stdout)
    assert info["created"] is True
    assert "created a new machine key" in first.stderr
    assert info["peer_id"].startswith("12D3KooW")
    assert info["signer_kind"] == "software"
    assert info["key_file"] == str(key)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert load_key_file(key).peer_id == info["peer_id"]

    again = ok(blob(tmp_path, "id"))
    assert again.stderr == ""
    assert info["peer_id"] in again.stdout
    assert "software" in again.stdout

    os.chmod(key, 0o644)
    err = one_line_error(blob(tmp_path, "id"), 5)
    assert f"chmod 600 {key}" in err


def test_admit_sign_and_verify(tmp_path: Path) -> None:
    auth = tmp_path / "authority.key"
    made = ok(blob(tmp_path, "authority", "new", "-o", str(auth)))
    public = made.stdout.strip()
    assert len(public) == 64
    assert (tmp_path / "authority.key.pub").read_text().strip() == public
    assert stat.S_IMODE(auth.stat().st_mode) == 0o600
    before = auth.read_bytes()
    one_line_error(blob(tmp_path, "authority", "new", "-o", str(auth)), 2)
    assert auth.read_bytes() == before

    peer = json.loads(ok(blob(tmp_path, "id", "--json")).stdout)["peer_id"]
    cert = tmp_path / "machine.cert"
    admitted = ok(
        blob(
            tmp_path, "admit", peer, "--operator", "alice", "--kernel-class", "cpu-abc",
            "--authority", str(auth), "--days", "2", "--serial", "77", "-o", str(cert), "--json",
        )
    )  # fmt: skip
    assert json.loads(admitted.stdout)["serial"] == 77
    att = tmp_path / "round.att"
    ok(
        blob(
            tmp_path, "attest", "sign", "--kind", "dataset-reviewed", "--digest", "ab" * 32,
            "--kernel-class", "cpu-abc", "--subject", "cd" * 32, "--cert", str(cert),
            "-o", str(att),
        )
    )  # fmt: skip

    def verify(*extra: str, path: Path = att) -> Result:
        return blob(tmp_path, "attest", "verify", str(path), "--json", *extra)

    valid = ok(verify("--authority", str(tmp_path / "authority.key.pub")))
    claims = json.loads(valid.stdout)
    assert claims["valid"] is True
    assert claims["signer_peer_id"] == peer
    assert claims["certificate"]["operator"] == "alice"
    assert claims["digest"] == "ab" * 32
    assert claims["subjects"] == ["cd" * 32]

    def rejected(reason: str, *extra: str, path: Path = att) -> None:
        result = verify(*extra, path=path)
        assert result.returncode == 1, (result.stdout, result.stderr)
        assert json.loads(result.stdout)["reason"] == reason

    rejected("wrong_kernel_class", "--authority", public, "--kernel-class", "cuda-x")
    rejected("unknown_authority", "--authority", "00" * 32)
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("# lost\n77\n")
    rejected("revoked", "--authority", public, "--revoked", str(revoked))
    revoked.write_text(f"{peer}\n")
    rejected("revoked", "--authority", public, "--revoked", str(revoked))

    data = att.read_bytes()
    flipped = tmp_path / "flipped.att"
    flipped.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    rejected("bad_signature", "--authority", public, path=flipped)
    truncated = tmp_path / "truncated.att"
    truncated.write_bytes(data[:-5])
    rejected("malformed", "--authority", public, path=truncated)

    text = blob(tmp_path, "attest", "verify", str(flipped), "--authority", public)
    assert text.returncode == 1
    assert text.stdout.startswith("rejected (bad signature)")
    missing = blob(tmp_path, "attest", "verify", str(tmp_path / "nope"), "--authority", public)
    one_line_error(missing, 3)


@pytest.mark.parametrize(
    "kind", ["round-result", "replay", "round-replay", "blobnet/round-replay", "blobnet/x"]
)
def test_attest_sign_refuses_kinds_only_computing_code_may_sign(tmp_path: Path, kind: str) -> None:
    """An operator cannot vouch for a round, a replay or an outer update by hand."""
    out = tmp_path / "a.att"
    result = blob(
        tmp_path, "attest", "sign", "--kind", kind, "--digest", "ab" * 32,
        "--kernel-class", "cpu-abc", "-o", str(out),
    )  # fmt: skip
    assert "reserved kind" in one_line_error(result, 2)
    assert not out.exists()
    # a kind outside the reserved ones still signs
    ok(
        blob(
            tmp_path, "attest", "sign", "--kind", "blobnet-x", "--digest", "ab" * 32,
            "--kernel-class", "cpu-abc", "-o", str(out),
        )
    )  # fmt: skip


def test_verify_can_require_a_hardware_signer(tmp_path: Path) -> None:
    auth = tmp_path / "authority.key"
    public = ok(blob(tmp_path, "authority", "new", "-o", str(auth))).stdout.strip()
    peer = json.loads(ok(blob(tmp_path, "id", "--json")).stdout)["peer_id"]
    cert = tmp_path / "machine.cert"
    ok(
        blob(
            tmp_path, "admit", peer, "--operator", "alice", "--kernel-class", "k",
            "--authority", str(auth), "-o", str(cert),
        )
    )  # fmt: skip
    att = tmp_path / "a.att"
    ok(
        blob(
            tmp_path, "attest", "sign", "--kind", "note", "--digest", "ab" * 32,
            "--kernel-class", "k", "--cert", str(cert), "-o", str(att),
        )
    )  # fmt: skip
    args = ("attest", "verify", str(att), "--authority", public, "--json")
    assert json.loads(ok(blob(tmp_path, *args)).stdout)["signer_kind"] == "software"
    refused = blob(tmp_path, *args, "--require-hardware")
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["reason"] == "signer_kind_not_allowed"


def test_bad_inputs_are_usage_errors(tmp_path: Path) -> None:
    auth = tmp_path / "authority.key"
    ok(blob(tmp_path, "authority", "new", "-o", str(auth)))
    bad_peer = blob(
        tmp_path, "admit", "QmNotAnEd25519Peer", "--operator", "a", "--kernel-class", "k",
        "--authority", str(auth), "-o", str(tmp_path / "c"),
    )  # fmt: skip
    assert "12D3KooW" in one_line_error(bad_peer, 2)
    # a certificate for someone else cannot be embedded in this machine's attestation
    other_key = tmp_path / "other.key"
    other = json.loads(ok(blob(tmp_path, "id", "--json", key=other_key)).stdout)["peer_id"]
    cert = tmp_path / "other.cert"
    ok(
        blob(
            tmp_path, "admit", other, "--operator", "bob", "--kernel-class", "k",
            "--authority", str(auth), "-o", str(cert),
        )
    )  # fmt: skip
    sign = blob(
        tmp_path, "attest", "sign", "--kind", "r", "--digest", "00" * 32, "--kernel-class", "k",
        "--cert", str(cert), "-o", str(tmp_path / "a.att"),
    )  # fmt: skip
    assert sign.returncode == 2
    assert "admits" in sign.stderr
    assert not (tmp_path / "a.att").exists()


def test_encrypted_authority_key(tmp_path: Path) -> None:
    auth = tmp_path / "authority.key"
    ok(blob(tmp_path, "authority", "new", "-o", str(auth), "--encrypt", passphrase="s3cret"))
    before = auth.read_bytes()
    peer = json.loads(ok(blob(tmp_path, "id", "--json")).stdout)["peer_id"]
    args = ("admit", peer, "--operator", "a", "--kernel-class", "k", "--authority", str(auth))
    wrong = blob(tmp_path, *args, "-o", str(tmp_path / "c"), passphrase="guess")
    assert "wrong passphrase" in one_line_error(wrong, 4)
    assert "BLOBNET_PASSPHRASE" in one_line_error(blob(tmp_path, *args, "-o", "c"), 2)
    assert auth.read_bytes() == before
    # BLOBNET_PASSPHRASE would also encrypt the machine key created by `id`, so use the
    # one created above with no passphrase in the environment: give both via env is fine,
    # the passphrase is ignored for an unencrypted key.
    ok(blob(tmp_path, *args, "-o", str(tmp_path / "c"), passphrase="s3cret"))
    assert (tmp_path / "c").stat().st_size > 0


@pytest.mark.parametrize("days", ["0", "-1", "x"])
def test_admit_rejects_bad_days(tmp_path: Path, days: str) -> None:
    result = blob(
        tmp_path, "admit", "12D3KooW", "--operator", "a", "--kernel-class", "k",
        "--authority", "a", "--days", days, "-o", "c",
    )  # fmt: skip
    assert result.returncode == 2


def real_blob(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOBNET_")}
    env.update(XDG_CONFIG_HOME=str(tmp / "xdg-config"), XDG_DATA_HOME=str(tmp / "xdg-data"))
    cmd = [sys.executable, "-m", "p2p.cli", "--store", str(tmp / "store")]
    cmd += ["--key", str(tmp / "cfg" / "machine.key"), *args]
    return subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


@pytest.mark.slow
def test_real_blob_program(tmp_path: Path) -> None:
    """End to end through ``python -m p2p.cli``: key creation, the exit status of a
    rejected attestation, and one-line errors."""
    key_path = tmp_path / "cfg" / "machine.key"
    created = real_blob(tmp_path, "id", "--json")
    assert created.returncode == 0, created.stderr
    peer = json.loads(created.stdout)["peer_id"]
    assert "created a new machine key" in created.stderr
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    machine = load_key_file(key_path)
    assert machine.peer_id == peer

    authority_key = MachineKey.generate()
    cert = Authority(SoftwareSigner(authority_key)).admit(
        peer, operator="a", kernel_class="k", not_before=0, not_after=2**40, serial=1
    )
    att = sign_attestation(
        SoftwareSigner(machine), kind="r", digest=bytes(32), kernel_class="k", time=0,
        certificate=cert,
    )  # fmt: skip
    data = att.encode()
    (tmp_path / "bad.att").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    public = format_public_key(authority_key.public_key_bytes)
    bad = real_blob(tmp_path, "attest", "verify", str(tmp_path / "bad.att"), "--authority", public)
    assert bad.returncode == 1, (bad.stdout, bad.stderr)
    assert "bad signature" in bad.stdout

    os.chmod(key_path, 0o640)
    refused = real_blob(tmp_path, "id")
    assert refused.returncode == 5
    assert "Traceback" not in refused.stderr
    assert refused.stderr.strip().count("\n") == 0
    assert f"chmod 600 {key_path}" in refused.stderr


def test_cert_show_tells_what_a_certificate_records(tmp_path: Path) -> None:
    """No command showed a certificate (machine kind, the AK, the EK hash, validity):
    `blob cert show FILE [--json]` does, and with --authority says whether it is valid."""
    import time

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from identity import HardwareRoot

    auth = tmp_path / "authority.key"
    public = ok(blob(tmp_path, "authority", "new", "-o", str(auth))).stdout.strip()
    peer = json.loads(ok(blob(tmp_path, "id", "--json")).stdout)["peer_id"]
    ak = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    )
    now = int(time.time())
    cert = Authority(SoftwareSigner(load_key_file(auth))).admit(
        peer, operator="alice", kernel_class="cpu-demo", not_before=now - 60,
        not_after=now + 86400, serial=42, hardware=HardwareRoot(ak=ak, ek_hash=b"\x07" * 32),
    )  # fmt: skip
    path = tmp_path / "m.cert"
    path.write_bytes(cert.encode())

    shown = json.loads(ok(blob(tmp_path, "cert", "show", str(path), "--json")).stdout)
    assert shown["machine_kind"] == "tpm" and shown["ak"] == ak.hex()
    assert shown["ek_hash"] == "07" * 32 and shown["peer_id"] == peer
    assert shown["window"] == "valid" and shown["not_after"] == now + 86400
    assert shown["checked"] is False and shown["valid"] is None
    text = ok(blob(tmp_path, "cert", "show", str(path))).stdout
    assert "machine kind: tpm" in text and ak.hex() in text and "07" * 32 in text
    assert "not checked" in text

    checked = json.loads(
        ok(blob(tmp_path, "cert", "show", str(path), "--authority", public, "--json")).stdout
    )
    assert checked["valid"] is True
    stranger = format_public_key(MachineKey.generate().public_key_bytes)
    refused = blob(tmp_path, "cert", "show", str(path), "--authority", stranger, "--json")
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["reason"] == "unknown_authority"
