"""The fast path inside real py-libp2p hosts (two hosts in one trio run, over loopback TCP):
against itself and against py-libp2p's own Noise+yamux, both ways, and its failure modes."""

from __future__ import annotations

import os

import pytest
import trio
from fast_helpers import (
    ECHO,
    Pipe,
    echo_roundtrip,
    libp2p_echo_handler,
    make_host,
    muxed_conn_to,
    running,
)
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.peerinfo import PeerInfo

from p2p.transport.fast import (
    FastYamuxConn,
    FastYamuxStream,
    kernel_rtt,
    read_exactly_into,
    read_into,
)
from p2p.transport.fast.yamux_core import HEADER, INITIAL_WINDOW, TYPE_DATA

SINK = TProtocol("/blobnet-test/sink/1.0.0")


async def connect(a: IHost, b: IHost) -> None:
    await a.connect(PeerInfo(b.get_id(), b.get_addrs()))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dialer", "listener"),
    [("fast", "fast"), ("fast", "default"), ("default", "fast"), ("noise-only", "fast")],
)
async def test_echo_is_byte_exact(dialer: str, listener: str) -> None:
    a, b = make_host(dialer), make_host(listener)
    b.set_stream_handler(ECHO, libp2p_echo_handler)
    with trio.fail_after(60):
        async with running(a, b):
            await connect(a, b)
            for size in (1, 5000, 16 * 1024 * 1024):
                payload = os.urandom(size)
                stream = await a.new_stream(b.get_id(), [ECHO])
                want = FastYamuxStream if dialer == "fast" else object
                assert isinstance(getattr(stream, "muxed_stream", None), want)
                assert await echo_roundtrip(Pipe.of_libp2p(stream), payload) == payload
                await stream.close()
            if dialer == "fast":
                assert isinstance(muxed_conn_to(a, b.get_id()), FastYamuxConn)


async def test_closing_a_host_wakes_the_peers_blocked_reader() -> None:
    a, b = make_host("fast"), make_host("fast")
    parked = trio.Event()

    async def park(stream: INetStream) -> None:
        parked.set()
        await trio.sleep_forever()

    b.set_stream_handler(SINK, park)
    with trio.fail_after(20):
        async with running(a):
            async with running(b):
                await connect(a, b)
                stream = await a.new_stream(b.get_id(), [SINK])
                await stream.write(b"x")
                await parked.wait()
                conn = muxed_conn_to(a, b.get_id())
            with pytest.raises((StreamReset, StreamEOF)):
                await stream.read(10)
            await conn.event_closed.wait()
            assert conn.dead_reason is not None


async def test_eof_semantics_match_py_libp2p() -> None:
    """read() raises StreamEOF after the peer's FIN (as py-libp2p's yamux); read_into gives 0."""
    a, b = make_host("fast"), make_host("fast")

    async def reply_and_close(stream: INetStream) -> None:
        await stream.write(b"bye")
        await stream.close()

    b.set_stream_handler(SINK, reply_and_close)
    with trio.fail_after(20):
        async with running(a, b):
            await connect(a, b)
            s1 = await a.new_stream(b.get_id(), [SINK])
            assert await s1.read(10) == b"bye"
            with pytest.raises(StreamEOF):
                await s1.read(10)
            s2 = await a.new_stream(b.get_id(), [SINK])
            buf = bytearray(10)
            assert await read_exactly_into(s2, buf) == 3
            assert buf[:3] == b"bye"
            assert await read_into(s2, buf) == 0


async def test_reset_reaches_the_peer() -> None:
    a, b = make_host("fast"), make_host("fast")
    got_reset = trio.Event()

    async def wait_for_reset(stream: INetStream) -> None:
        with pytest.raises(StreamReset):
            await stream.read(10)
        got_reset.set()

    b.set_stream_handler(SINK, wait_for_reset)
    with trio.fail_after(20):
        async with running(a, b):
            await connect(a, b)
            stream = await a.new_stream(b.get_id(), [SINK])
            await stream.reset()
            await got_reset.wait()
            with pytest.raises(StreamReset):
                await stream.write(b"late")


async def test_writer_waits_on_a_full_window_and_resumes_when_read() -> None:
    """Flow control without polling: an unread stream holds at most the 256 KiB base window."""
    a, b = make_host("fast"), make_host("fast")
    inbound: list[INetStream] = []
    arrived = trio.Event()

    async def park(stream: INetStream) -> None:
        inbound.append(stream)
        arrived.set()
        await trio.sleep_forever()

    b.set_stream_handler(SINK, park)
    payload = os.urandom(4 * 1024 * 1024)
    with trio.fail_after(20):
        async with running(a, b), trio.open_nursery() as nursery:
            await connect(a, b)
            stream = await a.new_stream(b.get_id(), [SINK])
            written = trio.Event()

            async def write_all() -> None:
                await stream.write(payload)
                written.set()

            nursery.start_soon(write_all)
            await arrived.wait()
            await trio.sleep(0.3)
            assert not written.is_set()
            peer = getattr(inbound[0], "muxed_stream", None)
            assert isinstance(peer, FastYamuxStream)
            assert peer._st.buffered <= INITIAL_WINDOW
            got = bytearray(len(payload))
            assert await read_exactly_into(inbound[0], got) == len(payload)
            await written.wait()
            assert bytes(got) == payload
            nursery.cancel_scope.cancel()


