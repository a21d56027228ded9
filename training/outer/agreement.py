"""Round closures: how every honest worker comes to apply the same set of updates (sans-IO).

Theory of operation
-------------------
A worker never applies its own guess of a round's updates. Round r from state S_r (root
R_r) is closed by a **closure**: a signed statement by one admitted worker, the proposer,
that names the included updates (each with its author's update attestation over
``[blob, R_r]``), the root R_{r+1} that applying them gives, and the blob of S_{r+1}.
A closure is self-contained: anyone holding the run's trust store can check it, fetch the
named blobs (content-addressed, from anyone) and recompute R_{r+1}.

1. **Validity** (:func:`check_closure`). The attestation (kind :data:`CLOSURE_KIND`,
   digest = :func:`closure_digest` of the body, subjects ``[R_r, R_{r+1}, state blob]``)
   verifies with a certificate of the run's authorities and is signed by the named
   proposer. The closure names the round's workers in three lists, each in strictly
   increasing peer order: ``included`` (the updates the aggregation takes in, each with a
   valid update attestation by that peer over ``[blob, R_r, commitment blob]``), ``left``
   (updates the proposer left out, each with such an attestation and the proposer's
   reason: a banned operator, a level below the run's, the score, a copy, not fetched in
   time) and ``passed`` (workers that sent no update this round, each with a valid pass
   attestation, :data:`training.outer.messages.PASS_KIND`, over ``R_r``). 1..``MAX_INCLUDED``
   entries in all, ``included`` possibly empty (the state then carries over: S_{r+1} is
   S_r with the round counted); no peer in two lists, no blob named twice (a copy) and no
   operator twice (one operator's keys count once); and the quorum (rule 7).
2. **Who proposes.** The workers ranked for round r are those whose valid update for r a
   worker holds, plus itself, ordered by ``BLAKE3(R_r || peer)`` (:func:`rank`): a new,
   unpredictable order every round, so the duty rotates. The worker at position p
   proposes at ``ready + p * proposer_timeout`` (:func:`proposal_time`), where ``ready``
   is when it holds updates from all K workers (or, if more, from every worker whose
   update for round r - 1 it heard, itself included, in time or after that round closed:
   a worker that joined a run of K is waited for from its second round on), counting
   only updates a closure could name (rule 1: a copy or an operator's second key does not
   count), or its round deadline passed, unless it
   already holds a valid closure for round r. A slot has no end: a worker that wakes from
   a long pause takes in what it heard before it looks at its slot, so it holds the
   others' closure and does not propose; a closure that still comes late loses to the
   tip by rule 3 (a higher round wins), and one for the current round is a rival like
   any other.
3. **Fork choice** (:class:`ClosureBook`). The tip is the valid closure of the highest
   round; among closures of that round, the one with the lowest
   ``(rank(R_r, proposer), closure digest)`` (:func:`priority`). Every worker moves to the
   tip: if the tip starts from the worker's own root it recomputes it from the named
   updates (and a closure whose recomputed root differs is invalid, the proposer's fault);
   if the tip is its own last closure there is nothing to do; otherwise (it missed rounds,
   or the tip is a better sibling of the closure it applied) it **catches up**: it fetches
   the tip's state blob, checks it has the tip's round and root, and rejoins from there
   (:func:`next_step`). However long a worker was away, one fetch brings it back.
4. **Failure cases.** Proposers that *disagree* (two closures for one round, from workers
   that ranked different peer sets or heard different updates) are resolved by rule 3:
   all workers that hear both pick the same one, and the other's followers catch up.
   A *slow* proposer (paused, dead, partitioned) is replaced by the next in rank after
   ``proposer_timeout``. An *equivocating* proposer (two different closures for one round)
   is recorded (:attr:`ClosureBook.equivocations`); rule 3 still picks one of them, the
   same one everywhere (the lower digest). A closure naming a blob nobody serves is
   dropped as unavailable after the fetch bound and the next best one becomes the tip.
   A longer chain always beats a better sibling: once round r+1 is closed on top of one
   closure of round r, a late, better-ranked closure of round r changes nothing (no
   reorganisation deeper than the tip). Honest workers that never hear each other (a
   partition) cannot both go on: only a side holding the quorum closes rounds (rule 7);
   the other waits, then stops, and catches up if the partition heals in time.
5. **On the wire** a closure travels compact (:func:`compact_body`): each attestation it
   names (included, left out, passed) replaced by its BLAKE3 digest, since every worker
   already heard them in the update and pass announcements (they were two thirds of a closure's
   bytes at K = 3). A receiver restores the signed body from the attestations it holds
   (:func:`expand_body`; the digests pin them) or, missing one, fetches the full closure
   blob the announcement names. The proposer signs, and everyone checks and keeps, the
   full body; the compact form is only a transfer encoding.
6. **Bounds.** Closures are kept for ``CLOSURE_WINDOW`` rounds below the tip and at most
   ``MAX_CLOSURES_PER_ROUND`` per round (the best ones by rule 3); older or extra ones
   cannot be the tip anyway.
7. **Quorum** (:func:`quorum_of`, :func:`present_operators`). A closure is valid only if
   the distinct admitted operators it names (included, left out or passed: each proved
   present at R_r by its own signature) are at least the run's quorum (the spec's
   ``quorum``; default :func:`majority`, floor(K/2)+1). Two groups of honest workers that
   cannot hear each other are then never both able to close a round, whatever the
   partition: one of them holds fewer than half of the run's operators. A proposer below
   the quorum does not propose; it waits, saying whom it waits for, and stops after its
   start timeout (``training.outer.worker``). What the majority does not guard against: a
   byzantine operator present on both sides of a split counts on both (a run that fears
   that sets a higher quorum), and a quorum set below a majority (``outer init --quorum``)
   lets two groups fork, a documented choice.

Time is an argument (``now``); nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import blake3

from blobstore.canonical import encode as encode_canonical
from blobstore.exitcodes import ExitCode
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
from training.errors import TrainingError
from training.outer.messages import (
    RUN_ID_RE,
    UPDATE_KIND,
    Refused,
    check_pass_attestation,
    update_subjects_ok,
)

CLOSURE_KIND = "blobnet/outer-closure"
CLOSURE_DOMAIN = b"blobnet/outer-closure/v1"
RANK_DOMAIN = b"blobnet/outer-rank/v1"
ATTESTATION_REF_DOMAIN = b"blobnet/outer-attestation-ref/v1"
CLOSURE_VERSION = 1  # included updates only, 1..MAX_INCLUDED of them
# A closure that leaves an update out, names a pass, or includes nothing (rule 1). A
# closure without any of these is version 1, so one closure has one spelling and those
# made before keep their bytes.
LISTS_CLOSURE_VERSION = 2
# At most this many updates in one closure: p2p.node.gossip sizes its rate limits for a run of
# at most MAX_RUN_WORKERS workers, and a closure never names more workers than the run has.
MAX_INCLUDED = 64
# An update attestation with its certificate is about 700 bytes: 64 of them, the closure's
# fields and msgpack headers stay under 64 KiB.
MAX_CLOSURE_SIZE = 64 * 1024
# A left-out update's reason: a short text ("one operator twice", "offers verification
# level 'bounded'; the run requires 'replayed'"); 64 of them stay within the size above.
MAX_REASON_LEN = 96
# Closures kept below the tip's round: a worker further behind catches up from the tip's
# state blob (rule 3), so older closures are never needed to decide.
CLOSURE_WINDOW = 4
# Siblings kept per round: honest proposers for one round are a handful (rank 0, then a
# few take-overs); the worst of more are dropped (they cannot be the tip).
MAX_CLOSURES_PER_ROUND = 16

_HEX = frozenset("0123456789abcdef")


class BadClosure(TrainingError):
    """Bytes that are not a canonical closure body (the proposer's fault)."""

    exit_code = ExitCode.BAD_DATA


@dataclass(frozen=True)
class Included:
    """One included update: its author, blob and the author's update attestation."""

    peer: str
    blob: str
    attestation: bytes


@dataclass(frozen=True)
class LeftOut:
    """An update the proposer left out (rule 1), and why: its author was present."""

    peer: str
    blob: str
    attestation: bytes
    reason: str


@dataclass(frozen=True)
class Passed:
    """A worker that sent no update this round, with its pass attestation (rule 1)."""

    peer: str
    attestation: bytes


@dataclass(frozen=True)
class Closure:
    run: str
    round: int
    start_root: str
    proposer: str
    included: tuple[Included, ...]
    result_root: str
    state_blob: str
    left: tuple[LeftOut, ...] = ()
    passed: tuple[Passed, ...] = ()

    def peers(self) -> list[str]:
        """The included updates' authors, in order."""
        return [x.peer for x in self.included]

    def present(self) -> list[str]:
        """Every worker the closure names (included, left out, passed), by peer."""
        named = [*self.peers(), *(x.peer for x in self.left), *(x.peer for x in self.passed)]
        return sorted(named, key=str.encode)

    @property
    def version(self) -> int:
        lists = self.left or self.passed or not self.included
        return LISTS_CLOSURE_VERSION if lists else CLOSURE_VERSION


def _fields(c: Closure) -> dict[str, Any]:
    out: dict[str, Any] = {
        "v": c.version,
        "run": c.run,
        "round": c.round,
        "start": c.start_root,
        "proposer": c.proposer,
        "included": [[x.peer, x.blob, x.attestation] for x in c.included],
    }
    if c.version == LISTS_CLOSURE_VERSION:
        out["left"] = [[x.peer, x.blob, x.attestation, x.reason] for x in c.left]
        out["passed"] = [[x.peer, x.attestation] for x in c.passed]
    out["result"] = c.result_root
    out["state"] = c.state_blob
    return out


def encode_closure(c: Closure) -> bytes:
    data: bytes = encode_canonical(_fields(c))
    if decode_closure(data) != c:
        raise ValueError("closure does not round-trip (a malformed field)")
    return data


def _hex64(value: Any, what: str) -> str:
    if type(value) is not str or len(value) != 64 or not set(value) <= _HEX:
        raise BadClosure(f"closure field {what} must be 64 lowercase hex digits")
    return value


def _peer(value: Any) -> str:
    if type(value) is not str or not 0 < len(value) <= 128:
        raise BadClosure("closure entry names no peer ID")
    return value


def _entries(obj: dict[str, Any], key: str, width: int) -> list[list[Any]]:
    items = obj[key]
    if type(items) is not list or len(items) > MAX_INCLUDED:
        raise BadClosure(f"closure {key} must be a list of at most {MAX_INCLUDED} entries")
    for item in items:
        if type(item) is not list or len(item) != width:
            raise BadClosure(f"closure {key} entries must have {width} fields")
    return items


def decode_closure(data: bytes) -> Closure:
    """Strictly parse a closure body; raises :class:`BadClosure` only."""
    obj = decode_msgpack_map(data, max_size=MAX_CLOSURE_SIZE, what="closure", error=BadClosure)
    try:
        version = obj["v"]
        if version not in (CLOSURE_VERSION, LISTS_CLOSURE_VERSION):
            raise BadClosure("closure has an unknown version")
        run, round_, proposer = obj["run"], obj["round"], obj["proposer"]
        start, result, state = obj["start"], obj["result"], obj["state"]
        items = _entries(obj, "included", 3)
        lefts = _entries(obj, "left", 4) if version == LISTS_CLOSURE_VERSION else []
        passes = _entries(obj, "passed", 2) if version == LISTS_CLOSURE_VERSION else []
    except KeyError as exc:
        raise BadClosure(f"closure lacks the field {exc}") from None
    if type(run) is not str or not RUN_ID_RE.fullmatch(run):
        raise BadClosure("closure has a malformed run ID")
    if type(round_) is not int or not 0 <= round_ < 1 << 32:
        raise BadClosure("closure round is out of range")
    if type(proposer) is not str or not 0 < len(proposer) <= 128:
        raise BadClosure("closure proposer is not a peer ID")
    if not 1 <= len(items) + len(lefts) + len(passes) <= MAX_INCLUDED:
        raise BadClosure(f"closure must name 1..{MAX_INCLUDED} workers")
    included = []
    for item in items:
        if type(item[2]) is not bytes:
            raise BadClosure("closure entry must be [peer, blob, attestation]")
        included.append(Included(_peer(item[0]), _hex64(item[1], "blob"), item[2]))
    left = []
    for item in lefts:
        reason = item[3]
        if type(item[2]) is not bytes or type(reason) is not str:
            raise BadClosure("closure left entry must be [peer, blob, attestation, reason]")
        if not 0 < len(reason.encode()) <= MAX_REASON_LEN:
            raise BadClosure(f"a left-out reason must be 1..{MAX_REASON_LEN} bytes")
        left.append(LeftOut(_peer(item[0]), _hex64(item[1], "blob"), item[2], reason))
    passed = []
    for item in passes:
        if type(item[1]) is not bytes:
            raise BadClosure("closure passed entry must be [peer, attestation]")
        passed.append(Passed(_peer(item[0]), item[1]))
    closure = Closure(
        run,
        round_,
        _hex64(start, "start"),
        proposer,
        tuple(included),
        _hex64(result, "result"),
        _hex64(state, "state"),
        tuple(left),
        tuple(passed),
    )
    canonical: bytes = encode_canonical(_fields(closure))
    if canonical != bytes(data):
        raise BadClosure("closure is not in canonical form")
    return closure


def compact_body(body: bytes) -> bytes:
    """A closure body with each attestation it names replaced by its BLAKE3 digest (rule
    5); ``BadClosure`` if ``body`` is not a closure body."""
    c = decode_closure(body)
    data: bytes = encode_canonical(_fields(_with_attestations(c, lambda x: attestation_digest(x))))
    return data


def expand_body(compact: bytes, lookup: Callable[[str, str], bytes | None]) -> bytes | None:
    """The full body of a compact one (rule 5), taking each attestation from
    ``lookup(peer, blob)`` (a pass's blob: "") where its digest is the one named; None if
    one is missing. ``BadClosure`` if ``compact`` is malformed."""
    c = decode_closure(compact)
    wanted = [
        *((x.peer, x.blob, x.attestation) for x in c.included),
        *((x.peer, x.blob, x.attestation) for x in c.left),
        *((x.peer, "", x.attestation) for x in c.passed),
    ]
    found: dict[bytes, bytes] = {}
    for peer, blob, digest in wanted:
        attestation = lookup(peer, blob)
        if attestation is None or attestation_digest(attestation) != digest:
            return None
        found[digest] = attestation
    data: bytes = encode_canonical(_fields(_with_attestations(c, found.__getitem__)))
    return data


def attestation_digest(attestation: bytes) -> bytes:
    return blake3.blake3(ATTESTATION_REF_DOMAIN + attestation).digest()


def _with_attestations(c: Closure, swap: Callable[[bytes], bytes]) -> Closure:
    """``c`` with each attestation it names replaced by ``swap(attestation)``."""
    return replace(
        c,
        included=tuple(replace(x, attestation=swap(x.attestation)) for x in c.included),
        left=tuple(replace(x, attestation=swap(x.attestation)) for x in c.left),
        passed=tuple(replace(x, attestation=swap(x.attestation)) for x in c.passed),
    )


def closure_digest(body: bytes) -> bytes:
    """What the proposer's attestation signs: BLAKE3 over the domain and the body."""
    return blake3.blake3(CLOSURE_DOMAIN + struct.pack("<Q", len(body)) + body).digest()


def sign_closure(
    signer: Signer,
    closure: Closure,
    *,
    kernel_class: str,
    certificate: AdmissionCertificate,
    time: int,
) -> tuple[bytes, bytes]:
    """(body, attestation) of a closure this worker proposes."""
    body = encode_closure(closure)
    attestation = sign_attestation(
        signer,
        kind=CLOSURE_KIND,
        digest=closure_digest(body),
        kernel_class=kernel_class,
        subjects=[closure.start_root, closure.result_root, closure.state_blob],
        time=time,
        certificate=certificate,
    )
    return body, attestation.encode()


def _verify(data: bytes, *, kind: str, trust: TrustStore, now: float) -> Attestation:
    try:
        return verify_attestation(data, trust=trust, now=now, kind=kind)
    except Rejected as exc:
        raise Refused(exc.reason.value, str(exc)) from None


def check_update_attestation(
    data: bytes, *, peer: str, blob: str, start_root: str, trust: TrustStore, now: float
) -> Attestation:
    """The update attestation of ``peer`` over ``[blob, start_root, commitment blob]``, or
    :class:`Refused`."""
    attestation = _verify(data, kind=UPDATE_KIND, trust=trust, now=now)
    if attestation.signer_peer_id != peer:
        raise Refused("signer is not the author", f"signed by {attestation.signer_peer_id}")
    if attestation.digest != bytes.fromhex(blob):
        raise Refused("digest is not the blob ID")
    if not update_subjects_ok(attestation.subjects, blob):
        raise Refused("wrong subjects", "expected [update blob, start root, commitment blob]")
    if attestation.subjects[1] != start_root:
        raise Refused("wrong state root", f"made from {attestation.subjects[1][:16]}")
    return attestation


@dataclass(frozen=True)
class CheckedClosure:
    """A valid closure with its digest, the operators of its included updates (in their
    order) and those of the workers it names otherwise (left out, then passed)."""

    closure: Closure
    body: bytes
    attestation: bytes
    digest: bytes
    operators: tuple[str, ...]
    others: tuple[str, ...] = ()

    def named(self) -> list[tuple[str, str]]:
        """(peer, operator) of every worker the closure names, by peer."""
        c = self.closure
        peers = [*c.peers(), *(x.peer for x in c.left), *(x.peer for x in c.passed)]
        pairs = zip(peers, (*self.operators, *self.others), strict=True)
        return sorted(pairs, key=lambda e: e[0].encode())


def check_closure(
    body: bytes, attestation: bytes, *, run: str, trust: TrustStore, now: float, quorum: int
) -> CheckedClosure:
    """Rules 1 and 7: the closure if it is valid and names at least ``quorum`` distinct
    operators (the run's, :func:`quorum_of`), else :class:`Refused` with the reason."""
    try:
        closure = decode_closure(body)
    except BadClosure as exc:
        raise Refused("malformed closure", str(exc)) from None
    if closure.run != run:
        raise Refused("another run's closure")
    signed = _verify(attestation, kind=CLOSURE_KIND, trust=trust, now=now)
    digest = closure_digest(body)
    if signed.signer_peer_id != closure.proposer:
        raise Refused("signer is not the proposer")
    if signed.digest != digest:
        raise Refused("digest is not the closure's")
    if signed.subjects != (closure.start_root, closure.result_root, closure.state_blob):
        raise Refused("wrong subjects", "expected [start root, result root, state blob]")
    lists = [closure.peers(), [x.peer for x in closure.left], [x.peer for x in closure.passed]]
    for peers in lists:
        if any(b <= a for a, b in itertools.pairwise(peers)):
            raise Refused("named workers are not in strictly increasing peer order")
    if len(set(closure.present())) != len(closure.present()):
        raise Refused("a worker named twice", "one peer in two of included, left, passed")
    blobs = [*(x.blob for x in closure.included), *(x.blob for x in closure.left)]
    if len(set(blobs)) != len(blobs):
        raise Refused("a copy", "one update blob is named for two workers")
    operators = []
    entries: list[Included | LeftOut] = [*closure.included, *closure.left]
    for entry in entries:
        update = check_update_attestation(
            entry.attestation,
            peer=entry.peer,
            blob=entry.blob,
            start_root=closure.start_root,
            trust=trust,
            now=now,
        )
        assert update.certificate is not None  # the trust store required one
        operators.append(update.certificate.operator)
    for passed in closure.passed:
        checked_pass = check_pass_attestation(
            passed.attestation,
            peer=passed.peer,
            run=run,
            round_=closure.round,
            start_root=closure.start_root,
            trust=trust,
            now=now,
        )
        assert checked_pass.certificate is not None  # the trust store required one
        operators.append(checked_pass.certificate.operator)
    if len(set(operators)) != len(operators):
        raise Refused("one operator twice", "an operator's keys count once per round")
    if len(operators) < quorum:
        raise Refused(
            "below the quorum",
            f"names {len(operators)} operator(s), the run's quorum is {quorum}",
        )
    ours = tuple(operators[: len(closure.included)])
    others = tuple(operators[len(closure.included) :])
    return CheckedClosure(closure, bytes(body), bytes(attestation), digest, ours, others)


# --- rule 7: the quorum ----------------------------------------------------------------


def majority(workers: int) -> int:
    """The default quorum of a run of ``workers`` (K): floor(K/2)+1 (rule 7)."""
    return workers // 2 + 1


def quorum_of(workers: int, quorum: int = 0) -> int:
    """The quorum a run of K ``workers`` closes rounds with: ``quorum`` where set (the
    spec's), else :func:`majority`."""
    return quorum or majority(workers)


def present_operators(
    me: tuple[str, str] | None, heard: Iterable[tuple[str, str]]
) -> dict[str, str]:
    """Rule 7 as a proposer counts it before it selects: operator -> peer of ``me`` (peer,
    operator; None when it has neither an update nor a pass for the round) and of each
    (peer, operator) whose valid update or pass for the round it ``heard``, an operator's
    first key (``me``'s, then in peer order) counting. A closure of them names exactly
    these operators: every update it does not include it lists as left out (a banned
    operator's too), every pass as passed."""
    out: dict[str, str] = {}
    if me is not None:
        out[me[1]] = me[0]
    for peer, operator in sorted(heard, key=lambda e: e[0].encode()):
        out.setdefault(operator, peer)
    return out


# --- rule 2: who proposes, when --------------------------------------------------------


def rank(start_root: str, peer: str) -> bytes:
    """A peer's place in round order: BLAKE3 over the round's start root and its ID."""
    return blake3.blake3(RANK_DOMAIN + bytes.fromhex(start_root) + peer.encode()).digest()


def proposer_order(start_root: str, peers: Iterable[str]) -> list[str]:
    return sorted(set(peers), key=lambda p: rank(start_root, p))


def proposal_time(ready: float, position: int, proposer_timeout: float) -> float:
    """When the worker at ``position`` proposes, counted from when its round is ready."""
    return ready + position * proposer_timeout


def priority(checked: CheckedClosure) -> tuple[bytes, bytes]:
    """Rule 3's order among closures of one round (lower is better)."""
    return rank(checked.closure.start_root, checked.closure.proposer), checked.digest


def distinct(
    updates: Mapping[str, str],
    *,
    me: str,
    operators: Mapping[str, str],
    banned: Container[str],
) -> dict[str, str]:
    """Of ``updates`` (peer -> blob; "" for one not known yet), those a closure could name
    together (rule 1), in ascending peer order: ``me``'s first, then the others' in peer
    order, a blob or an operator once, none of a ``banned`` operator, none of a peer whose
    operator (``operators``: peer -> operator) is unknown."""
    blobs: set[str] = set()
    seen: set[str] = set()
    out: dict[str, str] = {}
    others = sorted((p for p in updates if p != me), key=lambda p: p.encode())
    for peer in [me, *others] if me in updates else others:
        blob = updates[peer]
        operator = operators.get(peer)
        if operator is None or operator in banned or operator in seen:
            continue
        if blob and blob in blobs:
            continue
        blobs.add(blob)
        seen.add(operator)
        out[peer] = blob
    return dict(sorted(out.items(), key=lambda e: e[0].encode()))


def nameable(
    fetched: Mapping[str, str],
    announced: Mapping[str, str],
    *,
    me: str,
    operators: Mapping[str, str],
    banned: Container[str],
) -> dict[str, str]:
    """The fetched updates (peer -> blob) a closure could name (:func:`distinct`): ``me``'s
    and those whose blob is the one their author announced (``announced``: peer -> blob).
    What makes a round ready early (rule 2) counts these only, so a copy announced by an
    admitted worker does not close a round before an honest worker's update is in."""
    held = {
        peer: blob for peer, blob in fetched.items() if peer == me or announced.get(peer) == blob
    }
    return distinct(held, me=me, operators=operators, banned=banned)


def expected(
    workers: int,
    previous: Mapping[str, str],
    late: Mapping[str, str],
    *,
    me: str,
    operators: Mapping[str, str],
    banned: Container[str],
) -> int:
    """How many updates make a round ready before its deadline (rule 2): ``workers`` (K),
    or, if more, the updates of the previous round a closure could have named, in time for
    it (``previous``) or late (``late``), with ``me``'s (peer -> blob)."""
    heard = {**late, **previous}
    heard.setdefault(me, "")
    return max(workers, len(distinct(heard, me=me, operators=operators, banned=banned)))


# --- rule 3: fork choice ---------------------------------------------------------------


@dataclass
class ClosureBook:
    """The valid closures a worker holds, and which one is the tip (rules 3 and 5)."""

    by_round: dict[int, dict[bytes, CheckedClosure]] = field(default_factory=dict)
    bad: dict[bytes, str] = field(default_factory=dict)  # digest -> why it is no tip
    equivocations: list[tuple[int, str]] = field(default_factory=list)  # (round, proposer)

    def add(self, checked: CheckedClosure) -> bool:
        """Keep a valid closure; True if it is new (and may have changed the tip)."""
        r = checked.closure.round
        top = self.top_round()
        if checked.digest in self.bad or (top is not None and r < top - CLOSURE_WINDOW):
            return False
        siblings = self.by_round.setdefault(r, {})
        if checked.digest in siblings:
            return False
        for other in siblings.values():
            same = (other.closure.proposer, other.closure.start_root)
            if same == (checked.closure.proposer, checked.closure.start_root):
                self.equivocations.append((r, checked.closure.proposer))
        siblings[checked.digest] = checked
        if len(siblings) > MAX_CLOSURES_PER_ROUND:
            worst = max(siblings.values(), key=priority)
            del siblings[worst.digest]
        for old in [k for k in self.by_round if k < r - CLOSURE_WINDOW]:
            del self.by_round[old]
        return checked.digest in siblings

    def mark_bad(self, digest: bytes, reason: str) -> None:
        """A closure that failed recomputation or could not be fetched: never the tip."""
        self.bad[digest] = reason
        for siblings in self.by_round.values():
            siblings.pop(digest, None)

    def top_round(self) -> int | None:
        live = [r for r, s in self.by_round.items() if s]
        return max(live) if live else None

    def tip(self) -> CheckedClosure | None:
        top = self.top_round()
        if top is None:
            return None
        return min(self.by_round[top].values(), key=priority)

    def has_round(self, r: int, start_root: str) -> bool:
        return any(c.closure.start_root == start_root for c in self.by_round.get(r, {}).values())


@dataclass(frozen=True)
class Apply:
    """Recompute the tip from the named updates (it starts from our root)."""

    closure: CheckedClosure


@dataclass(frozen=True)
class CatchUp:
    """Fetch the tip's state blob and adopt it (we missed rounds, or a better sibling)."""

    closure: CheckedClosure


@dataclass(frozen=True)
class Stay:
    """Nothing to do: no tip, or the tip is what we already hold."""


Step = Apply | CatchUp | Stay


def next_step(book: ClosureBook, round_: int, root: str) -> Step:
    """Rule 3: what a worker holding state round ``round_`` with ``root`` does next."""
    tip = book.tip()
    if tip is None:
        return Stay()
    c = tip.closure
    if c.round == round_ and c.start_root == root:
        return Apply(tip)
    if c.round + 1 == round_ and c.result_root == root:
        return Stay()
    if c.round + 1 < round_:
        return Stay()  # we are ahead of every closure we hold (ours are still on the way)
    return CatchUp(tip)


def select_for_closure(
    updates: Mapping[str, tuple[str, bytes]],
    left: Mapping[str, tuple[str, bytes, str]] | None = None,
    passed: Mapping[str, bytes] | None = None,
) -> tuple[tuple[Included, ...], tuple[LeftOut, ...], tuple[Passed, ...]]:
    """The lists a proposer names (rule 1), each in peer order: ``updates`` included (peer
    -> (blob, attestation)), ``left`` out (peer -> (blob, attestation, reason), the reason
    cut to ``MAX_REASON_LEN`` bytes) and ``passed`` (peer -> pass attestation); at most
    ``MAX_INCLUDED`` in all, the included first."""

    def order(keys: Iterable[str]) -> list[str]:
        return sorted(keys, key=lambda p: p.encode())

    def short(reason: str) -> str:
        data = reason.encode()
        if len(data) <= MAX_REASON_LEN:
            return reason or "left out"
        return data[: MAX_REASON_LEN - 3].decode(errors="ignore") + "..."

    left, passed = left or {}, passed or {}
    included = tuple(Included(p, *updates[p]) for p in order(updates))[:MAX_INCLUDED]
    room = MAX_INCLUDED - len(included)
    out = tuple(LeftOut(p, left[p][0], left[p][1], short(left[p][2])) for p in order(left))
    out = out[:room]
    return included, out, tuple(Passed(p, passed[p]) for p in order(passed))[: room - len(out)]
