"""The closures a worker hears (training.outer.worker.closures), built without a worker:
only a proposer's own copy counts, refused ones are listed (bounded), a compact closure is
expanded from the attestations held or fetched whole and must match, and a closure marked
bad is no tip."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import trio

from tests.training.worker_parts import PARAMS, TRUST, Node, close, machine, update
from training.outer.agreement import ClosureBook, compact_body
from training.outer.announce import PeerDialer
from training.outer.messages import (
    ClosureAnnouncement,
    ClosureHeard,
    ClosureRefAnnouncement,
    ClosureRefHeard,
    encode_message,
)
from training.outer.worker.closures import MAX_ATTESTATIONS, MAX_REFUSED, Closures
from training.outer.worker.fetcher import BlobFetcher
from training.outer.worker.signals import Changes, Tasks

ROOT = "cd" * 32
ADDRS = ("/ip4/127.0.0.1/tcp/4001",)


def closures_of(tmp_path: Path) -> tuple[Closures, Tasks, Node]:
    me = machine()
    node = Node(tmp_path / "store", me.peer)
    n: Any = node
    fetcher = BlobFetcher(n, PARAMS, PeerDialer(), "test")
    tasks = Tasks()
    closures = Closures(
        PARAMS.run_id,
        TRUST,
        ClosureBook(),
        fetcher,
        Changes(),
        tasks,
        quorum=1,
        require_hardware=False,
        label="test",
    )
    return closures, tasks, node


async def test_only_the_proposers_own_copy_of_a_closure_counts(tmp_path: Path) -> None:
    closures, _, _ = closures_of(tmp_path)
    a, b = machine(), machine()
    checked = close(a, 0, ROOT, [update(a, 0, ROOT), update(b, 0, ROOT)])
    relayed = ClosureHeard(b.peer, checked.body, checked.attestation, ("/relayed",))
    closures.hear(relayed, time.time())
    assert closures.book.tip() is None
    closures.hear(ClosureHeard(a.peer, checked.body, checked.attestation, ADDRS), time.time())
    assert closures.book.tip() == checked
    assert closures.fetcher.providers(checked)[0] == ADDRS[0]  # its proposer first
    assert closures.refused == []


async def test_refused_closures_are_listed_at_most_max_refused(tmp_path: Path) -> None:
    closures, _, _ = closures_of(tmp_path)
    a = machine()
    other_run = close(a, 0, ROOT, [update(a, 0, ROOT)], run="run-2")
    for _ in range(MAX_REFUSED + 5):
        closures.hear(
            ClosureHeard(a.peer, other_run.body, other_run.attestation, ADDRS), time.time()
        )
    assert len(closures.refused) == MAX_REFUSED
    assert closures.refused[0]["peer"] == a.peer
    assert closures.book.tip() is None


async def test_a_compact_closure_is_expanded_from_held_attestations_or_fetched_whole(
    tmp_path: Path,
) -> None:
    """With every named update's attestation held, a compact closure is the signed one;
    with one missing, the full closure blob is fetched (here: held already) and heard only
    if it is the closure announced."""
    closures, _, node = closures_of(tmp_path)
    a, b = machine(), machine()
    updates = [update(a, 0, ROOT), update(b, 0, ROOT)]
    checked = close(a, 0, ROOT, updates)
    full = encode_message(ClosureAnnouncement(PARAMS.run_id, checked.body, checked.attestation, ()))
    blob = node.store.put_bytes(full)
    compact = ClosureRefAnnouncement(
        PARAMS.run_id, compact_body(checked.body), checked.attestation, blob, ADDRS
    )
    for x in updates:
        closures.keep_attestation(0, x.peer, x.blob, x.attestation)
    closures.hear_compact(ClosureRefHeard(a.peer, compact), time.time())
    assert closures.book.tip() == checked

    fetched, fetched_tasks, fetched_node = closures_of(tmp_path / "2")
    blob = fetched_node.store.put_bytes(full)
    another = close(a, 0, ROOT, updates[:1])  # a closure, not the one announced
    wrong = fetched_node.store.put_bytes(
        encode_message(ClosureAnnouncement(PARAMS.run_id, another.body, another.attestation, ()))
    )

    async def hear(blob: str) -> None:
        async with trio.open_nursery() as nursery:
            fetched_tasks.open(nursery)
            message = ClosureRefAnnouncement(
                PARAMS.run_id, compact_body(checked.body), checked.attestation, blob, ADDRS
            )
            fetched.hear_compact(ClosureRefHeard(a.peer, message), time.time())
            assert fetched.fetching == {blob}

    await hear(wrong)
    assert fetched.book.tip() is None
    await hear(blob)
    assert fetched.book.tip() == checked
    assert fetched.fetching == set()


def test_attestations_are_kept_for_the_rounds_a_closure_may_still_name(tmp_path: Path) -> None:
    closures, _, _ = closures_of(tmp_path)
    for i in range(MAX_ATTESTATIONS):
        closures.keep_attestation(i % 3, f"peer-{i}", "b", b"x")
    closures.keep_attestation(3, "late", "b", b"y")  # at the bound: rounds before 2 go
    assert len(closures.attestations) < MAX_ATTESTATIONS
    assert {r for r, _ in closures.attestations.values()} == {2, 3}


async def test_a_closure_marked_bad_is_no_tip_and_is_listed(tmp_path: Path) -> None:
    closures, _, _ = closures_of(tmp_path)
    a = machine()
    checked = close(a, 0, ROOT, [update(a, 0, ROOT)])
    closures.hear(ClosureHeard(a.peer, checked.body, checked.attestation, ADDRS), time.time())
    closures.mark_bad(checked, "result root mismatch")
    assert closures.book.tip() is None
    assert closures.refused == [{"peer": a.peer, "round": 0, "reason": "result root mismatch"}]
    closures.hear(ClosureHeard(a.peer, checked.body, checked.attestation, ADDRS), time.time())
    assert closures.book.tip() is None  # heard again: still no tip
