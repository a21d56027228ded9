"""Milestones: per round, signed evidence of whose updates were included, and re-checking a
run from the blobs alone (``blob outer milestones`` / ``blob outer verify``).

Theory of operation
-------------------
1. After a worker applies (or proposes) round r's closure it signs a **milestone**: the
   run, the round, the closure's digest, the start and result roots, the included
   ``(peer, blob)`` pairs (those the aggregation admitted), the excluded ones with their
   reasons, the run's **terms** (:class:`RunTerms`: how many rounds the run has, its
   replay rate, its outer optimiser and its quorum), the same for every worker of the
   run, and the **absent** workers (:func:`absent_workers`): ``(peer, operator)`` of each
   worker the previous round's closure named (included, left out or passed) whom this
   closure does not name at all (it left, or missed the round), so a departure is signed,
   not only logged. Every
   honest worker that applied the closure computes the same milestone, so milestones from
   distinct admitted operators over one digest are the evidence a payment rail releases on
   (DESIGN 8's two-operator rule; the rail is out of scope). Kind :data:`MILESTONE_KIND`,
   digest = BLAKE3 of the canonical body, subjects ``[closure digest as hex, result
   root]``. None is signed for a round the worker skipped by catching up: it did not
   recompute it. Version 3 added ``absent``, version 4 the quorum to the terms; version 2
   and 3 records still decode and verify.
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
   (against the run's authorities), its quorum (``training.outer.agreement`` rule 7:
   the spec's where the caller has the spec, which the terms must then state, else the
   terms') and the chain (each closure starts from the previous result); (c) each result
   recomputed from the start state and the named update blobs
   (``training.outer.aggregate``) with the terms' optimiser, and each milestone's
   signature and body against that recomputation; (d) every update the round's sample
   drew (``replay.sampled`` and ``replay.replayer_for`` from the closure's result) has a
   valid verdict, signed by its assigned replayer, on the blob the closure named.
5. **Catching up is signed.** A worker that adopts round r's result without recomputing
   it (``training.outer.worker``'s catch-up) signs a **catch-up record**
   (:class:`CatchUp`, kind :data:`CATCH_UP_KIND`): the run, the round, the closure's
   digest, its result root and state blob, and ``since``, the state round it held before
   (so it never saw the closures of rounds ``since .. r-1``). :func:`keep_catch_up` tags
   the record ``outer-<run>-catchup-<r>`` and the adopted state
   ``outer-<run>-anchor-<r+1>``. Verify accepts round r as caught up over (its closure's
   signature, not a recomputation) only with a valid record, signed by an admitted
   machine, naming that closure, root and state; only the rounds the record says it
   skipped need no closure. An anchor tag without a record, or a record that does not
   verify, fails verify naming the round: a tag is anyone's to make.
6. **Hardware.** ``require_hardware`` (the run spec's, or ``blob outer verify
   --require-hardware``) makes verify refuse every closure, update, milestone, verdict and
   catch-up record that no hardware signer made (``training.outer.messages`` rule 7).
"""

from __future__ import annotations

