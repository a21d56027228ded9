"""Negotiating Noise and yamux as the dialler in fewer round trips: multistream-select's
header and the one proposal leave in a single write, and a listener that answers anything
else is refused. Over our Noise the dialler does not wait for the answer at all: Noise's
first message follows the proposal in the same write, and the answer is checked before
Noise's reply is read (`AnsweredFirst`). A dial told to answer (a hole punch's) that
reached a listener takes the dialler's role once the listener stays silent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.security.security_multistream import SecurityMultistream
from libp2p.utils import encode_delim

from p2p.transport.fast.noise import FastNoiseTransport
from p2p.transport.fast.upgrade import (
    SILENT_PEER_S,
    AnsweredFirst,
    FastSecurityMultistream,
    select_pipelined,
)
from p2p.transport.host import build_host

HEADER = encode_delim(b"/multistream/1.0.0")
NOISE = TProtocol("/noise")


class Listener:
    """The far end: has already answered with ``answer``; records what it was sent, and
    whether anything was read before the first write."""

    def __init__(self, answer: bytes) -> None:
        self.answer = bytearray(answer)
        self.writes: list[bytes] = []
        self.read_before_write = False

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.writes.append(bytes(data))

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self.writes:
            self.read_before_write = True
        take = len(self.answer) if n is None else min(n, len(self.answer))
        out = bytes(self.answer[:take])
        del self.answer[:take]
        return out


async def test_header_and_proposal_leave_in_one_write() -> None:
    listener = Listener(HEADER + encode_delim(NOISE.encode()))
    assert await select_pipelined(listener, NOISE) == NOISE
    assert listener.writes == [HEADER + encode_delim(NOISE.encode())]
    assert not listener.read_before_write


@pytest.mark.parametrize(
    "answer", [HEADER + encode_delim(b"na"), encode_delim(b"/multistream/2.0.0") + HEADER]
)
async def test_a_listener_that_refuses_is_an_error(answer: bytes) -> None:
    with pytest.raises(MultiselectClientError):
        await select_pipelined(Listener(answer), NOISE)


def test_a_fast_host_negotiates_security_this_way() -> None:
    host = build_host(create_new_key_pair())
    upgrader = host.get_network().upgrader  # type: ignore[attr-defined]
    assert isinstance(upgrader.security_multistream, FastSecurityMultistream)
    assert list(upgrader.security_multistream.transports) == [NOISE]


class Wire:
    """The far end of a raw connection: what it was sent, and what it sends, a few bytes
    per read at most (any split must do)."""

    def __init__(self, answer: bytes, per_read: int = 5) -> None:
        self.answer = bytearray(answer)
        self.per_read = per_read
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.writes.append(bytes(data))

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        take = min(self.per_read, len(self.answer) if n is None else n)
        out = bytes(self.answer[:take])
        del self.answer[:take]
        return out


async def test_noise_leaves_with_the_proposal_and_its_reply_follows_the_answer() -> None:
    wire = Wire(HEADER + encode_delim(NOISE.encode()) + b"noise reply")
    conn = AnsweredFirst(wire, NOISE)
    await conn.write(b"noise msg 1")
    assert wire.writes == [HEADER + encode_delim(NOISE.encode()) + b"noise msg 1"]
    assert conn.awaiting_answer
    got = b""
    while len(got) < len(b"noise reply"):
        got += await conn.read(64)
    assert got == b"noise reply"
    assert not conn.awaiting_answer
    await conn.write(b"noise msg 3")  # later writes are plain
    assert wire.writes[-1] == b"noise msg 3"


@pytest.mark.parametrize(
    "answer", [HEADER + encode_delim(b"na"), encode_delim(b"/multistream/2.0.0"), b""]
)
async def test_a_listener_that_refuses_noise_fails_the_first_read(answer: bytes) -> None:
    conn = AnsweredFirst(Wire(answer), NOISE)
    await conn.write(b"noise msg 1")
    with pytest.raises(MultiselectClientError):
        await conn.read(64)


# A hole punch's own dial, made as the responder (py-libp2p's DCUtR initiator does so for
# a TCP simultaneous open), that reached the peer's listener instead: the peer is
# reachable after all. Real sockets on 127.0.0.1, both ends upgraded by our negotiator.


def _security(silent_peer_s: float = SILENT_PEER_S) -> tuple[FastSecurityMultistream, ID]:
    keys = create_new_key_pair()
    transport = FastNoiseTransport(keys)
    security = FastSecurityMultistream({NOISE: transport}, silent_peer_s=silent_peer_s)
    return security, ID.from_pubkey(keys.public_key)


@asynccontextmanager
async def _tcp_pair() -> AsyncIterator[tuple[RawConnection, RawConnection]]:
    """(the dialler's raw connection, the listener's), over a real loopback socket."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    dialled = await trio.open_tcp_stream("127.0.0.1", port)
    accepted = await listeners[0].accept()
    try:
        yield (
            RawConnection(TrioTCPStream(dialled), initiator=True),
            RawConnection(TrioTCPStream(accepted), initiator=False),
        )
    finally:
        await dialled.aclose()
        await accepted.aclose()
        await listeners[0].aclose()


async def _both(first: Any, second: Any) -> tuple[Any, Any]:
    out: list[Any] = [None, None]

    async def run(i: int, job: Any) -> None:
        out[i] = await job()

    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, 0, first)
            nursery.start_soon(run, 1, second)
    return out[0], out[1]


async def test_a_responder_dial_that_reached_a_listener_takes_the_diallers_role() -> None:
    (ours, our_id), (theirs, their_id) = _security(silent_peer_s=0.2), _security()
    async with _tcp_pair() as (dialled, accepted):
        mine, peers = await _both(
            lambda: ours.secure_inbound(dialled),  # told to answer on a socket it dialled
            lambda: theirs.secure_inbound(accepted),  # a listener: answers, as always
        )
        assert (mine.is_initiator, peers.is_initiator) == (True, False)
        assert (mine.get_remote_peer(), peers.get_remote_peer()) == (their_id, our_id)
        await mine.write(b"a chunk request")
        assert await peers.read(64) == b"a chunk request"


@pytest.mark.parametrize("far_end", [FastSecurityMultistream, SecurityMultistream])
async def test_a_responder_dial_whose_peer_dials_too_answers_as_the_responder(
    far_end: type[SecurityMultistream],
) -> None:
    # A real simultaneous open: the far end is a dialler, ours (proposal and Noise in one
    # write) or py-libp2p's (it waits for our header before it proposes), so our end
    # answers, as DCUtR asked (both dialling would fail the handshake).
    (ours, our_id), (fast, their_id) = _security(), _security()
    theirs = far_end(dict(fast.transports))
    async with _tcp_pair() as (dialled, accepted):
        simultaneous = RawConnection(accepted.stream, initiator=True)
        mine, peers = await _both(
            lambda: ours.secure_inbound(dialled),
            lambda: theirs.secure_outbound(simultaneous, our_id),
        )
        assert (mine.is_initiator, peers.is_initiator) == (False, True)
        assert mine.get_remote_peer() == their_id
