"""Every chunk behind a fetched tensor is checked against the manifest: a provider that
sends altered bytes is named, its chunks never reach the store, and the next provider
serves the tensor. Providers here are in-memory pairs whose far end is the protocol's own
sans-IO server (tests.p2p.fake_stream), serving a real store's blob."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from blobstore import Store
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.errors import FetchFailed
from p2p.fetch.tensors import fetch_tensors
from tests.p2p.fake_stream import FakeStream

CHUNK = 64 * 1024  # the smallest chunk size, so the file spans several chunks


class Providers:
    """A node (what ``fetch_tensors`` uses of ``p2p.node.node.Node``) with store ``store`` whose
    peers serve ``source``'s blobs; a peer named ``liar*`` flips the first byte of every
    chunk it sends."""

    def __init__(self, store: Store, source: Store) -> None:
        self.store = store
        self.source = source
        self.chunks_sent: dict[str, int] = {}

    def connected_peers(self) -> list[str]:
        return []

    async def open_blob_stream(self, peer: str) -> FakeStream:
        def serve(server: proto.ServerConnection, req: messages.Request) -> tuple[bytes, bool]:
            if isinstance(req, messages.ManifestRequest):
                manifest = self.source.manifest(req.blob_id).encode()
                return server.send_response(messages.ManifestResponse(manifest)), False
            assert isinstance(req, messages.GetRequest)
            out = b""
            for start, stop in req.ranges:
                for index in range(start, stop):
                    data = bytearray(self.source.read_chunk(req.blob_id, index))
                    if peer.startswith("liar"):
                        data[0] ^= 0xFF
                    self.chunks_sent[peer] = self.chunks_sent.get(peer, 0) + 1
                    out += server.send_chunk_header(index, len(data)) + bytes(data)
            return out + server.send_response(messages.End(server.unsent_indices())), False

        return FakeStream(serve)


World = tuple[Store, Store, str, dict[str, np.ndarray]]


@pytest.fixture
def world(tmp_path: Path) -> World:
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((64, 300)).astype(np.float32),  # ~75 KiB: two chunks
        "b": rng.standard_normal((128, 512)).astype(np.float32),  # 256 KiB
    }
    source = Store.open(tmp_path / "source")
    blob_id = source.put_bytes(save(tensors), chunk_size=CHUNK)
    assert source.manifest(blob_id).num_chunks >= 3
    dest = Store.open(tmp_path / "dest")
    return source, dest, blob_id, tensors


async def test_a_lying_provider_is_named_and_the_next_one_serves(world: World) -> None:
    source, dest, blob_id, tensors = world
    node = Providers(dest, source)
    with pytest.raises(FetchFailed, match="liar: sent a chunk that does not match its hash"):
        await fetch_tensors(node, blob_id, ["b"], peers=["liar"])
    assert node.chunks_sent["liar"] >= 1
    assert not dest.has(blob_id)
    assert not any(dest.chunk_bitmap(blob_id))  # nothing of the liar's was kept

    got = await fetch_tensors(node, blob_id, ["a"], peers=["liar-2", "honest"])
    assert np.array_equal(got.tensors["a"], tensors["a"])
    assert node.chunks_sent["liar-2"] >= 1
    assert 0 < got.fetched_chunks < got.num_chunks  # only the chunks under "a"
