"""What a serving node does with names in the background (``run_names``), over TCP on
127.0.0.1 with two nodes in this process.

The story: a program with no node (``blob train run --publish``) names a blob in the store
of a running ``blob serve``; the serving node notices the record on its next poll and
pushes it to its peers, which then answer for it offline. Publishing again in the store
supersedes the first record.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import trio

from blobstore import Store
from identity import MachineKey, SoftwareSigner
from p2p.names import service as names
from p2p.names.record import NameNotFound
from p2p.node.node import open_node

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

        # Another process with no node (a training run) names the blob in the same store.
        store = Store.open(tmp_path / "serving")
        record = await trio.to_thread.run_sync(
            partial(
                names.publish_in_store,
                store,
                SoftwareSigner(key),
                "final",
                blob_id,
                now=time.time(),
            )
        )

        ref = f"{serving.peer_id}/final"
        with trio.fail_after(10):
            while True:
                try:
                    found = await names.resolve(peer, ref, use_peers=False, use_dht=False)
                    break
                except NameNotFound:
                    await trio.sleep(POLL)
        assert found == record
        again = names.publish_in_store(
            store, SoftwareSigner(key), "final", blob_id, now=time.time()
        )
        assert again.seq > record.seq
        nursery.cancel_scope.cancel()
