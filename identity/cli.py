"""Identity commands of the ``blob`` program.

``blob id``, ``blob authority new``, ``blob admit``, ``blob cert show``, ``blob attest
sign``, ``blob attest verify`` and the ``blob tpm`` group (:mod:`identity.tpm.cli`). Errors are
the identity package's own, each with its ``exit_code``; ``blob attest verify`` prints its
verdict and exits 0 (valid) or 1 (rejected, malformed included) so scripts can rely on the
status alone.

Passphrases: ``BLOBNET_PASSPHRASE``, when set, encrypts keys these commands create and
decrypts encrypted keys they load; without it an encrypted key is unlocked by a prompt
when stdin is a terminal.
"""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path

import click

from blobstore.exitcodes import ExitCode
from blobstore.options import json_option

from ._files import PUBLIC_FILE_MODE, write_file
from .attestation import DIGEST_SIZE, MAX_ATTESTATION_SIZE, sign_attestation, verify_attestation
from .certificate import (
    MAX_CERTIFICATE_SIZE,
    AdmissionCertificate,
    Authority,
    iso_time,
    verify_certificate,
)
from .cli_common import (
    CLOCK_SKEW_ALLOWANCE_S,
    PASSPHRASE_ENV,
    authority_key_option,
    days_option,
    echo_json,
    env_passphrase,
    fields_error,
    kernel_class_option,
    load_key,
    load_trust,
    machine_key,
    make_trust_options,
    operator_option,
    read_input,
    require_hardware_option,
    scrypt_cost,
    trust_options,
)
from .errors import (
    KeyExists,
    Rejected,
    ReservedKind,
)
from .keyfile import create_key_file
from .keys import format_public_key
from .kinds import HARDWARE_SIGNER_KINDS, RESERVED_KINDS, RESERVED_PREFIX, is_reserved_kind
from .peerid import parse_peer_id
from .signer import SoftwareSigner
from .tpm.cli import tpm_group
from .tpm.signer import machine_signer


def register(group: click.Group) -> None:
    """Add the identity commands to the top-level group."""
    group.add_command(id_command)
    group.add_command(authority_group)
    group.add_command(admit_command)
    group.add_command(attest_group)
    group.add_command(cert_group)
    group.add_command(tpm_group)


@click.command("id")
@json_option()
@click.pass_context
def id_command(ctx: click.Context, as_json: bool) -> None:
    """Show this machine's peer ID (creating its key on first use)."""
    key, path, created = machine_key(ctx)
    signer = machine_signer(key, path)
    if as_json:
        echo_json(
            {
                "peer_id": key.peer_id,
                "public_key": format_public_key(key.public_key_bytes),
                "key_file": str(path),
                "signer_kind": signer.kind,
                "created": created,
            }
        )
    else:
        click.echo(f"peer ID:    {key.peer_id}")
        click.echo(f"key file:   {path}")
        click.echo(f"signer:     {signer.kind}")


@click.group("authority")
def authority_group() -> None:
    """Admission authorities: the keys that admit machines to a run."""


@authority_group.command("new")
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Private key file to create (mode 0600); the public key goes to FILE.pub.",
)
@click.option(
    "--encrypt", is_flag=True, help=f"Seal the key under a passphrase (${PASSPHRASE_ENV} or ask)."
)
@json_option()
@click.pass_context
def authority_new(ctx: click.Context, output: Path, encrypt: bool, as_json: bool) -> None:
    """Create an authority key and print its public key."""
    pub_path = output.with_name(output.name + ".pub")
    for p in (output, pub_path):
        if p.exists() or p.is_symlink():
            raise KeyExists(f"{p} already exists and is never overwritten; choose another path")
    passphrase = env_passphrase()
    if encrypt and passphrase is None:
        if not sys.stdin.isatty():
            raise click.UsageError(f"--encrypt needs a terminal or ${PASSPHRASE_ENV}")
        passphrase = click.prompt(
            f"New passphrase for {output}", hide_input=True, confirmation_prompt=True, err=True
        )
    key = create_key_file(output, passphrase, cost=scrypt_cost(ctx))
    public = format_public_key(key.public_key_bytes)
    write_file(pub_path, (public + "\n").encode(), mode=PUBLIC_FILE_MODE, overwrite=False)
    if as_json:
        echo_json(
            {
                "public_key": public,
                "key_file": str(output),
                "public_key_file": str(pub_path),
                "encrypted": passphrase is not None,
            }
        )
    else:
        click.echo(public)
        click.echo(
            f"blob: authority key {output} created; give verifiers {pub_path} "
            "(or the public key above)",
            err=True,
        )


