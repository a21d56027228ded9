"""A run's evidence (training.outer.milestones): ``blob outer verify`` fails on any gap from
the start to the end the milestones sign, and ``blob gc`` leaves verify what it needs until
``blob outer forget``.

A three-round run of three workers (three operators) is kept in a store in this process, as
a worker keeps it (``keep_round``), with every update sampled for replay; no sockets, no
torch. Each test then removes what a store's owner could remove with ``blob untag``, or
forges what it could forge (a catch-up, a milestone leaving out a departed worker), and
checks that verify names it. The last tests run two machines on swtpm TPMs (skipping,
saying why, where swtpm or tpm2-pytss is missing): a run that requires hardware takes their
records and refuses a software signer's, in the worker's ledger and in verify."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blobstore import Store
from blobstore.canonical import decode_map
from blobstore.canonical import encode as encode_canonical
from identity import (
    AdmissionCertificate,
    Authority,
    MachineKey,
    Signer,
    SoftwareSigner,
    TrustStore,
    create_key_file,
    format_public_key,
    load_key_file,
    machine_signer,
    parse_public_key,
    sign_attestation,
)
from tests.blob_cli import blob_here
from training.outer.aggregate import aggregate, wrap_update
from training.outer.agreement import (
    Closure,
    Included,
    check_closure,
    sign_closure,
)
from training.outer.codec import CodecParams, encode
from training.outer.loop import OuterState, state_root
from training.outer.messages import (
    NOT_HARDWARE,
    UPDATE_KIND,
    Candidate,
    ClosureAnnouncement,
    Ledger,
    Rejection,
    UpdateAnnouncement,
    VerdictAnnouncement,
    decode_message,
    encode_message,
)
from training.outer.milestones import (
    BadMilestone,
    RunTerms,
    catch_up_for,
    check_milestone,
    decode_milestone_record,
    keep_catch_up,
    keep_round,
    list_milestones,
    milestone_for,
    run_tags,
    sign_catch_up,
    sign_milestone,
    tag,
    verify_run,
)
from training.outer.replay import Verdict, replayer_for, sampled, sign_verdict
from training.outer.state_blob import encode_state

NOW = 1_700_000_000
KC = "cpu-test"
RUN = "evidence"
ROUNDS = 3
CODEC = CodecParams(chunk=256, k=16)
# Every update sampled (rate 1), so every round has a verdict per admitted update.
TERMS = RunTerms(rounds=ROUNDS, replay_rate=1.0, outer_lr=0.7, outer_momentum=0.9)
AUTHORITY = Authority(SoftwareSigner(MachineKey.generate()))
TRUST = TrustStore(frozenset({AUTHORITY.public_key_bytes}))


@dataclasses.dataclass
class Machine:
    key: MachineKey
    cert: AdmissionCertificate
    hardware: Signer | None = None  # a TPM-bound machine's signer (identity.machine_signer)

    @property
    def peer(self) -> str:
        return self.key.peer_id

    @property
    def signer(self) -> Signer:
        return self.hardware or SoftwareSigner(self.key)


def machine(operator: str) -> Machine:
    key = MachineKey.generate()
    cert = AUTHORITY.admit(
        key.peer_id,
        operator=operator,
        kernel_class=KC,
        not_before=0,
        not_after=NOW + 10**6,
        serial=1,
    )
    return Machine(key, cert)


WORKERS = sorted((machine(f"op-{i}") for i in range(3)), key=lambda m: m.peer)


def keep_run(
    store: Store,
    workers: Sequence[Machine] = WORKERS,
    *,
    left: Mapping[str, int] | None = None,
    trust: TrustStore = TRUST,
    now: int = NOW,
) -> list[dict[str, str]]:
    """Three rounds as ``workers[0]`` keeps them: start state, and per round the update
    blobs, closure, milestone (``keep_round``) and the replay verdicts; ``left``: peer ->
    the round from which that worker sends no update. Returns, per round, the blob each
    author's update was."""
    rng = np.random.default_rng(7)
    params = {"w": rng.standard_normal((32, 64)).astype(np.float32)}
    state = OuterState(0, params, {"w": np.zeros_like(params["w"])})
    store.tag(tag(RUN, "start"), store.put_bytes(encode_state(state)))
    me = workers[0]
    by_peer = {m.peer: m for m in workers}
    previous = None
    rounds = []
    for r in range(ROUNDS):
        root = state_root(state)
        included, blobs = [], {}
        members = sorted(
            (m for m in workers if r < (left or {}).get(m.peer, ROUNDS)), key=lambda m: m.peer
        )
        for m in members:
            # A direction every worker shares plus its own noise, as honest updates are.
            shared = np.random.default_rng(1000 + r).standard_normal((32, 64))
            grad = {"w": ((shared + rng.standard_normal((32, 64))) * 1e-2).astype(np.float32)}
            blob = store.put_bytes(
                wrap_update(encode(grad, CODEC), round_=r, start_root=root, author=m.peer)
            )
            attestation = sign_attestation(
                m.signer,
                kind=UPDATE_KIND,
                digest=bytes.fromhex(blob),
                kernel_class=KC,
                subjects=[blob, root, "c0" * 32],
                time=now,
                certificate=m.cert,
            )
            included.append(Included(m.peer, blob, attestation.encode()))
            blobs[m.peer] = blob

        def load(blob: str) -> bytes:
            return store.path(blob).read_bytes()

        agg = aggregate(state, list(blobs.items()), load, TERMS.outer(), start_root=root)
        result = state_root(agg.state)
        closure = Closure(
            RUN, r, root, me.peer, tuple(included), result, store.put_bytes(encode_state(agg.state))
        )
        body, attestation = sign_closure(
            me.signer, closure, kernel_class=KC, certificate=me.cert, time=now
        )
        checked = check_closure(body, attestation, run=RUN, trust=trust, now=now, quorum=1)
        milestone = sign_milestone(
            me.signer, milestone_for(checked, agg, TERMS, previous), kernel_class=KC,
            certificate=me.cert, time=now,
        )  # fmt: skip
        previous = checked
        keep_round(
            store,
            checked,
            closure_blob=store.put_bytes(
                encode_message(ClosureAnnouncement(RUN, body, attestation, ()))
            ),
            milestone_blob=store.put_bytes(milestone),
        )
        assert [p for p, _, _ in agg.admitted] == sorted(blobs)  # nobody excluded
        operators = {m.peer: m.cert.operator for m in members}
        for author, blob in blobs.items():
            assert sampled(result, author, TERMS.replay_rate)
            replayer = by_peer[replayer_for(result, author, operators) or ""]
            verdict = Verdict(RUN, r, author, blob, "c0" * 32, "match")
            signed = sign_verdict(
                replayer.signer, verdict, kernel_class=KC, certificate=replayer.cert, time=now
            )
            message = VerdictAnnouncement(RUN, r, author, blob, "c0" * 32, "match", signed)
            store.tag(
                f"{tag(RUN, 'verdict', r)}-{author}", store.put_bytes(encode_message(message))
            )
        rounds.append(blobs)
        state = agg.state
    return rounds


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kept run, made once: ``store`` hands each test a copy of it to untag and forge."""
    root = tmp_path_factory.mktemp("kept") / "store"
    keep_run(Store.open(root))
    return root


@pytest.fixture
def store(tmp_path: Path, kept: Path) -> Store:
    shutil.copytree(kept, tmp_path / "store")
    return Store.open(tmp_path / "store")


def failures(store: Store) -> list[str]:
    report = verify_run(store, RUN, TRUST)
    assert not report.ok
    return report.failures


def test_a_kept_run_verifies_every_round_to_its_signed_end(store: Store) -> None:
    report = verify_run(store, RUN, TRUST)
    assert report.ok, report.failures
    assert report.checked_rounds == [0, 1, 2]
    assert report.rounds == ROUNDS


@pytest.mark.parametrize("rounds", [[1], [0, 1, 2]], ids=["one", "all"])
def test_a_deleted_milestone_fails_verify(store: Store, rounds: list[int]) -> None:
    """Guards against verify passing a run whose milestones were untagged: it checked a
    milestone only when it found one."""
    for r in rounds:
        store.untag(tag(RUN, "milestone", r))
    if len(rounds) == 1:
        assert failures(store) == ["round 1: no milestone kept"]
    else:
        assert failures(store) == [
            "no valid milestone is kept: nothing signed says how many rounds the run has"
        ]


def test_a_deleted_verdict_fails_verify(store: Store) -> None:
    """Guards against verify passing a run whose verdicts on sampled updates were
    untagged: it checked the verdicts it found, and never asked which were due."""
    author = WORKERS[2].peer
    store.untag(f"{tag(RUN, 'verdict', 1)}-{author}")
    (failure,) = failures(store)
    assert failure.startswith(f"round 1: no verdict kept on {author[-8:]}'s sampled update")
    for name in [n for n in store.tags() if n.startswith(tag(RUN, "verdict"))]:
        store.untag(name)
    assert len(failures(store)) == ROUNDS * len(WORKERS)


def test_deleting_the_last_rounds_is_a_gap_not_a_shorter_run(store: Store) -> None:
    """Guards against verify passing a truncated run ("rounds checked: 2"): the run's
    length is in every signed milestone, so the last closure is due however many of the
    last rounds' records are gone."""
    store.untag(tag(RUN, "closure", 2))
    assert failures(store) == ["round 2: no closure kept"]
    store.untag(tag(RUN, "milestone", 2))
    store.untag(tag(RUN, "closure", 1))
    assert failures(store) == ["round 1: no closure kept", "round 2: no closure kept"]


