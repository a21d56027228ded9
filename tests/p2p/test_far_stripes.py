"""A provider across an ocean: its extra connections are dialled beside the
manifest request, not after it (p2p.fetch.download_probes.HaveProbes), and its bulk streams carry
pipelined requests (p2p.fetch.downloader rule 10): the next `get` is at the server before the
current answer ends, so a lane does not idle a round trip between two requests. A provider
that speaks only 1.0.0 refuses the 1.1.0 proposal; the fetch then goes on one request at a
time, at no cost to that provider.

In-process, in virtual time: each stream's far end is a real ServerConnection (answering
in order, as a blobnet server does), and the "network" opens as many connections as the
fetch asks for."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from fake_stream import FakeStream
from thread_clock import ThreadWatch, thread_aware_clock

from blobstore import Manifest, Store
from blobstore.writing import Writer
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.shell import OptimisticStream, multistream_message, proposal
from p2p.fetch import download_parts, downloader
from p2p.fetch.sched_records import SchedulerConfig
from p2p.fetch.scheduler import Scheduler
from p2p.fetch.striping import StripeConfig

RTT = 0.2  # virtual seconds: an intercontinental path, so the fetch stripes at once
REFUSAL = multistream_message(b"/multistream/1.0.0") + multistream_message(b"na")
CHUNK = 64 * 1024
DATA = bytes(range(256)) * (CHUNK // 256) * 200  # 200 chunks
MANIFEST = Manifest.of_bytes(DATA, chunk_size=CHUNK)
# Small requests, so that every lane has many in turn.
CONFIG = SchedulerConfig(max_chunks_per_request=2)


def serve_blob(
    server: proto.ServerConnection, req: messages.Request, decline: bool = False
) -> tuple[bytes, bool]:
    """A provider holding the whole blob; ``decline``: one that others fetch from, which
    declines a `try_get` (1.5.0)."""
    if isinstance(req, messages.ManifestRequest):
        return server.send_response(messages.ManifestResponse(MANIFEST.encode())), False
    n = MANIFEST.num_chunks
    if isinstance(req, messages.HaveRequest):
        bits = bytes([0xFF] * (n // 8) + ([(1 << (n % 8)) - 1] if n % 8 else []))
        return server.send_response(messages.HaveResponse(n, bits)), False
    assert isinstance(req, messages.GetRequest)
    if req.tentative and decline:
        return server.send_response(messages.End(server.unsent_indices())), False
    out = bytearray()
    for start, stop in req.ranges:
        for i in range(start, stop):
            offset, length = MANIFEST.chunk_span(i)
            out += server.send_chunk_header(i, length) + DATA[offset : offset + length]
    return bytes(out + server.send_response(messages.End(()))), False


class Lane(FakeStream):
    """One stream; answers reach the client a round trip after their request, and the
    stream notes every `get` that arrived while an earlier answer was still unread."""

    def __init__(
        self, network: StripedFake, pipelined: bool, echo: bytes, tentative: bool = False
    ) -> None:
        super().__init__(network.serve_as(self))
        if pipelined:
            self.server = proto.ServerConnection(
                messages.Version.V1_5 if tentative else messages.Version.V1_1
            )
        self.refused = pipelined and network.refuse
        self.reset_first = self.refused and network.reset_first
        self.inbound += echo
        self.ready_at = 0.0

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.refused:
            return  # nothing after the `na` is read, as a real listener does
        self.ready_at = max(self.ready_at, trio.current_time() + RTT)
        await super().write(data)

    async def read(self, n: int | None = None) -> bytes:
        await trio.sleep_until(self.ready_at)
        if self.reset_first:
            # The listener took the request after its `na` for another proposal and reset
            # the stream; the reset overtook the `na`.
            raise trio.BrokenResourceError("stream was reset")
        return await super().read(n)


class StripedFake:
    """A provider of the whole blob on up to ``StripeConfig.max_connections`` extra
    connections. ``refuse``: it serves 1.0.0 only and answers a 1.1.0 proposal `na`.
    ``decline``: others fetch the blob from it, so it declines a `try_get`."""

    def __init__(
        self, *, refuse: bool = False, reset_first: bool = False, decline: bool = False
    ) -> None:
        self.refuse = refuse
        self.reset_first = reset_first
        self.decline = decline
        self.extra = 0
        self.pipelined_gets = 0  # gets that arrived behind an unread answer
        self.gets = 0
        self.proposals: list[bool] = []  # pipelined or not, per bulk stream opened
        self.dialled_at: list[float] = []
        self.asked: list[tuple[str, float]] = []  # (request kind, virtual time)
        self.sent: dict[int, int] = {}  # chunk index -> times sent

    def serve_as(self, lane: Lane | None) -> Any:
        def serve(server: proto.ServerConnection, req: messages.Request) -> tuple[bytes, bool]:
            tentative = isinstance(req, messages.GetRequest) and req.tentative
            self.asked.append(("TryGet" if tentative else type(req).__name__, trio.current_time()))
            if tentative and self.decline:
                return serve_blob(server, req, decline=True)
            if isinstance(req, messages.GetRequest):
                self.gets += 1
                for start, stop in req.ranges:
                    for i in range(start, stop):
                        self.sent[i] = self.sent.get(i, 0) + 1
                if lane is not None and lane.inbound:
                    self.pipelined_gets += 1
            return serve_blob(server, req)

        return serve

    async def open_blob_stream(self, peer: str) -> Any:
        await trio.lowlevel.checkpoint()
        return Lane(self, False, b"")

    async def open_blob_stream_on(
        self, peer: str, lane: int, *, pipelined: bool = False, tentative: bool = False
    ) -> Any:
        await trio.lowlevel.checkpoint()
        self.proposals.append(pipelined)
        if not pipelined:
            return Lane(self, False, b"")
        ask = proposal(
            messages.Version.V1_5.protocol_id if tentative else messages.Version.V1_1.protocol_id
        )
        lane = Lane(self, True, REFUSAL if self.refuse else ask, tentative)
        return OptimisticStream(lane, ask)

    async def add_connection(self, peer: str) -> bool:
        self.dialled_at.append(trio.current_time())
        await trio.sleep(2 * RTT)  # TCP, then Noise
        self.extra += 1
        return True

    def connection_count(self, peer: str) -> int:
        return 1 + self.extra

    def connection_rtt(self, peer: str) -> float | None:
        return RTT


async def fetch(
    tmp_path: Path,
    network: StripedFake,
    config: SchedulerConfig = CONFIG,
    *,
    providers: Sequence[str] = ("far",),
    connections: int = 4,
    name: str = "s",
    **options: Any,
) -> Store:
    """Fetch the blob from ``providers`` over ``network`` into a store of its own and check
    it; ``options`` go to download_blob as they are."""
    store = Store.open(tmp_path / name)
    with trio.fail_after(300):
        await downloader.download_blob(
            network,
            store,
            MANIFEST.blob_id,
            providers=providers,
            config=config,
            stripe_config=StripeConfig(max_connections=connections),
            **options,
        )
    assert store.verify(MANIFEST.blob_id) == []
    return store


@pytest.fixture
def thread_watch(monkeypatch: pytest.MonkeyPatch) -> ThreadWatch:
    """Virtual time that jumps once every task has been blocked for 10 ms of real time,
    and never while the store works in a thread (thread_clock says why)."""
    return thread_aware_clock(monkeypatch, threshold=0.01)


@pytest.fixture
def virtual_clock(thread_watch: ThreadWatch) -> trio.testing.MockClock:
    return thread_watch.clock


async def test_striped_bulk_streams_carry_pipelined_requests(
    tmp_path: Path, virtual_clock: trio.abc.Clock
) -> None:
    network = StripedFake()
    await fetch(tmp_path, network)
    assert network.extra == 4
    assert any(network.proposals)  # bulk streams proposed 1.1.0
    assert network.pipelined_gets > 0, "no get was sent before the answer ahead of it"


@pytest.mark.parametrize(
    ("reset_first", "swarming"), [(False, False), (True, False), (False, True)]
)
async def test_a_provider_that_speaks_only_1_0_0_is_served_one_request_at_a_time(
    tmp_path: Path, virtual_clock: trio.abc.Clock, reset_first: bool, swarming: bool
) -> None:
    """Swarming, the first request's proposal is 1.5.0 (a `try_get`), which the provider
    refuses as well: the manifest is then asked on 1.0.0, and its bulk streams find out
    for themselves that it does not pipeline."""
    network = StripedFake(refuse=True, reset_first=reset_first)
    config = dataclasses.replace(CONFIG, defer_to_partial_holders=swarming)
    await fetch(tmp_path, network, config)
    assert network.pipelined_gets == 0
    # One refusal, then 1.0.0 streams only: the provider was not dropped as failing.
    assert network.proposals.count(True) <= network.extra
    assert not all(network.proposals)


async def test_the_first_chunk_is_asked_with_the_manifest(
    tmp_path: Path, virtual_clock: trio.abc.Clock
) -> None:
    """The first provider asked gets the manifest request and a `get` of
    the first chunk together, on one pipelined stream, a round trip before the manifest
    could say what to ask; the answer is read (and verified) once the manifest is in, and
    that chunk is asked of nobody again."""
    network = StripedFake()
    await fetch(tmp_path, network)
    manifest_at = min(t for kind, t in network.asked if kind == "ManifestRequest")
    first_get = min(t for kind, t in network.asked if kind == "GetRequest")
    assert first_get == manifest_at
    assert network.sent[download_parts.SPECULATIVE_CHUNK] == 1
    assert set(network.sent) == set(range(MANIFEST.num_chunks))


async def test_a_slow_store_thread_does_not_move_virtual_time(
    tmp_path: Path,
    virtual_clock: trio.abc.Clock,
    thread_watch: ThreadWatch,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store's work takes real time (here 0.3 s for each partial blob it opens, as a
    durable create can on a loaded machine); virtual time waits for it, so no request
    times out meanwhile and the first chunk is still asked once."""
    begin_partial = Writer.begin_partial

    def slow_begin_partial(self: Writer, manifest: Manifest) -> Any:
        time.sleep(0.3)
        return begin_partial(self, manifest)

    monkeypatch.setattr(Writer, "begin_partial", slow_begin_partial)
    network = StripedFake()
    await fetch(tmp_path, network)
    assert thread_watch.held > 0
    assert network.sent[downloader.SPECULATIVE_CHUNK] == 1
    assert set(network.sent) == set(range(MANIFEST.num_chunks))


