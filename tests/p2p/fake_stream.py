"""An in-memory blob stream whose far end is a real sans-IO ``ServerConnection``, for tests
of the client side (BlobClient, the downloader) without a network."""

from __future__ import annotations

from collections.abc import Callable

import trio

from p2p.blob import messages
from p2p.blob import protocol as proto

Serve = Callable[[proto.ServerConnection, messages.Request], tuple[bytes, bool]]


class FakeStream:
    """The client's end of a stream. Each request written is parsed by a ServerConnection
    and answered by ``serve`` with (bytes, end_of_stream_after_them). Reads return at most
    ``piece`` bytes; with nothing to read and no end of stream, a read waits forever."""

    def __init__(self, serve: Serve, piece: int | None = None) -> None:
        self.server = proto.ServerConnection()
        self.serve = serve
        self.piece = piece
        self.inbound = bytearray()
        self.eof = False
        self.reads = 0
        self.closed = False
        self.was_reset = False
        self._more = trio.Event()

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        while not self.inbound and not self.eof:
            await self._more.wait()
        self.reads += 1
        take = len(self.inbound) if n is None else min(n, len(self.inbound))
        if self.piece is not None:
            take = min(take, self.piece)
        out = bytes(self.inbound[:take])
        del self.inbound[:take]
        return out

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        self.server.receive_data(bytes(data))
        request = self.server.next_request()
        if request is not None:
            out, end = self.serve(self.server, request)
            self.inbound += out
            self.eof = self.eof or end
            self._more.set()
            self._more = trio.Event()

    async def close(self) -> None:
        self.closed = True

    async def reset(self) -> None:
        self.was_reset = True
