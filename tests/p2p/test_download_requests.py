"""A download's stream workers (p2p.fetch.download_requests), built alone: a real scheduler,
lanes, tally, buffer pool and chunk writer into a partial blob on disk, each stream an
in-memory one with a real ServerConnection behind it. A worker fetches every chunk a
provider holds, verified and written, and gives back its lane and every buffer; a provider
that sends a corrupt chunk is banned and penalized, and nothing of it is written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio
from fake_stream import FakeStream

from blobstore import Manifest, Store
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.buffers import ChunkBuffers
from p2p.fetch.chunk_writer import ChunkWriter
from p2p.fetch.download_lanes import Lanes
from p2p.fetch.download_parts import Changes
from p2p.fetch.download_requests import Requests
from p2p.fetch.download_tally import Tally
from p2p.fetch.sched_records import SchedulerConfig
from p2p.fetch.scheduler import Scheduler
from p2p.fetch.scores import PeerScores

CHUNK = 64 * 1024
DATA = os.urandom(20 * CHUNK + 77)  # 21 chunks: more than one 16-chunk request
MANIFEST = Manifest.of_bytes(DATA, chunk_size=CHUNK)


def chunk_length(index: int) -> int:
    return MANIFEST.chunk_span(index)[1]


class Network:
    """Every stream answers ``get`` with the blob's chunks, each corrupted if ``corrupt``."""

    def __init__(self, corrupt: bool = False) -> None:
        self.corrupt = corrupt
        self.opened = 0

    async def open_blob_stream(self, peer: str) -> Any:
        await trio.lowlevel.checkpoint()
        self.opened += 1
        return FakeStream(self.serve)

    def serve(self, server: proto.ServerConnection, req: messages.Request) -> tuple[bytes, bool]:
        assert isinstance(req, messages.GetRequest)
        out = bytearray()
        for start, stop in req.ranges:
            for i in range(start, stop):
                offset, length = MANIFEST.chunk_span(i)
                body = bytearray(DATA[offset : offset + length])
                if self.corrupt:
                    body[0] ^= 0xFF
                out += server.send_chunk_header(i, len(body)) + body
        return bytes(out + server.send_response(messages.End(()))), False


async def run_worker(
    tmp_path: Path, peer: str, network: Network, scores: PeerScores
) -> tuple[Scheduler, Lanes, Tally, ChunkBuffers, list[int]]:
    """One worker of ``peer`` on lane 0 until it ends; the parts, and the chunks missing."""
    store = Store.open(tmp_path / "s")
    partial = store.begin_partial(MANIFEST)
    try:
        config = SchedulerConfig()
        scheduler = Scheduler(MANIFEST.num_chunks, chunk_length, (), config)
        scheduler.add_peer(peer, trio.current_time())
        changes = Changes()
        tally = Tally(MANIFEST, scheduler, None, trio.current_time())
        lanes = Lanes(scheduler, changes, None)
        lanes.start(peer)
        buffers = ChunkBuffers(CHUNK, 4)
        async with ChunkWriter(partial) as writer:
            requests = Requests(
                network,
                MANIFEST.blob_id,
                chunk_length,
                scheduler,
                config,
                lanes=lanes,
                changes=changes,
                tally=tally,
                buffers=buffers,
                writer=writer,
                partial=partial,
                scores=scores,
            )
            with trio.fail_after(20):
                await requests.stream_worker(peer, None, 0)
        return scheduler, lanes, tally, buffers, partial.missing()
    finally:
        partial.close()


async def test_a_worker_fetches_every_chunk_verified_and_gives_back_its_lane_and_buffers(
    tmp_path: Path,
) -> None:
    scores = PeerScores()
    scheduler, lanes, tally, buffers, missing = await run_worker(
        tmp_path, "seed", Network(), scores
    )
    assert scheduler.done and missing == []
    assert tally.new_bytes == {"seed": len(DATA)} and tally.duplicate_bytes == 0
    assert tally.first_body_at is not None
    assert lanes.load("seed") == [0]
    assert buffers.in_use == 0
    assert scores.score("seed", trio.current_time()) == 0.0


async def test_a_corrupt_chunk_bans_and_penalizes_its_provider_and_nothing_of_it_is_written(
    tmp_path: Path,
) -> None:
    scores = PeerScores()
    network = Network(corrupt=True)
    scheduler, lanes, tally, buffers, missing = await run_worker(tmp_path, "liar", network, scores)
    stats = scheduler.stats_of("liar")
    assert stats is not None and stats.banned
    assert missing == list(range(MANIFEST.num_chunks))
    assert tally.new_bytes == {}
    # Penalized for this download (the score decays from the moment it was counted).
    assert scores.score("liar", trio.current_time()) == pytest.approx(1.0, rel=1e-3)
    assert lanes.load("liar") == [0]
    assert buffers.in_use == 0
    assert network.opened == 1  # banned at once: no second stream
