"""The decentralised outer loop's announcements and what a worker makes of them (sans-IO).

Workers of a run talk on one pubsub topic, ``blobnet/outer/<run ID>``, with three kinds
of canonical msgpack announcements (``encode_message`` / ``decode_message``):

- ``hello``: "I am in this run"; carries the sender's admission certificate so that only
  admitted machines count towards the start barrier.
- ``update``: "my pseudo-gradient for round r is blob B"; carries an attestation of kind
  ``blobnet/outer-update`` over B with subjects ``[B, state_root(S_r), C]`` where C is the
  blob of B's commitment (how it was computed, ``training.outer.replay``), and the
  addresses where B can be fetched.
- ``pass``: "I take part in round r and send no update": an attestation of kind
  ``blobnet/outer-pass`` (:data:`PASS_KIND`) whose digest is :func:`pass_digest` of the
  run, the round and ``state_root(S_r)``, subjects ``[state_root(S_r)]``, and the sender's
  addresses. A closure names it among the round's passed workers, so a worker that skips
  a round still counts toward the quorum (``training.outer.agreement`` rule 7), and the
  others do not wait for its update.
- ``state``: "after round r-1 the global state S_r has root R and is blob B"; carries an
  attestation of kind ``blobnet/outer-state`` with subjects ``[B, R]`` (sent at the end of
  a run, so workers compare their final roots).
- ``closure``: a round closure (``training.outer.agreement``): its canonical body and the
  proposer's attestation, and where its blobs can be fetched. Judged by the agreement
  core, not the ledger (it is passed through as :class:`ClosureHeard`).
- ``closure-ref``: the same closure, compact (``training.outer.agreement`` rule 5): the
  body with attestation digests, the proposer's attestation, and the blob of the full
  ``closure`` announcement for a receiver that lacks an attestation (passed through as
  :class:`ClosureRefHeard`).
- ``verdict``: a replay verdict on one round's update (``training.outer.replay``): the
  round, author, update and commitment blobs, the outcome and the replayer's attestation.
  Judged by the worker against what it applied (passed through as :class:`VerdictHeard`).

:class:`Ledger` is the protocol core: bytes and the authenticated pubsub sender in,
events out, with time as an argument. It owns these rules:

1. A message is first decoded strictly; a malformed one or one for another run is
   dropped and counted (the sender is at fault, the worker keeps going).
2. An update counts only if its attestation verifies against the run's trusted
   authorities at ``now`` (signature, certificate binding the signer's peer ID), the
   signer is the pubsub sender (pubsub messages are signed, so the sender is
   authenticated), the digest is the blob ID, and the subjects are exactly the blob, the
   state root the round started from and a commitment blob ID. A pass counts on the same
   terms, its digest and subjects those of the round's pass. Anything else is a
   :class:`Rejection` with a reason, recorded once per (round, sender, blob, reason); a
   pass is judged, buffered and counted as an update whose blob is "" (rules 3-5).
3. A round's update announcements may arrive before the worker reaches that round; they
   are buffered (a bounded window of rounds, a bounded count per round) and judged when
   the round opens, against the root the worker then holds.
4. Per round, the first valid update (or pass) of a sender is its update. A different
   valid blob, or a pass after an update or the reverse, from the same sender in the same
   round is recorded as equivocation and ignored (honest workers never send two; workers
   that heard them in different orders may then disagree, which rule 6 makes loud).
5. Presence (for the start barrier) is an admitted sender heard: a hello with a valid
   certificate for that sender, or any valid update, pass or state announcement.
6. State announcements give every worker the roots the others reached; a root for a
   state round that differs from the worker's own is a :class:`Disagreement`, reported
   once per (round, sender).
7. In a run that requires hardware (``require_hardware``), an update or state
   announcement counts only if a hardware signer made its attestation, and a hello only
   with a certificate that records the sender's TPM attestation key; anything else is
   refused as :data:`NOT_HARDWARE` (:func:`check_hardware`). ``verify_attestation``
   believes a hardware signer kind only with the co-signature of the AK the certificate
   records, so once an attestation verified against the run's trust store its kind is
   evidence. The worker applies the same rule to closures (the proposer's attestation and
   every update attestation they name) and to replay verdicts.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any

import blake3

from blobstore.canonical import CodecError
from blobstore.exitcodes import ExitCode
from blobstore.schema import Field, Schema
from identity import (
    AdmissionCertificate,
    Attestation,
    Rejected,
    TrustStore,
    decode_msgpack_map,
    is_hardware_signer,
    verify_attestation,
    verify_certificate,
)
from training.errors import TrainingError

TOPIC_PREFIX = "blobnet/outer/"
UPDATE_KIND = "blobnet/outer-update"
STATE_KIND = "blobnet/outer-state"
PASS_KIND = "blobnet/outer-pass"
PASS_DOMAIN = b"blobnet/outer-pass/v1"
MESSAGE_VERSION = 1

# A closure body is at most 64 KiB (training.outer.agreement.MAX_CLOSURE_SIZE), its
# attestation about 800 bytes and the addresses at most MAX_ADDRS * MAX_ADDR_LEN: 72 KiB
# bounds every message with room to spare, before msgpack allocates anything.
MAX_MESSAGE_SIZE = 72 * 1024
# A node listens on a handful of addresses; more is not a worker's announcement.
MAX_ADDRS = 8
MAX_ADDR_LEN = 256
MAX_RUN_ID_LEN = 64
MAX_ROUND = 1 << 32
# Announcements for rounds ahead of the one a worker is in are kept for this many rounds
# (a worker is at most one round behind an honest peer; two gives slack).
ROUND_WINDOW = 2
# Buffered announcements per future round: each admitted worker sends one update,
# re-published with back-off (deduplicated); this bounds what unadmitted senders can park.
MAX_PENDING_PER_ROUND = 256
# Rejections recorded per round (the rest are counted only).
MAX_REJECTIONS_PER_ROUND = 256

RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HEX = re.compile(r"[0-9a-f]{64}")
# A verdict's outcome is a short text ("match", "mismatch: loss of step 0 differs").
MAX_OUTCOME_LEN = 128
# Rule 7's reason: the attestation's key is not vouched for by a TPM attestation key.
NOT_HARDWARE = "not hardware-signed"


class BadMessage(TrainingError):
    """Bytes that are not a canonical outer-loop announcement (the sender's fault)."""

    exit_code = ExitCode.BAD_DATA


def topic(run_id: str) -> str:
    """The pubsub topic of a run."""
    return TOPIC_PREFIX + check_run_id(run_id)


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RE.fullmatch(run_id):
        raise ValueError(
            f"run ID {run_id!r} must be 1-{MAX_RUN_ID_LEN} letters, digits, '.', '_' or '-'"
        )
    return run_id


# --- messages ------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    run: str
    certificate: bytes


@dataclass(frozen=True)
class UpdateAnnouncement:
    run: str
    round: int
    blob: str
    attestation: bytes
    addrs: tuple[str, ...]


@dataclass(frozen=True)
class PassAnnouncement:
    run: str
    round: int
    attestation: bytes
    addrs: tuple[str, ...]


@dataclass(frozen=True)
class StateAnnouncement:
    run: str
    round: int
    root: str
    blob: str
    attestation: bytes
    addrs: tuple[str, ...]


@dataclass(frozen=True)
class ClosureAnnouncement:
    run: str
    body: bytes
    attestation: bytes
    addrs: tuple[str, ...]


@dataclass(frozen=True)
class ClosureRefAnnouncement:
    run: str
    compact: bytes
    attestation: bytes
    full: str  # blob ID of the full ClosureAnnouncement (addresses left empty)
    addrs: tuple[str, ...]


@dataclass(frozen=True)
class VerdictAnnouncement:
    run: str
    round: int
    author: str
    update: str
    commitment: str
    outcome: str
    attestation: bytes


Message = (
    Hello
    | UpdateAnnouncement
    | PassAnnouncement
    | StateAnnouncement
    | ClosureAnnouncement
    | ClosureRefAnnouncement
    | VerdictAnnouncement
)


def _run(value: str) -> str:
    if not RUN_ID_RE.fullmatch(value):
        raise CodecError("announcement has a malformed run ID")
    return value


def _round(value: int) -> int:
    if not 0 <= value < MAX_ROUND:
        raise CodecError(f"round {value} is out of range")
    return value


def _hex64(value: str) -> str:
    if not _HEX.fullmatch(value):
        raise CodecError("an announcement's blob IDs and roots are 64 lowercase hex digits")
    return value


def _addrs(value: list[Any]) -> tuple[str, ...]:
    if len(value) > MAX_ADDRS:
        raise CodecError(f"announcement lists more than {MAX_ADDRS} addresses")
    for addr in value:
        if type(addr) is not str or not 0 < len(addr) <= MAX_ADDR_LEN or "/p2p/" not in addr:
            raise CodecError("announcement address must be a multiaddr ending in /p2p/<id>")
    return tuple(value)


def _label(value: str) -> str:
    """A verdict's author or outcome: a short label."""
    if not 0 < len(value) <= MAX_OUTCOME_LEN:
        raise CodecError("verdict author or outcome is empty or too long")
    return value


def _hex(key: str) -> Field:
    return Field(key, str, into=_hex64)


_ROUND = Field("round", int, into=_round)
_ATTESTATION = Field("attestation", bytes)
_ADDRS = Field("addrs", list, out=list, into=_addrs)


def _schema(kind: str, *fields: Field) -> Schema:
    """A message's schema: the version, its type and its run, then its own fields."""
    head = (
        Field("v", int, const=MESSAGE_VERSION),
        Field("type", str, const=kind),
        Field("run", str, into=_run),
    )
    return Schema(f"{kind} announcement", *head, *fields)


# One schema per message (blobstore.schema), by its wire type: the key order is the one
# canonical spelling, so the bytes and blob IDs are those of every earlier build.
_SCHEMAS: dict[str, tuple[type[Any], Schema]] = {
    "hello": (Hello, _schema("hello", Field("cert", bytes, attr="certificate"))),
    "update": (UpdateAnnouncement, _schema("update", _ROUND, _hex("blob"), _ATTESTATION, _ADDRS)),
    "pass": (PassAnnouncement, _schema("pass", _ROUND, _ATTESTATION, _ADDRS)),
    "closure-ref": (
        ClosureRefAnnouncement,
        _schema("closure-ref", Field("compact", bytes), _ATTESTATION, _hex("full"), _ADDRS),
    ),
    "verdict": (
        VerdictAnnouncement,
        _schema(
            "verdict",
            _ROUND,
            Field("author", str, into=_label),
            _hex("update"),
            _hex("commitment"),
            Field("outcome", str, into=_label),
            _ATTESTATION,
        ),
    ),
    "closure": (
        ClosureAnnouncement,
        _schema("closure", Field("body", bytes), _ATTESTATION, _ADDRS),
    ),
    "state": (
        StateAnnouncement,
        _schema("state", _ROUND, _hex("root"), _hex("blob"), _ATTESTATION, _ADDRS),
    ),
}
_KIND_OF = {cls: kind for kind, (cls, _) in _SCHEMAS.items()}


def encode_message(msg: Message) -> bytes:
    """Canonical bytes of an announcement (``ValueError`` for a malformed one: our bug)."""
    data = _SCHEMAS[_KIND_OF[type(msg)]][1].encode(msg)
    try:
        if decode_message(data) != msg:
            raise ValueError("announcement does not round-trip")
    except BadMessage as exc:
        raise ValueError(str(exc)) from None
    return data


def decode_message(data: bytes) -> Message:
    """Strictly parse an announcement; raises :class:`BadMessage` only."""
    obj = decode_msgpack_map(data, max_size=MAX_MESSAGE_SIZE, what="announcement", error=BadMessage)
    version, kind = obj.get("v"), obj.get("type")
    if type(version) is not int or version != MESSAGE_VERSION:
        raise BadMessage("announcement has an unknown version")
    if type(kind) is not str or kind not in _SCHEMAS:
        raise BadMessage(f"unknown announcement type {kind!r:.40}")
    cls, schema = _SCHEMAS[kind]
    try:
        msg: Message = cls(**schema.read(obj))
    except CodecError as exc:
        raise BadMessage(str(exc)) from None
    if schema.encode(msg) != bytes(data):
        raise BadMessage("announcement is not in canonical form")
    return msg


# --- judging announcements -----------------------------------------------------------


class Refused(Exception):
    """An announcement does not count; ``reason`` says why (short, stable text)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _attestation(
    data: bytes, *, kind: str, blob: str, sender: str, trust: TrustStore, now: float
) -> Attestation:
    try:
        attestation = verify_attestation(data, trust=trust, now=now, kind=kind)
    except Rejected as exc:
        raise Refused(exc.reason.value, str(exc)) from None
    if attestation.signer_peer_id != sender:
        raise Refused(
            "signer is not the sender",
            f"signed by {attestation.signer_peer_id}, announced by {sender}",
        )
    if attestation.digest != bytes.fromhex(blob):
        raise Refused("digest is not the blob ID")
    return attestation


def check_update(
    msg: UpdateAnnouncement, *, sender: str, trust: TrustStore, now: float, root: str
) -> Attestation:
    """The update's attestation if it counts for a round that started from ``root``."""
    attestation = _attestation(
        msg.attestation, kind=UPDATE_KIND, blob=msg.blob, sender=sender, trust=trust, now=now
    )
    if not update_subjects_ok(attestation.subjects, msg.blob):
        raise Refused("wrong subjects", "expected [update blob, start root, commitment blob]")
    if attestation.subjects[1] != root:
        raise Refused("wrong state root", f"made from {attestation.subjects[1][:16]}")
    return attestation


def update_subjects_ok(subjects: tuple[str, ...], blob: str) -> bool:
    """An update attestation's subjects have its form: [blob, a root, a commitment blob]."""
    return (
        len(subjects) == 3 and subjects[0] == blob and all(_HEX.fullmatch(x) for x in subjects[1:])
    )


def pass_digest(run: str, round_: int, start_root: str) -> bytes:
    """What a pass attestation signs: the run, the round and the state root it starts
    from, domain-separated."""
    return blake3.blake3(
        PASS_DOMAIN
        + struct.pack("<Q", round_)
        + bytes.fromhex(start_root)
        + check_run_id(run).encode()
    ).digest()


def check_pass_attestation(
    data: bytes,
    *,
    peer: str,
    run: str,
    round_: int,
    start_root: str,
    trust: TrustStore,
    now: float,
) -> Attestation:
    """``peer``'s pass attestation for round ``round_`` of ``run`` from ``start_root``, or
    :class:`Refused`."""
    attestation = _attestation(
        data,
        kind=PASS_KIND,
        blob=pass_digest(run, round_, start_root).hex(),
        sender=peer,
        trust=trust,
        now=now,
    )
    if attestation.subjects != (start_root,):
        raise Refused("wrong state root", "a pass names the root its round starts from")
    return attestation


def check_state(
    msg: StateAnnouncement, *, sender: str, trust: TrustStore, now: float
) -> Attestation:
    """The state announcement's attestation if it counts."""
    attestation = _attestation(
        msg.attestation, kind=STATE_KIND, blob=msg.blob, sender=sender, trust=trust, now=now
    )
    if attestation.subjects != (msg.blob, msg.root):
        raise Refused("wrong subjects", "expected [state blob, state root]")
    return attestation


def check_hello(msg: Hello, *, sender: str, trust: TrustStore, now: float) -> AdmissionCertificate:
    try:
        certificate = AdmissionCertificate.decode(msg.certificate)
        verify_certificate(certificate, trust=trust, now=now, peer_id=sender)
    except Rejected as exc:
        raise Refused(exc.reason.value, str(exc)) from None
    return certificate


def check_hardware(attestation: Attestation, what: str) -> None:
    """Rule 7: refuse an attestation (already verified against the run's trust store)
    that no hardware signer made."""
    if not is_hardware_signer(attestation.signer_kind):
        raise Refused(
            NOT_HARDWARE,
            f"{what} by {attestation.signer_peer_id} was signed by a "
            f"{attestation.signer_kind!r} signer; this run accepts only attestations "
            "co-signed by a TPM attestation key the signer's admission records",
        )


# --- the ledger ----------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A valid update announcement: fetch ``blob`` from ``addrs`` and include it."""

    round: int
    peer: str
    blob: str
    addrs: tuple[str, ...]
    operator: str
    attestation: bytes = b""


@dataclass(frozen=True)
class PassHeard:
    """A valid pass: ``peer`` takes part in ``round`` without an update."""

    round: int
    peer: str
    addrs: tuple[str, ...]
    operator: str
    attestation: bytes


@dataclass(frozen=True)
class Rejection:
    round: int
    peer: str
    blob: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"peer": self.peer, "blob": self.blob, "reason": self.reason}


