"""The downloader's pipelined chunk writes, in-process over in-memory streams (a real
ServerConnection behind each) and a real store on disk: every chunk lands verified, a disk
that fails mid-download stops it with the store's error and keeps what was written, a
corrupt chunk bans its peer while another completes the blob, and no pooled buffer is
left out on loan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio
from fake_stream import FakeStream

from blobstore import Manifest, NoSpace, PartialBlob, Store
from p2p import downloader
from p2p import protocol as proto
from p2p.buffers import ChunkBuffers
from p2p.errors import unwrap_single

CHUNK = 64 * 1024
DATA = os.urandom(40 * CHUNK + 123)  # 41 chunks: more than two 16-chunk requests
MANIFEST = Manifest.of_bytes(DATA, chunk_size=CHUNK)
PARTS = [DATA[o : o + n] for o, n in (MANIFEST.chunk_span(i) for i in range(MANIFEST.num_chunks))]


def serving(flip: frozenset[int] = frozenset()) -> FakeStream:
    """A provider holding the whole blob; chunks in ``flip`` are sent corrupted."""

    def serve(server: proto.ServerConnection, req: proto.Request) -> tuple[bytes, bool]:
        if isinstance(req, proto.ManifestRequest):
            return server.send_response(proto.ManifestResponse(MANIFEST.encode())), False
        n = MANIFEST.num_chunks
        if isinstance(req, proto.HaveRequest):
            bits = bytes([0xFF] * (n // 8) + [(1 << (n % 8)) - 1])
            return server.send_response(proto.HaveResponse(n, bits)), False
        assert isinstance(req, proto.GetRequest)
        out = bytearray()
        for start, stop in req.ranges:
            for i in range(start, stop):
                body = bytearray(PARTS[i])
                if i in flip:
                    body[0] ^= 0xFF
                out += server.send_chunk_header(i, len(body)) + body
        return bytes(out + server.send_response(proto.End(()))), False

    return FakeStream(serve)


class Network:
    def __init__(self, flips: dict[str, frozenset[int]]) -> None:
        self.flips = flips

    async def open_blob_stream(self, peer: str) -> Any:
        await trio.lowlevel.checkpoint()
        return serving(self.flips[peer])


def track_pools(monkeypatch: pytest.MonkeyPatch) -> list[ChunkBuffers]:
    pools: list[ChunkBuffers] = []
    real_init = ChunkBuffers.__init__

    def init(self: ChunkBuffers, size: int, count: int) -> None:
        real_init(self, size, count)
        pools.append(self)

    monkeypatch.setattr(ChunkBuffers, "__init__", init)
    return pools


async def fetch(store: Store, network: Network) -> list[downloader.Progress]:
    reports: list[downloader.Progress] = []
    try:
        with trio.fail_after(20):
            await downloader.download_blob(
                network,
                store,
                MANIFEST.blob_id,
                providers=list(network.flips),
                progress=reports.append,
            )
    except BaseExceptionGroup as group:
        raise unwrap_single(group) from None
    return reports


async def test_every_chunk_lands_verified_and_every_buffer_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools = track_pools(monkeypatch)
    store = Store.open(tmp_path / "s")
    await fetch(store, Network({"a": frozenset(), "b": frozenset()}))
    assert store.path(MANIFEST.blob_id).read_bytes() == DATA
    assert store.verify(MANIFEST.blob_id) == []
    assert [pool.in_use for pool in pools] == [0]


async def test_a_failing_disk_stops_the_fetch_with_its_error_and_keeps_what_landed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools = track_pools(monkeypatch)
    real_write = PartialBlob.write_chunk
    full_at = 20

    def write_chunk(self: PartialBlob, index: int, data: Any, **kwargs: Any) -> bool:
        if index >= full_at:
            raise NoSpace(f"no space left for chunk {index}")
        return real_write(self, index, data, **kwargs)

    monkeypatch.setattr(PartialBlob, "write_chunk", write_chunk)
    store = Store.open(tmp_path / "s")
    with pytest.raises(NoSpace, match="no space left"):
        await fetch(store, Network({"a": frozenset()}))
    assert not store.has(MANIFEST.blob_id)
    assert [pool.in_use for pool in pools] == [0]
    # What verified before the disk filled was flushed and is kept for the next attempt.
    monkeypatch.setattr(PartialBlob, "write_chunk", real_write)
    with store.begin_partial(MANIFEST) as partial:
        assert set(partial.missing()) >= set(range(full_at, MANIFEST.num_chunks))
        assert partial.verified_count > 0
    await fetch(store, Network({"a": frozenset()}))
    assert store.verify(MANIFEST.blob_id) == []


@pytest.mark.parametrize("hash_on_arrival", [True, False])
async def test_a_corrupt_chunk_bans_its_peer_and_the_other_completes_the_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hash_on_arrival: bool
) -> None:
    # Hashed on the event loop as it arrives (few CPUs) or in the writer thread (many):
    # either way the store checks the digest against the manifest before writing.
    monkeypatch.setattr(downloader, "HASH_ON_ARRIVAL", hash_on_arrival)
    pools = track_pools(monkeypatch)
    store = Store.open(tmp_path / "s")
    every_chunk = frozenset(range(MANIFEST.num_chunks))
    reports = await fetch(store, Network({"liar": every_chunk, "honest": frozenset()}))
    assert store.path(MANIFEST.blob_id).read_bytes() == DATA
    assert store.verify(MANIFEST.blob_id) == []
    assert [pool.in_use for pool in pools] == [0]
    final = reports[-1]
    assert final.finished
    assert final.peers["liar"].banned
    assert final.new_bytes.get("liar", 0) == 0
    assert final.new_bytes["honest"] == len(DATA)
