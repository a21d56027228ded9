"""Fetching blobs for a worker, and reading a held one back.

1. A blob is fetched (verified chunk by chunk, ``p2p.fetch``) only if the store lacks it;
   one fetch per blob at a time in the process: a second caller waits for the one in
   flight.
2. An attempt with no progress for ``FETCH_STALL`` seconds is abandoned and tried again;
   the fetch gives up at its bound (:func:`fetch_bound`: three deadlines and the fetch
   floor, where the caller names no other).
3. A closure's blobs are asked of its proposer (at the addresses it announced with the
   closure) and named peers first, then of every worker heard of, at most
   ``MAX_PROVIDERS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from blobstore import StoreError
from p2p.errors import P2PError
from training.outer.aggregate import unwrap_update
from training.outer.agreement import CheckedClosure
from training.outer.announce import PeerDialer
from training.outer.codec import CodecError
from training.outer.params import RunParams
from training.outer.worker.signals import say

if TYPE_CHECKING:
    from p2p.node.node import Node

# A fetch attempt with no progress for this long is abandoned and tried again.
FETCH_STALL = 20.0
# A failed fetch is tried again after this pause.
FETCH_RETRY = 0.5
# Most peers asked for a closure's blobs besides its proposer and authors (every admitted
# worker of the largest run).
MAX_PROVIDERS = 64


def fetch_bound(params: RunParams) -> float:
    """The bound of one fetch a round waits on (rule 2)."""
    return 3 * params.deadline + params.fetch_floor


class BlobFetcher:
    """Fetches into the node's store and reads back from it (see the module's rules);
    ``dialer`` says whom a worker has heard of, and where."""

    def __init__(self, node: Node, params: RunParams, dialer: PeerDialer, label: str) -> None:
        self.node = node
        self.params = params
        self.dialer = dialer
        self.label = label
        self.inflight: dict[str, trio.Event] = {}  # blob -> set when its fetch ends
        # Closure digest -> the addresses its proposer announced with it (rule 3).
        self.closure_addrs: dict[bytes, tuple[str, ...]] = {}

    def bound(self) -> float:
        return fetch_bound(self.params)

    async def fetch(self, blob: str, providers: Sequence[str], bound: float) -> bool:
        """Fetch ``blob`` into the store (verified chunk by chunk); False if not in time."""
        has = self.node.store.has
        if await trio.to_thread.run_sync(has, blob):
            return True
        # One fetch per blob at a time in this process: a second would find the first's
        # partial blob locked. The later caller waits for the one in flight, then retries.
        with trio.move_on_after(bound):
            while blob in self.inflight:
                await self.inflight[blob].wait()
                if await trio.to_thread.run_sync(has, blob):
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
                        say(self.label, f"fetch {blob[:12]} failed (retrying): {exc}")
                if attempt.cancelled_caught:
                    say(self.label, f"fetch {blob[:12]} stalled (retrying)")
                await trio.sleep(FETCH_RETRY)
        return False

    def load(self, blob: str) -> bytes:
        """A held blob's bytes (blocking: call it in a thread)."""
        return self.node.store.path(blob).read_bytes()

    def author(self, blob: str) -> str | None:
        """The author an update blob's envelope names (None: not an update blob)."""
        try:
            return unwrap_update(self.load(blob)).author
        except (CodecError, OSError):
            return None

    def learn_closure(self, checked: CheckedClosure, addrs: Sequence[str]) -> None:
        """Where a closure's proposer said it serves the closure's blobs."""
        self.closure_addrs[checked.digest] = tuple(addrs)

    def providers(self, checked: CheckedClosure, peers: Sequence[str] = ()) -> list[str]:
        """Who may hold a closure's blobs: its proposer and the named peers first, then every
        worker heard of (each that applied the closure holds them)."""
        out = list(self.closure_addrs.get(checked.digest, ()))
        for peer in peers:
            out.extend(self.dialer.addrs(peer))
        for peer in list(self.dialer.peers)[:MAX_PROVIDERS]:
            out.extend(self.dialer.addrs(peer)[:1])
        return list(dict.fromkeys(out))

    def everyone(self) -> list[str]:
        """One address of each worker heard of, at most ``MAX_PROVIDERS``."""
        return [
            a for p in list(self.dialer.peers)[:MAX_PROVIDERS] for a in self.dialer.addrs(p)[:1]
        ]
