"""A fetcher serves what it holds unless told not to (`blob get --no-upload`,
``NodeConfig(upload=False)``): a node that fetched a blob with upload off answers nobody;
and what it holds is found through the seeder for a model directory too.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from blobstore import Store
from p2p.errors import P2PError
from p2p.fetch.download_parts import Progress
from p2p.node.node import NodeConfig, open_node

MiB = 1 << 20

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


@pytest.mark.timeout(120)
async def test_a_models_files_come_from_a_fellow_that_the_slow_seeder_names(
    tmp_path: Path,
) -> None:
    """Swarming works for a collection (a model directory) as for one
    blob. The seeder's upload is limited to 2 MB/s; a first worker fetched the model
    from it; a late worker told only the seeder learns of the first from it (peer
    exchange, per child blob) and takes most of the files from the first worker."""
    limit = 2e6
    model = tmp_path / "model"
    model.mkdir()
    for name, seed in (("weights-0.bin", 1), ("weights-1.bin", 2)):
        (model / name).write_bytes(_random_bytes(4 * MiB, seed))
    store = Store.open(tmp_path / "seeder")
    collection = store.put_dir(model)
    new_bytes: dict[str, dict[str, int]] = {}

    def progress(report: Progress) -> None:
        new_bytes[report.blob_id] = dict(report.new_bytes)

    async with (
        open_node(store, config=NodeConfig(dht=False, upload_limit=limit)) as seeder,
        open_node(tmp_path / "first", dht=False) as first,
        open_node(tmp_path / "late", dht=False) as late,
    ):
        with trio.fail_after(60):
            await first.fetch(collection, providers=seeder.addrs, announce=False)
            await late.fetch(collection, providers=seeder.addrs, progress=progress, announce=False)
        assert late.store.has(collection)
        children = [e.blob_id for e in late.store.collection_entries(collection) or ()]
        assert len(children) == 2 and all(late.store.has(c) for c in children)
        from_first = sum(new_bytes.get(c, {}).get(first.peer_id, 0) for c in children)
        from_seeder = sum(new_bytes.get(c, {}).get(seeder.peer_id, 0) for c in children)
    assert from_first + from_seeder == 8 * MiB
    assert from_first > 4 * MiB, (
        f"{from_first} bytes from the fellow, {from_seeder} from the seeder"
    )


def _random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)