@click.command("admit")
@click.argument("peer_id")
@operator_option
@kernel_class_option
@authority_key_option
@days_option
@click.option(
    "--serial",
    type=click.IntRange(min=0, max=(1 << 64) - 1),
    default=None,
    help="Serial number (default: random 63-bit).",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Certificate file to write.",
)
@json_option()
def admit_command(
    peer_id: str,
    operator: str,
    kernel_class: str,
    authority_path: Path,
    days: int,
    serial: int | None,
    output: Path,
    as_json: bool,
) -> None:
    """Sign an admission certificate for PEER_ID."""
    parse_peer_id(peer_id)
    authority = Authority(SoftwareSigner(load_key(authority_path)))
    now = int(time.time())
    try:
        cert = authority.admit(
            peer_id,
            operator=operator,
            kernel_class=kernel_class,
            not_before=max(0, now - CLOCK_SKEW_ALLOWANCE_S),
            not_after=now + days * 86400,
            serial=secrets.randbits(63) if serial is None else serial,
        )
    except ValueError as exc:
        raise fields_error(exc) from None
    write_file(output, cert.encode(), mode=PUBLIC_FILE_MODE, overwrite=True)
    if as_json:
        echo_json({**cert.to_json(), "file": str(output)})
    else:
        click.echo(
            f"admitted {peer_id} (operator {operator!r}, kernel class {kernel_class!r}) "
            f"until {iso_time(cert.not_after)}, serial {cert.serial}: {output}"
        )


@click.group("attest")
def attest_group() -> None:
    """Signed statements about digests, and their verification."""


@attest_group.command("sign")
@click.option(
    "--kind",
    required=True,
    help="Statement kind, e.g. dataset-reviewed (kinds of computed results, such as "
    "round-result and blobnet/..., are reserved for the commands that compute them).",
)
@click.option("--digest", "digest_hex", required=True, help="The 32-byte digest, 64 hex digits.")
@click.option("--kernel-class", required=True, help="Kernel class the statement is about.")
@click.option("--subject", "subjects", multiple=True, help="Blob ID the statement concerns.")
@click.option(
    "--cert",
    "cert_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="This machine's admission certificate, to embed.",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Attestation file to write.",
)
@json_option()
@click.pass_context
def attest_sign(
    ctx: click.Context,
    kind: str,
    digest_hex: str,
    kernel_class: str,
    subjects: tuple[str, ...],
    cert_path: Path | None,
    output: Path,
    as_json: bool,
) -> None:
    """Sign an attestation with this machine's key.

    Kinds that assert a computed result (round-result, replay, blobnet/...) are refused:
    only the command that computed the result signs those (see identity.kinds).
    """
    if is_reserved_kind(kind):
        reserved = ", ".join(sorted(RESERVED_KINDS))
        raise ReservedKind(
            f"--kind {kind!r} is a reserved kind: only the command that computed the result "
            f"signs it (`blob train run`, `blob train replay`, the outer loop); reserved are "
            f"{reserved} and every kind starting with {RESERVED_PREFIX!r}"
        )
    try:
        digest = bytes.fromhex(digest_hex)
    except ValueError:
        digest = b""
    if len(digest) != DIGEST_SIZE:
        raise click.BadParameter("must be 64 hex digits (32 bytes)", param_hint="--digest")
    cert = None
    if cert_path is not None:
        cert_data = read_input(cert_path, "certificate", MAX_CERTIFICATE_SIZE)
        cert = AdmissionCertificate.decode(cert_data)
    key, path, _created = machine_key(ctx)
    try:
        attestation = sign_attestation(
            machine_signer(key, path),
            kind=kind,
            digest=digest,
            kernel_class=kernel_class,
            subjects=subjects,
            time=int(time.time()),
            certificate=cert,
        )
    except ValueError as exc:
        raise fields_error(exc) from None
    write_file(output, attestation.encode(), mode=PUBLIC_FILE_MODE, overwrite=True)
    if as_json:
        echo_json({**attestation.to_json(), "file": str(output)})
    else:
        click.echo(f"signed {attestation.describe()}: {output}")


