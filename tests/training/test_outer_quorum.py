"""The quorum and the closures that name more than included updates
(training.outer.agreement rules 1 and 7), on the parts that decide: a closure names every
worker of its round (included, left out with a reason, passed), one of fewer operators
than the run's quorum is refused wherever it is checked (a worker's book, its own
proposal, ``blob outer verify``), a closure that includes nothing is valid and the state
then carries over, a pass is judged as an update is, and the spec writes its quorum only
when it is not the default."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from blobstore import Store
from identity import sign_attestation
from tests.blob_cli import blob_here
from tests.training.test_outer_evidence import KC as EVIDENCE_KC
from tests.training.test_outer_evidence import RUN, TRUST, WORKERS, keep_run
from tests.training.test_outer_worker_proposer import ROOT, proposer_of, state, trained
from tests.training.worker_parts import KC, PARAMS, Machine, Node, machine, update
from tests.training.worker_parts import TRUST as PARTS_TRUST
from training.outer.aggregate import aggregate, wrap_update
from training.outer.agreement import (
    CLOSURE_VERSION,
    LISTS_CLOSURE_VERSION,
    MAX_REASON_LEN,
    BadClosure,
    CheckedClosure,
    Closure,
    Included,
    LeftOut,
    Passed,
    check_closure,
    compact_body,
    decode_closure,
    encode_closure,
    expand_body,
    majority,
    present_operators,
    quorum_of,
    select_for_closure,
    sign_closure,
)
from training.outer.loop import OuterConfig, OuterState, state_root
from training.outer.messages import (
    PASS_KIND,
    UPDATE_KIND,
    Candidate,
    ClosureAnnouncement,
    Ledger,
    PassAnnouncement,
    PassHeard,
    Refused,
    Rejection,
    UpdateAnnouncement,
    decode_message,
    encode_message,
    pass_digest,
)
from training.outer.milestones import (
    Milestone,
    RunTerms,
    decode_milestone_record,
    keep_round,
    milestone_for,
    sign_milestone,
    tag,
    verify_run,
)
from training.outer.spec import BadSpec, RunSpec, decode_body
from training.outer.state_blob import encode_state

RESULT = "cd" * 32
STATE = "ef" * 32


def pass_of(m: Machine, round_: int, root: str, run: str = PARAMS.run_id) -> Passed:
    attestation = sign_attestation(
        m.signer,
        kind=PASS_KIND,
        digest=pass_digest(run, round_, root),
        kernel_class=KC,
        subjects=[root],
        time=1_700_000_000,
        certificate=m.cert,
    )
    return Passed(m.peer, attestation.encode())


def left_of(m: Machine, round_: int, root: str, reason: str = "scored worse") -> LeftOut:
    x = update(m, round_, root)
    return LeftOut(x.peer, x.blob, x.attestation, reason)


def signed(proposer: Machine, closure: Closure) -> tuple[bytes, bytes]:
    return sign_closure(
        proposer.signer, closure, kernel_class=KC, certificate=proposer.cert, time=1_700_000_000
    )


def closure_of(
    proposer: Machine,
    included: list[Included] | tuple[Included, ...] = (),
    left: list[LeftOut] | tuple[LeftOut, ...] = (),
    passed: list[Passed] | tuple[Passed, ...] = (),
    round_: int = 0,
) -> Closure:
    return Closure(
        PARAMS.run_id,
        round_,
        ROOT,
        proposer.peer,
        tuple(sorted(included, key=lambda x: x.peer.encode())),
        RESULT,
        STATE,
        tuple(sorted(left, key=lambda x: x.peer.encode())),
        tuple(sorted(passed, key=lambda x: x.peer.encode())),
    )


def check(proposer: Machine, closure: Closure, quorum: int) -> CheckedClosure:
    body, attestation = signed(proposer, closure)
    return check_closure(
        body, attestation, run=PARAMS.run_id, trust=PARTS_TRUST, now=1_700_000_000, quorum=quorum
    )


# --- rule 7: the quorum ----------------------------------------------------------------


def test_the_default_quorum_is_a_majority_so_two_halves_never_both_hold_it() -> None:
    assert [majority(k) for k in range(1, 8)] == [1, 2, 2, 3, 3, 4, 4]
    for k in range(1, 65):
        # Two disjoint groups of the run's operators: at most one of them holds a majority.
        assert all(not (a >= majority(k) and k - a >= majority(k)) for a in range(k + 1))
    assert quorum_of(4) == 3 and quorum_of(4, 2) == 2


def test_a_closure_below_the_quorum_is_refused_at_or_above_it_valid() -> None:
    """Two workers of a run of four cannot close its round (quorum 3); with a third
    operator's update the same proposer's closure is valid."""
    a, b, c = machine("op-a"), machine("op-b"), machine("op-c")
    two = closure_of(a, [update(a, 0, ROOT), update(b, 0, ROOT)])
    with pytest.raises(Refused, match="below the quorum") as refused:
        check(a, two, quorum=majority(4))
    assert "names 2 operator(s), the run's quorum is 3" in str(refused.value)
    three = closure_of(a, [update(a, 0, ROOT), update(b, 0, ROOT), update(c, 0, ROOT)])
    assert check(a, three, quorum=majority(4))


def test_left_out_and_passed_workers_count_and_a_closure_may_include_nothing() -> None:
    """Every update scored worse (left out) and a worker that sent none (passed): the
    closure includes nothing, still names three operators, and meets a quorum of three.
    Its operators list the included ones, then the left out, then the passed."""
    a, b, c = machine("op-a"), machine("op-b"), machine("op-c")
    closure = closure_of(
        a, left=[left_of(a, 0, ROOT), left_of(b, 0, ROOT)], passed=[pass_of(c, 0, ROOT)]
    )
    checked = check(a, closure, quorum=3)
    body, _ = signed(a, closure)
    assert decode_closure(body) == closure and closure.included == ()
    assert msgpack.unpackb(body)["v"] == LISTS_CLOSURE_VERSION
    assert checked.operators == ()
    named = dict(checked.named())
    assert named == {a.peer: "op-a", b.peer: "op-b", c.peer: "op-c"}
    assert sorted(closure.present()) == sorted(named)
    # The same without its pass names two: below the quorum of three.
    with pytest.raises(Refused, match="below the quorum"):
        check(a, dataclasses.replace(closure, passed=()), quorum=3)


def test_a_closure_of_included_updates_only_keeps_its_version_1_bytes() -> None:
    """A closure that leaves nothing out and names no pass is spelled as before (version
    1, no new keys): closures made before keep their digests, and the same closure
    spelled as version 2 is refused as not canonical (one closure, one spelling)."""
    a, b = machine("op-a"), machine("op-b")
    closure = closure_of(a, [update(a, 0, ROOT), update(b, 0, ROOT)])
    body = encode_closure(closure)
    fields = msgpack.unpackb(body)
    assert fields["v"] == CLOSURE_VERSION and "left" not in fields and "passed" not in fields
    keys = ["v", "run", "round", "start", "proposer", "included", "left", "passed"]
    spelled = {k: fields.get(k, []) for k in [*keys, "result", "state"]}
    spelled["v"] = LISTS_CLOSURE_VERSION
    with pytest.raises(BadClosure, match="canonical"):
        decode_closure(msgpack.packb(spelled, use_bin_type=True))


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        # One worker both left out and passed.
        (
            lambda a, b: ([left_of(a, 0, ROOT)], [pass_of(a, 0, ROOT), pass_of(b, 0, ROOT)]),
            "named twice",
        ),
        # A pass of another round, or made from another root.
        (lambda a, b: ([left_of(a, 0, ROOT)], [pass_of(b, 1, ROOT)]), "digest"),
        (lambda a, b: ([left_of(a, 0, ROOT)], [pass_of(b, 0, "ee" * 32)]), "digest"),
        # A left-out update made from another root.
        (lambda a, b: ([left_of(a, 0, "ee" * 32)], [pass_of(b, 0, ROOT)]), "wrong state root"),
        # A pass signed by another peer than the one named.
        (
            lambda a, b: (
                [left_of(a, 0, ROOT)],
                [dataclasses.replace(pass_of(b, 0, ROOT), peer=machine("op-z").peer)],
            ),
            "signer",
        ),
    ],
)
def test_what_a_closure_names_besides_its_updates_is_checked(make: object, reason: str) -> None:
    a, b = machine("op-a"), machine("op-b")
    left, passed = make(a, b)  # type: ignore[operator]
    with pytest.raises(Refused, match=reason):
        check(a, closure_of(a, left=left, passed=passed), quorum=1)


def test_one_operator_counts_once_across_the_lists() -> None:
    a, twin = machine("op-a"), machine("op-a")
    with pytest.raises(Refused, match="one operator twice"):
        check(a, closure_of(a, [update(a, 0, ROOT)], passed=[pass_of(twin, 0, ROOT)]), quorum=1)
    # ... and so, as a proposer counts it, a second key adds no one.
    present = present_operators((a.peer, "op-a"), [(twin.peer, "op-a"), ("peer-b", "op-b")])
    assert present == {"op-a": a.peer, "op-b": "peer-b"}
    assert present_operators(None, [("z", "op-z"), ("y", "op-z")]) == {"op-z": "y"}


def test_a_compact_closure_names_left_and_passed_attestations_by_digest_too() -> None:
    a, b, c = machine("op-a"), machine("op-b"), machine("op-c")
    included, left, passed = update(a, 0, ROOT), left_of(b, 0, ROOT), pass_of(c, 0, ROOT)
    body, _ = signed(a, closure_of(a, [included], [left], [passed]))
    compact = compact_body(body)
    assert len(compact) < len(body) - len(left.attestation) - len(passed.attestation)
    held = {
        (included.peer, included.blob): included.attestation,
        (left.peer, left.blob): left.attestation,
        (passed.peer, ""): passed.attestation,  # a pass is held under blob ""
    }
    assert expand_body(compact, lambda p, x: held.get((p, x))) == body
    del held[(passed.peer, "")]
    assert expand_body(compact, lambda p, x: held.get((p, x))) is None


def test_the_proposers_lists_are_in_peer_order_bounded_and_reasons_cut() -> None:
    long = "x" * (MAX_REASON_LEN + 10)
    included, left, passed = select_for_closure(
        {"b": ("1" * 64, b"u")},
        {"c": ("2" * 64, b"v", long), "a": ("3" * 64, b"w", "")},
        {"d": b"p"},
    )
    assert [x.peer for x in included] == ["b"] and [x.peer for x in passed] == ["d"]
    assert [x.peer for x in left] == ["a", "c"]
    assert left[0].reason == "left out" and len(left[1].reason.encode()) == MAX_REASON_LEN
    many = {f"p{i:03d}": (f"{i:064x}", b"u") for i in range(70)}
    inc, out, gone = select_for_closure(many, {"z": ("f" * 64, b"v", "r")}, {"y": b"p"})
    assert (len(inc), out, gone) == (64, (), ())


def test_a_closure_that_includes_nothing_carries_the_state_over() -> None:
    """Its result is S_r with the round counted: the parameters and momentum unchanged."""
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    state = OuterState(4, {"w": w}, {"w": np.ones_like(w)})
    agg = aggregate(state, [], lambda b: b"", OuterConfig(), start_root=state_root(state))
    assert agg.state.round == 5 and agg.admitted == ()
    assert np.array_equal(agg.state.params["w"], w)
    assert np.array_equal(agg.state.momentum["w"], np.ones_like(w))
    assert state_root(agg.state) != state_root(state)


# --- a pass on the wire ------------------------------------------------------------------


def pass_message(m: Machine, round_: int, root: str) -> bytes:
    passed = pass_of(m, round_, root)
    return encode_message(PassAnnouncement(PARAMS.run_id, round_, passed.attestation, ()))


def test_a_pass_is_judged_buffered_and_counted_as_an_update_is() -> None:
    me, peer, other = machine(), machine("op-p"), machine("op-o")
    ledger = Ledger(PARAMS.run_id, me.peer, PARTS_TRUST)
    # Heard before its round opens: buffered, then judged against the round's root.
    assert ledger.hear(pass_message(peer, 0, ROOT), peer.peer, 1_700_000_000) == []
    (event,) = ledger.open_round(0, ROOT, 1_700_000_000)
    assert isinstance(event, PassHeard) and (event.peer, event.operator) == (peer.peer, "op-p")
    assert peer.peer in ledger.present
    # An update after its pass is equivocation; a pass of another root is refused.
    x = update(peer, 0, ROOT)
    data = encode_message(UpdateAnnouncement(PARAMS.run_id, 0, x.blob, x.attestation, ()))
    (refused,) = ledger.hear(data, peer.peer, 1_700_000_000)
    assert isinstance(refused, Rejection) and refused.reason == "equivocation"
    (wrong,) = ledger.hear(pass_message(other, 0, "ee" * 32), other.peer, 1_700_000_000)
    assert isinstance(wrong, Rejection) and wrong.blob == ""
    # Round-tripped as its own announcement type.
    decoded = decode_message(pass_message(other, 3, ROOT))
    assert isinstance(decoded, PassAnnouncement) and decoded.round == 3
    assert not isinstance(decoded, Candidate)


# --- the spec and the evidence ---------------------------------------------------------


def spec(**kw: object) -> RunSpec:
    fields: dict[str, object] = {
        "run": "r",
        "initial": "a" * 64,
        "root": "b" * 64,
        "tensors": (("w", (2, 3)),),
        "inner_steps": 4,
        "workers": 4,
        "authorities": ("c" * 64,),
    }
    return RunSpec(**{**fields, **kw})  # type: ignore[arg-type]


def test_the_spec_writes_its_quorum_only_when_it_is_not_the_majority() -> None:
    default = spec()
    assert "quorum" not in default.body() and default.needed == 3
    assert spec(quorum=3) == default and "quorum" not in spec(quorum=3).body()
    low = spec(quorum=2)
    assert low.body()["quorum"] == 2 and low.needed == 2
    body = msgpack.packb(low.body(), use_bin_type=True)
    assert decode_body(body) == low
    # The majority spelled out is a second spelling of the default: refused.
    spelled = dict(sorted({**default.body(), "quorum": 3}.items()))
    with pytest.raises(BadSpec, match="canonical"):
        decode_body(msgpack.packb(spelled, use_bin_type=True))
    with pytest.raises(ValueError, match="quorum"):
        spec(quorum=5)


def test_a_milestone_signs_the_runs_quorum_and_an_older_one_still_decodes() -> None:
    m = WORKERS[0]
    terms = RunTerms(3, 0.25, 0.7, 0.9, quorum=2)
    milestone = Milestone(RUN, 0, "aa" * 32, ROOT, RESULT, (), (), terms, ())
    record = sign_milestone(m.signer, milestone, kernel_class=KC, certificate=m.cert, time=1)
    decoded, _ = decode_milestone_record(record)
    assert decoded == milestone and decoded.version == 4
    assert decoded.to_json()["terms"]["quorum"] == 2
    older = dataclasses.replace(milestone, terms=dataclasses.replace(terms, quorum=None))
    record = sign_milestone(m.signer, older, kernel_class=KC, certificate=m.cert, time=1)
    assert decode_milestone_record(record)[0].version == 3


def test_verify_refuses_a_round_closed_below_the_runs_quorum(tmp_path: Path) -> None:
    """One of three workers leaves after round 0 and the other two close rounds 1 and 2:
    a run of quorum 2 verifies; the same closures under a quorum of 3 (a spec that says
    so) fail, naming the first round closed below it."""
    store = Store.open(tmp_path / "store")
    keep_run(store, left={WORKERS[2].peer: 1})
    shutil.copytree(tmp_path / "store", tmp_path / "copy")
    assert verify_run(store, RUN, TRUST, quorum=2).ok
    report = verify_run(Store.open(tmp_path / "copy"), RUN, TRUST, quorum=3)
    assert not report.ok
    assert report.failures == [
        "round 1: closure: below the quorum: names 2 operator(s), the run's quorum is 3"
    ], report.failures
    assert report.checked_rounds == [0]


def test_pass_digests_bind_the_run_round_and_root() -> None:
    digests = {
        pass_digest("a", 0, ROOT),
        pass_digest("b", 0, ROOT),
        pass_digest("a", 1, ROOT),
        pass_digest("a", 0, RESULT),
    }
    assert len(digests) == 4


# --- the proposer: nothing left to include, a pass ----------------------------------------


def candidate_of(node: Node, m: Machine, round_: int, blob: str = "") -> Candidate:
    """``m``'s update for ``round_`` from ROOT, held in ``node``'s store, as announced
    (``blob``: another's, re-signed by ``m``: a copy)."""
    blob = blob or node.store.put_bytes(
        wrap_update(b"x" + m.peer.encode(), round_=round_, start_root=ROOT, author=m.peer)
    )
    attestation = sign_attestation(
        m.signer,
        kind=UPDATE_KIND,
        digest=bytes.fromhex(blob),
        kernel_class=KC,
        subjects=[blob, ROOT, "c0" * 32],
        time=int(time.time()),
        certificate=m.cert,
    )
    return Candidate(round_, m.peer, blob, (), m.cert.operator, attestation.encode())


async def test_a_copy_of_a_named_blob_is_not_named_so_the_closure_stays_valid(
    tmp_path: Path,
) -> None:
    """An admitted worker re-signs another's blob (a copy), its operator banned or not: a
    closure that listed it as left out would name one blob twice, and the proposer's own
    closure would be invalid ("BUG: our own closure is invalid (a copy ...)", every round of
    the churn test's byzantine worker). It is not named, nor counted toward the quorum."""
    me, other, copier = machine("op-me"), machine("op-other"), machine("op-copier")
    proposer, node = proposer_of(tmp_path, me)
    own, _ = await proposer.commit(state(0), ROOT, trained(me, 0))
    theirs = candidate_of(node, other, 0)
    copy = candidate_of(node, copier, 0, blob=theirs.blob)
    candidates = {other.peer: theirs, copier.peer: copy}
    fetched = {me.peer: own.blob, other.peer: theirs.blob, copier.peer: theirs.blob}
    for banned in ({}, {"op-copier": "failed replay of round 0"}):
        named = await proposer.select(state(0), ROOT, own, candidates, fetched, {}, banned)
        assert copier.peer not in [x.peer for x in (*named[0], *named[1], *named[2])]
    agg = aggregate(
        state(0),
        [(x.peer, x.blob) for x in named[0]],
        lambda b: node.store.path(b).read_bytes(),
        PARAMS.outer_config(),
        start_root=ROOT,
    )
    await proposer.close(state(0), ROOT, named, agg, state_root(agg.state))
    tip = proposer.book.tip()
    assert tip is not None and sorted(tip.closure.present()) == sorted([me.peer, other.peer])


async def test_a_proposer_whose_score_leaves_out_everything_closes_the_round_empty(
    tmp_path: Path,
) -> None:
    """Every candidate scored worse, its own included: the closure includes nothing, names
    both workers as left out with the score's reason, meets the run's quorum (2 of 3), and
    its result is the state carried over. (It raised ``BadClosure: closure must include
    1..64 updates`` before, and so did every worker that took over.)"""
    me, other = machine("op-me"), machine("op-other")
    proposer, node = proposer_of(tmp_path, me, score=lambda *_: "the loss rose")
    own, _ = await proposer.commit(state(0), ROOT, trained(me, 0))
    theirs = candidate_of(node, other, 0)
    fetched = {me.peer: own.blob, other.peer: theirs.blob}
    named = await proposer.select(state(0), ROOT, own, {other.peer: theirs}, fetched, {}, {})
    included, left, passed = named
    assert included == () and passed == ()
    assert sorted((x.peer, x.reason) for x in left) == sorted(
        [(me.peer, "the loss rose"), (other.peer, "the loss rose")]
    )
    agg = aggregate(state(0), [], node.store.path, PARAMS.outer_config(), start_root=ROOT)
    await proposer.close(state(0), ROOT, named, agg, state_root(agg.state))
    tip = proposer.book.tip()
    assert tip is not None and tip.closure.included == ()
    assert dict(tip.named()) == {me.peer: "op-me", other.peer: "op-other"}
    assert tip.closure.result_root == state_root(OuterState(1, state(0).params, state(0).momentum))


async def test_a_worker_that_passes_is_named_and_counts(tmp_path: Path) -> None:
    """A worker whose trainer had nothing for the round announces a pass, not an update;
    its closure names it as passed, so one other update makes the quorum of 2."""
    me, other = machine("op-me"), machine("op-other")
    proposer, node = proposer_of(tmp_path, me)
    own, message = await proposer.commit_pass(state(0), ROOT)
    announced = decode_message(message)
    assert isinstance(announced, PassAnnouncement) and own.blob == ""
    theirs = candidate_of(node, other, 0)
    named = await proposer.select(
        state(0), ROOT, own, {other.peer: theirs}, {other.peer: theirs.blob}, {}, {}
    )
    assert [x.peer for x in named[0]] == [other.peer]
    assert [x.peer for x in named[2]] == [me.peer]
    entries = [(x.peer, x.blob) for x in named[0]]
    agg = aggregate(
        state(0),
        entries,
        lambda b: node.store.path(b).read_bytes(),
        PARAMS.outer_config(),
        start_root=ROOT,
    )
    await proposer.close(state(0), ROOT, named, agg, state_root(agg.state))
    tip = proposer.book.tip()
    assert tip is not None and [x.peer for x in tip.closure.passed] == [me.peer]


def test_a_quorum_above_k_is_refused_and_one_of_half_or_less_warned(tmp_path: Path) -> None:
    """``outer init --quorum``: more than K is the user's mistake (exit 2, nothing made);
    half of K or less is a documented choice the command warns about; a worker given
    the run's --spec takes the spec's quorum and refuses its own."""
    state = tmp_path / "state.safetensors"
    state.write_bytes(b"")
    argv = ["--store", str(tmp_path / "s"), "outer", "init", "--state", str(state), "--run", "r"]
    argv += ["--authority", "ab" * 32, "--workers", "4", "--inner-steps", "2"]
    done = blob_here([*argv, "--quorum", "5"], code=2)
    assert "--quorum" in done.stderr and "more than the run's 4 workers" in done.stderr
    assert not (tmp_path / "s").exists() or not Store.open(tmp_path / "s").tags()
    warned = blob_here([*argv, "--quorum", "2"])  # fails later: the state file is empty
    assert "warning: --quorum 2 is at most half of the run's 4 workers" in warned.stderr
    assert "fork" in warned.stderr
    cert = tmp_path / "machine.cert"
    cert.write_bytes(machine().cert.encode())
    worker = ["--store", str(tmp_path / "s"), "outer", "worker", "--spec", "x", "--cert"]
    done = blob_here([*worker, str(cert), "--quorum", "2"], code=2)
    assert "the run's quorum is its spec's" in done.stderr, done.stderr


def test_verify_takes_a_round_closed_without_updates(tmp_path: Path) -> None:
    """A round whose closure includes nothing (both updates left out, with the score's
    reason) meets a quorum of 2 and verifies: its result is the state carried over, its
    milestone names no update, and no verdict is due."""
    from tests.training.test_outer_evidence import NOW

    store = Store.open(tmp_path / "store")
    w = np.ones((4, 8), np.float32)
    state = OuterState(0, {"w": w}, {"w": np.zeros_like(w)})
    store.tag(tag(RUN, "start"), store.put_bytes(encode_state(state)))
    root = state_root(state)
    a, b = WORKERS[0], WORKERS[1]
    left = []
    for m in (a, b):
        blob = store.put_bytes(
            wrap_update(b"u" + m.peer.encode(), round_=0, start_root=root, author=m.peer)
        )
        attestation = sign_attestation(
            m.signer, kind=UPDATE_KIND, digest=bytes.fromhex(blob), kernel_class=EVIDENCE_KC,
            subjects=[blob, root, "c0" * 32], time=NOW, certificate=m.cert,
        )  # fmt: skip
        left.append(LeftOut(m.peer, blob, attestation.encode(), "the loss rose"))
    terms = RunTerms(rounds=1, replay_rate=0.0, outer_lr=0.7, outer_momentum=0.9, quorum=2)
    agg = aggregate(state, [], store.path, terms.outer(), start_root=root)  # type: ignore[arg-type]
    result = state_root(agg.state)
    closure = Closure(
        RUN, 0, root, a.peer, (), result, store.put_bytes(encode_state(agg.state)),
        tuple(sorted(left, key=lambda x: x.peer.encode())),
    )  # fmt: skip
    body, attestation = sign_closure(
        a.signer, closure, kernel_class=EVIDENCE_KC, certificate=a.cert, time=NOW
    )
    checked = check_closure(body, attestation, run=RUN, trust=TRUST, now=NOW, quorum=2)
    milestone = sign_milestone(
        a.signer, milestone_for(checked, agg, terms), kernel_class=EVIDENCE_KC,
        certificate=a.cert, time=NOW,
    )  # fmt: skip
    keep_round(
        store,
        checked,
        closure_blob=store.put_bytes(
            encode_message(ClosureAnnouncement(RUN, body, attestation, ()))
        ),
        milestone_blob=store.put_bytes(milestone),
    )
    report = verify_run(store, RUN, TRUST, quorum=2)
    assert report.ok, report.failures
    assert report.checked_rounds == [0]
    assert verify_run(store, RUN, TRUST, quorum=3).failures == [
        "the milestones sign a quorum of 2, the run's spec says 3"
    ]
