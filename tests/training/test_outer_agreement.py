"""Round closures (training.outer.agreement): validity, fork choice, and the story of a run
on a fake clock: a paused proposer is replaced and its worker catches up, proposers that
disagree or equivocate still leave every worker on one tip."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import blake3
import pytest

from identity import (
    AdmissionCertificate,
    Authority,
    MachineKey,
    SoftwareSigner,
    TrustStore,
    sign_attestation,
)
from training.outer.agreement import (
    CLOSURE_WINDOW,
    Apply,
    CatchUp,
    CheckedClosure,
    Closure,
    ClosureBook,
    Included,
    Stay,
    check_closure,
    compact_body,
    decode_closure,
    distinct,
    encode_closure,
    expand_body,
    expected,
    nameable,
    next_step,
    priority,
    proposal_time,
    proposer_order,
    sign_closure,
)
from training.outer.messages import UPDATE_KIND, Refused

NOW = 1_700_000_000
KC = "cpu-test"
RUN = "run-1"
GENESIS = "00" * 32
AUTHORITY = Authority(SoftwareSigner(MachineKey.generate()))
TRUST = TrustStore(frozenset({AUTHORITY.public_key_bytes}))


@dataclasses.dataclass
class Machine:
    key: MachineKey
    cert: AdmissionCertificate

    @property
    def peer(self) -> str:
        return self.key.peer_id

    @property
    def signer(self) -> SoftwareSigner:
        return SoftwareSigner(self.key)


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


def blob_of(m: Machine, round_: int, root: str) -> str:
    return blake3.blake3(f"{m.peer}/{round_}/{root}".encode()).hexdigest()


def update(m: Machine, round_: int, root: str, blob: str | None = None) -> Included:
    blob = blob or blob_of(m, round_, root)
    attestation = sign_attestation(
        m.signer,
        kind=UPDATE_KIND,
        digest=bytes.fromhex(blob),
        kernel_class=KC,
        subjects=[blob, root, "c0" * 32],  # a commitment blob (never fetched here)
        time=NOW,
        certificate=m.cert,
    )
    return Included(m.peer, blob, attestation.encode())


def result_of(root: str, included: tuple[Included, ...]) -> str:
    """A stand-in for aggregation: a pure function of the start root and the named blobs."""
    return blake3.blake3((root + "".join(x.blob for x in included)).encode()).hexdigest()


def close(
    proposer: Machine, round_: int, root: str, included: list[Included], *, salt: str = ""
) -> CheckedClosure:
    entries = tuple(sorted(included, key=lambda x: x.peer))
    result = result_of(root, entries)
    state = blake3.blake3((result + salt).encode()).hexdigest()
    closure = Closure(RUN, round_, root, proposer.peer, entries, result, state)
    body, attestation = sign_closure(
        proposer.signer, closure, kernel_class=KC, certificate=proposer.cert, time=NOW
    )
    return check_closure(body, attestation, run=RUN, trust=TRUST, now=NOW, quorum=1)


WORKERS = [machine(f"op-{i}") for i in range(3)]
A, B, C = WORKERS


# --- validity ------------------------------------------------------------------------


def test_a_closure_round_trips_and_checks() -> None:
    checked = close(A, 0, GENESIS, [update(m, 0, GENESIS) for m in WORKERS])
    assert decode_closure(encode_closure(checked.closure)) == checked.closure
    assert checked.operators == ("op-0", "op-1", "op-2") or len(set(checked.operators)) == 3
    assert checked.closure.peers() == sorted(m.peer for m in WORKERS)


def _resign(proposer: Machine, closure: Closure) -> tuple[bytes, bytes]:
    return sign_closure(
        proposer.signer, closure, kernel_class=KC, certificate=proposer.cert, time=NOW
    )


def test_a_compact_closure_expands_to_the_signed_body_from_held_attestations() -> None:
    """On the wire a closure names its updates' attestations by digest (they were two
    thirds of its bytes); a receiver holding them restores the exact signed body, and one
    missing or holding another attestation gets None (it then fetches the full blob)."""
    updates = [update(m, 0, GENESIS) for m in WORKERS]
    checked = close(A, 0, GENESIS, updates)
    compact = compact_body(checked.body)
    assert len(compact) < len(checked.body) - 2 * sum(len(u.attestation) for u in updates) // 3
    held = {(u.peer, u.blob): u.attestation for u in updates}
    full = expand_body(compact, lambda p, b: held.get((p, b)))
    assert full == checked.body
    assert (
        check_closure(full, checked.attestation, run=RUN, trust=TRUST, now=NOW, quorum=1) == checked
    )
    missing = dict(list(held.items())[1:])
    assert expand_body(compact, lambda p, b: missing.get((p, b))) is None
    other = update(B, 0, GENESIS, blob=blob_of(C, 0, GENESIS))  # another attestation
    swapped = {**held, (updates[0].peer, updates[0].blob): other.attestation}
    assert expand_body(compact, lambda p, b: swapped.get((p, b))) is None


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        # Another worker's update copied under a second key: one blob named twice.
        (
            lambda c: dataclasses.replace(
                c,
                included=tuple(
                    sorted(
                        [c.included[0], update(B, 0, GENESIS, blob=c.included[0].blob)],
                        key=lambda x: x.peer,
                    )
                ),
            ),
            "a copy",
        ),
        # An update made from another state (stale) inside the closure.
        (lambda c: dataclasses.replace(c, included=(update(A, 0, "ee" * 32),)), "wrong state root"),
        # An entry whose attestation is another peer's.
        (
            lambda c: dataclasses.replace(
                c, included=(dataclasses.replace(update(A, 0, GENESIS), peer=B.peer),)
            ),
            "signer is not the author",
        ),
        (lambda c: dataclasses.replace(c, included=c.included[::-1]), "strictly increasing"),
    ],
)
def test_bad_closures_are_refused_with_their_reason(
    mutate: Callable[[Closure], Closure], reason: str
) -> None:
    good = close(A, 0, GENESIS, [update(A, 0, GENESIS), update(C, 0, GENESIS)]).closure
    if reason == "strictly increasing" and good.included[0].peer > good.included[1].peer:
        good = dataclasses.replace(good, included=good.included[::-1])
    body, attestation = _resign(A, mutate(good))
    with pytest.raises(Refused, match=reason):
        check_closure(body, attestation, run=RUN, trust=TRUST, now=NOW, quorum=1)


def test_a_closure_signed_by_someone_else_or_for_another_body_is_refused() -> None:
    checked = close(A, 0, GENESIS, [update(A, 0, GENESIS)])
    other_body, _ = _resign(A, dataclasses.replace(checked.closure, round=1))
    with pytest.raises(Refused, match="digest"):
        check_closure(other_body, checked.attestation, run=RUN, trust=TRUST, now=NOW, quorum=1)
    _, by_b = _resign(B, checked.closure)
    with pytest.raises(Refused, match="proposer"):
        check_closure(checked.body, by_b, run=RUN, trust=TRUST, now=NOW, quorum=1)
    with pytest.raises(Refused, match="another run"):
        check_closure(
            checked.body, checked.attestation, run="run-2", trust=TRUST, now=NOW, quorum=1
        )


def test_one_operator_counts_once() -> None:
    twin = machine("op-0")  # a second key of A's operator
    with pytest.raises(Refused, match="operator"):
        close(A, 0, GENESIS, [update(A, 0, GENESIS), update(twin, 0, GENESIS)])


# --- fork choice ---------------------------------------------------------------------


def test_the_tip_is_the_highest_round_then_the_best_ranked_proposer() -> None:
    ups = [update(m, 0, GENESIS) for m in WORKERS]
    siblings = [close(m, 0, GENESIS, ups) for m in WORKERS]
    best = min(siblings, key=priority)
    for order in (siblings, siblings[::-1]):
        book = ClosureBook()
        for s in order:
            book.add(s)
        assert book.tip() == best  # the same tip whatever order they were heard in
    # A longer chain beats a better-ranked sibling of its parent.
    worst = max(siblings, key=priority)
    child = close(B, 1, worst.closure.result_root, [update(B, 1, worst.closure.result_root)])
    book.add(child)
    assert book.tip() == child
    # A closure that failed recomputation is never the tip; the next best takes over.
    book.mark_bad(child.digest, "result root mismatch")
    assert book.tip() == best
    assert not book.add(child)


def test_an_equivocating_proposer_is_recorded_and_resolved_the_same_way_everywhere() -> None:
    ups = [update(m, 0, GENESIS) for m in WORKERS]
    one = close(A, 0, GENESIS, ups)
    two = close(A, 0, GENESIS, ups[:2])
    tips = set()
    for order in ((one, two), (two, one)):
        book = ClosureBook()
        for c in order:
            book.add(c)
        assert book.equivocations == [(0, A.peer)]
        tip = book.tip()
        assert tip is not None
        tips.add(tip.digest)
    assert tips == {min(one.digest, two.digest)}


def test_old_closures_are_dropped_outside_the_window() -> None:
    book = ClosureBook()
    root = GENESIS
    for r in range(CLOSURE_WINDOW + 3):
        c = close(A, r, root, [update(A, r, root)])
        book.add(c)
        root = c.closure.result_root
    assert min(book.by_round) >= CLOSURE_WINDOW + 2 - CLOSURE_WINDOW
    stale = close(B, 0, GENESIS, [update(B, 0, GENESIS)])
    assert not book.add(stale)


def test_next_step_applies_stays_or_catches_up() -> None:
    c0 = close(A, 0, GENESIS, [update(A, 0, GENESIS)])
    book = ClosureBook()
    assert next_step(book, 0, GENESIS) == Stay()
    book.add(c0)
    assert next_step(book, 0, GENESIS) == Apply(c0)
    assert next_step(book, 1, c0.closure.result_root) == Stay()
    # Missed rounds: the tip is two rounds ahead of us.
    r1 = c0.closure.result_root
    c1 = close(B, 1, r1, [update(B, 1, r1)])
    book.add(c1)
    assert next_step(book, 0, GENESIS) == CatchUp(c1)
    # A better sibling of the closure we applied.
    other = close(C, 1, "ab" * 32, [update(C, 1, "ab" * 32)])
    book2 = ClosureBook()
    book2.add(other)
    assert next_step(book2, 2, "cd" * 32) == CatchUp(other)


def test_a_round_is_ready_early_on_updates_a_closure_could_name_only() -> None:
    """What makes a round ready before its deadline counts the fetched updates a closure
    could name: an admitted worker's copy of another's blob, a second key of one operator,
    a banned operator's update or a blob its author did not announce do not count, so they
    cannot close a round before an honest worker's update is in."""
    operators = {"me": "op-me", "a": "op-a", "b": "op-b", "c": "op-b", "d": "op-d"}
    operators.update({"e": "op-e", "f": "op-f"})
    banned = {"op-d": "failed replay"}
    fetched = {"me": "b1", "a": "b1", "b": "b2", "c": "b3", "d": "b4", "e": "b5", "f": "b6"}
    announced = {
        "a": "b1",  # a copy of our blob
        "b": "b2",
        "c": "b3",  # operator b's second key
        "d": "b4",  # banned
        "e": "b9",  # fetched another blob than announced
        "f": "b6",
    }
    assert nameable(fetched, announced, me="me", operators=operators, banned=banned) == {
        "b": "b2",
        "f": "b6",
        "me": "b1",
    }
    # Readiness waits for as many as the previous round had that a closure could name, and
    # for an update that came after it closed, but a copy or a second key counts there no
    # more than here: one copier does not make every round wait for its deadline.
    previous = {"me": "p1", "b": "p2", "f": "p3"}
    late = {"g": "p1", "h": "p4", "i": "p5"}  # g a copy, i op-b's key
    operators.update({"g": "op-g", "h": "op-h", "i": "op-b"})
    assert expected(3, previous, late, me="me", operators=operators, banned=banned) == 4
    assert (
        expected(5, previous, late, me="me", operators=operators, banned=banned) == 5
    )  # K, when more than were heard