@dataclass(frozen=True)
class StateHeard:
    """A valid state announcement (a joiner fetches the latest one)."""

    round: int
    peer: str
    root: str
    blob: str
    addrs: tuple[str, ...]


@dataclass(frozen=True)
class Disagreement:
    round: int
    peer: str
    ours: str
    theirs: str

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "peer": self.peer, "ours": self.ours, "theirs": self.theirs}


@dataclass(frozen=True)
class ClosureHeard:
    """A closure announcement from an admitted sender, for the agreement core to judge."""

    peer: str
    body: bytes
    attestation: bytes
    addrs: tuple[str, ...]


@dataclass(frozen=True)
class ClosureRefHeard:
    """A compact closure announcement, for the worker to expand and judge."""

    peer: str
    message: ClosureRefAnnouncement


@dataclass(frozen=True)
class VerdictHeard:
    """A replay verdict from some sender, for the worker to judge."""

    peer: str
    verdict: VerdictAnnouncement


Event = (
    Candidate
    | PassHeard
    | Rejection
    | StateHeard
    | Disagreement
    | ClosureHeard
    | ClosureRefHeard
    | VerdictHeard
)


@dataclass
class _Round:
    root: str | None = None  # None until the worker opens the round
    pending: list[tuple[UpdateAnnouncement | PassAnnouncement, str]] = field(default_factory=list)
    accepted: dict[str, str] = field(default_factory=dict)  # peer -> blob ("": a pass)
    seen: set[tuple[str, str, str]] = field(default_factory=set)  # (peer, blob, reason)
    rejections: list[Rejection] = field(default_factory=list)
    refused: set[tuple[str, str]] = field(default_factory=set)  # (peer, blob) for good
    dropped: int = 0


