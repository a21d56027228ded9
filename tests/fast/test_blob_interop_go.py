"""The blob protocol across go-libp2p (hivemind's p2pd daemon), with blobnet's fast path on.

1. go serves, blobnet fetches: p2pd handles `/blobnet/blob/1.0.0` and hands every inbound
   stream to the real BlobServer over an on-disk store; a blobnet node fetches the blob
   from the go peer with its usual downloader (several streams and `get` requests).
2. blobnet serves, go fetches: a blobnet node serves its store; streams that p2pd opens to
   it carry the real BlobClient's requests (manifest, have, multi-range gets on two
   streams at once), and every chunk is verified into a fresh store.

Each blob is 49 chunks of 64 KiB, the last one short, so ranges and batching are exercised.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest
import trio
from fast_helpers import DaemonStream, assert_fast, muxed_conn_to, wait_connected
from libp2p.peer.id import ID
from p2pd_client import DaemonClient, DaemonConn, StreamInfo, run_daemon

from blobstore import MIN_CHUNK_SIZE, Manifest, Store
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.server import BlobServer
from p2p.blob.shell import BlobClient
from p2p.node.node import open_node

pytestmark = pytest.mark.slow

CHUNK_SIZE = MIN_CHUNK_SIZE
# 48 whole chunks and a 12345-byte tail: more than the downloader's 16-chunk requests.
BLOB_SIZE = 48 * CHUNK_SIZE + 12_345
# Chunks per range in the go-side client's requests, and ranges per `get`.
RANGE_CHUNKS = 8
RANGES_PER_GET = 2
TIMEOUT_S = 20


@dataclass(frozen=True)
class Blob:
    store: Store
    blob_id: str
    data: bytes
    num_chunks: int


@pytest.fixture
def blob(tmp_path: Path) -> Blob:
    """A multi-chunk blob of random bytes in an on-disk store (the serving side's)."""
    data = os.urandom(BLOB_SIZE)
    store = Store.open(tmp_path / "serving-store")
    blob_id = store.put_bytes(data, chunk_size=CHUNK_SIZE)
    num_chunks = store.manifest(blob_id).num_chunks
    assert num_chunks == 49
    return Blob(store, blob_id, data, num_chunks)


async def test_blobnet_fetches_blob_go_serves(
    p2pd_binary: Path, short_dir: Path, tmp_path: Path, blob: Blob
) -> None:
    server = BlobServer(blob.store)
    served: list[StreamInfo] = []

    async def go_blob_handler(info: StreamInfo, conn: DaemonConn) -> None:
        served.append(info)
        await server.handle_stream(DaemonStream(conn, info.peer))

    with trio.fail_after(TIMEOUT_S):
        async with (
            run_daemon(p2pd_binary, short_dir) as daemon,
            daemon.stream_handler(
                short_dir / "h.sock", [messages.Version.V1_0.protocol_id], go_blob_handler
            ),
            open_node(tmp_path / "fetching-store", dht=False) as node,
        ):
            go_raw_id, go_addrs = await daemon.identify()
            go_id = ID(go_raw_id)
            provider = f"{next(a for a in go_addrs if '/tcp/' in str(a))}/p2p/{go_id}"
            got = await node.fetch(blob.blob_id, providers=[provider], announce=False)
            assert got == blob.blob_id

            muxed = muxed_conn_to(node.host, go_id)
            assert_fast(muxed)
            assert muxed.is_initiator, "blobnet dialled the go provider"

            assert await trio.to_thread.run_sync(node.store.has, blob.blob_id)
            path = await trio.to_thread.run_sync(node.store.path, blob.blob_id)
            assert await trio.to_thread.run_sync(path.read_bytes) == blob.data
            assert await trio.to_thread.run_sync(node.store.verify, blob.blob_id) == []

    # Every stream came from the blobnet node, over go, for the blob protocol.
    assert {(info.peer, info.proto) for info in served} == {
        (node.host.get_id().to_bytes(), messages.Version.V1_0.protocol_id)
    }
    # A manifest stream, then a `have` stream whose peer runs two request streams.
    assert len(served) >= 3, f"only {len(served)} streams served"
    stats = server.stats
    assert stats.requests["ManifestRequest"] >= 1
    assert stats.requests["HaveRequest"] >= 1
    assert stats.requests["GetRequest"] >= 4, stats.requests  # 49 chunks, 16 per request
    # One provider: no endgame copies, so each chunk went over go exactly once.
    assert stats.chunks_sent == blob.num_chunks
    assert stats.bytes_sent == BLOB_SIZE
    assert stats.protocol_errors == 0
    assert stats.busy_rejections == 0


def _split_gets(num_chunks: int) -> list[list[tuple[tuple[int, int], ...]]]:
    """The chunk ranges of two streams' `get` requests: alternate RANGE_CHUNKS-chunk ranges
    to each stream, RANGES_PER_GET ranges per request (so ranges are never adjacent)."""
    ranges = [
        (start, min(start + RANGE_CHUNKS, num_chunks))
        for start in range(0, num_chunks, RANGE_CHUNKS)
    ]
    per_stream = (ranges[0::2], ranges[1::2])
    return [
        [tuple(mine[i : i + RANGES_PER_GET]) for i in range(0, len(mine), RANGES_PER_GET)]
        for mine in per_stream
    ]


async def _go_fetch(daemon: DaemonClient, peer: bytes, blob_id: str, store: Store) -> str:
    """Fetch `blob_id` from `peer` through streams p2pd opens, as an independent client
    would: manifest (checked against the ID), have, then gets on two streams at once, each
    chunk's BLAKE3 checked against the manifest and written to a partial blob."""
    opened: list[DaemonConn] = []

    async def open_client(chunk_length: proto.ExpectedLength | None = None) -> BlobClient:
        info, conn = await daemon.stream_open(peer, [messages.Version.V1_0.protocol_id])
        opened.append(conn)
        assert info.proto == messages.Version.V1_0.protocol_id
        assert info.peer == peer
        return BlobClient(DaemonStream(conn, info.peer), chunk_length)

    try:
        first = await open_client()
        raw = await first.manifest(blob_id)
        assert isinstance(raw, bytes), raw
        assert blake3.blake3(raw).hexdigest() == blob_id, "manifest does not match the blob ID"
        manifest = Manifest.decode(raw)

        def chunk_length(index: int) -> int:
            return manifest.chunk_span(index)[1]

        first.conn.set_expected_chunk_length(chunk_length)
        have = await first.have(blob_id)
        assert isinstance(have, messages.HaveResponse), have
        assert have.num_chunks == manifest.num_chunks
        assert all(have.has(i) for i in range(have.num_chunks))

        partial = await trio.to_thread.run_sync(store.begin_partial, manifest)
        received: list[int] = []

        async def on_chunk(index: int, data: memoryview) -> None:
            assert blake3.blake3(data).digest() == manifest.chunk_hash(index), index
            received.append(index)
            await trio.to_thread.run_sync(partial.write_chunk, index, bytes(data))

        async def run_gets(client: BlobClient, gets: list[tuple[tuple[int, int], ...]]) -> None:
            for ranges in gets:
                missing = await client.get(blob_id, ranges, on_chunk)
                assert missing == (), missing

        with partial:
            second = await open_client(chunk_length)
            first_gets, second_gets = _split_gets(manifest.num_chunks)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_gets, first, first_gets)
                nursery.start_soon(run_gets, second, second_gets)
            assert sorted(received) == list(range(manifest.num_chunks)), "chunk missing or twice"
            return await trio.to_thread.run_sync(partial.publish)
    finally:
        for conn in opened:
            await conn.aclose()