def test_distinct_keeps_our_own_update_first_and_drops_unknown_operators() -> None:
    """Of two updates of one operator (or one blob), the worker's own is the one kept,
    whatever the peer order; a peer whose operator is unknown is not counted."""
    operators = {"a": "op", "z": "op", "y": "op-y"}
    got = distinct(
        {"a": "b1", "z": "b2", "y": "b3", "x": "b4"}, me="z", operators=operators, banned=()
    )
    assert got == {"y": "b3", "z": "b2"}
    assert list(got) == ["y", "z"]  # ascending peer order, ours among them
    assert distinct({"a": "b1", "y": "b1"}, me="z", operators=operators, banned=()) == {"a": "b1"}
    assert distinct({"a": "", "y": ""}, me="z", operators=operators, banned=()) == {
        "a": "",
        "y": "",
    }


def test_proposer_order_rotates_with_the_round() -> None:
    peers = [m.peer for m in WORKERS]
    firsts = {proposer_order(blake3.blake3(bytes([i])).hexdigest(), peers)[0] for i in range(32)}
    assert firsts == set(peers)  # everyone leads some round
    assert proposal_time(10.0, 0, 3.0) == 10.0
    assert proposal_time(10.0, 2, 3.0) == 16.0


# --- a run on a fake clock -----------------------------------------------------------


