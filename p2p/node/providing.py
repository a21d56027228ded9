"""A node's provider records on the Kademlia DHT: what it announces, and whom it finds.

1. Every complete blob is provided at start, when it arrives, and again every
   ``reprovide_interval`` (records expire on DHT peers); a blob put into the store by
   another process is provided within ``NEW_BLOB_POLL`` seconds.
2. A change of the node's addresses (``set_advertised``) provides everything again, so
   records name the new addresses.
3. Provider records are best effort: a failed provide or lookup is logged, never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import trio
from libp2p.kad_dht.kad_dht import KadDHT

from blobstore import Store

log = logging.getLogger(__name__)

# How soon a blob put into the store by another process gets provided on the DHT.
NEW_BLOB_POLL = 10.0
# The multihash code of BLAKE3-256 (0x1e, length 0x20) prefixes blob IDs as DHT keys.
DHT_KEY_PREFIX = "1e20"
# How long one provide may take (a DHT walk to the closest peers); past it, rule 3.
PROVIDE_TIMEOUT = 30.0


def dht_key(blob_id: str) -> str:
    return DHT_KEY_PREFIX + blob_id


class ReprovideSchedule:
    """Which complete blobs are due to be provided (rules 1 and 2), sans-IO: each blob
    once when first seen, then every ``interval`` seconds; `forget` (new addresses) makes
    every blob due again."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._provided: dict[str, float] = {}  # blob ID -> when it was last provided

    def due(self, blob_ids: Iterable[str], now: float) -> list[str]:
        """Those of ``blob_ids`` to provide now, each counted as provided at ``now``."""
        out = []
        for blob_id in blob_ids:
            last = self._provided.get(blob_id)
            if last is None or now - last >= self.interval:
                self._provided[blob_id] = now
                out.append(blob_id)
        return out

    def forget(self) -> None:
        self._provided.clear()


class ProviderRecords:
    """A node's provider records (see :mod:`p2p.node.providing`): what it announces on
    ``dht`` (None: no DHT, so nothing), and whom it finds there. ``host`` is asked for its
    own peer ID, and its peerstore keeps the addresses of the providers found."""

    def __init__(
        self, store: Store, host: Any, dht: KadDHT | None, *, reprovide_interval: float
    ) -> None:
        self.store = store
        self.host = host
        self.dht = dht
        self.schedule = ReprovideSchedule(reprovide_interval)
        self._again = trio.Event()

    async def provide(self, blob_id: str) -> bool:
        if self.dht is None:
            return False
        try:
            with trio.move_on_after(PROVIDE_TIMEOUT):
                return bool(await self.dht.provide(dht_key(blob_id)))
        except Exception as exc:  # provider records are best effort
            log.info("provide %s failed: %r", blob_id[:12], exc)
        return False

    async def find_providers(self, blob_id: str, limit: int = 20) -> list[str]:
        """Peer IDs that advertise ``blob_id`` on the DHT (their addresses go to the
        peerstore, so they can be dialled)."""
        if self.dht is None:
            return []
        try:
            infos = await self.dht.find_providers(dht_key(blob_id), limit)
        except Exception as exc:  # a failed lookup just finds nobody
            log.info("find_providers %s failed: %r", blob_id[:12], exc)
            return []
        found: list[str] = []
        for info in infos:
            if info.peer_id == self.host.get_id():
                continue
            if info.addrs:
                self.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 3600)
            if str(info.peer_id) not in found:
                found.append(str(info.peer_id))
        return found

    def provide_again(self) -> None:
        """Provide every blob again now (rule 2: the node's addresses changed)."""
        self._again.set()

    async def run(self) -> None:
        """Provide every complete blob at start and each ``reprovide_interval``; blobs that
        appear meanwhile (a ``blob put`` beside a running ``blob serve``) are provided
        within ``NEW_BLOB_POLL`` seconds. Runs until cancelled."""
        while True:
            if self._again.is_set():
                self._again = trio.Event()
                self.schedule.forget()
            now = trio.current_time()
            ids = await trio.to_thread.run_sync(self._complete_ids)
            for blob_id in self.schedule.due(ids, now):
                await self.provide(blob_id)
            with trio.move_on_after(NEW_BLOB_POLL):
                await self._again.wait()

    def _complete_ids(self) -> list[str]:
        return [blob_id for blob_id in self.store.blob_ids() if self.store.has(blob_id)]

    async def announce(self, blob_id: str) -> None:
        """Provide ``blob_id`` now (a blob just added or fetched), if there is a DHT."""
        if self.dht is not None:
            await self.provide(blob_id)