import dataclasses
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
    Attestation,
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
    check_hardware,
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
# Version 4 states the run's quorum in its terms, version 3 names the absent workers (rule
# 1). Versions 3 and 2 (the run's terms, no absent workers) still decode; version 1 does
# not say how long its run is, so nothing signed would show a truncated run, and is
# refused.
MILESTONE_VERSION = 4
ABSENT_MILESTONE_VERSION = 3
TERMS_MILESTONE_VERSION = 2
CATCH_UP_KIND = "blobnet/outer-catch-up"
CATCH_UP_DOMAIN = b"blobnet/outer-catch-up/v1"
CATCH_UP_VERSION = 1
# A catch-up record is a few IDs and its attestation (about 1 KiB with the certificate).
MAX_CATCH_UP_SIZE = 16 * 1024
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
    # The distinct operators each closure names at least (outer_agreement rule 7); None
    # in a version 2 or 3 record, which predates it.
    quorum: int | None = None

    def fields(self) -> list[Any]:
        out: list[Any] = [self.rounds, self.replay_rate, self.outer_lr, self.outer_momentum]
        return out if self.quorum is None else [*out, self.quorum]

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
    # (peer, operator) of the workers the previous closure named and this one does not;
    # None only in a version 2 record, which predates the field.
    absent: tuple[tuple[str, str], ...] | None = ()

    @property
    def version(self) -> int:
        if self.absent is None:
            return TERMS_MILESTONE_VERSION
        return ABSENT_MILESTONE_VERSION if self.terms.quorum is None else MILESTONE_VERSION

    def fields(self) -> dict[str, Any]:
        out = {
            "v": self.version,
            "run": self.run,
            "round": self.round,
            "closure": self.closure,
            "start": self.start_root,
            "result": self.result_root,
            "included": [list(x) for x in self.included],
            "excluded": [list(x) for x in self.excluded],
            "terms": self.terms.fields(),
        }
        if self.absent is not None:
            out["absent"] = [list(x) for x in self.absent]
        return out

    def body(self) -> bytes:
        data: bytes = encode_canonical(self.fields())
        return data

    def digest(self) -> bytes:
        body = self.body()
        return blake3.blake3(MILESTONE_DOMAIN + struct.pack("<Q", len(body)) + body).digest()

    def to_json(self) -> dict[str, Any]:
        out = self.fields()
        out.pop("v")
        names = ("rounds", "replay_rate", "outer_lr", "outer_momentum", "quorum")
        out["terms"] = dict(zip(names, out["terms"], strict=False))
        return out


def absent_workers(
    previous: CheckedClosure | None, checked: CheckedClosure
) -> tuple[tuple[str, str], ...]:
    """Rule 1: (peer, operator) of each worker ``previous`` (the closure of the round
    before, whose result ``checked`` starts from) named and ``checked`` does not, by peer.
    Nothing without that previous closure (round 0, or one this worker never held)."""
    c = checked.closure
    if previous is None or (previous.closure.round, previous.closure.result_root) != (
        c.round - 1,
        c.start_root,
    ):
        return ()
    named = set(c.present())
    return tuple(sorted((p, op) for p, op in previous.named() if p not in named))


def milestone_for(
    checked: CheckedClosure,
    agg: Aggregate,
    terms: RunTerms,
    previous: CheckedClosure | None = None,
) -> Milestone:
    """Round ``checked``'s milestone; ``previous``: the closure of the round before."""
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
        absent_workers(previous, checked),
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
    return _signed_record(
        signer,
        milestone.body(),
        kind=MILESTONE_KIND,
        digest=milestone.digest(),
        subjects=(milestone.closure, milestone.result_root),
        kernel_class=kernel_class,
        certificate=certificate,
        time=time,
    )


def _signed_record(
    signer: Signer,
    body: bytes,
    *,
    kind: str,
    digest: bytes,
    subjects: tuple[str, ...],
    kernel_class: str,
    certificate: AdmissionCertificate,
    time: int,
) -> bytes:
    """A record blob of milestones.py's kinds: ``body`` and this worker's attestation of
    ``kind`` over ``digest`` (the body's domain-separated hash), encoded canonically."""
    attestation = sign_attestation(
        signer,
        kind=kind,
        digest=digest,
        kernel_class=kernel_class,
        subjects=subjects,
        time=time,
        certificate=certificate,
    )
    record: bytes = encode_canonical({"body": body, "attestation": attestation.encode()})
    return record


