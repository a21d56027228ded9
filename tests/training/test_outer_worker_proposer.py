"""This worker's updates and closures (training.outer.worker.proposer), built without a
worker, over a real store: an update is stored with its inner state and a commitment
naming both, attested, and old inner states deleted; a closure names one blob and one
operator once, no excluded operator and none its score refuses, each left out with its
reason; the closure is checked, held in the book, announced compact, and its aggregate
kept until taken or moot."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from identity import Attestation
from p2p.transport.meter import WireMeter
from tests.training.worker_parts import KC, PARAMS, TRUST, Machine, Node, config, machine
from training.outer.aggregate import wrap_update
from training.outer.agreement import ClosureBook
from training.outer.announce import Announcer, PeerDialer
from training.outer.loop import OuterState
from training.outer.messages import (
    Candidate,
    ClosureRefAnnouncement,
    UpdateAnnouncement,
    decode_message,
)
from training.outer.replay import decode_commitment
from training.outer.runs import Retention
from training.outer.trainer import Trained
from training.outer.worker.fetcher import BlobFetcher
from training.outer.worker.links import Links
from training.outer.worker.proposer import Proposer
from training.outer.worker.signals import Changes
from training.outer.worker.signing import Signing

ROOT = "ab" * 32


def proposer_of(tmp_path: Path, me: Machine, **changes: Any) -> tuple[Proposer, Node]:
    node = Node(tmp_path / "store", me.peer)
    n: Any = node
    cfg = config(tmp_path, keep_states=1, **changes)
    dialer = PeerDialer()
    fetcher = BlobFetcher(n, PARAMS, dialer, "test")
    links = Links(
        n, "topic", Announcer(), dialer, WireMeter(), Changes(), alone_bound=1.0, label="test"
    )
    signing = Signing(me.signer, me.cert)
    signing.kernel_class = KC
    proposer = Proposer(
        cfg, n, TRUST, ClosureBook(), fetcher, links, signing, Retention(1), label="test"
    )
    return proposer, node


def state(round_: int) -> OuterState:
    w = np.full(4, round_, np.float32)
    return OuterState(round_, {"w": w}, {"w": np.zeros(4, np.float32)})


def trained(me: Machine, round_: int) -> Trained:
    update = wrap_update(b"payload %d" % round_, round_=round_, start_root=ROOT, author=me.peer)
    rows = np.arange(PARAMS.inner_steps * PARAMS.batch, dtype=np.int64)
    return Trained(update, [1.0] * PARAMS.inner_steps, rows, b"inner %d" % round_, b"after")


async def test_an_update_is_stored_committed_and_attested(tmp_path: Path) -> None:
    me = machine()
    proposer, node = proposer_of(tmp_path, me)
    own, message = await proposer.commit(state(0), ROOT, trained(me, 0))
    announcement = decode_message(message)
    assert isinstance(announcement, UpdateAnnouncement)
    assert (announcement.round, announcement.blob) == (0, own.blob)
    blob, root, commitment = Attestation.decode(own.attestation).subjects
    assert (blob, root) == (own.blob, ROOT)
    c = decode_commitment(node.store.path(commitment).read_bytes())
    assert (c.update, c.author, c.round) == (own.blob, me.peer, 0)
    assert node.store.path(c.inner).read_bytes() == b"inner 0"
    own1, _ = await proposer.commit(state(1), ROOT, trained(me, 1))
    assert not node.store.has(c.inner)  # keep_states 1: round 0's inner state went
    assert own1.round == 1


async def test_a_closure_names_one_blob_and_one_operator_once(tmp_path: Path) -> None:
    me = machine("op-me")

    def refuse_f(state: Any, root: str, peer: str, data: bytes) -> str:
        return "scored too low" if peer == "peer-f" else ""

    proposer, node = proposer_of(tmp_path, me, score=refuse_f)
    own, _ = await proposer.commit(state(0), ROOT, trained(me, 0))

    def blob(author: str, tag: bytes = b"") -> str:
        data = wrap_update(b"x" + tag + author.encode(), round_=0, start_root=ROOT, author=author)
        return node.store.put_bytes(data)

    candidates = {
        "peer-a": Candidate(0, "peer-a", blob("peer-a"), (), "op-a"),
        "peer-b": Candidate(0, "peer-b", blob("peer-b"), (), "op-a"),  # op-a's second key
        "peer-c": Candidate(0, "peer-c", blob("peer-a"), (), "op-c"),  # a copy of a's blob
        "peer-d": Candidate(0, "peer-d", blob("peer-d"), (), "op-d"),  # excluded
        "peer-e": Candidate(0, "peer-e", blob("peer-a", b"2"), (), "op-e"),  # a's, renamed
        "peer-f": Candidate(0, "peer-f", blob("peer-f"), (), "op-f"),  # scored out
        "peer-g": Candidate(0, "peer-g", blob("peer-g"), (), "op-g"),
        "peer-h": Candidate(0, "peer-h", blob("peer-h"), (), "op-h"),  # fetched another
    }
    fetched = {p: c.blob for p, c in candidates.items()}
    fetched["peer-h"] = blob("peer-h", b"other")
    banned = {"op-d": "failed replay of round 0"}
    included, left, passed = await proposer.select(
        state(0), ROOT, own, candidates, fetched, {}, banned
    )
    assert sorted(x.peer for x in included) == sorted([me.peer, "peer-a", "peer-g"])
    assert [(r["peer"], r["reason"]) for r in proposer.refused] == [
        ("peer-b", "one operator twice"),
        ("peer-c", "a copy (blob already named)"),
        ("peer-d", "failed replay of round 0"),
        ("peer-e", "a copy (the blob's envelope names another author)"),
        ("peer-f", "scored too low"),
    ]
    # Each left out is named with its reason (its author was present: the quorum counts
    # it), an operator's second key not at all; one not fetched is left out too.
    # A copy of a blob the closure names otherwise is not named at all.
    assert [(x.peer, x.reason) for x in left] == [
        ("peer-d", "failed replay of round 0"),
        ("peer-e", "a copy (the blob's envelope names another author)"),
        ("peer-f", "scored too low"),
        ("peer-h", "not fetched in time"),
    ]
    assert passed == ()


async def test_a_closure_is_held_announced_compact_and_its_aggregate_kept(
    tmp_path: Path,
) -> None:
    me = machine()
    alone = dataclasses.replace(PARAMS, quorum=1)  # a run whose quorum one worker meets
    proposer, node = proposer_of(tmp_path, me, params=alone)
    own, _ = await proposer.commit(state(0), ROOT, trained(me, 0))
    named = await proposer.select(state(0), ROOT, own, {}, {me.peer: own.blob}, {}, {})
    assert [x.peer for x in named[0]] == [me.peer]
    agg: Any = dataclasses.make_dataclass("Agg", ["state"])(state(1))
    await proposer.close(state(0), ROOT, named, agg, "cd" * 32)
    tip = proposer.book.tip()
    assert tip is not None and tip.closure.proposer == me.peer
    assert node.store.has(tip.closure.state_blob)  # stored after the closure went out
    (announced,) = [decode_message(m) for m in node.published]
    assert isinstance(announced, ClosureRefAnnouncement)
    assert node.store.has(announced.full)  # the full closure, for whoever cannot expand it
    assert proposer.fetcher.providers(tip)[0] == node.reachable_addrs[0]
    proposer.entered(0)  # still round 0's state: the closure may win
    taken = proposer.taken(tip.digest)
    assert taken is not None and taken[1] == tip.closure.state_blob
    assert proposer.taken(tip.digest) is None  # once
    await proposer.close(state(0), ROOT, named, agg, "ee" * 32)
    proposer.entered(1)  # another closure's round-1 state: ours of round 0 lost
    assert proposer.proposed == {}