async def test_message_bodies_are_decrypted_straight_into_the_readers_buffer() -> None:
    """A reader that takes a small header, then a large body (a blob chunk), gets nearly
    every body frame decrypted straight into its buffer: only the frame that carries the
    header goes through the queue. Without a nudge that waits out trio's random order of
    ready tasks, about three frames per message took the queue and an extra copy."""
    a, b = make_host("fast"), make_host("fast")
    messages, body = 16, 1024 * 1024
    counts: dict[str, int] = {}
    done = trio.Event()

    async def sink(stream: INetStream) -> None:
        head, buf = bytearray(12), bytearray(body)
        for _ in range(messages):
            assert await read_exactly_into(stream, head) == len(head)
            assert await read_exactly_into(stream, buf) == body
        conn = getattr(stream, "muxed_conn", None)
        assert isinstance(conn, FastYamuxConn)
        counts.update(frames=conn.frames_received, direct=conn.direct_frames)
        done.set()

    b.set_stream_handler(SINK, sink)
    payload = os.urandom(12 + body)
    with trio.fail_after(30):
        async with running(a, b):
            await connect(a, b)
            stream = await a.new_stream(b.get_id(), [SINK])
            for _ in range(messages):
                await stream.write(payload)
            await done.wait()
    body_frames = messages * -(-body // 65519)
    assert counts["direct"] >= body_frames - messages * 3 // 2, counts


async def test_many_concurrent_streams_on_one_connection() -> None:
    a, b = make_host("fast"), make_host("fast")
    b.set_stream_handler(ECHO, libp2p_echo_handler)
    with trio.fail_after(30):
        async with running(a, b):
            await connect(a, b)
            results: dict[int, bool] = {}

            async def one(i: int) -> None:
                payload = os.urandom(200_000 + i)
                stream = await a.new_stream(b.get_id(), [ECHO])
                results[i] = await echo_roundtrip(Pipe.of_libp2p(stream), payload) == payload
                await stream.close()

            async with trio.open_nursery() as nursery:
                for i in range(24):
                    nursery.start_soon(one, i)
            assert results == dict.fromkeys(range(24), True)


async def test_a_forged_frame_closes_the_connection() -> None:
    """A wrong nonce (as after a replayed or injected frame) fails the tag: the receiver
    must drop the whole connection, and its blocked readers must wake with an error."""
    a, b = make_host("fast"), make_host("fast")
    inbound: list[INetStream] = []
    arrived = trio.Event()
    outcome: list[BaseException] = []

    async def read_forever(stream: INetStream) -> None:
        inbound.append(stream)
        arrived.set()
        try:
            while True:
                await stream.read(1 << 16)
        except BaseException as err:  # recorded for the assertion below
            outcome.append(err)
            raise

    b.set_stream_handler(SINK, read_forever)
    with trio.fail_after(20):
        async with running(a, b):
            await connect(a, b)
            stream = await a.new_stream(b.get_id(), [SINK])
            await stream.write(b"hello")
            await arrived.wait()
            conn = muxed_conn_to(a, b.get_id())
            conn.secured_conn.send_cipher.nonce += 1
            await stream.write(b"forged")
            peer_conn = inbound[0].muxed_conn
            assert isinstance(peer_conn, FastYamuxConn)
            await peer_conn.event_closed.wait()
            assert "authentication" in (peer_conn.dead_reason or "")
            while not outcome:  # noqa: ASYNC110 - the handler wakes on its own schedule
                await trio.sleep(0.01)
            assert isinstance(outcome[0], StreamReset)


async def test_window_overrun_gets_go_away_and_closes_both_ends() -> None:
    """A peer that sends more than the window allows is cut off with GO_AWAY(protocol error)."""
    a, b = make_host("fast"), make_host("fast")
    parked = trio.Event()

    async def park(stream: INetStream) -> None:
        parked.set()
        await trio.sleep_forever()

    b.set_stream_handler(SINK, park)
    with trio.fail_after(20):
        async with running(a, b):
            await connect(a, b)
            stream = await a.new_stream(b.get_id(), [SINK])
            await stream.write(b"x")
            await parked.wait()
            conn = muxed_conn_to(a, b.get_id())
            sid = stream.muxed_stream.stream_id  # type: ignore[attr-defined]
            # A DATA header claiming 16 MiB on a stream whose window is 256 KiB.
            await conn.submit(HEADER.pack(0, TYPE_DATA, 0, sid, 16 * 1024 * 1024), None)
            await conn.event_closed.wait()
            assert "GO_AWAY code 1" in (conn.dead_reason or "")


@pytest.mark.skipif(not hasattr(__import__("socket"), "TCP_INFO"), reason="needs TCP_INFO")
async def test_the_kernels_rtt_of_a_fast_stream_is_loopbacks() -> None:
    """`kernel_rtt` reads tcpi_rtt out of struct tcp_info: on loopback it is far below
    50 ms, where the fields beside it (the RTO, 200 ms at least; the MSS) are not. A stream
    of another stack has none."""
    a, b, c = make_host("fast"), make_host("fast"), make_host("default")
    b.set_stream_handler(ECHO, libp2p_echo_handler)
    c.set_stream_handler(ECHO, libp2p_echo_handler)
    with trio.fail_after(30):
        async with running(a, b, c):
            await connect(a, b)
            stream = await a.new_stream(b.get_id(), [ECHO])
            assert await echo_roundtrip(Pipe.of_libp2p(stream), b"x" * 5000) == b"x" * 5000
            rtt = kernel_rtt(stream)
            assert rtt is not None and 0 < rtt < 0.05, rtt
            await connect(c, b)
            plain = await c.new_stream(b.get_id(), [ECHO])
            assert kernel_rtt(plain) is None
