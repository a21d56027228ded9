"""A seeder holding a 4-chunk blob and two fetcher nodes connected to it, in-process over
loopback: what the tests of a seeder's view of its fetchers (1.4.0's count, 1.5.0's
`try_get`) start from."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from blobstore import Store
from p2p.node.node import Node, open_node

CHUNK = 64 * 1024
DATA = bytes(range(256)) * (4 * CHUNK // 256)  # 4 chunks


@dataclass
class Seeded:
    blob_id: str
    seed: Node
    first: Node
    second: Node
    peer: str  # the seeder's peer ID


@asynccontextmanager
async def seeder_and_two_fetchers(tmp_path: Path) -> AsyncIterator[Seeded]:
    """The nodes, each fetcher connected to the seeder (within 30 s)."""
    store = Store.open(tmp_path / "seed")
    blob_id = store.put_bytes(DATA, chunk_size=CHUNK)
    async with (
        open_node(store, dht=False) as seed,
        open_node(tmp_path / "first", dht=False) as first,
        open_node(tmp_path / "second", dht=False) as second,
    ):
        with trio.fail_after(30):
            peer = await first.connect(seed.addrs[0])
            await second.connect(seed.addrs[0])
        yield Seeded(blob_id, seed, first, second, peer)
