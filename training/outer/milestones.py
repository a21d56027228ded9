"""Milestones: per round, signed evidence of whose updates were included, and re-checking a
run from the blobs alone (``blob outer milestones`` / ``blob outer verify``).

Theory of operation
-------------------
1. After a worker applies (or proposes) round r's closure it signs a **milestone**: the
   run, the round, the closure's digest, the start and result roots, the included
   ``(peer, blob)`` pairs (those the aggregation admitted), the excluded ones with their
   reasons, and the run's **terms** (:class:`RunTerms`: how many rounds the run has, its
   replay rate and its outer optimiser), the same for every worker of the run. Every
   honest worker that applied the closure computes the same milestone, so milestones from
   distinct admitted operators over one digest are the evidence a payment rail releases on
   (DESIGN 8's two-operator rule; the rail is out of scope). Kind :data:`MILESTONE_KIND`,
   digest = BLAKE3 of the canonical body, subjects ``[closure digest as hex, result
   root]``. None is signed for a round the worker skipped by catching up: it did not
   recompute it.
2. A worker keeps, tagged in its store (:func:`keep_round`), ``outer-<run>-start`` (the
   state it started from), and per round ``outer-<run>-closure-<r>``,
   ``outer-<run>-milestone-<r>`` and ``outer-<run>-updates-<r>``: a collection blob naming
   every update blob the closure names, so ``blob gc`` keeps them (a tagged collection
   pins its children) for as long as the run is kept. ``blob outer forget`` untags all of
   a run's tags (:func:`run_tags`) and so hands its evidence to gc; the state blobs of old
   rounds are not evidence (each round is recomputed from the start state) and are
   untagged as the run goes.
3. **Verified.** A sampled update's replay verdict (``training.outer.replay``) arrives a
   round after its milestone, so it is its own signed record: every verdict a worker
   made or accepted is kept as a blob, tagged ``outer-<run>-verdict-<r>-<author>``.
   :func:`list_milestones` lists them per round beside the included updates (included vs
   verified).
4. :func:`verify_run` re-checks a run from these alone, and any gap is a failure:
   (a) the run's terms come from its milestones' signed bodies, so its length is fixed by
   signatures: every round from the start state's to the last one the terms name must
   have its closure and its milestone (a missing or invalid one is named; deleting the
   last rounds is a missing round, not a shorter run); (b) each closure's signature
   (against the run's authorities) and the chain (each closure starts from the previous
   result); (c) each result recomputed from the start state and the named update blobs
   (``training.outer.aggregate``) with the terms' optimiser, and each milestone's
   signature and body against that recomputation; (d) every update the round's sample
   drew (``replay.sampled`` and ``replay.replayer_for`` from the closure's result) has a
   valid verdict, signed by its assigned replayer, on the blob the closure named.
   A round the worker caught up over (its closure kept, an ``outer-<run>-anchor-<r+1>``
   tag on the adopted state, no milestone) rests on the closure's signature alone; the
   report lists each such round among its anchors, and the rounds before it that this
   worker never saw need no closure.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import blake3

from blobstore import CollectionEntry, Store, StoreError
from blobstore.canonical import encode as encode_canonical
from blobstore.collection import encode_collection
from identity import (
    AdmissionCertificate,
    Rejected,
    Signer,
    TrustStore,
    decode_msgpack_map,
    sign_attestation,
    verify_attestation,
)
from training.outer.aggregate import Aggregate, aggregate
from training.outer.agreement import CheckedClosure, check_closure
from training.outer.loop import OuterConfig, state_root
from training.outer.messages import (
    BadMessage,
    ClosureAnnouncement,
    Refused,
    VerdictAnnouncement,
    decode_message,
)
from training.outer.replay import (
    REPLAY_KIND,
    BadVerdict,
    Verdict,
    check_verdict,
    replayer_for,
    sampled,
)
from training.outer.state_blob import BadStateBlob, decode_state

MILESTONE_KIND = "blobnet/outer-milestone"
MILESTONE_DOMAIN = b"blobnet/outer-milestone/v1"
# Version 2 added the run's terms (rule 1): a milestone of version 1 does not say how long
# its run is, so nothing signed would show a truncated run.
MILESTONE_VERSION = 2
# A milestone lists at most MAX_INCLUDED (64) workers with peer IDs, blob IDs and short
# reasons, plus its attestation (about 1 KiB): 64 KiB bounds one with room to spare.
MAX_MILESTONE_SIZE = 64 * 1024


class BadMilestone(Exception):
    """Bytes that are not a canonical milestone record."""


@dataclass(frozen=True)
class RunTerms:
    """What every worker of a run is given identically and :func:`verify_run` needs: the
    run has rounds ``0 .. rounds - 1``, samples updates for replay at ``replay_rate`` and
    takes outer steps with ``outer`` (rule 1)."""

    rounds: int
    replay_rate: float
    outer_lr: float
    outer_momentum: float

    def fields(self) -> list[Any]:
        return [self.rounds, self.replay_rate, self.outer_lr, self.outer_momentum]

    def outer(self) -> OuterConfig:
        return OuterConfig(lr=self.outer_lr, momentum=self.outer_momentum)


@dataclass(frozen=True)
class Milestone:
    run: str
    round: int
    closure: str  # the closure digest, hex
    start_root: str
    result_root: str
    included: tuple[tuple[str, str], ...]  # (peer, blob)
    excluded: tuple[tuple[str, str, str], ...]  # (peer, blob, reason)
    terms: RunTerms

    def fields(self) -> dict[str, Any]:
        return {
            "v": MILESTONE_VERSION,
            "run": self.run,
            "round": self.round,
            "closure": self.closure,
            "start": self.start_root,
            "result": self.result_root,
            "included": [list(x) for x in self.included],
            "excluded": [list(x) for x in self.excluded],
            "terms": self.terms.fields(),
        }

    def body(self) -> bytes:
        data: bytes = encode_canonical(self.fields())
        return data

    def digest(self) -> bytes:
        body = self.body()
        return blake3.blake3(MILESTONE_DOMAIN + struct.pack("<Q", len(body)) + body).digest()

    def to_json(self) -> dict[str, Any]:
        out = self.fields()
        out.pop("v")
        out["terms"] = dict(zip(("rounds", "replay_rate", "outer_lr", "outer_momentum"),
                                out["terms"], strict=True))  # fmt: skip
        return out


def milestone_for(checked: CheckedClosure, agg: Aggregate, terms: RunTerms) -> Milestone:
    c = checked.closure
    return Milestone(
        c.run,
        c.round,
        checked.digest.hex(),
        c.start_root,
        state_root(agg.state),
        tuple((p, b) for p, b, _ in agg.admitted),
        tuple((e.peer, e.blob, e.reason) for e in agg.excluded),
        terms,
    )


def sign_milestone(
    signer: Signer,
    milestone: Milestone,
    *,
    kernel_class: str,
    certificate: AdmissionCertificate,
    time: int,
) -> bytes:
    """The milestone record blob: the body and this worker's attestation over it."""
    attestation = sign_attestation(
        signer,
        kind=MILESTONE_KIND,
        digest=milestone.digest(),
        kernel_class=kernel_class,
        subjects=[milestone.closure, milestone.result_root],
        time=time,
        certificate=certificate,
    )
    record: bytes = encode_canonical(
        {"body": milestone.body(), "attestation": attestation.encode()}
    )
    return record


