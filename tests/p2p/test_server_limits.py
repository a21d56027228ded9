"""The server's budgets, deadlines and honesty about what it holds: send buffers and streams
budgeted, a blob removed while serving is not found at once, the send deadline and a
plaintext peer refused.

An in-process ``BlobServer`` on a real host over TCP on 127.0.0.1 and a real store; the
clients are py-libp2p hosts that speak the protocol by hand, so they can misbehave (open
`get`s and never read them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from multiaddr import Multiaddr

from blobstore import Store
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob import server as server_mod
from p2p.blob.server import BlobServer, Budget, ServerLimits
from p2p.transport import host as host_mod
from p2p.transport.host import build_host

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    # py-libp2p 0.8.1's host leaves its TCP sockets to the garbage collector on shutdown.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

MiB = 1024 * 1024
CHUNK = 1 * MiB


# --- Budget bookkeeping -------------------------------------------------------------------


def test_budget_counts_per_peer_per_address_and_in_all() -> None:
    budget = Budget("bytes", total=10, per_peer=4, per_ip=6)
    assert budget.acquire("p1", "a", 4) is None
    assert "your peer" in (budget.acquire("p1", "a", 1) or "")
    # A second identity on the same address: identities are free, addresses are not.
    assert budget.acquire("p2", "a", 2) is None
    assert "your address" in (budget.acquire("p3", "a", 1) or "")
    assert budget.acquire("p4", "b", 4) is None
    assert "the server" in (budget.acquire("p5", "c", 1) or "")
    budget.release("p1", "a", 4)
    assert budget.acquire("p5", "c", 1) is None
    for peer, ip, amount in (("p2", "a", 2), ("p4", "b", 4), ("p5", "c", 1)):
        budget.release(peer, ip, amount)
    assert budget.used == 0 and not budget.by_peer and not budget.by_ip


def test_budget_hold_releases_only_what_it_took() -> None:
    budget = Budget("bytes", total=4, per_peer=4, per_ip=4)
    with budget.hold("p", "a", 3) as refused:
        assert refused is None
        with budget.hold("p", "a", 3) as refused_again:
            assert refused_again is not None
        assert budget.used == 3
    assert budget.used == 0


# --- In-process server --------------------------------------------------------------------


@dataclass
class Served:
    host: Any
    server: BlobServer
    store: Store
    blob_id: str
    root: Path

    @property
    def addr(self) -> Multiaddr:
        return Multiaddr(f"{self.host.get_addrs()[0]}/p2p/{self.host.get_id()}")


@asynccontextmanager
async def served(
    tmp_path: Path,
    size: int = 8 * CHUNK,
    *,
    fast: bool = False,
    limits: ServerLimits | None = None,
) -> AsyncIterator[Served]:
    store = Store.open(tmp_path / "server-store")
    blob_id = store.put_bytes(os.urandom(size), chunk_size=CHUNK)
    host = build_host(create_new_key_pair(), fast=fast)
    server = BlobServer(store, limits=limits)
    server.install(host)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        yield Served(host, server, store, blob_id, tmp_path)


@asynccontextmanager
async def client(target: Served, *, fast: bool = False) -> AsyncIterator[Any]:
    host = build_host(create_new_key_pair(), fast=fast)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        await host.connect(info_from_p2p_addr(target.addr))
        yield host
        await host.get_network().close_peer(target.host.get_id())


async def open_stream(
    host: Any, target: Served, protocol: str = messages.Version.V1_0.protocol_id
) -> Any:
    return await host.new_stream(target.host.get_id(), [TProtocol(protocol)])


async def first_event(stream: Any, request: messages.Request) -> messages.Response | None:
    """Send ``request`` and return the first event of its response (None: reset/closed)."""
    conn = proto.ClientConnection()
    await stream.write(conn.send_request(request))
    with trio.fail_after(20):
        while True:
            try:
                data = await stream.read(256 * 1024)
            except Exception:
                return None
            conn.receive_data(data)
            try:
                event = conn.next_event()
            except messages.RemoteProtocolError:
                return None
            if event is not None:
                return event


def all_chunks(blob_id: str) -> messages.GetRequest:
    return messages.GetRequest(blob_id, ((0, 8),))


async def unread_gets(host: Any, target: Served, count: int) -> list[Any]:
    """``count`` streams that each ask for the whole blob and never read a byte."""
    streams = []
    for _ in range(count):
        stream = await open_stream(host, target)
        await stream.write(messages.encode_request(all_chunks(target.blob_id)))
        streams.append(stream)
    return streams


async def wait_for(predicate: Any, seconds: float) -> bool:
    with trio.move_on_after(seconds):
        while not predicate():  # noqa: ASYNC110 - polling a plain counter, bounded
            await trio.sleep(0.05)
        return True
    return False


# --- Send buffers and streams are budgeted ----------------------------------------------


async def test_unread_gets_hold_at_most_the_peer_budget_and_get_busy(tmp_path: Path) -> None:
    """One identity opens 8 `get`s it never reads. Each holds a 1 MiB send buffer; with a
    per-peer budget of 3 buffers the rest are answered `busy` before any disk read."""
    limits = ServerLimits().with_(max_send_bytes_per_peer=3 * (CHUNK + 64))
    async with served(tmp_path, limits=limits) as target, client(target) as flooder:
        await unread_gets(flooder, target, 3)
        assert await wait_for(lambda: target.server.send_bytes.used == 3 * (CHUNK + 64), 10)
        stream = await open_stream(flooder, target)
        reply = await first_event(stream, all_chunks(target.blob_id))
        assert isinstance(reply, messages.ErrorResponse)
        assert reply.code == messages.ErrorCode.BUSY
        assert target.server.send_bytes.used == 3 * (CHUNK + 64)
        # The refused stream stays usable for what fits.
        have = await first_event(stream, messages.HaveRequest(target.blob_id))
        assert isinstance(have, messages.HaveResponse)


async def test_identities_on_one_address_share_its_budget(tmp_path: Path) -> None:
    limits = ServerLimits().with_(max_send_bytes_per_ip=2 * (CHUNK + 64))
    async with (
        served(tmp_path, limits=limits) as target,
        client(target) as first,
        client(target) as second,
        client(target) as third,
    ):
        await unread_gets(first, target, 1)
        await unread_gets(second, target, 1)
        assert await wait_for(lambda: target.server.send_bytes.used == 2 * (CHUNK + 64), 10)
        reply = await first_event(await open_stream(third, target), all_chunks(target.blob_id))
        assert isinstance(reply, messages.ErrorResponse)
        assert reply.code == messages.ErrorCode.BUSY
        assert "address" in reply.message


async def test_streams_over_the_address_budget_get_busy_after_their_request(
    tmp_path: Path,
) -> None:
    limits = ServerLimits().with_(max_streams_per_ip=2)
    async with (
        served(tmp_path, limits=limits) as target,
        client(target) as first,
        client(target) as second,
    ):
        held = [await open_stream(first, target), await open_stream(first, target)]
        for stream in held:
            await stream.write(b"\0")  # a request begun: the server holds the stream
        assert await wait_for(lambda: target.server.streams.used == 2, 10)
        refused = await open_stream(second, target)
        # Nothing is sent before a request (PROTOCOL.md 7.1 item 6) ...
        with trio.move_on_after(0.3):
            assert await refused.read(100) == b"", "the server spoke before a request"
        # ... and the request is answered `busy`.
        reply = await first_event(refused, messages.HaveRequest(target.blob_id))
        assert isinstance(reply, messages.ErrorResponse)
        assert reply.code == messages.ErrorCode.BUSY


async def test_reader_that_stops_reading_loses_its_stream_at_the_send_deadline(
    tmp_path: Path,
) -> None:
    """Mutation-list item: with the send deadline removed the buffer stays pinned and this
    fails. Deadline here: 1 s + 512 KiB at 64 MiB/s per slice. The server runs blobnet's
    own yamux (as `blob serve` does): py-libp2p's gives up on a zero window after 5 s by
    itself, which would hide a missing deadline."""
    limits = ServerLimits().with_(send_timeout_base=1.0, min_send_rate=64 * MiB)
    async with served(tmp_path, fast=True, limits=limits) as target, client(target) as reader:
        (stream,) = await unread_gets(reader, target, 1)
        assert await wait_for(lambda: target.server.send_bytes.used > 0, 10)
        start = trio.current_time()
        assert await wait_for(lambda: target.server.send_bytes.used == 0, 4.5)
        assert trio.current_time() - start < 4.5
        assert await wait_for(lambda: target.server.streams.used == 0, 5)
        await stream.reset()


# --- The server never claims what it does not have -----------------------------------------


def rot_on_disk(store: Store, blob_id: str, offset: int) -> None:
    """Flip one byte of the stored blob as a failing disk would: behind the page cache."""
    path = store.path(blob_id)
    os.chmod(path, 0o644)
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def test_rotten_chunk_is_never_sent_and_quarantines_the_blob(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with served(tmp_path) as target, client(target) as fetcher:
        rot_on_disk(target.store, target.blob_id, 3 * CHUNK + 17)
        stream = await open_stream(fetcher, target)
        conn = proto.ClientConnection()
        await stream.write(conn.send_request(all_chunks(target.blob_id)))
        events: list[messages.Response] = []
        with trio.fail_after(20), caplog.at_level(logging.WARNING, logger="p2p.blob.server"):
            while not events or isinstance(events[-1], messages.Chunk):
                conn.receive_data(await stream.read(256 * 1024))
                while (event := conn.next_event()) is not None:
                    events.append(event)
                    if not isinstance(event, messages.Chunk):
                        break
        sent = [e.index for e in events if isinstance(e, messages.Chunk)]
        assert 3 not in sent
        assert sent == [0, 1, 2]
        last = events[-1]
        assert isinstance(last, messages.ErrorResponse)
        assert last.code == messages.ErrorCode.INTERNAL
        # One clear line, then the blob is not served any more.
        lines = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
        assert len(lines) == 1 and target.blob_id in lines[0]
        assert target.server.stats.quarantined == 1
        for request in (messages.ManifestRequest(target.blob_id), all_chunks(target.blob_id)):
            reply = await first_event(stream, request)
            assert isinstance(reply, messages.ErrorResponse)
            assert reply.code == messages.ErrorCode.NOT_FOUND


async def test_blob_removed_by_another_process_is_not_found_at_once(tmp_path: Path) -> None:
    """`blob rm` (another process, another Store object) while `blob serve` runs: the
    server must not answer from a cached manifest that it still has the blob."""
    async with served(tmp_path) as target, client(target) as fetcher:
        stream = await open_stream(fetcher, target)
        assert isinstance(
            await first_event(stream, messages.HaveRequest(target.blob_id)), (messages.HaveResponse)
        )
        Store.open(tmp_path / "server-store").rm(target.blob_id)
        for request in (
            messages.ManifestRequest(target.blob_id),
            messages.HaveRequest(target.blob_id),
            all_chunks(target.blob_id),
        ):
            start = trio.current_time()
            reply = await first_event(stream, request)
            assert isinstance(reply, messages.ErrorResponse), request
            assert reply.code == messages.ErrorCode.NOT_FOUND
            assert trio.current_time() - start < 2.0


# --- Error frames survive the reset ------------------------------------------------------


async def test_error_frame_is_readable_after_the_server_gives_up(tmp_path: Path) -> None:
    """The server closes its side and waits RESET_GRACE before resetting, so a client that
    reads a moment later still gets the code. The client runs blobnet's yamux, which like
    go-yamux drops unread data when a reset arrives, so an immediate reset fails this."""
    async with served(tmp_path, fast=True) as target, client(target, fast=True) as peer:
        stream = await open_stream(peer, target)
        await stream.write((2**31).to_bytes(4, "big"))  # header length over the limit
        await trio.sleep(server_mod.RESET_GRACE / 3)
        conn = proto.ClientConnection()
        conn.send_request(messages.ManifestRequest(target.blob_id))  # lets the parser take it
        with trio.fail_after(10):
            conn.receive_data(await stream.read(65536))
        reply = conn.next_event()
        assert isinstance(reply, messages.ErrorResponse)
        assert reply.code == messages.ErrorCode.TOO_LARGE


# --- Mutation list: plaintext is never offered ---------------------------------------------


def test_only_noise_is_offered() -> None:
    offered = host_mod.security_options(create_new_key_pair(), fast=False)
    assert set(offered) == {TProtocol("/noise")}
    assert PLAINTEXT_PROTOCOL_ID not in offered


async def test_a_plaintext_only_peer_cannot_connect(tmp_path: Path) -> None:
    """Adding /plaintext/2.0.0 to the offered security protocols makes this fail."""
    async with served(tmp_path) as target:
        key_pair = create_new_key_pair()
        plain = new_host(
            key_pair=key_pair,
            sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)},
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        )
        async with plain.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            with trio.fail_after(30), pytest.raises(Exception):  # noqa: B017, PT011 - any refusal
                await plain.connect(info_from_p2p_addr(target.addr))
            assert not target.host.get_network().get_connections(plain.get_id())


# --- /blobnet/blob/1.1.0: pipelining ------------------------------------------------------


async def test_pipelined_requests_are_answered_in_order_on_1_1(tmp_path: Path) -> None:
    async with served(tmp_path) as target, client(target) as peer:
        stream = await open_stream(peer, target, messages.Version.V1_1.protocol_id)
        conn = proto.ClientConnection(
            messages.Version.V1_1, max_pipelined=messages.MAX_PIPELINED_REQUESTS
        )
        requests: list[messages.Request] = [
            messages.GetRequest(target.blob_id, ((i, i + 1),)) for i in range(6)
        ]
        requests.insert(2, messages.HaveRequest(target.blob_id))
        await stream.write(b"".join(conn.send_request(r) for r in requests))
        kinds: list[str] = []
        with trio.fail_after(20):
            while conn.outstanding_count:
                conn.receive_data(await stream.read(256 * 1024))
                while (event := conn.next_event()) is not None:
                    kinds.append(
                        f"chunk{event.index}" if isinstance(event, messages.Chunk) else "ok"
                    )
                    assert not isinstance(event, messages.ErrorResponse)
        assert kinds == [
            "chunk0", "ok", "chunk1", "ok", "ok", "chunk2", "ok",
            "chunk3", "ok", "chunk4", "ok", "chunk5", "ok",
        ]  # fmt: skip


async def test_pipelining_on_1_0_is_still_a_violation(tmp_path: Path) -> None:
    async with served(tmp_path) as target, client(target) as peer:
        stream = await open_stream(peer, target, messages.Version.V1_0.protocol_id)
        two = messages.encode_request(messages.HaveRequest(target.blob_id)) * 2
        await stream.write(two)
        conn = proto.ClientConnection()
        conn.send_request(messages.HaveRequest(target.blob_id))
        with trio.fail_after(20):
            while (event := conn.next_event()) is None:
                conn.receive_data(await stream.read(65536))
        assert isinstance(event, messages.HaveResponse)
        # The second request was a violation: an error (or a reset), never an answer.
        conn.send_request(messages.HaveRequest(target.blob_id))
        with trio.fail_after(20):
            try:
                while (event := conn.next_event()) is None:
                    conn.receive_data(await stream.read(65536))
            except Exception:
                event = None
        assert event is None or isinstance(event, messages.ErrorResponse)


def test_handshake_deadline_is_short() -> None:
    assert host_mod.HANDSHAKE_TIMEOUT <= 5.0


# --- Room for newcomers (server theory, rule 9) and the request-arrival deadline -----------


def test_the_reserve_goes_only_to_peers_holding_little() -> None:
    budget = Budget("streams", 10, 8, 100, reserved=3, light_peer=2, light_ip=100)
    for _ in range(7):
        assert budget.acquire("greedy", "a", 1) is None
    refused = budget.acquire("greedy", "a", 1)
    assert refused is not None and "keeps its last 3" in refused
    assert budget.acquire("newcomer", "b", 1) is None
    assert budget.acquire("newcomer", "b", 1) is None
    assert budget.acquire("newcomer", "b", 1) is not None  # it holds 2: no longer light
    assert budget.acquire("another", "c", 1) is None
    assert "at its limit" in (budget.acquire("late", "d", 1) or "")


def test_eviction_takes_the_longest_idle_stream_of_the_greediest_address() -> None:
    from collections import Counter

    from p2p.blob.server import IdleStreams, StreamSlot

    idle = IdleStreams()
    evicted: list[str] = []
    slots = {
        "a-old": StreamSlot("p1", "a"),
        "a-new": StreamSlot("p2", "a"),
        "b": StreamSlot("p3", "b"),
    }
    idle.wait(slots["a-new"], 5.0, lambda: evicted.append("a-new"))
    idle.wait(slots["a-old"], 1.0, lambda: evicted.append("a-old"))
    idle.wait(slots["b"], 0.0, lambda: evicted.append("b"))
    by_ip = Counter({"a": 6, "b": 2})
    by_peer = Counter({"p1": 3, "p2": 3, "p3": 2})
    victim = idle.victim(by_ip, by_peer, "c", "p9")
    assert victim is not None and victim.slot is slots["a-old"]
    # A newcomer from an address holding as much as the greediest evicts nobody there;
    # the identity rule then applies (p1 holds 3, the newcomer 2 + 1).
    victim = idle.victim(by_ip, by_peer, "a", "p3")
    assert victim is None


async def hold_idle_streams(host: Any, target: Served, count: int) -> list[Any]:
    """``count`` streams that each ask one `have` (answered) and then sit idle."""
    held = []
    for _ in range(count):
        stream = await open_stream(host, target)
        reply = await first_event(stream, messages.HaveRequest(target.blob_id))
        assert isinstance(reply, messages.HaveResponse)
        held.append(stream)
    return held


async def test_a_newcomer_is_served_when_greedy_peers_hold_the_stream_budget(
    tmp_path: Path,
) -> None:
    """64 identities x 16 idle streams held the whole 1,024-stream budget and every newcomer
    got `busy`. Here, scaled down to 6 streams with 2 reserved: the greedy identity is
    refused the reserve; a light one takes it; when all is taken, a newcomer's stream
    evicts the greedy identity's longest-idle stream instead of being refused."""
    limits = ServerLimits().with_(
        max_streams=6,
        reserved_streams=2,
        max_streams_per_peer=6,
        light_peer_streams=2,
        # Every client here dials from 127.0.0.1: addresses do not tell them apart.
        max_streams_per_ip=1000,
        light_ip_streams=1000,
    )
    async with (
        served(tmp_path, limits=limits) as target,
        client(target) as greedy,
        client(target) as light,
        client(target) as newcomer,
    ):
        await hold_idle_streams(greedy, target, 4)
        refused = await first_event(
            await open_stream(greedy, target), messages.HaveRequest(target.blob_id)
        )
        assert isinstance(refused, messages.ErrorResponse)
        assert refused.code == messages.ErrorCode.BUSY and "keeps its last" in refused.message
        assert await wait_for(lambda: target.server.streams.used == 4, 10)
        await hold_idle_streams(light, target, 2)
        assert target.server.streams.used == 6
        served_newcomer = await first_event(
            await open_stream(newcomer, target), messages.HaveRequest(target.blob_id)
        )
        assert isinstance(served_newcomer, messages.HaveResponse)
        assert target.server.evicted == 1
        assert target.server.streams.by_peer[str(greedy.get_id())] == 3


