"""What a worker keeps of the rounds it adopted (training.outer.worker.keeper), built
without a worker, over a real store: a dead branch's records go, a round caught up over is
kept with a signed catch-up record and its state anchored, a joiner's first state is its
start, state tags beyond keep_states go, and the last two closures are held."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.training.worker_parts import KC, PARAMS, Node, close, machine, update
from training.outer.loop import OuterState
from training.outer.milestones import tag
from training.outer.runs import Retention
from training.outer.worker.keeper import Keeper
from training.outer.worker.records import RoundRecord
from training.outer.worker.signing import Signing

RUN = PARAMS.run_id


def roots(n: int) -> list[str]:
    return [f"{i:02x}" * 32 for i in range(n)]


def record(round_: int, start_root: str, root: str, state_blob: str = "") -> RoundRecord:
    return RoundRecord(round_, start_root, root, state_blob, "dd" * 32, "", "p", "caught up")


def test_adopting_another_chain_drops_the_dead_branchs_records(tmp_path: Path) -> None:
    me = machine()
    node: Any = Node(tmp_path / "store", me.peer)
    keeper = Keeper(PARAMS, node, Signing(me.signer, me.cert), Retention(3))
    r = roots(5)
    for i in range(3):
        keeper.record(record(i, r[i], r[i + 1]))
    keeper.record(record(2, r[2], r[4]))  # a better sibling of round 2: replaces it
    assert [x.root for x in keeper.records.values()] == [r[1], r[2], r[4]]
    keeper.record(record(2, r[3], r[4]))  # round 2 of another chain: rounds 0 and 1 went
    assert sorted(keeper.records) == [2]


async def test_rounds_caught_up_over_are_kept_and_old_states_deleted(tmp_path: Path) -> None:
    """Each round caught up over: its closure, a signed catch-up record and the adopted
    state anchored and tagged; with keep_states 1, the previous state's tag goes (its blob
    stays while its anchor holds it); a joiner's first state is tagged as its start."""
    me, other = machine(), machine()
    node = Node(tmp_path / "store", me.peer)
    n: Any = node
    signing = Signing(me.signer, me.cert)
    signing.kernel_class = KC
    keeper = Keeper(PARAMS, n, signing, Retention(1))
    r = roots(4)
    blobs = [node.store.put_bytes(f"state {i}".encode()) for i in range(4)]
    for i in range(3):
        checked = close(
            other, i, r[i], [update(other, i, r[i])], result=r[i + 1], state_blob=blobs[i + 1]
        )
        closure_blob = node.store.put_bytes(checked.body)
        rec = record(i, r[i], r[i + 1], blobs[i + 1])
        rec.closure_blob = closure_blob
        state = OuterState(i + 1, {"w": np.zeros(2, np.float32)}, {"w": np.zeros(2, np.float32)})
        keeper.record(rec)
        await keeper.keep(state, checked, None, rec, caught_up_from=None if i == 0 else i)
        keeper.adopt(checked)
        tags = node.store.tags()
        assert tags[tag(RUN, "state", i + 1)] == blobs[i + 1]
        assert tags[tag(RUN, "closure", i)] == closure_blob
        if i == 0:  # a joiner's first state: no catch-up record, its start
            assert tags[tag(RUN, "start")] == blobs[1]
            assert tag(RUN, "catchup", 0) not in tags
        else:
            assert tags[tag(RUN, "anchor", i + 1)] == blobs[i + 1]
            assert tag(RUN, "catchup", i) in tags
        assert tag(RUN, "state", i) not in tags  # keep_states 1: the tip only
    assert node.store.has(blobs[2])  # untagged, but round 1's catch-up anchors it
    assert sorted(keeper.adopted) == [1, 2]  # the last two rounds' closures
