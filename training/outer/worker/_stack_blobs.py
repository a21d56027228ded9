"""Fetching blobs for a worker, and reading a held one back.

1. A blob is fetched (verified chunk by chunk, ``p2p.fetch``) only if the store lacks it;
   one fetch per blob at a time in the process: a second caller waits for the one in
   flight.
2. An attempt with no progress for ``FETCH_STALL`` seconds is abandoned and tried again;
   the fetch gives up at its bound (``_fetch_bound``: three deadlines and the fetch floor,
   where the caller names no other).
3. A closure's blobs are asked of its proposer and named peers first, then of every
   worker heard of, at most ``MAX_PROVIDERS``.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from blobstore import StoreError
from training.outer.aggregate import unwrap_update
from training.outer.agreement import CheckedClosure
from training.outer.codec import CodecError
from training.outer.messages import Candidate
from training.outer.worker._stack_state import WorkerState, _say

# A fetch attempt with no progress for this long is abandoned and tried again.
FETCH_STALL = 20.0
# A failed fetch is tried again after this pause.
FETCH_RETRY = 0.5
# Most peers asked for a closure's blobs besides its proposer and authors (every admitted
# worker of the largest run).
MAX_PROVIDERS = 64


class WorkerBlobs(WorkerState):
    """Fetching blobs and reading them back (see :mod:`training.outer.worker._stack_blobs`)."""

    async def _fetch(self, blob: str, providers: Sequence[str], bound: float) -> bool:
        """Fetch ``blob`` into the store (verified chunk by chunk); False if not in time."""

        if await trio.to_thread.run_sync(self.node.store.has, blob):
            return True
        # One fetch per blob at a time in this process: a second would find the first's
        # partial blob locked. The later caller waits for the one in flight, then retries.
        with trio.move_on_after(bound):
            while blob in self.inflight:
                await self.inflight[blob].wait()
                if await trio.to_thread.run_sync(self.node.store.has, blob):
                    return True
        if blob in self.inflight:
            return False
        done = self.inflight[blob] = trio.Event()
        try:
            return await self._fetch_once(blob, providers, bound)
        finally:
            del self.inflight[blob]
            done.set()

    async def _fetch_once(self, blob: str, providers: Sequence[str], bound: float) -> bool:
        from p2p.errors import P2PError

        with trio.move_on_after(bound):
            while True:
                with trio.move_on_after(FETCH_STALL) as attempt:

                    def progressed(_: object, attempt: trio.CancelScope = attempt) -> None:
                        attempt.deadline = trio.current_time() + FETCH_STALL

                    try:
                        await self.node.fetch(
                            blob, providers=list(providers), progress=progressed, announce=False
                        )
                        return True
                    except (P2PError, StoreError, OSError, trio.BrokenResourceError) as exc:
                        _say(self.label, f"fetch {blob[:12]} failed (retrying): {exc}")
                if attempt.cancelled_caught:
                    _say(self.label, f"fetch {blob[:12]} stalled (retrying)")
                await trio.sleep(FETCH_RETRY)
        return False

    def _load(self, blob: str) -> bytes:
        return self.node.store.path(blob).read_bytes()

    def _author(self, blob: str) -> str | None:
        """The author an update blob's envelope names (None: not an update blob)."""
        try:
            return unwrap_update(self._load(blob)).author
        except (CodecError, OSError):
            return None

    async def _fetch_update(self, candidate: Candidate, root: str) -> None:
        if await self._fetch(candidate.blob, candidate.addrs, float("inf")) and root == self.root:
            self.fetched[candidate.peer] = candidate.blob
            self.changed.set()

    def _providers(self, checked: CheckedClosure, peers: Sequence[str] = ()) -> list[str]:
        """Who may hold a closure's blobs: its proposer and the named peers first, then every
        worker heard of (each that applied the closure holds them)."""
        out = list(self.closure_addrs.get(checked.digest, ()))
        for peer in peers:
            out.extend(self.dialer.addrs(peer))
        for peer in list(self.dialer.peers)[:MAX_PROVIDERS]:
            out.extend(self.dialer.addrs(peer)[:1])
        return list(dict.fromkeys(out))

    def _everyone(self) -> list[str]:
        return [
            a for p in list(self.dialer.peers)[:MAX_PROVIDERS] for a in self.dialer.addrs(p)[:1]
        ]

    def _fetch_bound(self) -> float:
        return 3 * self.params.deadline + self.params.fetch_floor
