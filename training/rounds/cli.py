"""``blob train ...``: make base models, records and recipes; run, replay and check rounds.

Loaded through the ``blobnet.cli`` entry point when a train command is asked for, and by
``blob --help``. So the modules that import numpy (0.1 to 0.3 s; torch, transformers and
peft come later still, inside them) or libp2p (seconds) are imported inside the commands
that use them; everything else is imported here.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from blobstore import Store, parse_blob_id
from blobstore.catalog import check_tag_name
from blobstore.exitcodes import ExitCode
from blobstore.export import check_output
from blobstore.options import json_option
from identity import (
    PUBLIC_FILE_MODE,
    AdmissionCertificate,
    NotFound,
    ensure_key,
    machine_signer,
    write_file,
)
from identity.cli_common import load_trust, require_hardware_option, trust_options
from p2p.cli.common import check_peer_addrs
from training import determinism, kernel_class
from training.errors import BadModel, EvidenceRejected, TrainingError
from training.rounds.inputs import fetch_missing

PASSPHRASE_ENV = "BLOBNET_PASSPHRASE"
# Attestations and certificates are a few KiB; these bound what a command reads.
MAX_ATTESTATION_FILE = 1 << 20
MAX_CERT_FILE = 1 << 16
MAX_RECORDS_INPUT = 1 << 30


def _obj(ctx: click.Context) -> dict[str, Any]:
    obj = ctx.find_root().ensure_object(dict)
    return obj


def _store(ctx: click.Context) -> Store:
    root = _obj(ctx).get("store_root")
    if root is None:
        raise click.UsageError("no store: give --store DIR")
    return Store.open(Path(root))


def _key_path(ctx: click.Context) -> Path:
    path = _obj(ctx).get("key_path")
    if path is None:
        raise click.UsageError("no machine key: give --key FILE")
    return Path(path)


def _signer(ctx: click.Context) -> Any:
    path = _key_path(ctx)
    key, created = ensure_key(path, os.environ.get(PASSPHRASE_ENV) or None)
    if created:
        click.echo(f"blob: created a new machine key {path} (peer ID {key.peer_id})", err=True)
    return machine_signer(key, path)  # TPM-backed when `blob tpm bind` bound the key


def _read(path: Path, what: str, limit: int) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise NotFound(f"no {what} file at {path}") from None  # README: a missing file is 3
    if len(data) > limit:
        raise click.BadParameter(f"{what} file {path} is larger than {limit} bytes")
    return data


def _certificate(path: Path | None) -> Any:
    if path is None:
        return None
    return AdmissionCertificate.decode(_read(path, "certificate", MAX_CERT_FILE))


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True))


def _progress(quiet: bool) -> Any:
    if quiet:
        return None

    def on_step(step: int, bits: int) -> None:
        # The exact bits are the commitment's (--json); a person reads the loss.
        (loss,) = struct.unpack("<f", bits.to_bytes(4, "little"))
        click.echo(f"step {step}: loss {loss:.4f}", err=True)

    return on_step


@click.group("train")
def train_group() -> None:
    """Deterministic LoRA training rounds: run, replay, check."""


_tag_option = click.option(
    "--tag", "tag_name", metavar="NAME", help="Tag the result (pins it; a name for --base etc.)."
)


def _check_tag(name: str | None) -> None:
    """A bad tag name is refused before any work."""
    if name is not None:
        check_tag_name(name)


@train_group.command("init-model")
@click.option("--size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
@click.option(
    "--arch",
    type=click.Choice(["tiny-llama", "gpt2", "llama"]),
    default="tiny-llama",
    show_default=True,
    help="tiny-llama: the built-in byte-level model (--size); gpt2 / llama: a Hugging Face "
    "directory at toy size with a tokenizer trained on --corpus.",
)
@click.option(
    "--corpus",
    "corpus_paths",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Text file(s) to train the tokenizer of --arch gpt2/llama on.",
)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True)
@_tag_option
@json_option()
@click.pass_context
def init_model(
    ctx: click.Context,
    size: str,
    arch: str,
    corpus_paths: tuple[Path, ...],
    seed: int,
    tag_name: str | None,
    as_json: bool,
) -> None:
    """Make a base model locally (nothing downloaded) and put it in the store."""
    _check_tag(tag_name)
    store = _store(ctx)
    with tempfile.TemporaryDirectory(prefix="blobnet-model-") as tmp:
        if arch == "tiny-llama":
            # numpy and, inside, torch: only for the command that builds a model.
            from training.model import make_tiny_llama, save_base_model

            model = make_tiny_llama(size, seed)
            params = sum(p.numel() for p in model.parameters())
            save_base_model(model, Path(tmp))
        else:
            # numpy and, inside, torch and transformers: only for this command.
            from training.hf_model import MAX_CORPUS_BYTES, build_model_dir
            from training.model import load_base_model

            if not corpus_paths:
                raise click.UsageError(f"--arch {arch} needs --corpus FILE for its tokenizer")
            texts = [
                _read(p, "corpus", MAX_CORPUS_BYTES).decode("utf-8", errors="replace")
                for p in corpus_paths
            ]
            build_model_dir(arch, Path(tmp), texts, seed=seed)
            params = sum(p.numel() for p in load_base_model(Path(tmp)).parameters())
        blob_id = store.put_dir(Path(tmp))
    if tag_name is not None:
        store.tag(tag_name, blob_id)
    if as_json:
        _echo_json({"id": blob_id, "arch": arch, "seed": seed, "parameters": params})
    else:
        click.echo(blob_id)


@train_group.command("records")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--seq-len", type=int, required=True, help="Tokens per record.")
@click.option(
    "--base",
    "base_ref",
    default=None,
    help="Tokenise with this base model collection's tokenizer.json (default: byte-level, "
    "for the built-in tiny models).",
)
@_tag_option
@json_option()
@click.pass_context
def records_command(
    ctx: click.Context,
    files: tuple[Path, ...],
    seq_len: int,
    base_ref: str | None,
    tag_name: str | None,
    as_json: bool,
) -> None:
    """Tokenise FILEs into one records blob; prints its ID."""
    from training.records import decode_records, make_records  # numpy: this command only

    _check_tag(tag_name)
    store = _store(ctx)
    contents = [_read(f, "input", MAX_RECORDS_INPUT) for f in files]
    if base_ref is None:
        data = make_records(contents, seq_len)
    else:
        data = _tokenizer_records(store, store.resolve(base_ref), contents, seq_len)
    blob_id = store.put_bytes(data)
    if tag_name is not None:
        store.tag(tag_name, blob_id)
    if as_json:
        count = decode_records(data).count
        _echo_json({"id": blob_id, "seq_len": seq_len, "records": count})
    else:
        click.echo(blob_id)


def _tokenizer_records(store: Store, base_id: str, contents: list[bytes], seq_len: int) -> bytes:
    # These import numpy: only `blob train records --base` pays for them.
    from training.hf_model import config_bytes_to_dict, model_eos
    from training.model import CONFIG_NAME, MAX_CONFIG_SIZE, TOKENIZER_NAME
    from training.records import MAX_TOKENIZER_SIZE, make_tokenizer_records
    from training.rounds.round import verify_local

    if not store.is_collection(base_id):
        raise BadModel(f"--base {base_id} is not a model collection")
    entries = {e.path: e for e in store.read_collection(base_id)}
    for name in (CONFIG_NAME, TOKENIZER_NAME):
        if name not in entries:
            raise BadModel(f"--base {base_id} has no {name} to tokenise with")
        verify_local(store, entries[name].blob_id, f"base model file {name}")
    tokenizer = entries[TOKENIZER_NAME]
    config = _read(store.path(entries[CONFIG_NAME].blob_id), CONFIG_NAME, MAX_CONFIG_SIZE)
    return make_tokenizer_records(
        contents,
        seq_len,
        tokenizer_json=_read(store.path(tokenizer.blob_id), TOKENIZER_NAME, MAX_TOKENIZER_SIZE),
        tokenizer_id=tokenizer.blob_id,
        eos_id=model_eos(config_bytes_to_dict(config)),
    )


@train_group.command("recipe")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path, dir_okay=False),
    default=Path("recipe.msgpack"),
    show_default=True,
)
@click.option("--lr", type=float, default=None)
@click.option("--rank", type=int, default=None)
@click.option("--alpha", type=int, default=None)
@click.option("--dropout", type=float, default=None)
@click.option("--batch-size", type=int, default=None)
@click.option("--steps", type=int, default=None)
@click.option("--seq-len", type=int, default=None)
@click.option("--target", "targets", multiple=True, help="Target module (repeatable).")
@json_option()
def recipe_command(
    output: Path,
    lr: float | None,
    rank: int | None,
    alpha: int | None,
    dropout: float | None,
    batch_size: int | None,
    steps: int | None,
    seq_len: int | None,
    targets: tuple[str, ...],
    as_json: bool,
) -> None:
    """Write a recipe file (the defaults, with any option given changed)."""
    from training.rounds.recipe import Recipe  # numpy: this command only

    given: dict[str, Any] = {
        "lr": lr,
        "rank": rank,
        "alpha": alpha,
        "dropout": dropout,
        "batch_size": batch_size,
        "steps": steps,
        "seq_len": seq_len,
        "target_modules": targets or None,
    }
    recipe = Recipe(**{k: v for k, v in given.items() if v is not None})
    write_file(output, recipe.encode(), mode=PUBLIC_FILE_MODE, overwrite=True)
    if as_json:
        _echo_json({**recipe.to_dict(), "hash": recipe.hash, "file": str(output)})
    else:
        click.echo(f"{output}: recipe {recipe.hash}")


@train_group.command("kernel-class")
@click.option(
    "--device", type=click.Choice(["cuda", "cpu"]), default=None, help="Device (default cuda)."
)
@click.option("--threads", type=click.IntRange(1, 256), default=1, show_default=True)
@json_option()
def kernel_class_command(device: str | None, threads: int, as_json: bool) -> None:
    """Print this machine's kernel class ID (what an admission certificate names)."""
    resolved = determinism.resolve_device(device)
    determinism.enter(resolved, threads)
    kc = kernel_class.detect(resolved)
    if as_json:
        _echo_json({"id": kc.id, "hash": kc.hash, "fields": kc.fields})
    else:
        click.echo(kc.id)