@attest_group.command("verify")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@trust_options
@click.option("--kind", default=None, help="Require this statement kind.")
@click.option("--kernel-class", default=None, help="Require this kernel class.")
@require_hardware_option(
    "Accept only attestations co-signed by a TPM attestation key their certificate "
    "records (other hardware kinds carry no evidence this verifier checks)."
)
@json_option()
@click.pass_context
def attest_verify(
    ctx: click.Context,
    file: Path,
    authorities: tuple[str, ...],
    revoked_path: Path | None,
    kind: str | None,
    kernel_class: str | None,
    require_hardware: bool,
    as_json: bool,
) -> None:
    """Verify an attestation and its certificate; exit 0 if valid, 1 if rejected."""
    trust = load_trust(authorities, revoked_path)
    data = read_input(file, "attestation", MAX_ATTESTATION_SIZE)
    try:
        claims = verify_attestation(
            data,
            trust=trust,
            now=time.time(),
            kind=kind,
            kernel_class=kernel_class,
            signer_kinds=HARDWARE_SIGNER_KINDS if require_hardware else None,
        )
    except Rejected as exc:
        if as_json:
            echo_json({"valid": False, "reason": exc.reason.name.lower(), "message": str(exc)})
        else:
            click.echo(f"rejected ({exc.reason.value}): {exc}")
        ctx.exit(ExitCode.REJECTED)
    if as_json:
        echo_json({"valid": True, **claims.to_json()})
    else:
        cert = claims.certificate
        assert cert is not None
        click.echo(
            f"valid: {claims.describe()} (operator {cert.operator!r}, kernel class "
            f"{claims.kernel_class!r}, signer {claims.signer_kind}), digest {claims.digest.hex()}"
        )


@click.group("cert")
def cert_group() -> None:
    """Admission certificates (from `blob admit` or `blob tpm admit`)."""


@cert_group.command("show")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@make_trust_options(
    required=False,
    authority_help="Also check the certificate against this authority public key: 64 hex "
    "digits or a .pub file (repeatable); exit 1 if it is not valid now.",
)
@json_option()
@click.pass_context
def cert_show(
    ctx: click.Context,
    file: Path,
    authorities: tuple[str, ...],
    revoked_path: Path | None,
    as_json: bool,
) -> None:
    """Show an admission certificate: the machine it admits, its operator and kernel class,
    where its attestation key lives (machine kind tpm: the AK and the TPM's EK hash), its
    validity and its authority. With --authority, also whether it is valid now."""
    if revoked_path is not None and not authorities:
        raise click.UsageError("--revoked needs --authority: revocations count for a verifier")
    trust = load_trust(authorities, revoked_path) if authorities else None
    cert = AdmissionCertificate.decode(read_input(file, "certificate", MAX_CERTIFICATE_SIZE))
    now = time.time()
    window = (
        "not yet valid"
        if now < cert.not_before
        else "expired"
        if now >= cert.not_after
        else "valid"
    )
    verdict: Rejected | None = None
    if trust is not None:
        try:
            verify_certificate(cert, trust=trust, now=now)
        except Rejected as exc:
            verdict = exc
    if as_json:
        echo_json(
            {
                **cert.to_json(),
                "file": str(file),
                "not_before_utc": iso_time(cert.not_before),
                "not_after_utc": iso_time(cert.not_after),
                "window": window,
                "checked": trust is not None,
                "valid": None if trust is None else verdict is None,
                "reason": None if verdict is None else verdict.reason.name.lower(),
            }
        )
    else:
        hardware = cert.machine_kind != "software"
        rows = [
            ("peer ID", cert.peer_id),
            ("operator", repr(cert.operator)),
            ("kernel class", cert.kernel_class),
            ("machine kind", cert.machine_kind),
            ("AK", cert.ak.hex() if hardware and cert.ak else "none (software key)"),
            ("EK hash", cert.ek_hash.hex() if hardware and cert.ek_hash else "none"),
            ("validity", f"{iso_time(cert.not_before)} to {iso_time(cert.not_after)} ({window})"),
            ("serial", str(cert.serial)),
            ("authority", f"{cert.authority.hex()} ({cert.authority_kind})"),
        ]
        if trust is None:
            rows.append(("signature", "not checked (give --authority KEY)"))
        elif verdict is None:
            rows.append(("signature", "valid now for the authorities given"))
        else:
            rows.append(("signature", f"rejected ({verdict.reason.value}): {verdict}"))
        for label, value in rows:
            click.echo(f"{label + ':':<14}{value}")
    if verdict is not None:
        ctx.exit(ExitCode.REJECTED)