def test_gc_keeps_what_verify_needs_until_the_run_is_forgotten(store: Store) -> None:
    """Guards against gc deleting a finished run's update blobs (untagged, so gone after
    the grace period) and verify then failing on "an update blob is missing". Forgetting
    the run hands everything of it to gc, which --dry-run shows first."""
    assert store.gc(grace_seconds=0) != []  # the old states went: they are not evidence
    assert verify_run(store, RUN, TRUST).ok
    root = str(store.root)
    shown = blob_here(["--store", root, "outer", "forget", RUN, "--dry-run", "--json"], 0)
    assert set(json.loads(shown.stdout)["untagged"]) == set(run_tags(store, RUN))
    assert store.gc(grace_seconds=0) == []  # a dry run untags nothing
    blob_here(["--store", root, "outer", "forget", RUN], 0)
    assert run_tags(store, RUN) == {}
    would = json.loads(
        blob_here(["--store", root, "gc", "--grace", "0", "--dry-run", "--json"], 0).stdout
    )
    assert store.gc(grace_seconds=0) == sorted(would["would_remove"])
    assert store.blob_ids() == []
    assert failures(store) == [f"no {tag(RUN, 'start')} tag: this store holds no run {RUN!r}"]


def test_run_tags_are_the_runs_own(store: Store) -> None:
    """``forget a`` must not untag run ``a-verdict-1``'s tags, whose names start alike."""
    other = store.put_bytes(b"another run's closure")
    store.tag("outer-evidence-verdict-1-closure-0", other)
    store.tag("outer-evidence-x-start", other)
    assert other not in run_tags(store, RUN).values()