def _milestone_from_body(body: bytes) -> Milestone:
    obj = decode_msgpack_map(
        body, max_size=MAX_MILESTONE_SIZE, what="milestone", error=BadMilestone
    )
    version = obj.get("v")
    if version == 1:
        raise BadMilestone(
            "milestone version 1 does not sign the run's length, so a truncated run could not "
            "be told from a finished one: verify takes version 2 or later (a run made by this "
            "release)"
        )
    if version not in (MILESTONE_VERSION, ABSENT_MILESTONE_VERSION, TERMS_MILESTONE_VERSION):
        raise BadMilestone(f"milestone version {version!r} is not {MILESTONE_VERSION}")
    try:
        quorum = None
        if version == MILESTONE_VERSION:
            rounds, rate, lr, momentum, quorum = obj["terms"]
            if type(quorum) is not int or quorum < 1:
                raise ValueError("the quorum is a count of operators, at least 1")
        else:
            rounds, rate, lr, momentum = obj["terms"]
        absent = None
        if version != TERMS_MILESTONE_VERSION:
            absent = tuple((str(p), str(op)) for p, op in obj["absent"])
        m = Milestone(
            obj["run"],
            obj["round"],
            obj["closure"],
            obj["start"],
            obj["result"],
            tuple((str(p), str(b)) for p, b in obj["included"]),
            tuple((str(p), str(b), str(r)) for p, b, r in obj["excluded"]),
            RunTerms(int(rounds), float(rate), float(lr), float(momentum), quorum),
            absent,
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


def _verified(
    attestation: bytes, *, kind: str, trust: TrustStore, require_hardware: bool, what: str
) -> Attestation:
    """A record's attestation checked against ``trust`` as of its signing time (and, with
    ``require_hardware``, made by a hardware signer: rule 6); BadMilestone otherwise."""
    try:
        when = verify_attestation(attestation, kind=kind).time
        signed = verify_attestation(attestation, trust=trust, now=when, kind=kind)
        if require_hardware:
            check_hardware(signed, what)
    except (Rejected, Refused) as exc:
        raise BadMilestone(f"{what} attestation: {exc}") from None
    return signed


def check_milestone(
    data: bytes, *, trust: TrustStore, require_hardware: bool = False
) -> tuple[Milestone, str]:
    """The milestone and its signer's peer ID, if its attestation verifies."""
    milestone, attestation = decode_milestone_record(data)
    signed = _verified(
        attestation,
        kind=MILESTONE_KIND,
        trust=trust,
        require_hardware=require_hardware,
        what="milestone",
    )
    if signed.digest != milestone.digest():
        raise BadMilestone("milestone attestation is over another body")
    if signed.subjects != (milestone.closure, milestone.result_root):
        raise BadMilestone("milestone attestation names another closure or root")
    return milestone, signed.signer_peer_id


@dataclass(frozen=True)
class CatchUp:
    """Rule 5: a worker adopted round ``round``'s result (closure ``closure``, root
    ``result_root``, state blob ``state_blob``) without recomputing it, having held state
    round ``since``; it never saw the closures of rounds ``since .. round - 1``."""

    run: str
    round: int
    closure: str  # the closure digest, hex
    result_root: str
    state_blob: str
    since: int

    def __post_init__(self) -> None:
        if not 0 <= self.since <= self.round:
            raise ValueError("a catch-up's since round is between 0 and its round")

    def fields(self) -> dict[str, Any]:
        return {
            "v": CATCH_UP_VERSION,
            "run": self.run,
            "round": self.round,
            "closure": self.closure,
            "result": self.result_root,
            "state": self.state_blob,
            "since": self.since,
        }

    def body(self) -> bytes:
        data: bytes = encode_canonical(self.fields())
        return data

    def digest(self) -> bytes:
        body = self.body()
        return blake3.blake3(CATCH_UP_DOMAIN + struct.pack("<Q", len(body)) + body).digest()

    def subjects(self) -> tuple[str, str, str]:
        return (self.closure, self.result_root, self.state_blob)


def catch_up_for(checked: CheckedClosure, since: int) -> CatchUp:
    """The catch-up record of adopting ``checked``'s result from state round ``since``."""
    c = checked.closure
    return CatchUp(
        c.run, c.round, checked.digest.hex(), c.result_root, c.state_blob, min(since, c.round)
    )


def sign_catch_up(
    signer: Signer,
    catch_up: CatchUp,
    *,
    kernel_class: str,
    certificate: AdmissionCertificate,
    time: int,
) -> bytes:
    """The catch-up record blob: the body and this worker's attestation over it."""
    return _signed_record(
        signer,
        catch_up.body(),
        kind=CATCH_UP_KIND,
        digest=catch_up.digest(),
        subjects=catch_up.subjects(),
        kernel_class=kernel_class,
        certificate=certificate,
        time=time,
    )


def check_catch_up(
    data: bytes, *, trust: TrustStore, require_hardware: bool = False
) -> tuple[CatchUp, str]:
    """A catch-up record and its signer's peer ID, if its attestation verifies (as of its
    signing time, against ``trust``); :class:`BadMilestone` otherwise."""
    what = "catch-up record"
    obj = decode_msgpack_map(data, max_size=MAX_CATCH_UP_SIZE, what=what, error=BadMilestone)
    body, attestation = obj.get("body"), obj.get("attestation")
    if type(body) is not bytes or type(attestation) is not bytes or len(obj) != 2:
        raise BadMilestone(f"{what} must be {{body, attestation}}")
    fields = decode_msgpack_map(body, max_size=MAX_CATCH_UP_SIZE, what=what, error=BadMilestone)
    if fields.get("v") != CATCH_UP_VERSION:
        raise BadMilestone(f"{what} version {fields.get('v')!r} is not {CATCH_UP_VERSION}")
    try:
        catch_up = CatchUp(
            str(fields["run"]),
            int(fields["round"]),
            str(fields["closure"]),
            str(fields["result"]),
            str(fields["state"]),
            int(fields["since"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadMilestone(f"{what} has a malformed field: {exc}") from None
    if catch_up.body() != body or encode_canonical(obj) != bytes(data):
        raise BadMilestone(f"{what} is not in canonical form")
    signed = _verified(
        attestation, kind=CATCH_UP_KIND, trust=trust, require_hardware=require_hardware, what=what
    )
    if signed.digest != catch_up.digest():
        raise BadMilestone(f"{what} attestation is over another body")
    if signed.subjects != catch_up.subjects():
        raise BadMilestone(f"{what} attestation names another closure, root or state")
    return catch_up, signed.signer_peer_id


def closure_hardware(checked: CheckedClosure) -> None:
    """Rule 6 (and ``training.outer.messages`` rule 7) for a closure already checked
    against the run's trust store: its proposer's attestation and every update attestation
    it names come from hardware signers; :class:`Refused` otherwise."""
    c = checked.closure
    check_hardware(Attestation.decode(checked.attestation), "closure")
    updates: list[Any] = [*c.included, *c.left]
    for x in updates:
        check_hardware(Attestation.decode(x.attestation), "update")
    for passed in c.passed:
        check_hardware(Attestation.decode(passed.attestation), "pass")


# --- listing and verifying a run ------------------------------------------------------


def tag(run: str, what: str, round_: int | None = None) -> str:
    return f"outer-{run}-{what}" + ("" if round_ is None else f"-{round_}")


# The tags a run's workers make (rule 2), after ``outer-<run>-``; a peer ID has no '-', so
# run "a" never claims run "a-verdict-1"'s tags.
_RUN_TAG = re.compile(
    r"(start|end|fixed|base|data|resume|resume-inner"
    r"|(closure|milestone|updates|anchor|catchup|state)-\d+"
    r"|verdict-\d+-[^-]+)"
)


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
    # Applied after all (a better closure of a round it had caught up over): that round's
    # catch-up, of a dead branch, is no longer this worker's account of it.
    _untag(store, tag(c.run, "catchup", c.round), tag(c.run, "anchor", c.round + 1))


def keep_catch_up(
    store: Store, checked: CheckedClosure, *, closure_blob: str, record_blob: str
) -> None:
    """Rule 5: pin a round this worker caught up over: its closure, its signed catch-up
    record and the adopted state (the state verify goes on from). A milestone it signed
    for that round before (of another closure, a dead branch) no longer holds."""
    c = checked.closure
    store.tag(tag(c.run, "anchor", c.round + 1), c.state_blob)
    store.tag(tag(c.run, "catchup", c.round), record_blob)
    store.tag(tag(c.run, "closure", c.round), closure_blob)
    _untag(store, tag(c.run, "milestone", c.round), tag(c.run, "updates", c.round))


def _untag(store: Store, *names: str) -> None:
    tags = store.tags()
    for name in names:
        if name in tags:
            try:
                store.untag(name)
            except StoreError:
                pass  # gone meanwhile: what was asked


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
    data: bytes, *, run: str, trust: TrustStore | None, require_hardware: bool = False
) -> tuple[VerdictAnnouncement, str]:
    """A kept verdict and its replayer's peer ID (signature checked against ``trust`` as
    of signing time, if given, and with ``require_hardware`` made by a hardware signer);
    ``BadMilestone`` otherwise."""
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
        signed = check_verdict(verdict, msg.attestation, trust=trust, now=when)
        if require_hardware:
            check_hardware(signed, "verdict")
        return msg, signed.signer_peer_id
    except (Rejected, BadVerdict, Refused) as exc:
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
            milestone, attestation = decode_milestone_record(data)
            signed = verify_attestation(attestation, kind=MILESTONE_KIND)
            if trust is not None:
                check_milestone(data, trust=trust)
            entry["signer"], entry["signer_kind"] = signed.signer_peer_id, signed.signer_kind
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
    require_hardware: bool = False,
    quorum: int | None = None,
) -> Report:
    """Rules 4-6 of the module: re-check a run's closures, results, milestones, verdicts
    and catch-ups, from its start to the end its milestones sign (``require_hardware``:
    every one of them signed by a hardware signer; ``quorum``: the run's, from its spec,
    else its milestones' terms say it)."""
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
    if require_hardware:
        report.anchors.append("hardware: every record co-signed by a TPM attestation key")
    closures = _rounds(store, run, "closure")
    milestones = _rounds(store, run, "milestone")
    verdicts = _verdicts(store, run)
    terms = _terms(store, milestones, trust, report)
    if terms is None:
        return report
    report.rounds = terms.rounds
    report.anchors.append(f"the run has rounds 0..{terms.rounds - 1} (its milestones' terms)")
    if quorum is not None and terms.quorum is not None and terms.quorum != quorum:
        report.failures.append(
            f"the milestones sign a quorum of {terms.quorum}, the run's spec says {quorum}"
        )
        return report
    quorum = quorum or terms.quorum
    if quorum is not None:
        report.anchors.append(f"each closure names at least {quorum} operator(s) (its quorum)")
    # Rule 5: a round kept with a catch-up record or an anchor on its result and no
    # milestone was caught up over; only a valid signed record makes it so.
    anchors = _rounds(store, run, "anchor")
    records = _rounds(store, run, "catchup")
    caught_up = {r for r in closures if (r + 1 in anchors or r in records) and r not in milestones}
    catch_ups: dict[int, tuple[CatchUp, str]] = {}
    for r in sorted(caught_up):
        try:
            if r not in records:
                raise BadMilestone(
                    "caught up over without a signed catch-up record (an anchor tag alone is "
                    "not evidence)"
                )
            catch_ups[r] = check_catch_up(
                load(records[r]), trust=trust, require_hardware=require_hardware
            )
            if (catch_ups[r][0].run, catch_ups[r][0].round) != (run, r):
                raise BadMilestone("catch-up record is another run's or round's")
        except (BadMilestone, StoreError, OSError) as exc:
            catch_ups.pop(r, None)
            report.failures.append(f"round {r}: {exc}")
    for r in range(state.round, terms.rounds):
        skipped = any(cu.since <= r < x for x, (cu, _) in catch_ups.items())
        if r not in closures and not skipped:
            report.failures.append(f"round {r}: no closure kept")
        elif r in closures and r not in caught_up and r not in milestones:
            report.failures.append(f"round {r}: no milestone kept")
    for r in sorted(x for x in closures if x >= terms.rounds):
        report.failures.append(f"round {r}: a closure past the run's last round")
    config = terms.outer()
    need = quorum or 1  # milestones before the quorum, and no spec: one operator, as ever
    previous = _previous_closure(store, closures, run, state.round, root, trust, need)
    for r in sorted(x for x in closures if state.round <= x < terms.rounds):
        if r != state.round and r not in catch_ups:
            return report  # the chain is broken where a closure is missing (named above)
        try:
            checked = _check_kept_closure(load(closures[r]), run, trust, need)
            if require_hardware:
                closure_hardware(checked)
        except (BadMessage, Refused, Rejected, StoreError, OSError) as exc:
            report.failures.append(f"round {r}: closure: {exc}")
            return report
        c = checked.closure
        if r in caught_up:
            if r not in catch_ups:
                return report  # its record is missing or invalid (named above)
            # The worker skipped rounds by catching up to this closure's result: from here
            # its state rests on the closure's signature, not on a recomputation.
            catch_up, signer = catch_ups[r]
            if catch_up.subjects() != (checked.digest.hex(), c.result_root, c.state_blob):
                report.failures.append(
                    f"round {r}: the catch-up record names another closure, root or state"
                )
                return report
            try:
                state = decode_state(load(c.state_blob))
            except (BadStateBlob, StoreError, OSError) as exc:
                report.failures.append(f"round {r}: caught-up state: {exc}")
                return report
            root = state_root(state)
            if root != c.result_root or state.round != r + 1:
                report.failures.append(f"round {r}: caught-up state is not the closure's result")
                return report
            report.anchors.append(
                f"caught up at round {r} to root {root} (signed by {signer[-8:]}, not recomputed)"
            )
            report.checked_rounds.append(r)
            previous = checked
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
                milestone, _signer = check_milestone(
                    load(milestones[r]), trust=trust, require_hardware=require_hardware
                )
                expected = milestone_for(checked, agg, terms, previous)
                if milestone.absent is None:  # version 2: no absent workers to compare
                    expected = dataclasses.replace(expected, absent=None)
                if milestone != expected:
                    raise BadMilestone("milestone does not match the recomputed round")
            except (BadMilestone, StoreError, OSError) as exc:
                report.failures.append(f"round {r}: milestone: {exc}")
        _check_verdicts(
            r, checked, agg, terms, verdicts.get(r, []), load, trust, report, require_hardware
        )
        if progress is not None:
            progress(f"round {r}: ok, root {new_root[:16]}")
        report.checked_rounds.append(r)
        state, root, previous = agg.state, new_root, checked
    return report


def _check_kept_closure(data: bytes, run: str, trust: TrustStore, quorum: int) -> CheckedClosure:
    """A kept closure announcement, checked as of its proposer's signing time."""
    msg = decode_message(data)
    if not isinstance(msg, ClosureAnnouncement):
        raise Refused("not a closure announcement")
    when = verify_attestation(msg.attestation).time
    return check_closure(msg.body, msg.attestation, run=run, trust=trust, now=when, quorum=quorum)


def _previous_closure(
    store: Store,
    closures: dict[int, str],
    run: str,
    round_: int,
    root: str,
    trust: TrustStore,
    quorum: int,
) -> CheckedClosure | None:
    """The closure whose result the start state is (a joiner's), if kept and valid: the
    first milestone's absent workers are counted from it (rule 1)."""
    if round_ - 1 not in closures:
        return None
    try:
        data = store.path(closures[round_ - 1]).read_bytes()
        checked = _check_kept_closure(data, run, trust, quorum)
    except (BadMessage, Refused, Rejected, StoreError, OSError):
        return None
    return checked if checked.closure.result_root == root else None


def _check_verdicts(
    r: int,
    checked: CheckedClosure,
    agg: Aggregate,
    terms: RunTerms,
    kept: list[tuple[str, str]],
    load: Callable[[str], bytes],
    trust: TrustStore,
    report: Report,
    require_hardware: bool = False,
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
            msg, signer = check_verdict_record(
                load(vblob), run=c.run, trust=trust, require_hardware=require_hardware
            )
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