_peer_option = click.option(
    "--peer", "peers", multiple=True, help="Fetch missing inputs from this multiaddr (repeatable)."
)
_cert_option = click.option(
    "--cert",
    "cert_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="This machine's admission certificate, carried in its attestation.",
)


@train_group.command("run")
@click.option("--base", "base_ref", required=True, help="Base model collection ID.")
@click.option("--records", "records_ref", required=True, help="Records blob ID.")
@click.option(
    "--recipe", "recipe_path", required=True, type=click.Path(path_type=Path, dir_okay=False)
)
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), required=True)
@click.option(
    "--device",
    type=click.Choice(["cuda", "cpu"]),
    default=None,
    help="Device (default cuda; cpu only when named).",
)
@click.option("--threads", type=click.IntRange(1, 256), default=1, show_default=True)
@_peer_option
@_cert_option
@click.option("-q", "--quiet", is_flag=True, help="No per-step progress on stderr.")
@click.option(
    "--publish",
    "publish_as",
    metavar="NAME",
    default=None,
    help="Name the adapter <this peer ID>/NAME (a `blob serve` on this store spreads it).",
)
@json_option()
@click.pass_context
def run_command(
    ctx: click.Context,
    base_ref: str,
    records_ref: str,
    recipe_path: Path,
    seed: int,
    device: str | None,
    threads: int,
    peers: tuple[str, ...],
    cert_path: Path | None,
    quiet: bool,
    publish_as: str | None,
    as_json: bool,
) -> None:
    """Run a round: fetch inputs, train, publish adapter and round record."""
    # numpy (and torch, once the round trains): only the commands that run rounds.
    from training.rounds.recipe import Recipe
    from training.rounds.round import RoundInputs, check_certificate, run_round

    if publish_as is not None:
        from p2p.names.record import check_name  # libp2p: only when a name is published

        check_name(publish_as)  # refuse a bad name before any training
    check_peer_addrs(peers, "--peer")
    recipe = Recipe.decode(_read(recipe_path, "recipe", 1 << 16))
    certificate = _certificate(cert_path)
    resolved = determinism.resolve_device(device)  # refuse before any fetch or load
    if cert_path is None:
        click.echo(
            "blob train run: warning: no --cert, so the round's attestation carries no "
            "admission certificate and `blob train check` will reject it; give --cert FILE "
            "(from `blob admit`) for a round others can accept",
            err=True,
        )
    store = _store(ctx)
    ids = (
        [_resolve(store, base_ref), _resolve(store, records_ref)]
        if not peers
        else [parse_blob_id(base_ref), parse_blob_id(records_ref)]
    )
    signer = _signer(ctx)
    if certificate is not None:
        # A certificate for another key or kernel class is refused before any fetch.
        determinism.enter(resolved, threads, seed)
        check_certificate(certificate, signer, kernel_class.detect(resolved).id)
    fetch_missing(store, ids, peers, key_path=_key_path(ctx))
    result = run_round(
        store,
        RoundInputs(ids[0], ids[1], recipe, seed),
        signer,
        now=time.time(),
        device=device,
        threads=threads,
        certificate=certificate,
        on_step=_progress(quiet),
    )
    c = result.commitment
    published = None
    if publish_as is not None:
        from p2p.names.service import publish_in_store  # libp2p: only when a name is published

        published = publish_in_store(store, signer, publish_as, c.adapter_id, now=time.time())
    if as_json:
        named = None if published is None else published.to_json()
        _echo_json({"round": result.round_id, "commitment": c.to_json(), "name": named})
    else:
        click.echo(f"round {result.round_id}")
        click.echo(f"digest {c.digest.hex()}")
        click.echo(f"adapter {c.adapter_id}")
        if published is not None:
            click.echo(f"name {published.ref} seq {published.seq}")