def test_milestones_exits_1_on_an_invalid_entry(store: Store) -> None:
    """Guards against ``blob outer milestones`` printing INVALID and exiting 0."""
    root = str(store.root)
    authority = format_public_key(AUTHORITY.public_key_bytes)
    argv = ["--store", root, "outer", "milestones", RUN, "--authority", authority]
    assert "INVALID" not in blob_here(argv, 0).stdout
    store.tag(tag(RUN, "milestone", 1), store.put_bytes(b"not a milestone"))
    assert "round    1  INVALID" in blob_here(argv, 1).stdout
    assert [e.get("error") is None for e in list_milestones(store, RUN, TRUST)] == [
        True,
        False,
        True,
    ]


def catch_up_at_round_2(
    store: Store, *, signer: Machine | None = None, since: int = 1, **forged: Any
) -> None:
    """A worker paused after round 0 wakes to find rounds 1 and 2 closed and adopts
    closure 2's state, as the worker keeps that (``keep_catch_up``): closure 2, the adopted
    state and its signed catch-up record (by ``signer``, with ``forged`` fields changed),
    and no milestone for rounds it did not recompute."""
    tags = store.tags()
    msg = decode_message(store.path(tags[tag(RUN, "closure", 2)]).read_bytes())
    assert isinstance(msg, ClosureAnnouncement)
    checked = check_closure(msg.body, msg.attestation, run=RUN, trust=TRUST, now=NOW, quorum=1)
    for name in list(run_tags(store, RUN)):
        if (
            name != tag(RUN, "start")
            and not name.endswith(("-0", "closure-2"))
            and (f"{tag(RUN, 'verdict', 0)}-" not in name)
        ):
            store.untag(name)
    me = signer or WORKERS[0]
    catch_up = dataclasses.replace(catch_up_for(checked, since), **forged)
    record = sign_catch_up(me.signer, catch_up, kernel_class=KC, certificate=me.cert, time=NOW)
    keep_catch_up(
        store,
        checked,
        closure_blob=tags[tag(RUN, "closure", 2)],
        record_blob=store.put_bytes(record),
    )


