"""Negotiating Noise and yamux as the dialler in one round trip each (issue 15 item 4):
multistream-select's header and the one proposal leave in a single write, and a listener
that answers anything else is refused."""

from __future__ import annotations

import pytest
import trio
from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.utils import encode_delim

from p2p.fast.upgrade import FastSecurityMultistream, select_pipelined
from p2p.host import build_host

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
