"""``blob tpm``: bind a machine key to its TPM, and admit machines on their TPMs.

Machine: ``blob tpm bind`` (evidence file), then ``blob tpm answer`` (to the challenge).
Authority: ``blob tpm challenge`` (checks the evidence, makes the challenge), then
``blob tpm admit`` (checks the answer, signs a certificate recording the AK and EK).
Refusals exit 1 with their reason; the README's "Machines rooted in a TPM" has a
runnable sequence.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import click

from blobstore.options import json_option

from .._files import PUBLIC_FILE_MODE, write_file
from ..certificate import Authority, HardwareRoot, iso_time
from ..cli_common import (
    CLOCK_SKEW_ALLOWANCE_S,
    MAX_REVOCATION_LIST_SIZE,
    authority_key_option,
    days_option,
    echo_json,
    fields_error,
    kernel_class_option,
    load_key,
    machine_key,
    operator_option,
    read_input,
)
from ..errors import BadTpmData, NotFound
from ..signer import SoftwareSigner
from . import device
from .admission import (
    DEFAULT_CHALLENGE_LIFETIME_S,
    MAX_EK_CA_FILE_SIZE,
    Admitted,
    check_binding,
    make_challenge,
    parse_ek_cas,
)
from .formats import (
    CREDENTIAL_SIZE,
    MAX_ANSWER_SIZE,
    MAX_CHALLENGE_SIZE,
    MAX_EVIDENCE_SIZE,
    NONCE_SIZE,
    Answer,
    Challenge,
    Evidence,
)
from .registry import open_registry
from .signer import TCTI_ENV, MachineBinding, binding_path, read_binding

DEFAULT_TCTI = "device:/dev/tpmrm0"
# Challenges live minutes; a longer one only widens the window a leaked one is useful.
MAX_CHALLENGE_LIFETIME_S = 3600

_tcti_option = click.option(
    "--tcti",
    envvar=TCTI_ENV,
    default=None,
    help=f"The TPM: device:/dev/tpmrm0 (default for bind), tabrmd, or swtpm:host=H,port=N "
    f"(${TCTI_ENV}).",
)


def _tcti_source(ctx: click.Context) -> str:
    """Where the --tcti value came from, for the message when the TPM cannot be opened."""
    if ctx.get_parameter_source("tcti") is click.core.ParameterSource.ENVIRONMENT:
        return f"from ${TCTI_ENV}"
    return "from --tcti"


def _read_bounded(path: Path, what: str, limit: int) -> bytes:
    data = read_input(path, what, limit)
    if len(data) > limit:
        raise BadTpmData(f"{path} is larger than a {what} can be ({limit} bytes)")
    return data


@click.group("tpm")
def tpm_group() -> None:
    """Machine identities rooted in a TPM 2.0: binding and admission."""


@tpm_group.command("bind")
@_tcti_option
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Evidence file to write (give it to the authority).",
)
@json_option()
@click.pass_context
def tpm_bind(ctx: click.Context, tcti: str | None, output: Path, as_json: bool) -> None:
    """Have this machine's TPM vouch for its key; write the evidence for the authority.

    Records the binding beside the key (KEY.tpm), so attestations this machine signs from
    now on carry the TPM attestation key's co-signature.
    """
    key, key_path, _created = machine_key(ctx)
    source = _tcti_source(ctx) if tcti else f"the default; give --tcti or ${TCTI_ENV}"
    tcti = tcti or DEFAULT_TCTI
    started = time.perf_counter()
    evidence, ak = device.bind(key, tcti, source)
    elapsed = time.perf_counter() - started
    binding = MachineBinding(peer_id=key.peer_id, tcti=tcti, ak=ak)
    write_file(output, evidence.encode(), mode=PUBLIC_FILE_MODE, overwrite=True)
    write_file(binding_path(key_path), binding.encode(), mode=PUBLIC_FILE_MODE, overwrite=True)
    if as_json:
        echo_json(
            {
                "peer_id": key.peer_id,
                "tcti": tcti,
                "ak": ak.hex(),
                "evidence": str(output),
                "binding": str(binding_path(key_path)),
                "seconds": round(elapsed, 4),
            }
        )
    else:
        click.echo(f"bound {key.peer_id} to the TPM at {tcti}: evidence {output}")


@tpm_group.command("challenge")
@click.argument("evidence_path", metavar="EVIDENCE", type=click.Path(path_type=Path))
@click.option(
    "--ek-ca",
    "ek_ca_paths",
    multiple=True,
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="A TPM manufacturer's CA certificate (PEM or DER) the EK must chain to (repeatable).",
)
@authority_key_option
@click.option(
    "--registry",
    "registry_path",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="The authority's TPM registry (created on first use).",
)
@click.option(
    "--lifetime",
    type=click.IntRange(min=1, max=MAX_CHALLENGE_LIFETIME_S),
    default=DEFAULT_CHALLENGE_LIFETIME_S,
    show_default=True,
    help="Seconds the machine has to answer.",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Challenge file to write (give it to the machine).",
)
@json_option()
def tpm_challenge(
    evidence_path: Path,
    ek_ca_paths: tuple[Path, ...],
    authority_path: Path,
    registry_path: Path,
    lifetime: int,
    output: Path,
    as_json: bool,
) -> None:
    """Check a machine's TPM evidence and issue the credential-activation challenge."""
    # Every file is read before any is parsed: a missing one is named (exit 3) whatever
    # the others hold.
    evidence_data = _read_bounded(evidence_path, "TPM evidence", MAX_EVIDENCE_SIZE)
    ca_files = [(_read_bounded(p, "EK CA file", MAX_EK_CA_FILE_SIZE), p) for p in ek_ca_paths]
    authority = load_key(authority_path)
    evidence = Evidence.decode(evidence_data)
    cas = [ca for data, path in ca_files for ca in parse_ek_cas(data, str(path))]
    now = time.time()
    machine = check_binding(evidence, cas, now=now)
    credential = secrets.token_bytes(CREDENTIAL_SIZE)
    challenge = make_challenge(
        machine,
        credential=credential,
        nonce=secrets.token_bytes(NONCE_SIZE),
        expires=int(now) + lifetime,
        authority=authority.public_key_bytes,
    )
    with open_registry(registry_path) as registry:
        registry.registry.check_not_admitted(machine.ek_hash, machine.peer_id, now)
        registry.save(registry.registry.with_challenge(machine, challenge, credential, now))
    write_file(output, challenge.encode(), mode=PUBLIC_FILE_MODE, overwrite=True)
    if as_json:
        echo_json(
            {
                "peer_id": machine.peer_id,
                "ek_hash": machine.ek_hash.hex(),
                "ak": machine.ak.hex(),
                "expires": challenge.expires,
                "challenge": str(output),
            }
        )
    else:
        click.echo(
            f"evidence of {machine.peer_id} checked; challenge {output} expires "
            f"{iso_time(challenge.expires)}"
        )


