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
from typing import TYPE_CHECKING, Any

import trio
from libp2p.kad_dht.kad_dht import KadDHT

from blobstore import Store

if TYPE_CHECKING:
    from p2p.node.node import NodeConfig

log = logging.getLogger(__name__)

# How soon a blob put into the store by another process gets provided on the DHT.
NEW_BLOB_POLL = 10.0
# The multihash code of BLAKE3-256 (0x1e, length 0x20) prefixes blob IDs as DHT keys.
DHT_KEY_PREFIX = "1e20"


def dht_key(blob_id: str) -> str:
    return DHT_KEY_PREFIX + blob_id


class Providing:
    """Provider records (see :mod:`p2p.node.providing`); a base of
    :class:`p2p.node.node.Node`, which sets these attributes."""

    store: Store
    host: Any
    config: NodeConfig
    dht: KadDHT | None
    _reprovide_now: trio.Event

    async def provide(self, blob_id: str) -> bool:
        if self.dht is None:
            return False
        try:
            with trio.move_on_after(30):
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

    async def _reprovide_loop(self) -> None:
        """Provide every complete blob at start and each ``reprovide_interval``; blobs that
        appear meanwhile (a ``blob put`` beside a running ``blob serve``) are provided
        within ``NEW_BLOB_POLL`` seconds."""
        provided: dict[str, float] = {}
        while True:
            if self._reprovide_now.is_set():  # our addresses changed (set_advertised)
                self._reprovide_now = trio.Event()
                provided.clear()
            now = trio.current_time()
            ids = await trio.to_thread.run_sync(self._complete_ids)
            for blob_id in ids:
                last = provided.get(blob_id)
                if last is None or now - last >= self.config.reprovide_interval:
                    provided[blob_id] = now
                    await self.provide(blob_id)
            with trio.move_on_after(NEW_BLOB_POLL):
                await self._reprovide_now.wait()

    def _complete_ids(self) -> list[str]:
        return [blob_id for blob_id in self.store.blob_ids() if self.store.has(blob_id)]

    async def _announce(self, blob_id: str) -> None:
        if self.dht is not None:
            with trio.move_on_after(30):
                await self.provide(blob_id)
