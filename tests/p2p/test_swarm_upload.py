"""A fetcher serves what it holds unless told not to (`blob get --no-upload`,
``NodeConfig(upload=False)``): a node that fetched a blob with upload off answers nobody."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from blobstore import Store
from p2p.errors import P2PError
from p2p.node import NodeConfig, open_node

pytestmark = pytest.mark.timeout(90)

# Generous for a loaded 2-vCPU machine; a fetch from a local node takes well under a second.
FETCH_BOUND_S = 30


@pytest.mark.parametrize("upload", [True, False])
async def test_a_fetcher_serves_what_it_fetched_only_with_upload_on(
    tmp_path: Path, upload: bool
) -> None:
    seeder_store = Store.open(tmp_path / "seeder")
    blob_id = seeder_store.put_bytes(b"a checkpoint shard " * 50_000)
    config = NodeConfig(dht=False, upload=upload)
    async with (
        open_node(seeder_store, dht=False) as seeder,
        open_node(tmp_path / "fetcher", config=config) as fetcher,
        open_node(tmp_path / "late", dht=False) as late,
    ):
        with trio.fail_after(FETCH_BOUND_S):
            await fetcher.fetch(blob_id, providers=seeder.addrs, announce=False)
        with trio.fail_after(FETCH_BOUND_S):
            if upload:
                await late.fetch(blob_id, providers=fetcher.addrs, announce=False)
                assert late.store.has(blob_id)
            else:
                with pytest.raises(P2PError):
                    await late.fetch(blob_id, providers=fetcher.addrs, announce=False)
                assert not late.store.has(blob_id)
