"""The send reserve kept for newcomers (p2p.blob.server, theory rule 9), sans-IO: the
budgets' bookkeeping, with no host and no clock.

Regression: in a flood of 64 identities x 16 unread 16 MiB `get`s, the identities whose
first `get`s came before their other streams held little send buffer yet and so took the
reserve; a newcomer's `get` was answered `busy` until those sends timed out (18 s), and
its fetch stalled that long.
"""

from __future__ import annotations

from pathlib import Path

from blobstore import Store
from p2p.blob.server import BlobServer, Budget, ServerLimits


def test_a_peer_heavy_in_another_budget_is_kept_from_the_reserve() -> None:
    budget = Budget("send buffers", 4, 4, 4, reserved=2, light_peer=2, light_ip=2)
    assert budget.acquire("filler", "a", 2) is None
    refused = budget.acquire("greedy", "b", 1, heavy="your peer holds 16 streams")
    assert refused is not None and "keeps its last 2" in refused and "16 streams" in refused
    assert budget.acquire("newcomer", "c", 1) is None


def test_a_peer_holding_many_streams_does_not_get_the_send_reserve(tmp_path: Path) -> None:
    limits = ServerLimits().with_(
        max_send_bytes=4,
        max_send_bytes_per_peer=4,
        max_send_bytes_per_ip=4,
        reserved_send_bytes=2,
        light_peer_send_bytes=2,
        light_ip_send_bytes=4,
        light_peer_streams=2,
        light_ip_streams=4,
    )
    server = BlobServer(Store.open(tmp_path / "store"), limits=limits)
    for _ in range(3):  # over light_peer_streams, from an address still under light_ip
        assert server.streams.acquire("greedy", "a", 1) is None
    assert server.streams.acquire("filler", "b", 1) is None
    assert server.streams.acquire("newcomer", "c", 1) is None
    with server._hold_send_bytes("filler", "b", 2) as refused:
        assert refused is None  # the unreserved part
        # The greedy identity holds no send buffer yet: light in that budget alone.
        with server._hold_send_bytes("greedy", "a", 1) as refused:
            assert refused is not None and "3 streams" in refused
        with server._hold_send_bytes("newcomer", "c", 2) as refused:
            assert refused is None
            assert server.send_bytes.used == 4
    # And from an address holding many streams, whatever the identity holds.
    for _ in range(2):
        assert server.streams.acquire("sybil", "a", 1) is None
    assert server.streams.heaviness("sybil", "a") == "your address holds 5 streams"