def test_rounds_caught_up_over_rest_on_a_signed_catch_up_and_are_listed(store: Store) -> None:
    """Verify accepts a signed catch-up: it names the catch-up among its anchors, needs no
    closure for the round the record says the worker skipped, and still wants the rounds
    it did apply."""
    catch_up_at_round_2(store)
    report = verify_run(store, RUN, TRUST)
    assert report.ok, report.failures
    assert report.checked_rounds == [0, 2]
    signer = WORKERS[0].peer[-8:]
    assert any(a.startswith("caught up at round 2") and signer in a for a in report.anchors)
    store.untag(tag(RUN, "milestone", 0))
    assert failures(store) == [
        "no valid milestone is kept: nothing signed says how many rounds the run has"
    ]


ROGUE = Authority(SoftwareSigner(MachineKey.generate()))


def _unadmitted() -> Machine:
    key = MachineKey.generate()
    cert = ROGUE.admit(
        key.peer_id, operator="mallory", kernel_class=KC, not_before=0, not_after=NOW + 10**6,
        serial=7,
    )  # fmt: skip
    return Machine(key, cert)


def test_an_unsigned_or_forged_catch_up_fails_verify_naming_its_round(store: Store) -> None:
    """Guards against verify taking a round as caught up over (checked by the closure's
    signature only, and the rounds before it excused from having closures) on the word of
    a tag anyone can make: an anchor tag without a signed record, a record by a machine
    the run's authority did not admit, one over another root, and one that claims fewer
    skipped rounds than the store lacks each fail, naming the round."""
    catch_up_at_round_2(store)
    store.untag(tag(RUN, "catchup", 2))  # the anchor tag on the state alone
    gap = "round 1: no closure kept"  # nothing signed excuses it
    assert failures(store) == [
        "round 2: caught up over without a signed catch-up record (an anchor tag alone is "
        "not evidence)",
        gap,
    ]
    catch_up_at_round_2(store, signer=_unadmitted())
    failure, also = failures(store)
    assert failure.startswith("round 2: catch-up record attestation: "), failure
    assert "add its public key to the trusted authorities" in failure
    assert also == gap
    catch_up_at_round_2(store, result_root="ab" * 32)
    assert failures(store) == ["round 2: the catch-up record names another closure, root or state"]
    catch_up_at_round_2(store, since=2)  # "I skipped nothing": then round 1 is a gap
    assert failures(store) == [gap]


def test_a_worker_that_left_is_named_absent_in_the_signed_milestones(tmp_path: Path) -> None:
    """Guards against a departed worker going unnamed: worker 2 sends nothing from round 1
    on, so round 1's milestone names it (peer and operator) among the absent, signed, and
    ``blob outer milestones`` shows it; verify recomputes the field, so a milestone that
    leaves the absent worker out fails it. A version 2 record (before the field) still
    verifies."""
    store = Store.open(tmp_path / "store")
    gone = WORKERS[2]
    keep_run(store, left={gone.peer: 1})
    assert verify_run(store, RUN, TRUST).ok
    root = str(store.root)
    listed = json.loads(
        blob_here(["--store", root, "outer", "milestones", RUN, "--json"], 0).stdout
    )
    assert [m["absent"] for m in listed] == [[], [[gone.peer, gone.cert.operator]], []]
    shown = blob_here(["--store", root, "outer", "milestones", RUN], 0).stdout
    assert f"absent {gone.cert.operator} {gone.peer[-8:]}" in shown
    me = WORKERS[0]
    milestone, _ = decode_milestone_record(store.path(listed[1]["blob"]).read_bytes())
    for forged, failure in (
        (dataclasses.replace(milestone, absent=()), ["round 1: milestone: milestone does not "
                                                     "match the recomputed round"]),
        (dataclasses.replace(milestone, absent=None), []),
    ):  # fmt: skip
        record = sign_milestone(me.signer, forged, kernel_class=KC, certificate=me.cert, time=NOW)
        store.tag(tag(RUN, "milestone", 1), store.put_bytes(record))
        assert verify_run(store, RUN, TRUST).failures == failure