async def test_go_fetches_blob_blobnet_serves(
    p2pd_binary: Path, short_dir: Path, tmp_path: Path, blob: Blob
) -> None:
    fresh = Store.open(tmp_path / "go-client-store")
    with trio.fail_after(TIMEOUT_S):
        async with (
            run_daemon(p2pd_binary, short_dir) as daemon,
            open_node(blob.store, dht=False) as node,
        ):
            go_raw_id, _ = await daemon.identify()
            go_id = ID(go_raw_id)
            node_id = node.host.get_id().to_bytes()
            await daemon.connect(node_id, node.host.get_addrs())
            muxed = await wait_connected(node.host, go_id)
            assert_fast(muxed)
            assert not muxed.is_initiator, "go dialled, so blobnet must be the responder"

            assert await _go_fetch(daemon, node_id, blob.blob_id, fresh) == blob.blob_id
            # The go side closed its streams; the server finishes them cleanly.
            with trio.fail_after(5):
                while node.server.streams_per_peer:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            stats = node.server.stats
            assert stats.requests == {"ManifestRequest": 1, "HaveRequest": 1, "GetRequest": 4}
            assert stats.chunks_sent == blob.num_chunks
            assert stats.bytes_sent == BLOB_SIZE
            assert stats.protocol_errors == 0
            # Still the same fast connection: nothing was redialled.
            assert muxed_conn_to(node.host, go_id) is muxed

    assert fresh.has(blob.blob_id)
    assert fresh.path(blob.blob_id).read_bytes() == blob.data
    assert fresh.verify(blob.blob_id) == []
