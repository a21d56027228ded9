"""Milestones: per round, signed evidence of whose updates were included, and re-checking a
run from the blobs alone (``blob outer milestones`` / ``blob outer verify``).

Theory of operation
-------------------
1. After a worker applies (or proposes) round r's closure it signs a **milestone**: the
   run, the round, the closure's digest, the start and result roots, the included
   ``(peer, blob)`` pairs (those the aggregation admitted) and the excluded ones with their
   reasons. Every honest worker that applied the closure computes the same milestone, so
   milestones from distinct admitted operators over one digest are the evidence a payment
   rail releases on (DESIGN 8's two-operator rule; the rail is out of scope). Kind
   :data:`MILESTONE_KIND`, digest = BLAKE3 of the canonical body, subjects
   ``[closure digest as hex, result root]``. None is signed for a round the worker
   skipped by catching up: it did not recompute it.
2. A worker keeps, tagged in its store, ``outer-<run>-start`` (the state it started from),
   and per round ``outer-<run>-closure-<r>`` and ``outer-<run>-milestone-<r>``; update blobs
   stay in the store. :func:`verify_run` re-checks from these alone: each closure's
   signatures (against the run's authorities), the chain (each closure starts from the
   previous result), each result recomputed from the start state and the named update
   blobs (``training.outer.aggregate``), and each milestone's signature and body against
   that recomputation. Any failure is reported; none may be skipped silently.
3. **Verified.** A sampled update's replay verdict (``training.outer.replay``) arrives a
   round after its milestone, so it is its own signed record: every verdict a worker
   made or accepted is kept as a blob, tagged ``outer-<run>-verdict-<r>-<author>``.
   :func:`list_milestones` lists them per round beside the included updates (included vs
   verified); :func:`verify_run` checks each one's signature and that it judges an update
   the round's closure named.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack

from blobstore import Store, StoreError
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
from training.outer.replay import REPLAY_KIND, BadVerdict, Verdict, check_verdict
from training.outer.state_blob import BadStateBlob, decode_state

MILESTONE_KIND = "blobnet/outer-milestone"
MILESTONE_DOMAIN = b"blobnet/outer-milestone/v1"
MILESTONE_VERSION = 1
# A milestone lists at most MAX_INCLUDED (64) workers with peer IDs, blob IDs and short
# reasons, plus its attestation (about 1 KiB): 64 KiB bounds one with room to spare.
MAX_MILESTONE_SIZE = 64 * 1024


class BadMilestone(Exception):
    """Bytes that are not a canonical milestone record."""


@dataclass(frozen=True)
class Milestone:
    run: str
    round: int
    closure: str  # the closure digest, hex
    start_root: str
    result_root: str
    included: tuple[tuple[str, str], ...]  # (peer, blob)
    excluded: tuple[tuple[str, str, str], ...]  # (peer, blob, reason)

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
        }

    def body(self) -> bytes:
        data: bytes = msgpack.packb(self.fields(), use_bin_type=True)
        return data

    def digest(self) -> bytes:
        body = self.body()
        return blake3.blake3(MILESTONE_DOMAIN + struct.pack("<Q", len(body)) + body).digest()

    def to_json(self) -> dict[str, Any]:
        out = self.fields()
        out.pop("v")
        return out


def milestone_for(checked: CheckedClosure, agg: Aggregate) -> Milestone:
    c = checked.closure
    return Milestone(
        c.run,
        c.round,
        checked.digest.hex(),
        c.start_root,
        state_root(agg.state),
        tuple((p, b) for p, b, _ in agg.admitted),
        tuple((e.peer, e.blob, e.reason) for e in agg.excluded),
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
    record: bytes = msgpack.packb(
        {"body": milestone.body(), "attestation": attestation.encode()}, use_bin_type=True
    )
    return record


def _milestone_from_body(body: bytes) -> Milestone:
    obj = decode_msgpack_map(
        body, max_size=MAX_MILESTONE_SIZE, what="milestone", error=BadMilestone
    )
    try:
        m = Milestone(
            obj["run"],
            obj["round"],
            obj["closure"],
            obj["start"],
            obj["result"],
            tuple((str(p), str(b)) for p, b in obj["included"]),
            tuple((str(p), str(b), str(r)) for p, b, r in obj["excluded"]),
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
        if name.startswith(prefix) and round_.isdigit() and author:
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


@dataclass
class Report:
    run: str
    checked_rounds: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    anchors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and bool(self.checked_rounds)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "ok": self.ok,
            "anchors": self.anchors,
            "checked_rounds": self.checked_rounds,
            "failures": self.failures,
        }


def verify_run(
    store: Store,
    run: str,
    trust: TrustStore,
    config: OuterConfig,
    *,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Rule 2 of the module: re-check a run's closures, results and milestones."""
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
    for r in sorted(closures):
        if r < state.round:
            continue
        caught_up = r != state.round and r + 1 in anchors
        if r != state.round and not caught_up:
            report.failures.append(f"round {state.round}: no closure kept (next is round {r})")
            return report
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
        if caught_up:
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
                if milestone != milestone_for(checked, agg):
                    raise BadMilestone("milestone does not match the recomputed round")
            except (BadMilestone, StoreError, OSError) as exc:
                report.failures.append(f"round {r}: milestone: {exc}")
        named = {(x.peer, x.blob) for x in c.included}
        for author, vblob in verdicts.get(r, []):
            try:
                msg, _replayer = check_verdict_record(load(vblob), run=run, trust=trust)
                if msg.round != r or msg.author != author or (author, msg.update) not in named:
                    raise BadMilestone("verdict judges an update the closure did not name")
            except (BadMilestone, StoreError, OSError) as exc:
                report.failures.append(f"round {r}: verdict on {author[-8:]}: {exc}")
        if progress is not None:
            progress(f"round {r}: ok, root {new_root[:16]}")
        report.checked_rounds.append(r)
        state, root = agg.state, new_root
    return report
