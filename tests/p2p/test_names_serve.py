"""What a serving node does with names in the background (``run_names``), over TCP on
127.0.0.1 with two nodes in this process.

The story: ``blob publish`` runs beside a ``blob serve`` on the same store (another
process: here, a second cache over the same directory); the serving node notices the new
record on its next poll and pushes it to its peers, which then answer for it offline.
"""

from __future__ import annotations

import time
from pathlib import Path

import trio

from blobstore import Store
from identity import MachineKey, SoftwareSigner
from p2p import names
from p2p.names_cache import NameCache
from p2p.names_record import sign_record
from p2p.node import open_node

POLL = 0.1


async def test_a_record_written_beside_a_serving_node_reaches_its_peers(tmp_path: Path) -> None:
    key = MachineKey.generate()
    async with (
        open_node(tmp_path / "serving", key=key, dht=False) as serving,
        open_node(tmp_path / "peer", dht=False) as peer,
        trio.open_nursery() as nursery,
    ):
        names.install(serving)
        names.install(peer)
        await peer.connect(serving.addrs[0])
        nursery.start_soon(lambda: names.run_names(serving, poll=POLL))
        blob_id = await serving.add_bytes(b"state " * 1000)

        # "blob publish" in another process: its own cache over the same store.
        store = Store.open(tmp_path / "serving")
        other_process = NameCache.for_store_root(store.root, store.tmp_dir)
        record = sign_record(
            SoftwareSigner(key), name="final", blob_id=blob_id, seq=1, time=int(time.time())
        )
        other_process.offer(record, now=record.time, own=True)
        await trio.to_thread.run_sync(other_process.persist, record.key)

        ref = f"{serving.peer_id}/final"
        with trio.fail_after(10):
            while True:
                try:
                    found = await names.resolve(peer, ref, use_peers=False, use_dht=False)
                    break
                except names.NameNotFound:
                    await trio.sleep(POLL)
        assert found == record
        nursery.cancel_scope.cancel()
