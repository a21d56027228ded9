"""A worker's blob fetcher (training.outer.worker.fetcher), built without a worker, over a
real store: a held blob is not fetched, one fetch per blob at a time, a stalled attempt is
tried again and the fetch gives up at its bound, and who is asked for a closure's blobs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio
import trio.testing

from blobstore import Store, blob_id_of
from p2p.errors import FetchFailed
from training.outer.announce import PeerDialer
from training.outer.params import RunParams
from training.outer.worker.fetcher import FETCH_STALL, MAX_PROVIDERS, BlobFetcher, fetch_bound

PARAMS = RunParams("run-1", workers=3, rounds=2, inner_steps=1)
DATA = b"an update's bytes" * 100


class Node:
    """A node whose fetch puts ``DATA`` into its (real) store after ``behaviour``: each
    attempt takes the next of "ok", "fail" or "stall" (no progress, ever)."""

    def __init__(self, store: Store, *behaviour: str, delay: float = 1.0) -> None:
        self.store = store
        self.delay = delay
        self.behaviour = list(behaviour)
        self.attempts: list[list[str]] = []

    async def fetch(
        self, blob: str, *, providers: list[str], progress: Callable[[object], None], announce: bool
    ) -> None:
        self.attempts.append(providers)
        what = self.behaviour.pop(0) if self.behaviour else "ok"
        if what == "stall":
            await trio.sleep_forever()
        await trio.sleep(self.delay)
        if what == "fail":
            raise FetchFailed("no provider answered")
        progress(None)
        self.store.put_bytes(DATA)


def fetcher(
    tmp_path: Path, *behaviour: str, dialer: PeerDialer | None = None, delay: float = 1.0
) -> BlobFetcher:
    node = Node(Store.open(tmp_path / "store"), *behaviour, delay=delay)
    return BlobFetcher(node, PARAMS, dialer or PeerDialer(), "test")  # type: ignore[arg-type]


def attempts(f: BlobFetcher) -> list[list[str]]:
    node: Any = f.node
    return list(node.attempts)


def run(fn: Callable[[], Any]) -> Any:
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_held_blob_is_read_back_not_fetched(tmp_path: Path) -> None:
    f = fetcher(tmp_path)
    blob = f.node.store.put_bytes(DATA)

    async def main() -> bool:
        return await f.fetch(blob, ["/ip4/127.0.0.1/tcp/1"], 10.0)

    assert run(main) is True
    assert attempts(f) == []
    assert f.load(blob) == DATA
    assert f.author(blob) is None  # not an update blob


def test_one_fetch_per_blob_at_a_time(tmp_path: Path) -> None:
    """A second caller for a blob in flight waits for the first fetch (a second would find
    its partial blob locked) and finds the blob held. (On the real clock: the waiters
    look for the blob in a thread, which a virtual clock would jump past.)"""
    f = fetcher(tmp_path, delay=0.2)
    blob = blob_id_of([DATA])
    got: list[bool] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(lambda: _fetch(got))

    async def _fetch(out: list[bool]) -> None:
        out.append(await f.fetch(blob, ["a"], 10.0))

    trio.run(main)
    assert got == [True, True, True]
    assert len(attempts(f)) == 1
    assert f.inflight == {}


def test_a_stalled_or_failed_attempt_is_tried_again_until_the_bound(tmp_path: Path) -> None:
    """An attempt with no progress for FETCH_STALL is abandoned, a failed one retried; the
    fetch gives up (False) at its bound, not before."""
    f = fetcher(tmp_path, "fail", "stall", "ok")
    blob = blob_id_of([DATA])

    async def main() -> tuple[bool, float]:
        ok = await f.fetch(blob, ["a"], 3 * FETCH_STALL)
        return ok, trio.current_time()

    ok, when = run(main)
    assert ok and FETCH_STALL < when < 2 * FETCH_STALL
    assert len(attempts(f)) == 3

    g = fetcher(tmp_path / "g", *["stall"] * 10)

    async def never() -> tuple[bool, float]:
        ok = await g.fetch(blob, ["a"], 2.5 * FETCH_STALL)
        return ok, trio.current_time()

    assert run(never) == (False, 2.5 * FETCH_STALL)
    assert len(attempts(g)) == 3
    assert fetch_bound(PARAMS) == 3 * PARAMS.deadline + PARAMS.fetch_floor


def test_a_closures_blobs_are_asked_of_its_proposer_and_named_peers_first(
    tmp_path: Path,
) -> None:
    dialer = PeerDialer()
    for i in range(MAX_PROVIDERS + 5):
        dialer.learn(f"peer-{i}", [f"/p{i}/a", f"/p{i}/b"], float(i))
    f = fetcher(tmp_path, dialer=dialer)
    checked: Any = SimpleNamespace(digest=b"d" * 32)
    f.learn_closure(checked, ["/proposer"])
    out = f.providers(checked, ["peer-7"])
    assert out[:3] == ["/proposer", "/p7/a", "/p7/b"]
    assert len(out) == 3 + MAX_PROVIDERS - 1  # one address of each other worker, bounded
    assert len(set(out)) == len(out)
    assert f.everyone()[:2] == ["/p0/a", "/p1/a"]