@pytest.mark.parametrize("others_fetch", [False, True])
async def test_a_swarming_fetcher_asks_its_first_chunk_as_a_try_get(
    tmp_path: Path, virtual_clock: trio.abc.Clock, others_fetch: bool
) -> None:
    """In a swarm every fetcher's first request goes to the seeder, so a first chunk asked
    with each manifest would be the one chunk the seeder sends N times. It is asked as a
    `try_get` (1.5.0): a seeder alone with this fetcher sends it a round trip sooner; one
    that others fetch from declines it, and the fetcher asks for that chunk later like
    any other, as one the seeder still holds (the decline is no `missing`)."""
    network = StripedFake(decline=others_fetch)
    await fetch(tmp_path, network, dataclasses.replace(CONFIG, defer_to_partial_holders=True))
    manifest_at = min(t for kind, t in network.asked if kind == "ManifestRequest")
    assert min(t for kind, t in network.asked if kind == "TryGet") == manifest_at
    assert [kind for kind, _ in network.asked].count("TryGet") == 1
    first_get = min(t for kind, t in network.asked if kind == "GetRequest")
    if others_fetch:
        assert first_get >= manifest_at + RTT
    assert network.sent == dict.fromkeys(range(MANIFEST.num_chunks), 1)


async def test_the_providers_a_fetch_is_named_are_its_origins_and_found_ones_are_not(
    tmp_path: Path, virtual_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler spares an origin while a finished fellow can serve ("Origins last"),
    so the downloader must say which providers are origins: those the caller gave and
    those it names later, not those discovery finds."""
    marked: dict[str, bool] = {}
    set_origin = Scheduler.set_origin

    def spy(self: Scheduler, peer: str, origin: bool = True) -> None:
        marked[peer] = origin
        set_origin(self, peer, origin)

    monkeypatch.setattr(Scheduler, "set_origin", spy)
    found_in, found = trio.open_memory_channel[str](1)
    named_in, named = trio.open_memory_channel[str](1)
    found_in.send_nowait("found")
    named_in.send_nowait("mirror")
    found_in.close()
    named_in.close()
    config = dataclasses.replace(CONFIG, defer_to_partial_holders=True)
    await fetch(tmp_path, StripedFake(), config, more_providers=found, named_providers=named)
    assert marked == {"far": True, "mirror": True, "found": False}


async def test_the_transfer_rate_counts_from_the_first_byte_like_raw_tcp(
    tmp_path: Path, virtual_clock: trio.abc.Clock
) -> None:
    """The WAN bench compares a fetch's rate with raw TCP's, which runs from the first
    byte received to the last; a fetch's first byte comes a request's round trip after
    it starts, and that round trip is not part of the transfer rate."""
    seen: list[download_parts.Progress] = []
    # Swarm mode, and a seeder that others fetch from: it declines the first chunk asked
    # with the manifest, so the first get is sent once the download has started.
    swarm = dataclasses.replace(CONFIG, defer_to_partial_holders=True)
    await fetch(tmp_path, StripedFake(decline=True), swarm, progress=seen.append)
    final = seen[-1]
    assert final.finished and final.done_bytes == MANIFEST.size
    receiving = final.done_bytes / final.transfer_rate_bytes_per_s
    assert final.transfer_rate_bytes_per_s > final.rate_bytes_per_s
    assert final.elapsed - receiving == pytest.approx(RTT, rel=0.25)


class StuckFake(StripedFake):
    """ "far" as above, and "stuck", which answers `manifest` and `have` but never a `get`
    (a provider that stalls without closing anything)."""

    async def open_blob_stream(self, peer: str) -> Any:
        lane = await super().open_blob_stream(peer)
        return self._stall(lane) if peer == "stuck" else lane

    async def open_blob_stream_on(
        self, peer: str, lane: int, *, pipelined: bool = False, tentative: bool = False
    ) -> Any:
        stream = await super().open_blob_stream_on(
            peer, lane, pipelined=pipelined, tentative=tentative
        )
        if peer != "stuck":
            return stream
        self._stall(stream.stream if isinstance(stream, OptimisticStream) else stream)
        return stream

    def _stall(self, lane: Lane) -> Lane:
        serve = lane.serve

        def stalled(server: proto.ServerConnection, req: messages.Request) -> tuple[bytes, bool]:
            if isinstance(req, messages.GetRequest):
                return b"", False
            return serve(server, req)  # type: ignore[no-any-return]

        lane.serve = stalled
        return lane

    def connection_count(self, peer: str) -> int:
        return 1


class ForgetfulFake(StripedFake):
    """ "far" as above, and "forgetful", which answers the manifest request (and the
    first chunk's `get` beside it) but then says it lacks the blob when asked `have`.
    Notes when each of forgetful's streams was reset."""

    def __init__(self) -> None:
        super().__init__()
        self.forgetful_resets: list[float] = []

    async def open_blob_stream(self, peer: str) -> Any:
        return self._watch(peer, await super().open_blob_stream(peer))

    async def open_blob_stream_on(
        self, peer: str, lane: int, *, pipelined: bool = False, tentative: bool = False
    ) -> Any:
        stream = await super().open_blob_stream_on(
            peer, lane, pipelined=pipelined, tentative=tentative
        )
        self._watch(peer, stream.stream if isinstance(stream, OptimisticStream) else stream)
        return stream

    def _watch(self, peer: str, lane: Lane) -> Lane:
        if peer != "forgetful":
            return lane
        serve = lane.serve

        def forgetful(server: proto.ServerConnection, req: messages.Request) -> tuple[bytes, bool]:
            if isinstance(req, messages.HaveRequest):
                gone = messages.ErrorResponse(messages.ErrorCode.NOT_FOUND, "deleted meanwhile")
                return server.send_response(gone), False
            return serve(server, req)  # type: ignore[no-any-return]

        async def reset() -> None:
            self.forgetful_resets.append(trio.current_time())

        lane.serve = forgetful
        lane.reset = reset  # type: ignore[method-assign]
        return lane

    def connection_count(self, peer: str) -> int:
        return 1


async def test_a_provider_dropped_at_have_gets_its_first_chunk_stream_reset_at_once(
    tmp_path: Path, virtual_clock: trio.abc.Clock
) -> None:
    """The first provider asked gets the manifest request and chunk 0's `get` on one
    stream. If it then turns out useless (its `have` says it lacks the blob), that stream
    is reset as its task ends, not held open with its answer unread until the fetch from
    the others is over."""
    network = ForgetfulFake()
    send, more = trio.open_memory_channel[str](1)

    async def discover() -> None:
        await trio.sleep(5 * RTT)  # "far" is found later, so forgetful is asked first
        await send.send("far")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(discover)
        await fetch(tmp_path, network, providers=["forgetful"], connections=1, more_providers=more)
    done = trio.current_time()
    assert network.proposals[0], "forgetful was asked for the first chunk with the manifest"
    assert len(network.forgetful_resets) >= 2  # the `have` stream and the speculative one
    assert max(network.forgetful_resets) < 5 * RTT < done


async def test_a_provider_that_stalls_does_not_hold_the_tail(
    tmp_path: Path, virtual_clock: trio.abc.Clock
) -> None:
    """ "stuck" takes requests and never answers them, nor closes anything. Once "far" has
    emptied the pool it copies stuck's requests, which are late by then (endgame), so the
    fetch ends about when far alone would have ended, not when stuck's requests time out."""

    async def took(network: StripedFake, providers: list[str], name: str) -> float:
        start = trio.current_time()
        await fetch(tmp_path, network, providers=providers, connections=1, name=name)
        return trio.current_time() - start

    alone = await took(StripedFake(), ["far"], "alone")
    with_stuck = await took(StuckFake(), ["far", "stuck"], "stuck")
    # The copies cost a round trip or two of far's, not the stalled requests' timeout.
    assert with_stuck < alone + download_parts.IDLE_WAKE_S / 2


async def test_a_far_providers_lanes_are_dialled_beside_the_manifest_request(
    tmp_path: Path, virtual_clock: trio.abc.Clock
) -> None:
    """Dialled once the manifest and `have` were in, the lanes came up two round trips
    after the download started; dialled beside the manifest request, they are up one round
    trip after it (a dial takes two)."""
    network = StripedFake()
    start = trio.current_time()
    await fetch(tmp_path, network)
    manifest_at = min(t for kind, t in network.asked if kind == "ManifestRequest")
    assert len(network.dialled_at) == 4  # four bulk lanes; the first becomes the control lane
    assert max(network.dialled_at) - start < RTT / 2
    assert max(network.dialled_at) <= manifest_at + RTT / 2