def test_a_version_1_milestone_is_refused_saying_it_does_not_sign_the_runs_length(
    tmp_path: Path,
) -> None:
    """Version 1 milestones carry no signed run terms, so nothing would show a run cut short:
    decoding one fails, and the message says why rather than only naming a version."""
    store = Store.open(tmp_path / "store")
    keep_run(store)
    listed = list_milestones(store, RUN)
    record = decode_map(store.path(listed[0]["blob"]).read_bytes(), max_size=1 << 20, what="m")
    body = decode_map(record["body"], max_size=1 << 20, what="body")
    body = {k: v for k, v in body.items() if k not in ("terms", "absent")} | {"v": 1}
    old = encode_canonical({"body": encode_canonical(body), "attestation": record["attestation"]})
    with pytest.raises(BadMilestone, match="does not sign the run's length"):
        decode_milestone_record(old)


# --- hardware: TPM-bound machines (swtpm) in a run that requires hardware ----------------


@dataclasses.dataclass
class Hardware:
    """An authority with two machines admitted on their TPMs and one admitted in software."""

    trust: TrustStore
    authority: str  # its public key, hex
    tpm_a: Machine
    tpm_b: Machine
    soft: Machine
    a_key: Path


def _cert(path: Path) -> AdmissionCertificate:
    return AdmissionCertificate.decode(path.read_bytes())


@pytest.fixture(scope="module")
def hardware(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hardware]:
    """Two swtpm processes (two machines' TPMs, EK certificates from one local CA), each
    machine bound and admitted through ``blob tpm`` as the README says; skips, saying why,
    where swtpm or tpm2-pytss is missing."""
    from identity.tpm.swtpm import local_ca_certificates, missing_tools, running_swtpm

    missing = missing_tools()
    if missing is not None:
        pytest.skip(f"TPM tests cannot run here: {missing}")
    root = tmp_path_factory.mktemp("hardware")
    akey, registry = root / "authority.key", root / "registry"
    public = blob_here(["--key", str(akey), "authority", "new", "-o", str(akey)], 0).stdout.strip()
    with running_swtpm(root / "a", root / "ca") as a, running_swtpm(root / "b", root / "ca") as b:
        ca = [arg for path in local_ca_certificates(root / "ca") for arg in ("--ek-ca", str(path))]

        def admitted(name: str, tcti: str | None) -> tuple[Machine, Path]:
            key = root / name / "machine.key"
            create_key_file(key)
            k, cert = str(key), str(key.with_name("cert"))
            if tcti is None:
                peer = load_key_file(key).peer_id
                blob_here(["admit", peer, "--operator", name, "--kernel-class", KC,
                           "--authority", str(akey), "-o", cert], 0)  # fmt: skip
                return Machine(load_key_file(key), _cert(Path(cert))), key
            ev, ch, an = (str(key.with_name(x)) for x in ("evidence", "challenge", "answer"))
            blob_here(["--key", k, "tpm", "bind", "--tcti", tcti, "-o", ev], 0)
            blob_here(["--key", k, "tpm", "challenge", ev, *ca, "--authority", str(akey),
                       "--registry", str(registry), "-o", ch], 0)  # fmt: skip
            blob_here(["--key", k, "tpm", "answer", ch, "-o", an], 0)
            blob_here(["--key", k, "tpm", "admit", an, "--operator", name, "--kernel-class", KC,
                       "--authority", str(akey), "--registry", str(registry), "-o", cert],
                      0)  # fmt: skip
            machine_key = load_key_file(key)
            signer = machine_signer(machine_key, key)
            return Machine(machine_key, _cert(Path(cert)), signer), key

        tpm_a, a_key = admitted("op-tpm-a", a.tcti)
        tpm_b, _ = admitted("op-tpm-b", b.tcti)
        soft, _ = admitted("op-soft", None)
        trust = TrustStore(frozenset({parse_public_key(public)}))
        yield Hardware(trust, public, tpm_a, tpm_b, soft, a_key)