async def test_half_a_request_loses_its_stream_at_the_arrival_deadline(tmp_path: Path) -> None:
    """Slowloris: a stream that sends the first bytes of a request header and then nothing
    is reset at the request-arrival deadline (here 1 s), not held until the idle timeout
    (60 s). Without the deadline nothing else ends it."""
    limits = ServerLimits().with_(request_timeout=1.0)
    async with served(tmp_path, limits=limits) as target, client(target) as loris:
        stream = await open_stream(loris, target)
        header = proto.ClientConnection().send_request(messages.HaveRequest(target.blob_id))
        await stream.write(header[: len(header) // 2])
        assert await wait_for(lambda: target.server.streams.used == 1, 10)
        start = trio.current_time()
        assert await wait_for(lambda: target.server.streams.used == 0, 5.0)
        assert 0.9 < trio.current_time() - start < 5.0


# --- Threads -----------------------------------------------------------------------------


async def test_reads_of_the_store_never_wait_for_the_processs_other_threads(
    tmp_path: Path,
) -> None:
    """Guards against serving on trio's default thread limiter: 42 of a daemon's puts
    of FIFOs (or reads of a hung mount) held all 40 of its threads, and a peer's get then
    waited 51 s. With every default thread held, manifests, bitmaps and chunks (read and
    hashed in threads the first time) are still answered, from the server's own."""
    import threading

    release = threading.Event()
    default = trio.to_thread.current_default_thread_limiter()
    async with served(tmp_path) as target, client(target) as fetcher, trio.open_nursery() as hogs:
        for _ in range(int(default.total_tokens)):
            hogs.start_soon(trio.to_thread.run_sync, release.wait)
        assert await wait_for(lambda: default.borrowed_tokens == default.total_tokens, 10)
        try:
            with trio.fail_after(10):
                stream = await open_stream(fetcher, target)
                manifest = await first_event(stream, messages.ManifestRequest(target.blob_id))
                assert isinstance(manifest, messages.ManifestResponse)
                have = await first_event(stream, messages.HaveRequest(target.blob_id))
                assert isinstance(have, messages.HaveResponse)
                chunk = await first_event(stream, messages.GetRequest(target.blob_id, ((0, 1),)))
                assert isinstance(chunk, messages.Chunk), chunk
        finally:
            release.set()
