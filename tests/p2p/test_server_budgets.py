"""The server's budgets as one part (p2p.blob.server.ServingBudgets, theory rules 2 and 9),
sans-IO: what admits a stream, who is evicted for a light newcomer, and the send reserve.
bench/sim's servers decide with this part, so it must be the server's own rule."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from blobstore import Store
from p2p.blob.server import BlobServer, IdleStreams, ServerLimits, ServingBudgets, StreamSlot

LIMITS = ServerLimits().with_(
    max_streams=4,
    max_streams_per_peer=4,
    max_streams_per_ip=4,
    reserved_streams=1,
    light_peer_streams=1,
    light_ip_streams=1,
)


def test_a_light_newcomer_evicts_the_longest_idle_stream_of_the_heaviest_holder() -> None:
    budgets = ServingBudgets(LIMITS)
    evicted: list[StreamSlot] = []
    slots = [StreamSlot("greedy", "a") for _ in range(3)]
    for k, slot in enumerate(slots):
        assert budgets.admit(slot.peer, slot.ip, lambda w: None) is None
        budgets.idle.wait(slot, float(k), lambda slot=slot: evicted.append(slot))
    assert budgets.admit("other", "b", lambda w: None) is None  # the reserve: light
    assert budgets.streams.used == 4

    def evict(victim: object) -> None:
        waiting = victim
        budgets.streams.release(waiting.slot.peer, waiting.slot.ip, 1)  # type: ignore[attr-defined]
        waiting.evict()  # type: ignore[attr-defined]

    assert budgets.admit("newcomer", "c", evict) is None
    assert evicted == [slots[0]]  # idle longest, of the address holding the most
    # A heavy peer gets no slot by eviction: only the light may take one.
    refused = budgets.admit("greedy", "a", evict)
    assert refused is not None and evicted == [slots[0]]


def test_the_server_decides_with_its_budgets_part(tmp_path: Path) -> None:
    server = BlobServer(Store.open(tmp_path / "store"), limits=LIMITS)
    assert server.streams is server.budgets.streams
    assert server.send_bytes is server.budgets.send_bytes
    assert server.idle is server.budgets.idle
    with server.budgets.hold_send("peer", "a", 1) as refused:
        assert refused is None and server.send_bytes.used == 1
    assert server.send_bytes.used == 0


def _reference_victim(
    idle: IdleStreams, by_ip: Counter[str], by_peer: Counter[str], ip: str, peer: str
) -> object | None:
    """Rule 9 as first written: for each holder, most streams first, scan every waiting
    stream (O(holders x waiting) per newcomer)."""
    for holdings, mine, by_address in ((by_ip, ip, True), (by_peer, peer, False)):
        floor = holdings[mine] + 1
        for key in sorted(holdings, key=holdings.__getitem__, reverse=True):
            if holdings[key] <= floor:
                break
            waiting = [
                (w.since, k)
                for k, w in idle.waiting.items()
                if (w.slot.ip if by_address else w.slot.peer) == key
            ]
            if waiting:
                return idle.waiting[min(waiting)[1]]
    return None


@pytest.mark.parametrize("seed", range(20))
def test_the_indexed_eviction_picks_the_streams_the_rule_names(seed: int) -> None:
    """The eviction looks only at holders with idle streams (a seeder shared by a
    thousand simulated fetchers spent ~12 ms a newcomer scanning every waiting stream for
    every holder); it must pick exactly the stream rule 9 names, ties included."""
    rng = random.Random(seed)
    idle = IdleStreams()
    by_ip: Counter[str] = Counter()
    by_peer: Counter[str] = Counter()
    slots = []
    for _ in range(rng.randint(1, 60)):
        slot = StreamSlot(f"p{rng.randint(0, 9)}", f"a{rng.randint(0, 5)}")
        by_ip[slot.ip] += 1
        by_peer[slot.peer] += 1
        slots.append(slot)
        if rng.random() < 0.6:
            idle.wait(slot, float(rng.randint(0, 5)), lambda: None)
    for slot in rng.sample(slots, len(slots) // 4):
        idle.working(slot)
    ip, peer = f"a{rng.randint(0, 7)}", f"p{rng.randint(0, 12)}"
    expected = _reference_victim(idle, by_ip, by_peer, ip, peer)
    got = idle.victim(by_ip, by_peer, ip, peer)
    assert got is expected
    if got is not None:  # and the next one, with that stream gone from the waiting
        expected = _reference_victim(idle, by_ip, by_peer, ip, peer)
        assert idle.victim(by_ip, by_peer, ip, peer) is expected