def _milestone_from_body(body: bytes) -> Milestone:
    obj = decode_msgpack_map(
        body, max_size=MAX_MILESTONE_SIZE, what="milestone", error=BadMilestone
    )
    if obj.get("v") != MILESTONE_VERSION:
        raise BadMilestone(f"milestone version {obj.get('v')!r} is not {MILESTONE_VERSION}")
    try:
        rounds, rate, lr, momentum = obj["terms"]
        m = Milestone(
            obj["run"],
            obj["round"],
            obj["closure"],
            obj["start"],
            obj["result"],
            tuple((str(p), str(b)) for p, b in obj["included"]),
            tuple((str(p), str(b), str(r)) for p, b, r in obj["excluded"]),
            RunTerms(int(rounds), float(rate), float(lr), float(momentum)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadMilestone(f"milestone has a malformed field: {exc}") from None
    if m.body() != bytes(body):
        raise BadMilestone("milestone is not in canonical form")
    return m


def decode_milestone_record(data: bytes) -> tuple[Milestone, bytes]:
    """(milestone, attestation bytes) of a record blob; :class:`BadMilestone` otherwise."""
    obj = decode_msgpack_map(
        data, max_size=MAX_MILESTONE_SIZE + 4096, what="milestone record", error=BadMilestone
    )
    body, attestation = obj.get("body"), obj.get("attestation")
    if type(body) is not bytes or type(attestation) is not bytes or len(obj) != 2:
        raise BadMilestone("milestone record must be {body, attestation}")
    return _milestone_from_body(body), attestation


def check_milestone(data: bytes, *, trust: TrustStore) -> tuple[Milestone, str]:
    """The milestone and its signer's peer ID, if its attestation verifies."""
    milestone, attestation = decode_milestone_record(data)
    try:
        # Certificates are checked as of when the milestone was signed.
        when = verify_attestation(attestation, kind=MILESTONE_KIND).time
        signed = verify_attestation(attestation, trust=trust, now=when, kind=MILESTONE_KIND)
    except Rejected as exc:
        raise BadMilestone(f"milestone attestation: {exc}") from None
    if signed.digest != milestone.digest():
        raise BadMilestone("milestone attestation is over another body")
    if signed.subjects != (milestone.closure, milestone.result_root):
        raise BadMilestone("milestone attestation names another closure or root")
    return milestone, signed.signer_peer_id


# --- listing and verifying a run ------------------------------------------------------


def tag(run: str, what: str, round_: int | None = None) -> str:
    return f"outer-{run}-{what}" + ("" if round_ is None else f"-{round_}")


# The tags a run's workers make (rule 2), after ``outer-<run>-``; a peer ID has no '-', so
# run "a" never claims run "a-verdict-1"'s tags.
_RUN_TAG = re.compile(r"(start|end|(closure|milestone|updates|anchor|state)-\d+|verdict-\d+-[^-]+)")


def run_tags(store: Store, run: str) -> dict[str, str]:
    """Every tag of ``run`` in ``store`` (name -> blob): what ``blob outer forget`` drops."""
    prefix = f"outer-{run}-"
    return {
        name: blob
        for name, blob in store.tags().items()
        if name.startswith(prefix) and _RUN_TAG.fullmatch(name[len(prefix) :])
    }


def keep_round(
    store: Store, checked: CheckedClosure, *, closure_blob: str, milestone_blob: str
) -> None:
    """Rule 2: pin what :func:`verify_run` needs of a round this worker applied: its closure
    and milestone blobs, and (in a collection blob) every update blob the closure names."""
    c = checked.closure
    entries = [
        CollectionEntry(f"{i:03d}-{x.peer}", x.blob, store.manifest(x.blob).size)
        for i, x in enumerate(c.included)
    ]
    with store.lease() as lease:  # no gc between publishing the collection and tagging it
        updates = store.put_bytes(encode_collection(entries), lease=lease)
        store.tag(tag(c.run, "updates", c.round), updates)
    store.tag(tag(c.run, "milestone", c.round), milestone_blob)
    store.tag(tag(c.run, "closure", c.round), closure_blob)


def _rounds(store: Store, run: str, what: str) -> dict[int, str]:
    prefix = tag(run, what) + "-"
    out = {}
    for name, blob in store.tags().items():
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            out[int(name[len(prefix) :])] = blob
    return out


def _verdicts(store: Store, run: str) -> dict[int, list[tuple[str, str]]]:
    """Round -> [(author, verdict record blob)] of the verdicts kept (rule 3)."""
    prefix = tag(run, "verdict") + "-"
    out: dict[int, list[tuple[str, str]]] = {}
    for name, blob in store.tags().items():
        round_, _, author = name[len(prefix) :].partition("-")
        if name.startswith(prefix) and round_.isdigit() and author and "-" not in author:
            out.setdefault(int(round_), []).append((author, blob))
    return out


def check_verdict_record(
    data: bytes, *, run: str, trust: TrustStore | None
) -> tuple[VerdictAnnouncement, str]:
    """A kept verdict and its replayer's peer ID (signature checked against ``trust`` as
    of signing time, if given); ``BadMilestone`` otherwise."""
    try:
        msg = decode_message(data)
    except BadMessage as exc:
        raise BadMilestone(f"verdict record: {exc}") from None
    if not isinstance(msg, VerdictAnnouncement) or msg.run != run:
        raise BadMilestone("verdict record is not a verdict of this run")
    verdict = Verdict(msg.run, msg.round, msg.author, msg.update, msg.commitment, msg.outcome)
    try:
        when = verify_attestation(msg.attestation, kind=REPLAY_KIND).time
        if trust is None:
            return msg, verify_attestation(msg.attestation, kind=REPLAY_KIND).signer_peer_id
        return msg, check_verdict(verdict, msg.attestation, trust=trust, now=when).signer_peer_id
    except (Rejected, BadVerdict) as exc:
        raise BadMilestone(f"verdict attestation: {exc}") from None


def list_milestones(
    store: Store, run: str, trust: TrustStore | None = None
) -> list[dict[str, Any]]:
    """Every milestone of ``run`` in ``store``, by round (signature checked with ``trust``),
    with the verdicts on that round's sampled updates (``verified``)."""
    out = []
    verdicts = _verdicts(store, run)
    for r, blob in sorted(_rounds(store, run, "milestone").items()):
        data = store.path(blob).read_bytes()
        entry: dict[str, Any] = {"round": r, "blob": blob}
        try:
            if trust is None:
                milestone, attestation = decode_milestone_record(data)
                entry["signer"] = verify_attestation(
                    attestation, kind=MILESTONE_KIND
                ).signer_peer_id
            else:
                milestone, entry["signer"] = check_milestone(data, trust=trust)
            entry.update(milestone.to_json())
        except (BadMilestone, Rejected) as exc:
            entry["error"] = str(exc)
        entry["verified"] = []
        for author, vblob in sorted(verdicts.get(r, [])):
            try:
                msg, replayer = check_verdict_record(
                    store.path(vblob).read_bytes(), run=run, trust=trust
                )
                entry["verified"].append(
                    {"author": author, "update": msg.update, "outcome": msg.outcome,
                     "replayer": replayer}
                )  # fmt: skip
            except BadMilestone as exc:
                entry["verified"].append({"author": author, "error": str(exc)})
        out.append(entry)
    return out


def invalid_entries(entries: list[dict[str, Any]]) -> int:
    """How many milestones and verdicts of a :func:`list_milestones` listing are invalid."""
    return sum("error" in e for e in entries) + sum(
        "error" in v for e in entries for v in e["verified"]
    )


@dataclass
class Report:
    run: str
    checked_rounds: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    anchors: list[str] = field(default_factory=list)
    rounds: int | None = None  # the run's length, from its milestones' terms (rule 4a)

    @property
    def ok(self) -> bool:
        return not self.failures and bool(self.checked_rounds)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "ok": self.ok,
            "rounds": self.rounds,
            "anchors": self.anchors,
            "checked_rounds": self.checked_rounds,
            "failures": self.failures,
        }


def _terms(
    store: Store, milestones: dict[int, str], trust: TrustStore, report: Report
) -> RunTerms | None:
    """Rule 4a: the run's terms, which every valid milestone must state alike."""
    found: dict[RunTerms, int] = {}
    for r, blob in sorted(milestones.items()):
        try:
            milestone, _signer = check_milestone(store.path(blob).read_bytes(), trust=trust)
        except (BadMilestone, StoreError, OSError):
            continue  # named in its round's check
        found.setdefault(milestone.terms, r)
    if not found:
        report.failures.append(
            "no valid milestone is kept: nothing signed says how many rounds the run has"
        )
        return None
    if len(found) > 1:
        report.failures.append(
            "milestones disagree on the run's terms (rounds "
            + ", ".join(f"{r}: {t.fields()}" for t, r in found.items())
            + ")"
        )
        return None
    return next(iter(found))


def verify_run(
    store: Store,
    run: str,
    trust: TrustStore,
    *,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Rule 4 of the module: re-check a run's closures, results, milestones and verdicts,
    from its start to the end its milestones sign."""
    report = Report(run)
    tags = store.tags()
    start_tag = tag(run, "start")
    if start_tag not in tags:
        report.failures.append(f"no {start_tag} tag: this store holds no run {run!r}")
        return report

    def load(blob: str) -> bytes:
        return store.path(blob).read_bytes()

    try:
        state = decode_state(load(tags[start_tag]))
    except (BadStateBlob, StoreError, OSError) as exc:
        report.failures.append(f"start state {tags[start_tag][:16]}: {exc}")
        return report
    root = state_root(state)
    report.anchors.append(f"started at round {state.round}, root {root}")
    closures = _rounds(store, run, "closure")
    milestones = _rounds(store, run, "milestone")
    verdicts = _verdicts(store, run)
    anchors = _rounds(store, run, "anchor")  # states this worker caught up to
    terms = _terms(store, milestones, trust, report)
    if terms is None:
        return report
    report.rounds = terms.rounds
    report.anchors.append(f"the run has rounds 0..{terms.rounds - 1} (its milestones' terms)")
    # A closure kept with an anchor on its result and no milestone: a round caught up over.
    caught_up = {r for r in closures if r + 1 in anchors and r not in milestones}
    for r in range(state.round, terms.rounds):
        later = [x for x in closures if x >= r]
        if r not in closures and not (later and min(later) in caught_up):
            report.failures.append(f"round {r}: no closure kept")
        elif r in closures and r not in caught_up and r not in milestones:
            report.failures.append(f"round {r}: no milestone kept")
    for r in sorted(x for x in closures if x >= terms.rounds):
        report.failures.append(f"round {r}: a closure past the run's last round")
    config = terms.outer()
    for r in sorted(x for x in closures if state.round <= x < terms.rounds):
        if r != state.round and r not in caught_up:
            return report  # the chain is broken where a closure is missing (named above)
        try:
            msg = decode_message(load(closures[r]))
            if not isinstance(msg, ClosureAnnouncement):
                raise Refused("not a closure announcement")
            attestation_time = verify_attestation(msg.attestation).time
            checked = check_closure(
                msg.body, msg.attestation, run=run, trust=trust, now=attestation_time
            )
        except (BadMessage, Refused, Rejected, StoreError, OSError) as exc:
            report.failures.append(f"round {r}: closure: {exc}")
            return report
        c = checked.closure
        if r in caught_up:
            # The worker skipped rounds by catching up to this closure's result: from here
            # its state rests on the closure's signature, not on a recomputation.
            try:
                state = decode_state(load(anchors[r + 1]))
            except (BadStateBlob, StoreError, OSError) as exc:
                report.failures.append(f"round {r}: caught-up state: {exc}")
                return report
            root = state_root(state)
            if root != c.result_root or state.round != r + 1:
                report.failures.append(f"round {r}: caught-up state is not the closure's result")
                return report
            report.anchors.append(f"caught up at round {r} to root {root} (signed, not recomputed)")
            report.checked_rounds.append(r)
            continue
        if c.start_root != root:
            report.failures.append(
                f"round {r}: closure starts from {c.start_root[:16]}, not {root[:16]}"
            )
            return report
        try:
            agg = aggregate(
                state, [(x.peer, x.blob) for x in c.included], load, config, start_root=root
            )
        except (StoreError, OSError) as exc:
            report.failures.append(f"round {r}: an update blob is missing: {exc}")
            return report
        new_root = state_root(agg.state)
        if new_root != c.result_root:
            report.failures.append(
                f"round {r}: recomputed root {new_root[:16]} is not the closure's"
            )
            return report
        if r in milestones:
            try:
                milestone, _signer = check_milestone(load(milestones[r]), trust=trust)
                if milestone != milestone_for(checked, agg, terms):
                    raise BadMilestone("milestone does not match the recomputed round")
            except (BadMilestone, StoreError, OSError) as exc:
                report.failures.append(f"round {r}: milestone: {exc}")
        _check_verdicts(r, checked, agg, terms, verdicts.get(r, []), load, trust, report)
        if progress is not None:
            progress(f"round {r}: ok, root {new_root[:16]}")
        report.checked_rounds.append(r)
        state, root = agg.state, new_root
    return report


def _check_verdicts(
    r: int,
    checked: CheckedClosure,
    agg: Aggregate,
    terms: RunTerms,
    kept: list[tuple[str, str]],
    load: Callable[[str], bytes],
    trust: TrustStore,
    report: Report,
) -> None:
    """Rule 4d: each kept verdict is valid and judges an update the closure named, and
    every update the round's sample drew has one, from its assigned replayer."""
    c = checked.closure
    named = {(x.peer, x.blob) for x in c.included}
    by_peer = dict(zip(c.peers(), checked.operators, strict=True))
    operators = {p: by_peer[p] for p, _, _ in agg.admitted}
    judged: dict[str, str] = {}  # author -> the replayer who signed the verdict
    for author, vblob in kept:
        try:
            msg, signer = check_verdict_record(load(vblob), run=c.run, trust=trust)
            if msg.round != r or msg.author != author or (author, msg.update) not in named:
                raise BadMilestone("verdict judges an update the closure did not name")
            judged[author] = signer
        except (BadMilestone, StoreError, OSError) as exc:
            report.failures.append(f"round {r}: verdict on {author[-8:]}: {exc}")
    for peer, _blob, _ in agg.admitted:
        due = replayer_for(c.result_root, peer, operators)
        if due is None or not sampled(c.result_root, peer, terms.replay_rate):
            continue
        if peer not in judged:
            if all(a != peer for a, _ in kept):
                report.failures.append(
                    f"round {r}: no verdict kept on {peer[-8:]}'s sampled update "
                    f"(its replayer is {due[-8:]})"
                )
        elif judged[peer] != due:
            report.failures.append(
                f"round {r}: the verdict on {peer[-8:]} is signed by {judged[peer][-8:]}, "
                f"not its replayer {due[-8:]}"
            )
