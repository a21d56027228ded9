"""Chunk availability for :mod:`p2p.fetch.scheduler`: each chunk's state, its rarity
among usable partial peers, the claims of peers fetching it, the swarm partition and the
min-heaps pool chunks are handed out from (its "Rarest first", "Swarm partition" and
"Cost" sections).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from p2p.fetch.sched_records import (
    _POOL,
    _VERIFIED,
    MAX_PARTITION_CHUNKS,
    SchedulerConfig,
    _chunk_hashes,
    _Peer,
    _Request,
    _set_bits,
    bitmap_of,
)


class Availability:
    """Chunk state, rarity, claims and the hand-out heaps of one download."""

    def __init__(
        self,
        num_chunks: int,
        chunk_length: Callable[[int], int],
        verified: Iterable[int] = (),
        config: SchedulerConfig = SchedulerConfig(),  # noqa: B008 (frozen: safe to share)
        start: int = 0,
        own: str = "",
    ) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must not be negative, not {num_chunks}")
        self._n = num_chunks
        self._stride = max(num_chunks, 1)
        # Equal rarity goes by index counted from `start` (wrapping): fetchers of one blob
        # that start at different chunks take different chunks from a sole seeder first.
        self._start = start % self._stride
        self._chunk_length = chunk_length
        self._cfg = config
        self._state = bytearray(num_chunks)  # all _POOL
        self._rarity = [0] * num_chunks
        # Usable partial peers that claim each chunk (they said it is soon theirs).
        self._claims = [0] * num_chunks
        # The swarm partition: this fetcher's weights, and the chunks (bitmap) that
        # belong to a fetching fellow, recomputed at each rebuild.
        self._own_weights: list[int] | None = (
            _chunk_hashes(own, num_chunks)
            if own and config.defer_to_partial_holders and num_chunks <= MAX_PARTITION_CHUNKS
            else None
        )
        self._elsewhere = bytes((num_chunks + 7) // 8)
        self._verified_count = 0
        for i in verified:
            self._check_index(i)
            if self._state[i] != _VERIFIED:
                self._state[i] = _VERIFIED
                self._verified_count += 1
        self._pool_count = num_chunks - self._verified_count
        # Pool chunks with no usable partial holder (rarity 0): fetchable only from a peer
        # that has everything.
        self._orphans = self._pool_count
        self._full_usable = 0
        # Keys are rarity * stride + position (index counted from `start`); every rarity
        # is 0 here, so the sorted positions of pool chunks are already a heap.
        self._full_heap = sorted(self._pos(i) for i in range(num_chunks) if self._state[i] == _POOL)
        self._dirty = False
        self._pushes = 0  # heap entries pushed since the last rebuild
        self._inflight: dict[int, set[int]] = {}  # chunk -> live request ids still owing it
        self._requests: dict[int, _Request] = {}
        self._request_peer: dict[int, str] = {}  # every id ever issued -> its peer
        self._deadlines: list[tuple[float, int]] = []
        self._overdue: set[int] = set()
        self._next_id = 1
        self._peers: dict[str, _Peer] = {}
        self._partials: dict[str, _Peer] = {}  # usable peers with a partial bitmap
        # The usable peers, their rates and the best rate, until one changes (Picking).
        self._rates: tuple[list[_Peer], list[float], float] | None = None

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self._n:
            raise ValueError(f"chunk index {i} out of range 0..{self._n - 1}")

    def _parse_bitmap(self, bitmap: bytes | None) -> bytearray | None:
        if bitmap is None:
            return None
        n = self._n
        if len(bitmap) != (n + 7) // 8:
            raise ValueError(
                f"have-bitmap is {len(bitmap)} bytes, a blob of {n} chunks needs "
                f"{(n + 7) // 8} (a peer sending it is a protocol error)"
            )
        bm = bytearray(bitmap)
        if n & 7:
            bm[-1] &= (1 << (n & 7)) - 1
        if int.from_bytes(bm, "little").bit_count() == n:
            return None  # holds everything: share the full heap
        return bm

    def _parse_soon(self, soon: bytes | None, bitmap: bytearray | None) -> bytearray | None:
        """A peer's soon-bitmap, less what it holds; None when it claims nothing."""
        if soon is None or bitmap is None:
            return None  # a peer with every chunk claims none
        claims = self._parse_bitmap(soon)
        if claims is None:
            claims = bytearray(b"\xff" * len(bitmap))
            if self._n & 7:
                claims[-1] = (1 << (self._n & 7)) - 1
        held = int.from_bytes(bitmap, "little")
        bits = int.from_bytes(claims, "little") & ~held
        if not bits:
            return None
        return bytearray(bits.to_bytes(len(bitmap), "little"))

    def _set_soon_unused(self, p: _Peer, claims: bytearray | None) -> None:
        """Set the claims of a peer whose holdings count nowhere (not usable yet)."""
        p.soon = claims
        p.soon_count = 0 if claims is None else int.from_bytes(claims, "little").bit_count()

    def _replace_soon(self, p: _Peer, new: bytearray | None) -> None:
        if not p.usable or p.bitmap is None:
            self._set_soon_unused(p, new if p.bitmap is not None else None)
            return
        old = int.from_bytes(p.soon, "little") if p.soon is not None else 0
        now = int.from_bytes(new, "little") if new is not None else 0
        diff = old ^ now
        fetching = p.soon_count > 0
        self._set_soon_unused(p, new)
        if self._own_weights is not None and fetching != (p.soon_count > 0):
            self._dirty = True  # it joins or leaves the partition
        claims = self._claims
        state = self._state
        while diff:
            low = diff & -diff
            i = low.bit_length() - 1
            diff ^= low
            before = claims[i]
            claims[i] = before + (1 if now & low else -1)
            if state[i] == _POOL and (before == 0) != (claims[i] == 0):
                self._offer(i)

    def _contribute(self, p: _Peer, sign: int) -> None:
        """Add (+1) or remove (-1) a usable peer's holdings from the rarity counts (and a
        partial peer's claims from the claim counts)."""
        self._rates = None  # the usable peers change
        bm = p.bitmap
        if bm is None:
            self._full_usable += sign
            return
        if p.soon is not None:
            claims = self._claims
            for i in _set_bits(p.soon):
                claims[i] += sign
        if sign > 0:
            self._partials[p.name] = p
        else:
            self._partials.pop(p.name, None)
            p.heap = []
        rarity = self._rarity
        state = self._state
        orphans = 0
        for i in _set_bits(bm):
            r = rarity[i]
            rarity[i] = r + sign
            if state[i] == _POOL and (r == 0 or r + sign == 0):
                orphans -= sign
        self._orphans += orphans
        self._dirty = True

    def _replace_bitmap(self, p: _Peer, new: bytearray | None) -> None:
        old = p.bitmap
        if not p.usable:
            p.bitmap = new
            return
        if old is None and new is None:
            return
        if old is not None and new is not None:
            diff = int.from_bytes(old, "little") ^ int.from_bytes(new, "little")
            # Few changed chunks: update them one by one rather than rebuild every heap.
            if diff.bit_count() <= max(64, self._n >> 6):
                while diff:
                    low = diff & -diff
                    i = low.bit_length() - 1
                    diff ^= low
                    self._set_bit(p, i, bool(new[i >> 3] >> (i & 7) & 1))
                return
        self._contribute(p, -1)
        p.bitmap = new
        self._contribute(p, +1)

    def _set_bit(self, p: _Peer, i: int, has: bool) -> None:
        """Flip chunk i in usable partial peer p's bitmap, keeping rarity and heaps exact."""
        bm = p.bitmap
        assert bm is not None
        if bool(bm[i >> 3] >> (i & 7) & 1) == has:
            return
        bm[i >> 3] ^= 1 << (i & 7)
        r = self._rarity[i]
        nr = r + (1 if has else -1)
        self._rarity[i] = nr
        if self._state[i] == _POOL:
            if r == 0:
                self._orphans -= 1
            elif nr == 0:
                self._orphans += 1
            self._offer(i)

    def _forget_chunks(self, p: _Peer, lacked: set[int]) -> None:
        """The peer said it lacks these chunks: drop them from its bitmap."""
        if p.bitmap is None:
            n = self._n
            bm = bytearray(b"\xff" * ((n + 7) // 8))
            if n & 7:
                bm[-1] = (1 << (n & 7)) - 1
            for i in lacked:
                bm[i >> 3] &= ~(1 << (i & 7)) & 0xFF
            self._contribute(p, -1)
            p.bitmap = bm
            self._contribute(p, +1)
            return
        for i in lacked:
            self._set_bit(p, i, False)

    def _pos(self, i: int) -> int:
        """Chunk i's place in the hand-out order among chunks of equal rarity."""
        return (i - self._start) % self._stride

    def _rank(self, i: int) -> int:
        """Hand-out rank of pool chunk i: by rarity, an unclaimed chunk before a claimed
        one (its claimer will have it soon, and can pass it on; a chunk of a fellow's
        share of the partition counts as claimed)."""
        return 2 * self._rarity[i] + (self._claims[i] > 0 or self._elsewhere[i >> 3] >> (i & 7) & 1)

    def _partition(self) -> None:
        """Recompute which chunks belong to a fetching fellow (see "Swarm partition")."""
        own = self._own_weights
        if own is None:
            return
        mask = 0
        for q in self._partials.values():
            if not q.soon_count:
                continue
            if q.beats is None:
                theirs = _chunk_hashes(q.name, self._n)
                q.beats = int.from_bytes(
                    bitmap_of((i for i in range(self._n) if theirs[i] > own[i]), self._n),
                    "little",
                )
            mask |= q.beats
        self._elsewhere = mask.to_bytes((self._n + 7) // 8, "little")

    def _key(self, i: int) -> int:
        return self._rank(i) * self._stride + (i - self._start) % self._stride

    def _offer(self, i: int) -> None:
        """Push pool chunk i, at its current rarity, to every heap that may serve it."""
        if self._dirty:
            return  # the rebuild will place it
        key = self._key(i)
        heapq.heappush(self._full_heap, key)
        pushes = 1
        byte, bit = i >> 3, 1 << (i & 7)
        for q in self._partials.values():
            bm = q.bitmap
            assert bm is not None
            if bm[byte] & bit:
                heapq.heappush(q.heap, key)
                pushes += 1
        self._pushes += pushes
        # Lazy deletion leaves stale entries behind; rebuild once they could dominate.
        if self._pushes > 2 * self._n + 64:
            self._dirty = True

    def _rebuild(self) -> None:
        self._partition()
        state = self._state
        stride = self._stride
        pool = [i for i in range(self._n) if state[i] == _POOL]
        start = self._start
        rank = {i: self._rank(i) for i in pool}
        full = [rank[i] * stride + (i - start) % stride for i in pool]
        heapq.heapify(full)
        self._full_heap = full
        for p in self._partials.values():
            bm = p.bitmap
            assert bm is not None
            heap = [
                rank[i] * stride + (i - start) % stride for i in pool if bm[i >> 3] >> (i & 7) & 1
            ]
            heapq.heapify(heap)
            p.heap = heap
        self._dirty = False
        self._pushes = 0

    def _fetchable_pool(self) -> int:
        """Pool chunks that some usable peer holds."""
        return self._pool_count if self._full_usable else self._pool_count - self._orphans