@dataclasses.dataclass
class SimWorker:
    """A worker reduced to its agreement decisions (rules 2 and 3), on a fake clock."""

    m: Machine
    round: int = 0
    root: str = GENESIS
    book: ClosureBook = dataclasses.field(default_factory=ClosureBook)
    heard: dict[str, Included] = dataclasses.field(default_factory=dict)
    announced_at: float = 0.0
    paused_from: float = -1.0
    paused_until: float = -1.0
    inbox: list[object] = dataclasses.field(default_factory=list)
    catch_ups: int = 0


class Net:
    """Delivers every message to every worker at once; a paused worker reads its inbox
    when it wakes; ``cut`` keeps pairs of workers from hearing each other."""

    def __init__(self, workers: list[SimWorker], deadline: float, timeout: float) -> None:
        self.workers = workers
        self.deadline = deadline
        self.timeout = timeout
        self.cut: set[frozenset[str]] = set()

    def send(self, sender: SimWorker, msg: object) -> None:
        for w in self.workers:
            if w is not sender and frozenset({w.m.peer, sender.m.peer}) not in self.cut:
                w.inbox.append(msg)

    def tick(self, now: float) -> None:
        for w in self.workers:
            if w.paused_from <= now < w.paused_until:
                continue
            for msg in w.inbox:
                if isinstance(msg, Included):
                    self._hear_update(w, msg)
                else:
                    assert isinstance(msg, CheckedClosure)
                    w.book.add(msg)
            w.inbox.clear()
            self._act(w, now)

    def _hear_update(self, w: SimWorker, inc: Included) -> None:
        w.heard[inc.peer] = inc

    def _act(self, w: SimWorker, now: float) -> None:
        while True:
            step = next_step(w.book, w.round, w.root)
            if isinstance(step, Apply):
                c = step.closure.closure
                assert result_of(c.start_root, c.included) == c.result_root
                self._enter(w, c.round + 1, c.result_root, now)
            elif isinstance(step, CatchUp):
                c = step.closure.closure
                w.catch_ups += 1
                self._enter(w, c.round + 1, c.result_root, now)
            else:
                break
        if w.round >= ROUNDS:
            return
        mine = [x for x in w.heard.values() if x.blob == blob_of(w.m, w.round, w.root)]
        if not mine:
            own = update(w.m, w.round, w.root)
            w.heard[w.m.peer] = own
            w.announced_at = now
            self.send(w, own)
        if w.book.has_round(w.round, w.root):
            return
        ours = [x for x in w.heard.values() if x.blob == blob_of_peer(x.peer, w.round, w.root)]
        ready = w.announced_at + self.deadline
        if len(ours) == len(self.workers):
            ready = min(ready, now)
        position = proposer_order(w.root, [x.peer for x in ours]).index(w.m.peer)
        if now >= proposal_time(ready, position, self.timeout):
            closure = close(w.m, w.round, w.root, ours)
            w.book.add(closure)
            self.send(w, closure)
            self._act(w, now)

    def _enter(self, w: SimWorker, round_: int, root: str, now: float) -> None:
        w.round, w.root, w.heard = round_, root, {}
        del now