@tpm_group.command("answer")
@click.argument("challenge_path", metavar="CHALLENGE", type=click.Path(path_type=Path))
@_tcti_option
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Answer file to write (give it back to the authority).",
)
@click.pass_context
def tpm_answer(ctx: click.Context, challenge_path: Path, tcti: str | None, output: Path) -> None:
    """Activate the authority's credential in this machine's TPM and sign the answer."""
    challenge = Challenge.decode(_read_bounded(challenge_path, "TPM challenge", MAX_CHALLENGE_SIZE))
    key, key_path, _created = machine_key(ctx)
    source = _tcti_source(ctx)
    if tcti is None:
        binding = read_binding(key_path)
        tcti = DEFAULT_TCTI if binding is None else binding.tcti
        source = (
            f"the default; give --tcti or ${TCTI_ENV}"
            if binding is None
            else f"recorded in {binding_path(key_path)} by `blob tpm bind`"
        )
    credential = device.activate(tcti, challenge, source)
    answer = Answer.sign(key, challenge.nonce, credential)
    write_file(output, answer.encode(), mode=PUBLIC_FILE_MODE, overwrite=True)
    click.echo(f"answered the challenge for {key.peer_id}: {output}")


def _append_revocation(path: Path, admitted: Admitted) -> None:
    try:
        old = _read_bounded(path, "revocation list", MAX_REVOCATION_LIST_SIZE)
    except NotFound:
        old = b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    line = f"{admitted.serial}  # {admitted.peer_id}, replaced by a new admission of its TPM\n"
    write_file(path, old + line.encode(), mode=PUBLIC_FILE_MODE, overwrite=True)


