"""The server's budgets as one part (p2p.blob.server.ServingBudgets, theory rules 2 and 9),
sans-IO: what admits a stream, who is evicted for a light newcomer, and the send reserve.
bench/sim's servers decide with this part, so it must be the server's own rule."""

from __future__ import annotations

from pathlib import Path

from blobstore import Store
from p2p.blob.server import BlobServer, ServerLimits, ServingBudgets, StreamSlot

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
