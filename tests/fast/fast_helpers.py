"""Hosts, an echo protocol and daemon-stream adapters shared by the fast path's stack and
interop tests."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from multiaddr import Multiaddr
from p2pd_client import DaemonConn

import p2p.transport.fast as fast
from p2p.transport.fast import FastSecureConn, FastYamuxConn

ECHO = TProtocol("/blobnet-test/echo/1.0.0")
# What a DaemonStream read without a size asks the daemon's unix socket for.
DAEMON_READ_SIZE = 1024 * 1024
LOOPBACK = Multiaddr("/ip4/127.0.0.1/tcp/0")
_LEN = struct.Struct(">Q")
# Echo replies are written in pieces of this size as they are read.
ECHO_PIECE = 1 << 20


def make_host(kind: str) -> IHost:
    """A host with blobnet's fast path ("fast"), py-libp2p's own Noise+yamux ("default"), or
    our Noise under py-libp2p's yamux ("noise-only")."""
    kp = create_new_key_pair()
    if kind == "fast":
        host = new_host(
            key_pair=kp, sec_opt=fast.security_options(kp), muxer_opt=fast.muxer_options()
        )
        fast.install(host)
        return host
    if kind == "default":
        return new_host(key_pair=kp)
    if kind == "noise-only":
        # Our Noise data path under py-libp2p's own yamux (what a host gets without install()).
        return new_host(key_pair=kp, sec_opt=fast.security_options(kp))
    raise ValueError(kind)


@contextlib.asynccontextmanager
async def running(*hosts: IHost) -> AsyncIterator[None]:
    async with contextlib.AsyncExitStack() as stack:
        for host in hosts:
            await stack.enter_async_context(host.run([LOOPBACK]))
        yield
        for host in hosts:
            with trio.move_on_after(5):
                await host.close()


class Pipe:
    """The two calls the echo protocol needs, over a libp2p stream or a daemon stream."""

    def __init__(
        self,
        send: Callable[[bytes | memoryview], Awaitable[None]],
        recv_into: Callable[[memoryview], Awaitable[int]],
    ) -> None:
        self.send = send
        self.recv_into = recv_into

    @classmethod
    def of_libp2p(cls, stream: INetStream) -> Pipe:
        async def recv_into(view: memoryview) -> int:
            return await fast.read_into(stream, view)

        return cls(stream.write, recv_into)  # type: ignore[arg-type]

    @classmethod
    def of_daemon(cls, conn: Any) -> Pipe:
        async def recv_into(view: memoryview) -> int:
            data = await conn.receive_some(len(view))
            view[: len(data)] = data
            return len(data)

        return cls(conn.send_all, recv_into)

    async def recv_exactly(self, n: int) -> bytearray:
        out = bytearray(n)
        view = memoryview(out)
        pos = 0
        while pos < n:
            got = await self.recv_into(view[pos:])
            if got == 0:
                raise EOFError(f"echo stream ended after {pos} of {n} bytes")
            pos += got
        return out


async def serve_echo(pipe: Pipe) -> int:
    """Server side: an 8-byte length, then echo that many bytes back as they come."""
    length: int = _LEN.unpack(await pipe.recv_exactly(8))[0]
    buf = memoryview(bytearray(min(length, ECHO_PIECE) or 1))
    left = length
    while left:
        got = await pipe.recv_into(buf[: min(left, len(buf))])
        if got == 0:
            raise EOFError(f"echo request ended with {left} bytes missing")
        await pipe.send(bytes(buf[:got]))
        left -= got
    return length


async def echo_roundtrip(pipe: Pipe, payload: bytes) -> bytes:
    """Client side: send the request while reading the echo concurrently."""
    result = bytearray()

    async def receive() -> None:
        result.extend(await pipe.recv_exactly(len(payload)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await pipe.send(_LEN.pack(len(payload)))
        view = memoryview(payload)
        for off in range(0, len(payload), ECHO_PIECE):
            await pipe.send(view[off : off + ECHO_PIECE])
    return bytes(result)


async def libp2p_echo_handler(stream: INetStream) -> None:
    try:
        await serve_echo(Pipe.of_libp2p(stream))
    finally:
        await stream.close()


def muxed_conn_to(host: IHost, peer_id: Any) -> Any:
    """The muxed connection `host` holds to `peer_id` (the first one)."""
    conns = host.get_network().get_connections(peer_id)
    assert conns, f"no connection to {peer_id}"
    return conns[0].muxed_conn


def assert_fast(muxed: object) -> None:
    """`muxed` runs blobnet's Noise and yamux (not py-libp2p's) under the standard IDs."""
    assert isinstance(muxed, FastYamuxConn), f"connection runs {type(muxed).__name__}"
    assert isinstance(muxed.secured_conn, FastSecureConn)
    assert getattr(muxed, "negotiated_security_protocol", None) == "/noise"
    assert getattr(muxed, "negotiated_muxer_protocol", None) == "/yamux/1.0.0"


async def wait_connected(host: IHost, peer_id: ID, timeout_s: float = 5) -> Any:
    """The muxed connection to `peer_id`, once the swarm has registered it: an inbound
    connection appears a moment after the dialler's CONNECT returns, with no event for it."""
    with trio.fail_after(timeout_s):
        while not host.get_network().get_connections(peer_id):  # noqa: ASYNC110
            await trio.sleep(0.01)
    return muxed_conn_to(host, peer_id)


@dataclass(frozen=True)
class DaemonPeerConn:
    peer_id: ID


class DaemonStream:
    """A p2pd stream as blobnet's blob protocol uses a libp2p stream (`p2p.blob.shell.Stream`,
    plus `.muxed_conn.peer_id` for BlobServer's per-peer limits).

    `read` returns b"" at EOF (which `p2p.blob.shell.read_some` takes as EOF, like py-libp2p's
    StreamEOF). `close` half-closes the unix socket, but this p2pd then ends the libp2p
    stream both ways (a reply still owed is lost), so close only when done reading. The
    control protocol has no reset; `reset` closes the socket outright, the nearest thing."""

    def __init__(self, conn: DaemonConn, peer: bytes) -> None:
        self.conn = conn
        self.muxed_conn = DaemonPeerConn(ID(peer))

    async def read(self, n: int | None = None) -> bytes:
        return await self.conn.receive_some(n or DAEMON_READ_SIZE)

    async def write(self, data: bytes) -> None:
        await self.conn.send_all(data)

    async def close(self) -> None:
        await self.conn.stream.send_eof()

    async def reset(self) -> None:
        await self.conn.aclose()