class Ledger:
    """What one worker has heard on its run's topic (rules 1-7 of the module docstring)."""

    def __init__(
        self, run_id: str, own_peer: str, trust: TrustStore, *, require_hardware: bool = False
    ) -> None:
        self.run_id = check_run_id(run_id)
        self.own_peer = own_peer
        self.trust = trust
        self.require_hardware = require_hardware  # rule 7
        self.current = 0  # the lowest round still accepting updates
        self.rounds: dict[int, _Round] = {}
        self.present: set[str] = set()
        self.roots: dict[int, dict[str, str]] = {}  # state round -> peer -> root
        self.own_roots: dict[int, str] = {}
        self.reported: set[tuple[int, str]] = set()
        self.malformed = 0
        self.other_runs = 0
        self.latest_state: StateHeard | None = None
        # Admitted workers whose update for the round before the current one came after
        # it closed here, and its blob (rule 2 of outer_agreement counts them: a slow
        # worker, or one that joined, is waited for in the next round). At most
        # MAX_PENDING_PER_ROUND. And the operator of each admitted worker heard.
        self.late: dict[int, dict[str, str]] = {}
        self.operators: dict[str, str] = {}

    def _round(self, r: int) -> _Round:
        return self.rounds.setdefault(r, _Round())

    def hear(self, data: bytes, sender: str, now: float) -> list[Event]:
        """Judge one pubsub message from ``sender`` (the authenticated pubsub source)."""
        if sender == self.own_peer:
            return []
        try:
            msg = decode_message(data)
        except BadMessage:
            self.malformed += 1
            return []
        if msg.run != self.run_id:
            self.other_runs += 1
            return []
        if isinstance(msg, Hello):
            try:
                certificate = check_hello(msg, sender=sender, trust=self.trust, now=now)
            except Refused:
                return []
            if self.require_hardware and not certificate.hardware:
                return []  # rule 7: not admitted on a TPM, so not one of this run's workers
            self.present.add(sender)
            self.operators[sender] = certificate.operator
            return []
        if isinstance(msg, StateAnnouncement):
            return self._hear_state(msg, sender, now)
        if isinstance(msg, ClosureAnnouncement):
            return [ClosureHeard(sender, msg.body, msg.attestation, msg.addrs)]
        if isinstance(msg, VerdictAnnouncement):
            return [VerdictHeard(sender, msg)]
        if isinstance(msg, ClosureRefAnnouncement):
            return [ClosureRefHeard(sender, msg)]
        if msg.round == self.current - 1 and sender in self.present:
            late = self.late.setdefault(msg.round, {})
            if sender in late or len(late) < MAX_PENDING_PER_ROUND:
                late[sender] = msg.blob if isinstance(msg, UpdateAnnouncement) else ""
            return []
        if msg.round < self.current or msg.round > self.current + ROUND_WINDOW:
            return []
        book = self._round(msg.round)
        if book.root is None:
            if len(book.pending) < MAX_PENDING_PER_ROUND:
                if (msg, sender) not in book.pending:
                    book.pending.append((msg, sender))
            else:
                book.dropped += 1
            return []
        event = self._judge(msg.round, book, msg, sender, now)
        return [] if event is None else [event]

    def _judge(
        self,
        r: int,
        book: _Round,
        msg: UpdateAnnouncement | PassAnnouncement,
        sender: str,
        now: float,
    ) -> Candidate | PassHeard | Rejection | None:
        assert book.root is not None
        blob = msg.blob if isinstance(msg, UpdateAnnouncement) else ""
        if book.accepted.get(sender) == blob or (sender, blob) in book.refused:
            return None  # a re-publication of what we already judged
        try:
            if isinstance(msg, UpdateAnnouncement):
                attestation = check_update(
                    msg, sender=sender, trust=self.trust, now=now, root=book.root
                )
            else:
                attestation = check_pass_attestation(
                    msg.attestation,
                    peer=sender,
                    run=self.run_id,
                    round_=r,
                    start_root=book.root,
                    trust=self.trust,
                    now=now,
                )
            if self.require_hardware:
                check_hardware(attestation, "update" if blob else "pass")
            if sender in book.accepted:
                raise Refused("equivocation", f"{sender} already announced another update")
        except Refused as refused:
            key = (sender, blob, refused.reason)
            if key in book.seen:
                return None
            book.seen.add(key)
            if len(book.rejections) >= MAX_REJECTIONS_PER_ROUND:
                book.dropped += 1
                return None
            rejection = Rejection(r, sender, blob, refused.reason)
            book.rejections.append(rejection)
            return rejection
        book.accepted[sender] = blob
        self.present.add(sender)
        assert attestation.certificate is not None  # the trust store required one
        operator = attestation.certificate.operator
        self.operators[sender] = operator
        if isinstance(msg, PassAnnouncement):
            return PassHeard(r, sender, msg.addrs, operator, msg.attestation)
        return Candidate(r, sender, msg.blob, msg.addrs, operator, msg.attestation)

    def open_round(self, r: int, root: str, now: float) -> list[Event]:
        """Start judging round ``r``'s updates against ``root``; earlier rounds close."""
        self.current = r
        for old in [k for k in self.rounds if k < r]:
            del self.rounds[old]
        self.late = {k: v for k, v in self.late.items() if k == r - 1}
        book = self._round(r)
        if book.root is not None and book.root != root:
            # The worker moved to another state of the same round (it caught up to a
            # better closure): what was judged against the old root no longer holds.
            book = self.rounds[r] = _Round()
        book.root = root
        pending, book.pending = book.pending, []
        events: list[Event] = []
        for msg, sender in pending:
            event = self._judge(r, book, msg, sender, now)
            if event is not None:
                events.append(event)
        return events

    def rejections(self, r: int) -> list[Rejection]:
        book = self.rounds.get(r)
        return [] if book is None else list(book.rejections)

    def reject(self, r: int, peer: str, blob: str, reason: str) -> Rejection:
        """Refuse for good an accepted update whose blob turned out bad (undecodable).

        The sender keeps its slot: another blob from it in this round is equivocation.
        """
        book = self._round(r)
        book.refused.add((peer, blob))
        rejection = Rejection(r, peer, blob, reason)
        if len(book.rejections) < MAX_REJECTIONS_PER_ROUND:
            book.rejections.append(rejection)
        return rejection

    def _hear_state(self, msg: StateAnnouncement, sender: str, now: float) -> list[Event]:
        try:
            attestation = check_state(msg, sender=sender, trust=self.trust, now=now)
            if self.require_hardware:
                check_hardware(attestation, "state announcement")
        except Refused:
            return []
        self.present.add(sender)
        heard = self.roots.setdefault(msg.round, {})
        if sender in heard:
            return []
        heard[sender] = msg.root
        # Keep only recent state rounds: roots older than the window are settled.
        for old in [k for k in self.roots if k < msg.round - 4 * ROUND_WINDOW]:
            del self.roots[old]
        event = StateHeard(msg.round, sender, msg.root, msg.blob, msg.addrs)
        if self.latest_state is None or msg.round > self.latest_state.round:
            self.latest_state = event
        events: list[Event] = [event]
        events.extend(self._compare(msg.round))
        return events

    def own_root(self, r: int, root: str) -> list[Event]:
        """Record the root of the state this worker reached for state round ``r``."""
        self.own_roots[r] = root
        return list(self._compare(r))

    def _compare(self, r: int) -> list[Disagreement]:
        ours = self.own_roots.get(r)
        if ours is None:
            return []
        out = []
        for peer, theirs in self.roots.get(r, {}).items():
            if theirs != ours and (r, peer) not in self.reported:
                self.reported.add((r, peer))
                out.append(Disagreement(r, peer, ours, theirs))
        return out

    def roots_heard(self, r: int) -> dict[str, str]:
        return dict(self.roots.get(r, {}))
