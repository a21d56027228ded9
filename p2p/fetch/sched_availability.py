"""Chunk availability, a part of :class:`p2p.fetch.scheduler.Scheduler`: each chunk's
state, the live requests still owing it, its rarity among usable partial peers, the claims
of peers fetching it, the swarm partition and the min-heaps pool chunks are handed out
from (the scheduler's "Rarest first", "Swarm partition" and "Cost" sections).

It knows peers only through the holdings the scheduler hands it (`contribute`,
`replace_bitmap`, `replace_soon`, `forget_chunks`) and requests only by id (`take`,
`release`, `verify`); its attributes are read by the scheduler and its `Picking`, and
changed only here.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from p2p.fetch.sched_records import (
    _INFLIGHT,
    _POOL,
    _VERIFIED,
    MAX_PARTITION_CHUNKS,
    SchedulerConfig,
    _chunk_hashes,
    _Peer,
    _set_bits,
    bitmap_of,
)


class Availability:
    """Chunk state, rarity, claims and the hand-out heaps of one blob of `num_chunks`
    chunks, chunk i `chunk_length(i)` bytes long, `verified` ones held already."""

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
        self.n = num_chunks
        self.stride = max(num_chunks, 1)
        # Equal rarity goes by index counted from `start` (wrapping): fetchers of one blob
        # that start at different chunks take different chunks from a sole seeder first.
        self.start = start % self.stride
        self._chunk_length = chunk_length
        self._cfg = config
        self.state = bytearray(num_chunks)  # all _POOL
        self.rarity = [0] * num_chunks
        # Usable partial peers that claim each chunk (they said it is soon theirs).
        self.claims = [0] * num_chunks
        # The swarm partition: this fetcher's weights, and the chunks (bitmap) that
        # belong to a fetching fellow, recomputed at each rebuild.
        self._own_weights: list[int] | None = (
            _chunk_hashes(own, num_chunks)
            if own and config.defer_to_partial_holders and num_chunks <= MAX_PARTITION_CHUNKS
            else None
        )
        self._elsewhere = bytes((num_chunks + 7) // 8)
        self.verified_count = 0
        for i in verified:
            self.check_index(i)
            if self.state[i] != _VERIFIED:
                self.state[i] = _VERIFIED
                self.verified_count += 1
        self.pool_count = num_chunks - self.verified_count
        # Pool chunks with no usable partial holder (rarity 0): fetchable only from a peer
        # that has everything.
        self.orphans = self.pool_count
        self.full_usable = 0
        # Keys are rarity * stride + position (index counted from `start`); every rarity
        # is 0 here, so the sorted positions of pool chunks are already a heap.
        self.full_heap = sorted(self._pos(i) for i in range(num_chunks) if self.state[i] == _POOL)
        self.dirty = False
        self._pushes = 0  # heap entries pushed since the last rebuild
        self.inflight: dict[int, set[int]] = {}  # chunk -> live request ids still owing it
        self.partials: dict[str, _Peer] = {}  # usable peers with a partial bitmap

    def check_index(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise ValueError(f"chunk index {i} out of range 0..{self.n - 1}")

    def parse_bitmap(self, bitmap: bytes | None) -> bytearray | None:
        if bitmap is None:
            return None
        n = self.n
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

    def parse_soon(self, soon: bytes | None, bitmap: bytearray | None) -> bytearray | None:
        """A peer's soon-bitmap, less what it holds; None when it claims nothing."""
        if soon is None or bitmap is None:
            return None  # a peer with every chunk claims none
        claims = self.parse_bitmap(soon)
        if claims is None:
            claims = bytearray(b"\xff" * len(bitmap))
            if self.n & 7:
                claims[-1] = (1 << (self.n & 7)) - 1
        held = int.from_bytes(bitmap, "little")
        bits = int.from_bytes(claims, "little") & ~held
        if not bits:
            return None
        return bytearray(bits.to_bytes(len(bitmap), "little"))

    def set_soon_unused(self, p: _Peer, claims: bytearray | None) -> None:
        """Set the claims of a peer whose holdings count nowhere (not usable yet)."""
        p.soon = claims
        p.soon_count = 0 if claims is None else int.from_bytes(claims, "little").bit_count()

    def replace_soon(self, p: _Peer, new: bytearray | None) -> None:
        if not p.usable or p.bitmap is None:
            self.set_soon_unused(p, new if p.bitmap is not None else None)
            return
        old = int.from_bytes(p.soon, "little") if p.soon is not None else 0
        now = int.from_bytes(new, "little") if new is not None else 0
        diff = old ^ now
        fetching = p.soon_count > 0
        self.set_soon_unused(p, new)
        if self._own_weights is not None and fetching != (p.soon_count > 0):
            self.dirty = True  # it joins or leaves the partition
        claims = self.claims
        state = self.state
        while diff:
            low = diff & -diff
            i = low.bit_length() - 1
            diff ^= low
            before = claims[i]
            claims[i] = before + (1 if now & low else -1)
            if state[i] == _POOL and (before == 0) != (claims[i] == 0):
                self._offer(i)

    def contribute(self, p: _Peer, sign: int) -> None:
        """Add (+1) or remove (-1) a usable peer's holdings from the rarity counts (and a
        partial peer's claims from the claim counts)."""
        bm = p.bitmap
        if bm is None:
            self.full_usable += sign
            return
        if p.soon is not None:
            claims = self.claims
            for i in _set_bits(p.soon):
                claims[i] += sign
        if sign > 0:
            self.partials[p.name] = p
        else:
            self.partials.pop(p.name, None)
            p.heap = []
        rarity = self.rarity
        state = self.state
        orphans = 0
        for i in _set_bits(bm):
            r = rarity[i]
            rarity[i] = r + sign
            if state[i] == _POOL and (r == 0 or r + sign == 0):
                orphans -= sign
        self.orphans += orphans
        self.dirty = True

    def replace_bitmap(self, p: _Peer, new: bytearray | None) -> None:
        old = p.bitmap
        if not p.usable:
            p.bitmap = new
            return
        if old is None and new is None:
            return
        if old is not None and new is not None:
            diff = int.from_bytes(old, "little") ^ int.from_bytes(new, "little")
            # Few changed chunks: update them one by one rather than rebuild every heap.
            if diff.bit_count() <= max(64, self.n >> 6):
                while diff:
                    low = diff & -diff
                    i = low.bit_length() - 1
                    diff ^= low
                    self._set_bit(p, i, bool(new[i >> 3] >> (i & 7) & 1))
                return
        self.contribute(p, -1)
        p.bitmap = new
        self.contribute(p, +1)

    def _set_bit(self, p: _Peer, i: int, has: bool) -> None:
        """Flip chunk i in usable partial peer p's bitmap, keeping rarity and heaps exact."""
        bm = p.bitmap
        assert bm is not None
        if bool(bm[i >> 3] >> (i & 7) & 1) == has:
            return
        bm[i >> 3] ^= 1 << (i & 7)
        r = self.rarity[i]
        nr = r + (1 if has else -1)
        self.rarity[i] = nr
        if self.state[i] == _POOL:
            if r == 0:
                self.orphans -= 1
            elif nr == 0:
                self.orphans += 1
            self._offer(i)

    def forget_chunks(self, p: _Peer, lacked: set[int]) -> None:
        """The peer said it lacks these chunks: drop them from its bitmap."""
        if p.bitmap is None:
            n = self.n
            bm = bytearray(b"\xff" * ((n + 7) // 8))
            if n & 7:
                bm[-1] = (1 << (n & 7)) - 1
            for i in lacked:
                bm[i >> 3] &= ~(1 << (i & 7)) & 0xFF
            self.contribute(p, -1)
            p.bitmap = bm
            self.contribute(p, +1)
            return
        for i in lacked:
            self._set_bit(p, i, False)

    def _pos(self, i: int) -> int:
        """Chunk i's place in the hand-out order among chunks of equal rarity."""
        return (i - self.start) % self.stride

    def _rank(self, i: int) -> int:
        """Hand-out rank of pool chunk i: by rarity, an unclaimed chunk before a claimed
        one (its claimer will have it soon, and can pass it on; a chunk of a fellow's
        share of the partition counts as claimed)."""
        return 2 * self.rarity[i] + (self.claims[i] > 0 or self._elsewhere[i >> 3] >> (i & 7) & 1)

    def _partition(self) -> None:
        """Recompute which chunks belong to a fetching fellow (see "Swarm partition")."""
        own = self._own_weights
        if own is None:
            return
        mask = 0
        for q in self.partials.values():
            if not q.soon_count:
                continue
            if q.beats is None:
                theirs = _chunk_hashes(q.name, self.n)
                q.beats = int.from_bytes(
                    bitmap_of((i for i in range(self.n) if theirs[i] > own[i]), self.n),
                    "little",
                )
            mask |= q.beats
        self._elsewhere = mask.to_bytes((self.n + 7) // 8, "little")

    def _key(self, i: int) -> int:
        return self._rank(i) * self.stride + (i - self.start) % self.stride

    def _offer(self, i: int) -> None:
        """Push pool chunk i, at its current rarity, to every heap that may serve it."""
        if self.dirty:
            return  # the rebuild will place it
        key = self._key(i)
        heapq.heappush(self.full_heap, key)
        pushes = 1
        byte, bit = i >> 3, 1 << (i & 7)
        for q in self.partials.values():
            bm = q.bitmap
            assert bm is not None
            if bm[byte] & bit:
                heapq.heappush(q.heap, key)
                pushes += 1
        self._pushes += pushes
        # Lazy deletion leaves stale entries behind; rebuild once they could dominate.
        if self._pushes > 2 * self.n + 64:
            self.dirty = True

    def _rebuild(self) -> None:
        self._partition()
        state = self.state
        stride = self.stride
        pool = [i for i in range(self.n) if state[i] == _POOL]
        start = self.start
        rank = {i: self._rank(i) for i in pool}
        full = [rank[i] * stride + (i - start) % stride for i in pool]
        heapq.heapify(full)
        self.full_heap = full
        for p in self.partials.values():
            bm = p.bitmap
            assert bm is not None
            heap = [
                rank[i] * stride + (i - start) % stride for i in pool if bm[i >> 3] >> (i & 7) & 1
            ]
            heapq.heapify(heap)
            p.heap = heap
        self.dirty = False
        self._pushes = 0

    def refresh(self) -> None:
        """Rebuild the heaps if a change marked them stale (before chunks are picked)."""
        if self.dirty:
            self._rebuild()

    def pick(
        self, heap: list[int], bitmap: bytearray | None, limit: int, after_rank: int | None
    ) -> list[int]:
        """Pop up to `limit` pool chunks off `heap` (the full heap, or a partial peer's
        with its `bitmap`), best key first, in at most ``max_ranges_per_request`` ranges;
        `after_rank`: stop at the first chunk of this rank or more (None: no such stop)."""
        state = self.state
        stride = self.stride
        max_ranges = self._cfg.max_ranges_per_request
        stop = None if after_rank is None else after_rank * stride
        picked: list[int] = []
        chosen: set[int] = set()
        ranges = 0
        start = self.start
        while heap and len(picked) < limit:
            key = heap[0]
            i = (key % stride + start) % stride
            if (
                state[i] != _POOL
                or key // stride != self._rank(i)
                or i in chosen
                or (bitmap is not None and not bitmap[i >> 3] >> (i & 7) & 1)
            ):
                heapq.heappop(heap)  # stale entry
                continue
            if stop is not None and key >= stop:
                break  # held or claimed by a partial peer: left to it (keys go by rank)
            after = ranges + 1 - ((i - 1) in chosen) - ((i + 1) in chosen)
            if after > max_ranges:
                break  # leave it for the next request
            heapq.heappop(heap)
            picked.append(i)
            chosen.add(i)
            ranges = after
        return picked

    def take(self, picked: list[int], rid: int) -> int:
        """Live request `rid` now owes the chunks `picked` (pool ones leave the pool);
        returns their bytes."""
        nbytes = 0
        state = self.state
        chunk_length = self._chunk_length
        rarity = self.rarity
        inflight = self.inflight
        for i in picked:
            nbytes += chunk_length(i)
            if state[i] == _POOL:
                state[i] = _INFLIGHT
                self.pool_count -= 1
                if rarity[i] == 0:
                    self.orphans -= 1
            inflight.setdefault(i, set()).add(rid)
        return nbytes

    def release(self, rid: int, unreceived: set[int]) -> int:
        """Live request `rid` no longer owes `unreceived`: a chunk nobody else owes goes
        back to the pool and to every heap that may serve it. Returns their bytes."""
        nbytes = 0
        state = self.state
        chunk_length = self._chunk_length
        for i in sorted(unreceived):
            nbytes += chunk_length(i)
            if state[i] != _INFLIGHT:
                continue
            owers = self.inflight[i]
            owers.discard(rid)
            if not owers:
                del self.inflight[i]
                state[i] = _POOL
                self.pool_count += 1
                if self.rarity[i] == 0:
                    self.orphans += 1
                self._offer(i)
        return nbytes

    def verify(self, i: int) -> bool:
        """Chunk i arrived and matched its hash: True if it is new."""
        s = self.state[i]
        if s == _VERIFIED:
            return False
        if s == _POOL:
            self.pool_count -= 1
            if self.rarity[i] == 0:
                self.orphans -= 1
        else:
            # Other live requests still owe it (endgame copies); they will deliver a
            # duplicate that the scheduler reports as not new.
            del self.inflight[i]
        self.state[i] = _VERIFIED
        self.verified_count += 1
        return True

    def fetchable_pool(self) -> int:
        """Pool chunks that some usable peer holds."""
        return self.pool_count if self.full_usable else self.pool_count - self.orphans

    def check_invariants(self, peers: Iterable[_Peer], owers: dict[int, set[int]]) -> None:
        """Recount every derived quantity from scratch, given every known peer and the
        chunks each live request still owes (tests only: O(num_chunks))."""
        state = self.state
        n = self.n
        assert self.verified_count == sum(1 for s in state if s == _VERIFIED)
        assert self.pool_count == sum(1 for s in state if s == _POOL)
        rarity = [0] * n
        claims = [0] * n
        full_usable = 0
        for p in peers:
            if p.usable and p.bitmap is not None:
                assert self.partials.get(p.name) is p
                for i in _set_bits(p.bitmap):
                    rarity[i] += 1
                if p.soon is not None:
                    assert not int.from_bytes(p.soon, "little") & int.from_bytes(p.bitmap, "little")
                    for i in _set_bits(p.soon):
                        claims[i] += 1
            else:
                assert p.name not in self.partials
                full_usable += p.usable
        assert rarity == self.rarity
        assert claims == self.claims
        assert self.full_usable == full_usable
        assert self.orphans == sum(1 for i in range(n) if state[i] == _POOL and rarity[i] == 0)
        assert owers == self.inflight
        assert all(state[i] == _INFLIGHT for i in owers)
        assert all(s != _INFLIGHT or i in owers for i, s in enumerate(state))
        if not self.dirty:
            full = set(self.full_heap)
            for i in range(n):
                if state[i] == _POOL:
                    key = self._key(i)
                    assert key in full, i
                    for p in self.partials.values():
                        if p.holds(i):
                            assert key in p.heap, (p.name, i)