def test_tpm_signed_records_pass_require_hardware_and_software_ones_are_refused(
    tmp_path: Path, hardware: Hardware
) -> None:
    """A run of two TPM-bound machines verifies with --require-hardware: every closure,
    update, milestone and verdict carries the AK's co-signature (signer kind "tpm"). The
    same run with one software-admitted machine verifies without it and fails with it,
    naming the round and the software signer; a software-signed milestone is refused
    where a TPM-signed one passes. Guards against require-hardware being a flag nobody
    checks."""
    hw = hardware
    now = int(time.time())
    tpm_run = Store.open(tmp_path / "tpm")
    keep_run(tpm_run, sorted([hw.tpm_a, hw.tpm_b], key=lambda m: m.peer), trust=hw.trust, now=now)
    report = verify_run(tpm_run, RUN, hw.trust, require_hardware=True)
    assert report.ok, report.failures
    assert {m["signer_kind"] for m in list_milestones(tpm_run, RUN, hw.trust)} == {"tpm"}
    verify = ["outer", "verify", RUN, "--authority", hw.authority, "--require-hardware"]
    blob_here(["--store", str(tpm_run.root), *verify], 0)

    mixed = Store.open(tmp_path / "mixed")
    keep_run(mixed, [hw.tpm_a, hw.soft], trust=hw.trust, now=now)
    assert verify_run(mixed, RUN, hw.trust).ok
    (failure,) = verify_run(mixed, RUN, hw.trust, require_hardware=True).failures
    assert failure.startswith(
        f"round 0: closure: not hardware-signed: update by {hw.soft.peer} was signed by a "
        "'software' signer"
    ), failure
    assert "FAILED round 0: closure: not hardware-signed" in (
        blob_here(["--store", str(mixed.root), *verify], 1).stdout
    )

    blob = list_milestones(tpm_run, RUN, hw.trust)[0]["blob"]
    milestone, _ = decode_milestone_record(tpm_run.path(blob).read_bytes())
    for m, kind in ((hw.tpm_b, "tpm"), (hw.soft, "software")):
        record = sign_milestone(m.signer, milestone, kernel_class=KC, certificate=m.cert, time=now)
        assert check_milestone(record, trust=hw.trust)[1] == m.peer
        if kind == "tpm":
            check_milestone(record, trust=hw.trust, require_hardware=True)
        else:
            with pytest.raises(BadMilestone, match="milestone attestation: not hardware-signed"):
                check_milestone(record, trust=hw.trust, require_hardware=True)


def test_a_worker_in_a_hardware_run_takes_only_tpm_signed_updates(hardware: Hardware) -> None:
    """The worker's ledger (training.outer.messages rule 7): in a run that requires
    hardware, the TPM-bound machine's update counts and the software one's is refused with
    the reason "not hardware-signed" (both count in a run that does not); a machine that
    is not TPM-bound, or whose certificate lacks its TPM's key, is refused before it
    starts."""
    from training.outer.params import OuterNetError
    from training.outer.worker.signing import check_signer

    hw = hardware
    now = int(time.time())
    root = "ab" * 32

    def announce(m: Machine) -> UpdateAnnouncement:
        blob = "cd" * 32 if m is hw.soft else "ef" * 32
        attestation = sign_attestation(
            m.signer, kind=UPDATE_KIND, digest=bytes.fromhex(blob), kernel_class=KC,
            subjects=[blob, root, "c0" * 32], time=now, certificate=m.cert,
        )  # fmt: skip
        return UpdateAnnouncement(RUN, 0, blob, attestation.encode(), ())

    heard = {}
    for require in (False, True):
        ledger = Ledger(RUN, hw.tpm_a.peer, hw.trust, require_hardware=require)
        ledger.open_round(0, root, now)
        heard[require] = [
            ledger.hear(encode_message(announce(m)), m.peer, now) for m in (hw.tpm_b, hw.soft)
        ]
    assert [type(e) for (e,) in heard[False]] == [Candidate, Candidate]
    (tpm,), (soft,) = heard[True]
    assert isinstance(tpm, Candidate) and tpm.peer == hw.tpm_b.peer
    assert soft == Rejection(0, hw.soft.peer, "cd" * 32, NOT_HARDWARE)

    check_signer(hw.tpm_a.signer, hw.tpm_a.cert, require_hardware=True)
    with pytest.raises(OuterNetError, match="requires hardware-signed attestations"):
        check_signer(hw.soft.signer, hw.soft.cert, require_hardware=True)
    software_cert = hw.a_key.with_name("software-cert")
    blob_here(["admit", hw.tpm_a.peer, "--operator", "op-tpm-a", "--kernel-class", KC,
               "--authority", str(hw.a_key.parents[1] / "authority.key"), "-o",
               str(software_cert)], 0)  # fmt: skip
    with pytest.raises(OuterNetError, match="certificate does not record that TPM's"):
        check_signer(hw.tpm_a.signer, _cert(software_cert), require_hardware=False)
