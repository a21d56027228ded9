"""A worker's aggregates (training.outer.worker.aggregator), built without a worker: the
aggregate made ahead of a closure is taken when the closure names exactly its updates on
the same state, and computed afresh otherwise; one ahead a round, one at a time, and none
for a state the worker has moved on from."""

from __future__ import annotations

import numpy as np
import trio

from training.outer.aggregate import aggregate, rooted, wrap_update
from training.outer.codec import CodecParams, encode
from training.outer.loop import OuterConfig, OuterState
from training.outer.worker.aggregator import Aggregator
from training.outer.worker.signals import Tasks

CODEC = CodecParams(chunk=256, k=16)
CONFIG = OuterConfig(lr=0.7, momentum=0.9)
ROOT = "ab" * 32
PEERS = [f"12D3KooWpeer{i}" for i in range(3)]


def state(round_: int = 3) -> OuterState:
    params = {"w": np.random.default_rng(0).standard_normal(1024).astype(np.float32)}
    return OuterState(round_, params, {"w": np.zeros(1024, np.float32)})


def blobs(s: OuterState) -> dict[str, bytes]:
    """One honest update a peer: the blob IDs are made up, the bytes real."""
    shared = np.random.default_rng(1000).standard_normal(1024)
    out = {}
    for i, peer in enumerate(PEERS):
        own = np.random.default_rng(i).standard_normal(1024)
        grad = {"w": ((shared + own) * 1e-2).astype(np.float32)}
        out[f"{i:02x}" * 32] = wrap_update(
            encode(grad, CODEC), round_=s.round, start_root=ROOT, author=peer
        )
    return out


async def test_an_aggregate_ahead_is_taken_for_exactly_its_updates() -> None:
    s = state()
    held = blobs(s)
    loads: list[str] = []

    def load(blob: str) -> bytes:
        loads.append(blob)
        return held[blob]

    entries = [(p, b) for p, b in zip(PEERS, held, strict=True)]
    expected = rooted(aggregate(s, entries, load, CONFIG, start_root=ROOT))
    once = len(loads)  # what one aggregate reads
    loads.clear()
    tasks = Tasks()
    aggregator = Aggregator(CONFIG, load, tasks)
    aggregator.entered(s.round, ROOT)
    assert not aggregator.may_start_ahead(s.round, ROOT)  # the run's tasks do not start yet
    async with trio.open_nursery() as nursery:
        tasks.open(nursery)
        assert aggregator.may_start_ahead(s.round, ROOT)
        aggregator.start_ahead(s, ROOT, tuple(entries))
        assert not aggregator.may_start_ahead(s.round, ROOT)  # one a round
        agg, root, ahead = await aggregator.aggregate(s, ROOT, list(reversed(entries)))
    assert ahead and root == expected[1]
    assert agg.state.params["w"].tobytes() == expected[0].state.params["w"].tobytes()
    assert len(loads) == once  # not aggregated twice
    assert not aggregator.may_start_ahead(s.round, ROOT)  # still one a round

    # The next round: a closure naming other updates than those aggregated ahead is
    # computed afresh.
    s4 = state(4)
    held.update(blobs(s4))
    entries4 = [(p, b) for p, b in zip(PEERS, blobs(s4), strict=True)]
    two = rooted(aggregate(s4, entries4[:2], held.__getitem__, CONFIG, start_root=ROOT))
    aggregator.entered(s4.round, ROOT)
    async with trio.open_nursery() as nursery:
        tasks.open(nursery)
        assert aggregator.may_start_ahead(s4.round, ROOT)
        aggregator.start_ahead(s4, ROOT, tuple(entries4))
        agg, root, ahead = await aggregator.aggregate(s4, ROOT, entries4[:2])
    assert not ahead and root == two[1]


async def test_an_aggregate_ahead_for_a_state_moved_on_from_is_for_nobody() -> None:
    s = state()
    held = blobs(s)
    entries = tuple((p, b) for p, b in zip(PEERS, held, strict=True))
    tasks = Tasks()
    started = trio.Event()
    release = trio.Event()

    def load(blob: str) -> bytes:
        trio.from_thread.run_sync(started.set)
        trio.from_thread.run(release.wait)
        return held[blob]

    aggregator = Aggregator(CONFIG, load, tasks)
    aggregator.entered(s.round, ROOT)
    async with trio.open_nursery() as nursery:
        tasks.open(nursery)
        aggregator.start_ahead(s, ROOT, entries)
        await started.wait()
        assert not aggregator.may_start_ahead(s.round + 1, "cd" * 32)  # one at a time
        aggregator.entered(s.round + 1, "cd" * 32)  # the state moved on meanwhile
        release.set()
    ahead = aggregator.ahead
    assert ahead is not None and ahead.done.is_set() and ahead.result is None
    assert aggregator.may_start_ahead(s.round + 1, "cd" * 32)
