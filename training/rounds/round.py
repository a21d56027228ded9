"""Running, replaying and checking a training round against a blob store.

Theory of operation:

1. Inputs are blobs: the base model (a Hugging Face causal-LM directory as a collection:
   ``config.json``, safetensors weights, one file or sharded, ``tokenizer.json``), the
   records (tokenised by that tokenizer.json, or byte-level for the built-in models),
   plus a recipe and a seed. The device is resolved first, so without CUDA (and without
   "cpu" named) nothing is loaded at all. Then every input blob (the base
   collection and each file in it, the records, and for a replay the round record) is
   verified against its ID: a corrupt local copy is named as such (``CorruptInput``,
   exit 4) instead of surfacing as a replay that "differs at step N".
2. ``execute`` enters deterministic mode, detects the kernel class, loads that family's
   audited kernel set, trains every step under the auditor (``make_round_auditor``: its
   dispatcher regime on a CPU machine without an accelerator), publishes the adapter as a
   peft-loadable collection and returns the commitment (training.rounds.commitment).
3. ``run_round`` signs the commitment's digest (statement kind ``round-result``) and
   publishes the round record; its blob ID is the round ID.
4. ``replay_round`` reads a round record, refuses unless this machine is of the same
   kernel class, re-executes with the record's recipe, seed and thread count, and compares
   as it goes: the start state, then each step's loss bits (stopping at, and naming, the
   first step that differs), the end state, the adapter ID and finally the digest. Only
   an identical digest is attested, with the kind ``blobnet/round-replay`` that only this
   code signs (``blob attest sign`` refuses reserved kinds).
5. ``check_evidence`` accepts a round when all given attestations verify (signature,
   admission certificate valid now, not revoked, kernel class of the round), are over the
   round's digest, and come from at least two distinct admitted operators: the runner's
   ``round-result`` and at least one ``blobnet/round-replay`` from another operator.
   A second ``round-result`` does not count: it says "I ran it", not "I replayed it".
   With ``require_hardware`` every attestation must be co-signed by a TPM attestation key
   its certificate records (identity.attestation, rules 1-3). What this proves with
   software keys: two admitted operators signed the digest, not that a replay ran
   (identity.kinds says why and what hardware signers add).

The trainer (torch and peft) is imported inside the functions that train: checking a
round's evidence (``blob train check``) runs without the ``train`` extra.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blobstore import BlobNotFound, CorruptChunk, Store
from identity import (
    HARDWARE_SIGNER_KINDS,
    AdmissionCertificate,
    Attestation,
    AttestationRejected,
    Reason,
    Signer,
    TrustStore,
    sign_attestation,
    verify_attestation,
)
from training import determinism, kernel_class
from training.errors import (
    AuditViolation,
    BadModel,
    BadRecords,
    BadRoundRecord,
    CertificateMismatch,
    CorruptInput,
    EvidenceRejected,
    ReplayMismatch,
)
from training.kernel_class import KernelClass
from training.model import (
    CONFIG_NAME,
    INDEX_NAME,
    WEIGHTS_NAME,
    base_tokenizer_id,
    check_records_fit,
    load_base_model,
)
from training.records import HEADER_SIZE_V2, MAX_TOKENS, decode_records
from training.rounds import audit
from training.rounds.commitment import (
    MAX_RECORD_SIZE,
    REPLAY_KIND,
    ROUND_KIND,
    Commitment,
    RoundRecord,
)
from training.rounds.recipe import Recipe, recipe_hash

# Stdout-free progress hook: (step, loss bits).
StepHook = Callable[[int, int], None]


@dataclass(frozen=True)
class RoundInputs:
    base_id: str
    records_id: str
    recipe: Recipe
    seed: int


@dataclass(frozen=True)
class RoundResult:
    round_id: str
    record: RoundRecord

    @property
    def commitment(self) -> Commitment:
        return self.record.commitment


@dataclass(frozen=True)
class ReplayResult:
    commitment: Commitment
    attestation: Attestation
    attestation_id: str


def _load_base(store: Store, base_id: str, workdir: Path) -> Any:
    if not store.is_collection(base_id):
        raise BadModel(
            f"base {base_id} is not a collection (a model directory: {CONFIG_NAME} and "
            f"{WEIGHTS_NAME} or {INDEX_NAME} with its shards)"
        )
    names = {e.path for e in store.read_collection(base_id)}
    if CONFIG_NAME not in names or not names & {WEIGHTS_NAME, INDEX_NAME}:
        raise BadModel(
            f"base {base_id} holds {sorted(names)[:8]}, not {CONFIG_NAME} with "
            f"{WEIGHTS_NAME} or {INDEX_NAME}"
        )
    target = workdir / "base"
    store.export(base_id, target)
    return load_base_model(target)


def verify_local(store: Store, blob_id: str, what: str) -> None:
    """``CorruptInput`` naming ``blob_id`` unless every chunk of the local copy matches its
    ID: a flipped byte on this disk must be blamed on this disk, not on the round."""
    try:
        bad = store.verify(blob_id)
    except CorruptChunk:
        bad = [-1]
    if bad:
        where = "its stored bytes" if bad == [-1] else f"chunk(s) {', '.join(map(str, bad[:8]))}"
        raise CorruptInput(
            f"local blob {blob_id} ({what}) is corrupt in this store: {where} do not match "
            "its ID; the local disk is at fault, not the round: fetch it again (--peer)"
        )


def verify_inputs(store: Store, base_id: str, records_id: str) -> None:
    """Verify the base collection (the listing and every file in it) and the records."""
    verify_local(store, base_id, "base model collection")
    if store.is_collection(base_id):
        for entry in store.read_collection(base_id):
            if not store.has(entry.blob_id):
                raise BlobNotFound(
                    f"base model file {entry.path} ({entry.blob_id}) is not in the store; "
                    "fetch the base again (--peer)"
                )
            verify_local(store, entry.blob_id, f"base model file {entry.path}")
    verify_local(store, records_id, "records")


def execute(
    store: Store,
    inputs: RoundInputs,
    *,
    device: str | None = None,
    threads: int = determinism.DEFAULT_THREADS,
    expect: Commitment | None = None,
    on_step: StepHook | None = None,
    admit: Callable[[KernelClass], None] | None = None,
) -> Commitment:
    """Train the round deterministically and publish its adapter; returns the commitment.

    With ``expect`` (a replay), stops with ``ReplayMismatch`` at the first difference.
    ``admit`` sees the detected kernel class before anything is loaded or trained (the
    runner's certificate check: a mismatch must not cost a whole round first).
    """
    resolved = determinism.resolve_device(device)
    # Inputs must be present before any heavy import or training starts.
    for blob_id in (inputs.base_id, inputs.records_id):
        if not store.has(blob_id):
            raise BlobNotFound(f"round input {blob_id} is not in the store; fetch it (--peer)")
    verify_inputs(store, inputs.base_id, inputs.records_id)
    determinism.enter(resolved, threads, inputs.seed)
    from training.rounds import trainer  # torch and peft: see the module doc

    kc = kernel_class.detect(resolved)
    if expect is not None and kc != expect.kernel_class:
        raise ReplayMismatch(_kernel_class_difference(expect.kernel_class, kc))
    if admit is not None:
        admit(kc)
    allowed = audit.load_kernel_set(kc.family)
    if store.manifest(inputs.records_id).size > HEADER_SIZE_V2 + 4 * MAX_TOKENS:
        raise BadRecords(f"blob {inputs.records_id} is too large to be a records blob")
    records = decode_records(store.path(inputs.records_id).read_bytes())
    with tempfile.TemporaryDirectory(prefix="blobnet-round-") as tmp:
        workdir = Path(tmp)
        base = _load_base(store, inputs.base_id, workdir)
        vocab = int(base.get_input_embeddings().num_embeddings)
        check_records_fit(records, base_tokenizer_id(store, inputs.base_id), vocab)
        session = trainer.prepare(base, inputs.recipe, inputs.seed, resolved)
        start_root = trainer.state_root(session)
        if expect is not None and start_root != expect.start_root:
            raise ReplayMismatch(
                "replay differs before step 0: the start state (LoRA initialisation) differs"
            )

        def step_hook(step: int, bits: int) -> None:
            if expect is not None and bits != expect.step_log[step]:
                raise ReplayMismatch(
                    f"replay differs first at step {step}: loss bits {bits:08x}, "
                    f"round record has {expect.step_log[step]:08x}"
                )
            if on_step is not None:
                on_step(step, bits)

        auditor = audit.make_round_auditor(resolved, allowed)
        log = trainer.run_steps(session, records, auditor=auditor, on_step=step_hook)
        end_root = trainer.state_root(session)
        after = kernel_class.detect(resolved)
        if after != kc:
            changed = sorted(
                k
                for k in set(kc.fields) | set(after.fields)
                if kc.fields.get(k) != after.fields.get(k)
            )
            raise AuditViolation(
                f"round refused: {', '.join(changed)} changed while it trained (kernel class "
                f"{kc.id} became {after.id}); nothing was published"
            )
        if expect is not None and end_root != expect.end_root:
            raise ReplayMismatch("replay differs after the last step: the end state differs")
        adapter_dir = workdir / "adapter"
        trainer.save_adapter(session, adapter_dir)
        adapter_id = store.put_dir(adapter_dir)
    commitment = Commitment(
        base_id=inputs.base_id,
        records_id=inputs.records_id,
        recipe_hash=recipe_hash(inputs.recipe),
        seed=inputs.seed,
        kernel_class=kc,
        steps=inputs.recipe.steps,
        start_root=start_root,
        end_root=end_root,
        step_log=tuple(log),
        adapter_id=adapter_id,
    )
    if expect is not None:
        if adapter_id != expect.adapter_id:
            raise ReplayMismatch(
                f"replay's adapter {adapter_id} differs from the round's {expect.adapter_id}"
            )
        if commitment.digest != expect.digest:
            raise ReplayMismatch(
                f"replay digest {commitment.digest.hex()} differs from {expect.digest.hex()}"
            )
    return commitment


def _kernel_class_difference(want: KernelClass, have: KernelClass) -> str:
    keys = sorted(set(want.fields) | set(have.fields))
    diff = [
        f"{k}={have.fields.get(k)!r} (round: {want.fields.get(k)!r})"
        for k in keys
        if want.fields.get(k) != have.fields.get(k)
    ]
    return (
        f"this machine is not of the round's kernel class {want.id}, so it cannot replay it: "
        + "; ".join(diff[:6])
    )


def check_certificate(
    certificate: AdmissionCertificate | None, signer: Signer, kernel_class_id: str
) -> None:
    """``CertificateMismatch`` unless ``certificate`` (if any) admits this signer for this
    kernel class: an attestation carrying it would only ever be rejected."""
    if certificate is None:
        return
    if certificate.peer_id != signer.peer_id:
        raise CertificateMismatch(
            f"the certificate admits peer {certificate.peer_id}, but this machine's key is "
            f"{signer.peer_id}; give this machine's own certificate (--cert)"
        )
    if certificate.kernel_class != kernel_class_id:
        raise CertificateMismatch(
            f"the certificate admits kernel class {certificate.kernel_class}, but this run's "
            f"kernel class is {kernel_class_id} (device, --threads and the settings of "
            "`blob train kernel-class --json` decide it); get a certificate for it or run "
            "with the settings it was issued for"
        )


def _attest(
    signer: Signer,
    commitment: Commitment,
    now: float,
    certificate: AdmissionCertificate | None,
    *,
    kind: str = ROUND_KIND,
    round_id: str | None = None,
) -> Attestation:
    subjects = (commitment.base_id, commitment.records_id, commitment.adapter_id)
    return sign_attestation(
        signer,
        kind=kind,
        digest=commitment.digest,
        kernel_class=commitment.kernel_class_id,
        subjects=subjects if round_id is None else (round_id, *subjects),
        time=int(now),
        certificate=certificate,
    )


def run_round(
    store: Store,
    inputs: RoundInputs,
    signer: Signer,
    *,
    now: float,
    device: str | None = None,
    threads: int = determinism.DEFAULT_THREADS,
    certificate: AdmissionCertificate | None = None,
    on_step: StepHook | None = None,
) -> RoundResult:
    """Execute, attest and publish a round; the round ID is the record's blob ID."""
    commitment = execute(
        store,
        inputs,
        device=device,
        threads=threads,
        on_step=on_step,
        admit=lambda kc: check_certificate(certificate, signer, kc.id),
    )
    attestation = _attest(signer, commitment, now, certificate)
    record = RoundRecord(commitment, inputs.recipe, attestation.encode())
    round_id = store.put_bytes(record.encode())
    return RoundResult(round_id=round_id, record=record)


def load_record(store: Store, round_id: str) -> RoundRecord:
    """The round record ``round_id`` from the store (size-checked before it is read)."""
    size = store.manifest(round_id).size
    if size > MAX_RECORD_SIZE:
        raise BadRoundRecord(f"blob {round_id} is {size} bytes: too large to be a round record")
    verify_local(store, round_id, "round record")
    return RoundRecord.decode(store.path(round_id).read_bytes())


def replay_round(
    store: Store,
    round_id: str,
    signer: Signer,
    *,
    now: float,
    certificate: AdmissionCertificate | None = None,
    on_step: StepHook | None = None,
) -> ReplayResult:
    """Re-run a round; on the identical digest, attest it and publish the attestation."""
    record = load_record(store, round_id)
    c = record.commitment
    check_certificate(certificate, signer, c.kernel_class_id)
    threads = c.kernel_class.fields.get("threads", determinism.DEFAULT_THREADS)
    inputs = RoundInputs(c.base_id, c.records_id, record.recipe, c.seed)
    execute(
        store,
        inputs,
        device=c.kernel_class.family,
        threads=int(threads),
        expect=c,
        on_step=on_step,
    )
    attestation = _attest(signer, c, now, certificate, kind=REPLAY_KIND, round_id=round_id)
    attestation_id = store.put_bytes(attestation.encode())
    return ReplayResult(commitment=c, attestation=attestation, attestation_id=attestation_id)


@dataclass(frozen=True)
class Evidence:
    digest: bytes
    kernel_class_id: str
    operators: tuple[str, ...]
    signers: tuple[str, ...]
    signer_kinds: tuple[str, ...]


def check_evidence(
    record: RoundRecord,
    attestations: Iterable[bytes],
    *,
    trust: TrustStore,
    now: float,
    include_runner: bool = True,
    require_hardware: bool = False,
) -> Evidence:
    """Accept the round only with two valid attestations over its digest from distinct
    admitted operators of its kernel class, at least one of them a replay; otherwise
    ``EvidenceRejected`` saying why.

    The runner's ``round-result`` attestation (in the record; with ``include_runner``)
    counts for the runner's operator; every other attestation must be a replay
    (``blobnet/round-replay``, signed only by ``replay_round``). Every attestation given
    must verify: a bad one is a rejection, not something to skip silently.
    ``require_hardware`` accepts only hardware-backed signers (identity.kinds).
    """
    c = record.commitment
    signer_kinds = HARDWARE_SIGNER_KINDS if require_hardware else None
    runner = record.attestation if include_runner else None
    blobs: list[bytes] = [record.attestation] if include_runner else []
    for data in attestations:
        if data not in blobs:
            blobs.append(data)
    operators: dict[str, str] = {}
    replayers: set[str] = set()
    signers: list[str] = []
    kinds: list[str] = []
    for data in blobs:
        kind = ROUND_KIND if data == runner else REPLAY_KIND
        try:
            claims = verify_attestation(
                data,
                trust=trust,
                now=now,
                kind=kind,
                kernel_class=c.kernel_class_id,
                signer_kinds=signer_kinds,
            )
        except AttestationRejected as exc:
            if exc.reason is Reason.WRONG_KIND:
                raise EvidenceRejected(
                    f"rejected ({exc.reason.value}): {exc}; only `blob train replay` makes "
                    f"the {REPLAY_KIND!r} attestation that vouches for a round"
                ) from exc
            raise EvidenceRejected(f"rejected ({exc.reason.value}): {exc}") from exc
        if claims.digest != c.digest:
            raise EvidenceRejected(
                f"rejected: {claims.describe()} is over digest {claims.digest.hex()}, "
                f"not the round's {c.digest.hex()}"
            )
        assert claims.certificate is not None  # verify_attestation with trust requires it
        operators.setdefault(claims.certificate.operator, claims.signer_peer_id)
        if kind == REPLAY_KIND:
            replayers.add(claims.certificate.operator)
        signers.append(claims.signer_peer_id)
        kinds.append(claims.signer_kind)
    if len(operators) < 2 or not replayers:
        names = ", ".join(repr(o) for o in operators) or "none"
        raise EvidenceRejected(
            f"rejected: the attestations come from {len(operators)} distinct admitted "
            f"operator(s) ({names}) with {len(replayers)} replay(s); two operators, one of "
            "them replaying, are needed, so get a replay (`blob train replay`) from another "
            "operator"
        )
    return Evidence(
        digest=c.digest,
        kernel_class_id=c.kernel_class_id,
        operators=tuple(sorted(operators)),
        signers=tuple(signers),
        signer_kinds=tuple(kinds),
    )


def required_inputs(record: RoundRecord) -> Sequence[str]:
    return (record.commitment.base_id, record.commitment.records_id)