@tpm_group.command("admit")
@click.argument("answer_path", metavar="ANSWER", type=click.Path(path_type=Path))
@operator_option
@kernel_class_option
@authority_key_option
@click.option(
    "--registry",
    "registry_path",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="The authority's TPM registry (the one the challenge was issued with).",
)
@days_option
@click.option(
    "--replace",
    is_flag=True,
    help="If this TPM is already admitted, revoke that admission (--revoked) and admit this key.",
)
@click.option(
    "--revoked",
    "revoked_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Revocation list a replaced admission's serial is appended to (needed by --replace).",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Certificate file to write.",
)
@json_option()
def tpm_admit(
    answer_path: Path,
    operator: str,
    kernel_class: str,
    authority_path: Path,
    registry_path: Path,
    days: int,
    replace: bool,
    revoked_path: Path | None,
    output: Path,
    as_json: bool,
) -> None:
    """Check a challenge's answer and sign the admission certificate (signer kind tpm)."""
    if replace and revoked_path is None:
        # A replaced certificate left off every revocation list would stay valid: two live
        # identities for one TPM.
        raise click.UsageError("--replace needs --revoked FILE, the list the replaced serial joins")
    answer_data = _read_bounded(answer_path, "TPM answer", MAX_ANSWER_SIZE)
    authority = Authority(SoftwareSigner(load_key(authority_path)))  # read before parsing
    answer = Answer.decode(answer_data)
    now = int(time.time())
    serial = secrets.randbits(63)
    with open_registry(registry_path) as registry:
        remaining, pending, replaced = registry.registry.answer(answer, now=now, replace=replace)
        try:
            cert = authority.admit(
                pending.peer_id,
                operator=operator,
                kernel_class=kernel_class,
                not_before=max(0, now - CLOCK_SKEW_ALLOWANCE_S),
                not_after=now + days * 86400,
                serial=serial,
                hardware=HardwareRoot(ak=pending.ak, ek_hash=pending.ek_hash),
            )
        except ValueError as exc:
            raise fields_error(exc) from None
        admitted = Admitted(pending.ek_hash, pending.peer_id, cert.serial, cert.not_after)
        # Crash order: the replaced serial is revoked before the registry forgets it, and
        # the registry records the admission before its certificate exists.
        if replaced is not None:
            assert revoked_path is not None
            _append_revocation(revoked_path, replaced)
        registry.save(remaining.with_admission(admitted))
    write_file(output, cert.encode(), mode=PUBLIC_FILE_MODE, overwrite=True)
    if as_json:
        echo_json(
            {
                **cert.to_json(),
                "file": str(output),
                "replaced_serial": None if replaced is None else replaced.serial,
            }
        )
    else:
        click.echo(
            f"admitted {cert.peer_id} on its TPM (operator {operator!r}, kernel class "
            f"{kernel_class!r}) until {iso_time(cert.not_after)}, serial {cert.serial}: {output}"
        )
        if replaced is not None:
            click.echo(
                f"replaced serial {replaced.serial} ({replaced.peer_id}), now on "
                f"{revoked_path}; give verifiers that revocation list",
                err=True,
            )
