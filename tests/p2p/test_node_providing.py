"""A node's provider records (p2p.node.providing), built without a node: which blobs are
due to be provided when (rules 1 and 2, on virtual time), and what a failed provide or
lookup does (rule 3: logged, never raised)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from blobstore import Store
from p2p.node.providing import NEW_BLOB_POLL, ProviderRecords, ReprovideSchedule, dht_key

INTERVAL = 3600.0


def test_each_blob_is_due_when_first_seen_then_every_interval() -> None:
    schedule = ReprovideSchedule(INTERVAL)
    assert schedule.due(["a", "b"], now=0.0) == ["a", "b"]
    assert schedule.due(["a", "b"], now=INTERVAL - 1) == []
    assert schedule.due(["a", "b", "c"], now=INTERVAL - 1) == ["c"]  # new: at once
    assert schedule.due(["a", "b", "c"], now=INTERVAL) == ["a", "b"]
    schedule.forget()  # the node's addresses changed
    assert schedule.due(["a", "b", "c"], now=INTERVAL + 1) == ["a", "b", "c"]


class Host:
    """What the part asks of a libp2p host: its own ID and a peerstore."""

    def __init__(self) -> None:
        self.added: list[tuple[Any, list[str]]] = []

    def get_id(self) -> str:
        return "self"

    def get_peerstore(self) -> Host:
        return self

    def add_addrs(self, peer: Any, addrs: list[str], ttl: int) -> None:
        self.added.append((peer, addrs))


class Info:
    def __init__(self, peer_id: str, addrs: list[str]) -> None:
        self.peer_id = peer_id
        self.addrs = addrs


class DHT:
    """Records what is provided, at what (virtual) time; fails where told to."""

    def __init__(self, failing: bool = False) -> None:
        self.failing = failing
        self.provided: list[tuple[str, float]] = []
        self.providers: list[Info] = []
        self.changed = trio.Event()

    async def provide(self, key: str) -> bool:
        if self.failing:
            raise OSError("no route")
        self.provided.append((key, trio.current_time()))
        self.changed.set()
        self.changed = trio.Event()
        return True

    async def find_providers(self, key: str, limit: int) -> list[Info]:
        if self.failing:
            raise OSError("no route")
        return self.providers[:limit]

    async def until_provided(self, count: int) -> None:
        with trio.fail_after(2 * NEW_BLOB_POLL):
            while len(self.provided) < count:
                await self.changed.wait()


@pytest.fixture
def virtual_clock() -> trio.testing.MockClock:
    """Virtual time that jumps only after a second of real idleness: the part lists the
    store in a thread, which a loaded machine may take a while to run."""
    return trio.testing.MockClock(autojump_threshold=1.0)


async def test_blobs_are_provided_at_start_when_they_arrive_and_again_when_asked(
    tmp_path: Path, virtual_clock: trio.abc.Clock
) -> None:
    store = Store.open(tmp_path / "s")
    first = store.put_bytes(b"first")
    dht = DHT()
    records = ProviderRecords(store, Host(), dht, reprovide_interval=INTERVAL)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(records.run)
        await dht.until_provided(1)
        assert dht.provided == [(dht_key(first), start)]
        later = store.put_bytes(b"put by another process")
        await dht.until_provided(2)
        assert dht.provided[1] == (dht_key(later), start + NEW_BLOB_POLL)
        asked = trio.current_time()
        records.provide_again()  # new addresses: everything again, at once
        await dht.until_provided(4)
        assert sorted(dht.provided[2:]) == sorted(
            [(dht_key(first), asked), (dht_key(later), asked)]
        )
        nursery.cancel_scope.cancel()


async def test_a_failed_provide_or_lookup_is_no_error(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s")
    records = ProviderRecords(store, Host(), DHT(failing=True), reprovide_interval=INTERVAL)
    assert await records.provide("ab" * 32) is False
    assert await records.find_providers("ab" * 32) == []
    without = ProviderRecords(store, Host(), None, reprovide_interval=INTERVAL)
    assert await without.provide("ab" * 32) is False
    await without.announce("ab" * 32)  # nothing to announce on


async def test_providers_found_are_named_once_without_ourselves_and_their_addresses_kept(
    tmp_path: Path,
) -> None:
    host, dht = Host(), DHT()
    dht.providers = [Info("self", ["/ip4/1.2.3.4/tcp/1"]), Info("p", ["/ip4/5.6.7.8/tcp/2"]),
                     Info("p", []), Info("q", [])]  # fmt: skip
    records = ProviderRecords(Store.open(tmp_path / "s"), host, dht, reprovide_interval=INTERVAL)
    assert await records.find_providers("ab" * 32) == ["p", "q"]
    assert host.added == [("p", ["/ip4/5.6.7.8/tcp/2"])]
