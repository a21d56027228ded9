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
import trio.testing
from fake_stream import FakeStream
from thread_clock import thread_aware_clock

from blobstore import Manifest, NoSpace, PartialBlob, Store
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.buffers import ChunkBuffers
from p2p.errors import unwrap_single
from p2p.fetch import download_parts, downloader
from p2p.fetch.sched_records import SchedulerConfig
from p2p.fetch.scores import PeerScores

CHUNK = 64 * 1024
DATA = os.urandom(40 * CHUNK + 123)  # 41 chunks: more than two 16-chunk requests
MANIFEST = Manifest.of_bytes(DATA, chunk_size=CHUNK)
PARTS = [DATA[o : o + n] for o, n in (MANIFEST.chunk_span(i) for i in range(MANIFEST.num_chunks))]


def serving(flip: frozenset[int] = frozenset()) -> FakeStream:
    """A provider holding the whole blob; chunks in ``flip`` are sent corrupted."""

    def serve(server: proto.ServerConnection, req: messages.Request) -> tuple[bytes, bool]:
        if isinstance(req, messages.ManifestRequest):
            return server.send_response(messages.ManifestResponse(MANIFEST.encode())), False
        n = MANIFEST.num_chunks
        if isinstance(req, messages.HaveRequest):
            bits = bytes([0xFF] * (n // 8) + [(1 << (n % 8)) - 1])
            return server.send_response(messages.HaveResponse(n, bits)), False
        assert isinstance(req, messages.GetRequest)
        out = bytearray()
        for start, stop in req.ranges:
            for i in range(start, stop):
                body = bytearray(PARTS[i])
                if i in flip:
                    body[0] ^= 0xFF
                out += server.send_chunk_header(i, len(body)) + body
        return bytes(out + server.send_response(messages.End(()))), False

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


async def fetch(
    store: Store, network: Network, config: SchedulerConfig | None = None
) -> list[download_parts.Progress]:
    reports: list[download_parts.Progress] = []
    try:
        with trio.fail_after(20):
            await downloader.download_blob(
                network,
                store,
                MANIFEST.blob_id,
                providers=list(network.flips),
                progress=reports.append,
                config=config,
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
    pools = track_pools(monkeypatch)
    store = Store.open(tmp_path / "s")
    every_chunk = frozenset(range(MANIFEST.num_chunks))
    network = Network({"liar": every_chunk, "honest": frozenset()})
    reports = await fetch(store, network, SchedulerConfig(hash_on_arrival=hash_on_arrival))
    assert store.path(MANIFEST.blob_id).read_bytes() == DATA
    assert store.verify(MANIFEST.blob_id) == []
    assert [pool.in_use for pool in pools] == [0]
    final = reports[-1]
    assert final.finished
    assert final.peers["liar"].banned
    assert final.new_bytes.get("liar", 0) == 0
    assert final.new_bytes["honest"] == len(DATA)


# --- deadlines, memory of liars, round trips (virtual time) -----------------------------


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    """Virtual time that jumps once every task has been blocked for 10 ms of real time,
    and never while the store works in a thread (thread_clock says why)."""
    return thread_aware_clock(monkeypatch, threshold=0.01).clock


class Delayed(FakeStream):
    """A FakeStream whose answers arrive ``rtt`` (virtual) seconds after each request."""

    def __init__(self, serve: Any, rtt: float) -> None:
        super().__init__(serve)
        self.rtt = rtt
        self.ready_at = 0.0

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self.ready_at = trio.current_time() + self.rtt
        await super().write(data)

    async def read(self, n: int | None = None) -> bytes:
        await trio.sleep_until(self.ready_at)
        return await super().read(n)


class Recording:
    """Providers by name; records each request (peer, kind, virtual time) it serves.
    ``stall_first_get``: the first `get` stream of that peer never answers."""

    def __init__(
        self,
        flips: dict[str, frozenset[int]],
        *,
        rtt: float = 0.0,
        stall_first_get: str | None = None,
    ) -> None:
        self.flips = flips
        self.rtt = rtt
        self.stall_first_get = stall_first_get
        self.requests: list[tuple[str, str, float]] = []

    async def open_blob_stream(self, peer: str) -> Any:
        await trio.lowlevel.checkpoint()
        inner = serving(self.flips[peer])

        def serve(server: proto.ServerConnection, req: messages.Request) -> tuple[bytes, bool]:
            kind = type(req).__name__
            self.requests.append((peer, kind, trio.current_time()))
            if isinstance(req, messages.GetRequest) and peer == self.stall_first_get:
                self.stall_first_get = None
                return b"", False  # never answers: only the request deadline ends it
            return inner.serve(server, req)

        return Delayed(serve, self.rtt) if self.rtt else FakeStream(serve)


async def test_a_get_that_never_answers_is_ended_by_its_deadline(
    tmp_path: Path, virtual_clock: trio.abc.Clock
) -> None:
    """Regression guard: without the request deadline a
    provider's stalled `get` holds its chunks forever and the fetch never ends."""
    store = Store.open(tmp_path / "s")
    network = Recording({"only": frozenset()}, stall_first_get="only")
    start = trio.current_time()
    with trio.fail_after(600):  # virtual seconds: far beyond any deadline
        await downloader.download_blob(network, store, MANIFEST.blob_id, providers=["only"])
    assert store.verify(MANIFEST.blob_id) == []
    gets = [t for _, kind, t in network.requests if kind == "GetRequest"]
    assert len(gets) >= 3  # the stalled one, and the retry of its chunks after it
    # It ended at its deadline (base + bytes / minimum rate), not much later.
    limit = SchedulerConfig().request_timeout_base + len(DATA) / (256 * 1024)
    assert trio.current_time() - start < limit + 5


async def test_a_peer_that_lied_is_remembered_by_the_next_download(
    tmp_path: Path, virtual_clock: trio.abc.Clock
) -> None:
    """A liar banned in one download gets no `get` in the next one while an
    honest provider can serve it; the memory decays (PeerScores)."""
    scores = PeerScores()
    every_chunk = frozenset(range(MANIFEST.num_chunks))
    first = Recording({"liar": every_chunk, "honest": frozenset()})
    store = Store.open(tmp_path / "one")
    await downloader.download_blob(
        first, store, MANIFEST.blob_id, providers=["liar", "honest"], scores=scores
    )
    assert scores.distrusted("liar", trio.current_time())
    assert not scores.distrusted("honest", trio.current_time())
    again = Recording({"liar": every_chunk, "honest": frozenset()})
    await downloader.download_blob(
        again,
        Store.open(tmp_path / "two"),
        MANIFEST.blob_id,
        providers=["liar", "honest"],
        scores=scores,
    )
    assert ("liar", "GetRequest") not in {(p, k) for p, k, _ in again.requests}
    assert ("honest", "GetRequest") in {(p, k) for p, k, _ in again.requests}


async def test_the_first_chunk_comes_two_round_trips_after_the_start(
    tmp_path: Path, virtual_clock: trio.abc.Clock
) -> None:
    """`have` goes out beside `manifest`, so the first `get` leaves after one round trip
    and its first chunk lands after the second (not the third)."""
    rtt = 1.0
    network = Recording({"far": frozenset()}, rtt=rtt)
    store = Store.open(tmp_path / "s")
    start = trio.current_time()
    await downloader.download_blob(network, store, MANIFEST.blob_id, providers=["far"])
    first_get = min(t for _, kind, t in network.requests if kind == "GetRequest")
    assert first_get - start == pytest.approx(rtt, abs=0.05)
    kinds = [k for _, k, t in network.requests if t - start < rtt / 2]
    assert sorted(kinds) == ["HaveRequest", "ManifestRequest"]
    assert store.verify(MANIFEST.blob_id) == []


@pytest.mark.parametrize(
    ("timed", "kernel", "seen"),
    [
        (0.40, 0.20, 0.20),  # a new connection's first request: it waited out the setup too
        (0.21, 0.20, 0.20),  # a later one: one round trip and the server's time
        (1e-3, 5e-5, 1e-3 - 5e-5),  # loopback: the server's time is all there is
        (0.30, None, 0.30),  # no kernel figure (another stack or OS): as timed
    ],
)
def test_a_requests_round_trip_is_corrected_by_the_kernels_rtt(
    monkeypatch: pytest.MonkeyPatch, timed: float, kernel: float | None, seen: float
) -> None:
    """The first `have` on a connection dialled without waiting for the muxer's answer
    takes two round trips; the scheduler and stripe growth must see one (a 100 ms path
    read as 200 ms is striped eight ways instead of four)."""
    monkeypatch.setattr(download_parts, "kernel_rtt", lambda stream: kernel)
    assert download_parts.path_rtt(timed, object()) == pytest.approx(seen)