def _resolve(store: Store, ref: str) -> str:
    return store.resolve(ref)


@train_group.command("replay")
@click.argument("round_ref")
@_peer_option
@_cert_option
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also write the attestation to this file.",
)
@click.option("-q", "--quiet", is_flag=True, help="No per-step progress on stderr.")
@json_option()
@click.pass_context
def replay_command(
    ctx: click.Context,
    round_ref: str,
    peers: tuple[str, ...],
    cert_path: Path | None,
    output: Path | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Re-run a round; exit 0 and attest only on the identical digest."""
    # numpy (and torch, once the round trains): only the commands that run rounds.
    from training.rounds.round import check_certificate, load_record, replay_round, required_inputs

    check_peer_addrs(peers, "--peer")
    if output is not None:
        check_output(output)  # a missing directory, before the fetch and the whole replay
    certificate = _certificate(cert_path)
    store = _store(ctx)
    round_id = parse_blob_id(round_ref) if peers else _resolve(store, round_ref)
    signer = _signer(ctx)
    fetch_missing(store, [round_id], peers, key_path=_key_path(ctx))
    record = load_record(store, round_id)
    determinism.resolve_device(record.commitment.kernel_class.family)
    # A certificate for another key or kernel class is refused before the inputs' fetch.
    check_certificate(certificate, signer, record.commitment.kernel_class_id)
    fetch_missing(store, list(required_inputs(record)), peers, key_path=_key_path(ctx))
    result = replay_round(
        store,
        round_id,
        signer,
        now=time.time(),
        certificate=certificate,
        on_step=_progress(quiet),
    )
    if output is not None:
        write_file(output, result.attestation.encode(), mode=PUBLIC_FILE_MODE, overwrite=True)
    if as_json:
        _echo_json(
            {
                "round": round_id,
                "digest": result.commitment.digest.hex(),
                "attestation": result.attestation_id,
                "identical": True,
            }
        )
    else:
        click.echo(f"identical digest {result.commitment.digest.hex()}")
        click.echo(f"attestation {result.attestation_id}")


@train_group.command("check")
@click.argument("round_ref")
@click.argument("attestations", nargs=-1, required=True)
@trust_options
@require_hardware_option(
    "Accept only attestations co-signed by a TPM attestation key their admission "
    "certificate records (`blob tpm`)."
)
@json_option()
@click.pass_context
def check_command(
    ctx: click.Context,
    round_ref: str,
    attestations: tuple[str, ...],
    authorities: tuple[str, ...],
    revoked_path: Path | None,
    require_hardware: bool,
    as_json: bool,
) -> None:
    """Evidence check: accept ROUND only with valid attestations over its digest from two
    distinct admitted operators of its kernel class: the runner's (in the round record)
    and a replay attestation that only `blob train replay` makes. ATTESTATION: a file or
    a blob ID.

    With software keys this shows that two admitted operators signed the digest, not that
    the replay ran (a key in a file can sign anything); --require-hardware accepts only
    attestations co-signed by a TPM-resident key the authority admitted (`blob tpm`)."""
    from training.rounds.round import check_evidence, load_record  # numpy: this command only

    trust = load_trust(authorities, revoked_path)  # the named files first (a missing one: 3)
    store = _store(ctx)
    record = load_record(store, _resolve(store, round_ref))
    blobs = [_attestation_bytes(store, a) for a in attestations]
    try:
        evidence = check_evidence(
            record, blobs, trust=trust, now=time.time(), require_hardware=require_hardware
        )
    except EvidenceRejected as exc:
        if as_json:
            _echo_json({"accepted": False, "message": str(exc)})
        else:
            click.echo(str(exc))
        ctx.exit(ExitCode.REJECTED)
    if as_json:
        _echo_json(
            {
                "accepted": True,
                "digest": evidence.digest.hex(),
                "kernel_class": evidence.kernel_class_id,
                "operators": list(evidence.operators),
                "signers": list(evidence.signers),
                "signer_kinds": list(evidence.signer_kinds),
            }
        )
    else:
        click.echo(
            f"accepted: digest {evidence.digest.hex()} attested by operators "
            f"{', '.join(evidence.operators)} ({evidence.kernel_class_id}; signers "
            f"{', '.join(sorted(set(evidence.signer_kinds)))})"
        )


def _attestation_bytes(store: Store, ref: str) -> bytes:
    path = Path(ref)
    if path.is_file():
        return _read(path, "attestation", MAX_ATTESTATION_FILE)
    blob_id = store.resolve(ref)
    return _read(store.path(blob_id), "attestation", MAX_ATTESTATION_FILE)


def main() -> None:  # pragma: no cover - `python -m training.rounds.cli` for debugging
    try:
        train_group.main(standalone_mode=True)
    except TrainingError as exc:
        click.echo(f"blob: error: {exc}", err=True)
        sys.exit(exc.exit_code)
