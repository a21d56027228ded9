"""`Availability`, the scheduler's chunk part, built on its own: chunk states, rarity,
claims, the swarm partition and the hand-out heaps (no `Scheduler`, no peers' requests)."""

from __future__ import annotations

import pytest

from p2p.fetch.sched_availability import Availability
from p2p.fetch.sched_records import (
    _INFLIGHT,
    _POOL,
    _VERIFIED,
    SchedulerConfig,
    _chunk_hashes,
    _Peer,
    bitmap_of,
)

N = 8


def length(index: int) -> int:
    return 1000 + index  # unequal lengths catch a mix-up of index and size


def partial(name: str, held: set[int], soon: set[int] | None = None) -> _Peer:
    p = _Peer(name, bytearray(bitmap_of(held, N)))
    if soon is not None:
        p.soon = bytearray(bitmap_of(soon, N))
        p.soon_count = len(soon)
    return p


def chunks_with(
    *peers: _Peer, config: SchedulerConfig | None = None, own: str = ""
) -> Availability:
    chunks = Availability(N, length, config=config or SchedulerConfig(), own=own)
    for p in peers:
        chunks.contribute(p, +1)
    chunks.refresh()
    return chunks


def test_rarest_chunks_are_handed_out_first_then_by_index() -> None:
    a = partial("a", {0, 1, 2, 3})
    b = partial("b", {2, 3})
    chunks = chunks_with(a, b)
    assert chunks.rarity == [1, 1, 2, 2, 0, 0, 0, 0]
    assert chunks.orphans == 4
    chunks.check_invariants([a, b], {})
    assert chunks.pick(chunks.full_heap, None, N, None) == [4, 5, 6, 7, 0, 1, 2, 3]


def test_a_partial_peers_heap_holds_only_its_chunks() -> None:
    a = partial("a", {1, 5})
    chunks = chunks_with(a)
    assert chunks.pick(a.heap, a.bitmap, N, None) == [1, 5]


def test_after_rank_leaves_held_chunks_to_their_holders() -> None:
    a = partial("a", {0, 1})
    chunks = chunks_with(a)
    assert chunks.pick(chunks.full_heap, None, N, after_rank=1) == [2, 3, 4, 5, 6, 7]


def test_a_claimed_chunk_goes_after_unclaimed_ones_of_equal_rarity() -> None:
    a = partial("a", {0}, soon={1})
    chunks = chunks_with(a)
    assert chunks.claims[1] == 1
    assert chunks.pick(chunks.full_heap, None, 3, None) == [2, 3, 4]
    assert chunks.pick(chunks.full_heap, None, N, None) == [5, 6, 7, 1, 0]


def test_ranges_are_capped() -> None:
    chunks = Availability(N, length, config=SchedulerConfig(max_ranges_per_request=2))
    a = partial("a", {0, 2, 4, 6})
    chunks.contribute(a, +1)
    chunks.refresh()
    assert chunks.pick(a.heap, a.bitmap, N, None) == [0, 2]


def test_take_release_and_verify_keep_the_counts() -> None:
    chunks = chunks_with()
    assert chunks.take([0, 1, 2], rid=1) == length(0) + length(1) + length(2)
    assert chunks.take([2], rid=2) == length(2)  # an endgame copy
    assert chunks.pool_count == N - 3
    assert chunks.inflight == {0: {1}, 1: {1}, 2: {1, 2}}
    assert chunks.verify(0) is True
    assert chunks.verify(0) is False
    # Request 1 ends owing 1 and 2: chunk 1 goes back to the pool, 2 is still owed by 2.
    assert chunks.release(1, {1, 2}) == length(1) + length(2)
    assert chunks.state[1] == _POOL and chunks.state[2] == _INFLIGHT
    assert chunks.state[0] == _VERIFIED
    assert chunks.fetchable_pool() == 0  # nobody holds anything
    assert chunks.orphans == chunks.pool_count == N - 2
    chunks.check_invariants([], {2: {2}})
    full = _Peer("f", None)
    chunks.contribute(full, +1)
    assert chunks.fetchable_pool() == N - 2
    assert 1 in chunks.pick(chunks.full_heap, None, N, None)


def test_verified_chunks_are_never_in_a_heap() -> None:
    chunks = Availability(N, length, verified=[1, 3])
    chunks.contribute(_Peer("f", None), +1)
    assert chunks.verified_count == 2
    assert chunks.verify(1) is False  # verified before this download started
    assert chunks.verify(2) is True  # late data of a released request: in the heap still
    assert chunks.pick(chunks.full_heap, None, N, None) == [0, 4, 5, 6, 7]


def test_a_full_peer_that_lacks_chunks_becomes_partial() -> None:
    full = _Peer("f", None)
    chunks = chunks_with(full)
    assert chunks.full_usable == 1
    chunks.forget_chunks(full, {3})
    assert full.bitmap is not None and not full.holds(3)
    assert chunks.full_usable == 0 and chunks.partials == {"f": full}
    chunks.refresh()
    chunks.check_invariants([full], {})
    assert 3 not in chunks.pick(full.heap, full.bitmap, N, None)


def test_a_small_bitmap_change_updates_the_heaps_in_place() -> None:
    a = partial("a", {0})
    chunks = chunks_with(a)
    new = chunks.parse_bitmap(bitmap_of({0, 6}, N))
    chunks.replace_bitmap(a, new)
    assert not chunks.dirty  # applied per chunk, no rebuild
    assert chunks.rarity[6] == 1
    chunks.check_invariants([a], {})  # chunk 6 is in a's heap
    assert chunks.pick(a.heap, a.bitmap, N, None) == [0, 6]


def test_parse_bitmap_rejects_the_wrong_length_and_sees_a_full_one() -> None:
    chunks = chunks_with()
    with pytest.raises(ValueError, match="protocol error"):
        chunks.parse_bitmap(b"\xff\xff")
    assert chunks.parse_bitmap(b"\xff") is None  # holds everything
    assert chunks.parse_soon(b"\x0f", bytearray(b"\x03")) == bytearray(b"\x0c")


def test_the_swarm_partition_leaves_a_fellows_share_to_it() -> None:
    config = SchedulerConfig(defer_to_partial_holders=True)
    fellow = partial("b", set(), soon={0})  # fetching, holds nothing yet
    chunks = chunks_with(fellow, config=config, own="me")
    mine, theirs = _chunk_hashes("me", N), _chunk_hashes("b", N)
    fellows = [i for i in range(N) if theirs[i] > mine[i] and i != 0]
    own = [i for i in range(1, N) if i not in fellows]
    assert fellows and own  # the names split these 8 chunks both ways
    # Chunk 0 is claimed; the fellow's share counts as claimed: both go after this
    # fetcher's own share.
    picked = chunks.pick(chunks.full_heap, None, N, None)
    assert picked[: len(own)] == own
    assert sorted(picked[len(own) :]) == sorted([0, *fellows])