ROUNDS = 6
_BY_PEER = {m.peer: m for m in WORKERS}


def blob_of_peer(peer: str, round_: int, root: str) -> str:
    return blob_of(_BY_PEER[peer], round_, root)


def run(net: Net, until: float, start: float = 0.0, step: float = 0.5) -> None:
    t = start
    while t <= until:
        net.tick(t)
        t += step


def _tips(workers: list[SimWorker]) -> set[tuple[int, str]]:
    return {(w.round, w.root) for w in workers}


def test_a_paused_proposer_is_replaced_and_its_worker_catches_up() -> None:
    # Whoever leads round 0 acts first (so it has heard no other update yet), announces
    # its update, then is paused for 40 s (ten deadlines).
    order = proposer_order(GENESIS, [m.peer for m in WORKERS])
    workers = [SimWorker(_BY_PEER[p]) for p in order]
    net = Net(workers, deadline=4.0, timeout=3.0)
    paused = workers[0]
    paused.paused_from, paused.paused_until = 0.5, 40.0
    run(net, 0.0)
    assert all(w.m.peer in w.heard for w in workers)  # every update is on the wire
    run(net, 39.5, start=0.5)
    others = [w for w in workers if w is not paused]
    assert paused.round == 0
    assert all(w.round >= 3 for w in others)  # the next in rank closed rounds without it
    run(net, 100.0, start=40.0)
    assert _tips(workers) == {(ROUNDS, workers[0].root)}  # one final state, no fork
    assert paused.catch_ups == 1  # one catch-up from the tip, however many rounds missed
    assert all(w.catch_ups == 0 for w in workers if w is not paused)


def test_proposers_that_disagree_end_on_one_tip_once_they_hear_each_other() -> None:
    workers = [SimWorker(m) for m in WORKERS]
    net = Net(workers, deadline=4.0, timeout=3.0)
    # A partition: A alone, B and C together; each side closes rounds on its own.
    net.cut = {frozenset({A.peer, B.peer}), frozenset({A.peer, C.peer})}
    run(net, 12.0)
    a, *others = workers
    assert (a.round, a.root) not in _tips(others)  # the sides have forked
    net.cut = set()
    # Healed: the closures each side re-sends reach the other side (as announcements are
    # re-sent with back-off in the real worker).
    for w in workers:
        tip = w.book.tip()
        assert tip is not None
        net.send(w, tip)
    run(net, 100.0, start=12.5)
    assert _tips(workers) == {(ROUNDS, workers[0].root)}
