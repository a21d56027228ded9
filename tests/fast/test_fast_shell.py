"""The trio shell over a bare socket pair (no hosts): what goes on the wire when a writer is
cancelled with its frame only part-way into a full socket, and how long a dialler that
proposed yamux without waiting (yamux_core invariant 9) waits for the listener's answer."""

from __future__ import annotations

import os
from typing import Any

import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.utils import encode_delim

from p2p.transport.fast import FastSecureConn, FastYamuxConn
from p2p.transport.fast.noise_frames import CipherState, FrameReader
from p2p.transport.fast.yamux_core import HEADER, TYPE_DATA

KEY_OUT = bytes(range(32))
KEY_IN = bytes(range(1, 33))


def make_conn(sock: trio.socket.SocketType, **kwargs: Any) -> FastYamuxConn:
    kp = create_new_key_pair()
    peer = ID.from_pubkey(kp.public_key)
    raw = RawConnection(TrioTCPStream(trio.SocketStream(sock)), initiator=True)
    secure = FastSecureConn(
        local_peer=peer,
        local_private_key=kp.private_key,
        remote_peer=peer,
        remote_permanent_pubkey=kp.public_key,
        is_initiator=True,
        raw=raw,
        send_cipher=CipherState(KEY_OUT),
        recv_cipher=CipherState(KEY_IN),
    )
    return FastYamuxConn(secure, peer, **kwargs)


def data_payload(wire: bytes) -> bytes:
    """Decrypt our side's wire bytes and return the DATA payload of stream 1, in order."""
    reader = FrameReader(1 << 20)
    cipher = CipherState(KEY_OUT)
    plain = bytearray()
    view = memoryview(wire)
    while view:
        view = view[reader.feed(view) :]
        while (frame := reader.next_frame()) is not None:
            plain += cipher.decrypt(frame)
    assert reader.buffered == 0, "the wire must end on a whole Noise frame"
    out = bytearray()
    pos = 0
    while pos < len(plain):
        _, typ, _, sid, length = HEADER.unpack_from(plain, pos)
        pos += 12
        if typ == TYPE_DATA:
            assert sid == 1
            out += plain[pos : pos + length]
            pos += length
    return bytes(out)


async def test_cancelled_writer_leaves_whole_frames_on_the_wire() -> None:
    ours, theirs = trio.socket.socketpair()
    # A small buffer, so the write blocks in the socket long before the 256 KiB window.
    ours.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, 32 * 1024)
    conn = make_conn(ours)
    stream_payload = os.urandom(1024 * 1024)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.start)
            await conn.event_started.wait()
            stream = await conn.open_stream()
            # The peer reads nothing yet, so the writer is cancelled mid-frame.
            with trio.move_on_after(0.3) as scope:
                await stream.write(stream_payload)
            assert scope.cancelled_caught
            # Now drain the peer side until the send loop has flushed the rest.
            wire = bytearray()
            with trio.move_on_after(1.0):
                while True:
                    data = await theirs.recv(1 << 20)
                    if not data:
                        break
                    wire += data
            assert conn.dead_reason is None
            got = data_payload(bytes(wire))
            assert len(got) > 0
            assert stream_payload.startswith(got)
            nursery.cancel_scope.cancel()
    theirs.close()


ECHO = encode_delim(b"/multistream/1.0.0") + encode_delim(b"/yamux/1.0.0")


def sealed(plain: bytes) -> bytes:
    """One Noise frame from the far end (its send key is our receive key)."""
    body = CipherState(KEY_IN).encrypt(plain)
    return len(body).to_bytes(2, "big") + body


@pytest.fixture
def virtual_clock() -> trio.testing.MockClock:
    """Virtual time for the connection's timers (the echo deadline, the uncork), jumping
    only after 100 ms of real idleness: the sockets are real, and a jump while the kernel
    still moves bytes between them would fire a deadline that real time never reaches."""
    return trio.testing.MockClock(autojump_threshold=0.1)


async def test_a_listener_that_never_answers_the_proposal_ends_the_connection(
    virtual_clock: trio.testing.MockClock,
) -> None:
    """With the muxer proposed optimistically, such a listener still costs no more than
    the negotiation timeout: the session ends within it, with a reason that names the
    muxer."""
    ours, theirs = trio.socket.socketpair()
    conn = make_conn(ours, expect=ECHO, echo_timeout=0.3)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.start)
            await conn.event_started.wait()
            await theirs.send(sealed(ECHO[:5]))  # half an answer is no answer
            await conn.event_closed.wait()
    assert conn.dead_reason is not None
    assert "did not answer our muxer proposal within 0.3 s" in conn.dead_reason
    theirs.close()


async def test_an_answered_proposal_outlives_the_echo_deadline(
    virtual_clock: trio.testing.MockClock,
) -> None:
    ours, theirs = trio.socket.socketpair()
    conn = make_conn(ours, expect=ECHO, echo_timeout=0.2)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.start)
            await conn.event_started.wait()
            deadline = trio.current_time() + 0.2  # the echo deadline, in virtual time
            await theirs.send(sealed(ECHO))
            await trio.sleep_until(deadline + 0.3)  # past it: its timer has run
            assert conn.dead_reason is None
            assert not conn.session.awaiting_echo
            nursery.cancel_scope.cancel()
    theirs.close()


def _tcp_pair() -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
    import socket as stdlib_socket

    listener = stdlib_socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    ours = stdlib_socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    listener.close()
    ours.setblocking(False)
    return trio.socket.from_stdlib_socket(ours), trio.socket.from_stdlib_socket(theirs)


def _corked(sock: trio.socket.SocketType) -> bool:
    import socket as stdlib_socket

    return bool(sock.getsockopt(stdlib_socket.IPPROTO_TCP, stdlib_socket.TCP_CORK))


async def test_a_young_connection_sends_its_small_frames_together(
    virtual_clock: trio.testing.MockClock,
) -> None:
    """A new connection may send ~10 segments before its first ACK; its first frames are
    small and many, so they are corked for COALESCE_S and leave together: the first
    answers of a fetch at 200 ms came a round trip sooner (0.2 s, not 0.4 s)."""
    from p2p.transport.fast import noise

    ours, theirs = _tcp_pair()
    conn = make_conn(ours)
    secure = conn.secured_conn
    assert isinstance(secure, FastSecureConn)
    received = 0

    async def drain() -> None:
        nonlocal received
        while received < 200 + noise.COALESCE_BYTES:
            received += len(await theirs.recv(1 << 20))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            corked_at = trio.current_time()
            await secure.send_wire(memoryview(b"x" * 100))
            assert _corked(ours)  # what follows within the window shares the segment
            await trio.sleep_until(corked_at + noise.COALESCE_S / 2)
            assert _corked(ours)  # for the whole window (virtual time)
            await trio.sleep_until(corked_at + noise.COALESCE_S * 2)
            assert not _corked(ours)  # and then it leaves
            nursery.start_soon(drain)
            await secure.send_wire(memoryview(b"y" * noise.COALESCE_BYTES))
            await trio.sleep(noise.COALESCE_S * 2)  # its window ends, virtual time
            await secure.send_wire(memoryview(b"z" * 100))
            assert not _corked(ours)  # no longer young: its window has grown
    ours.close()
    theirs.close()
