"""A small trio client of go-libp2p-daemon's control protocol (hivemind's p2pd), for tests.

Protocol (hivemind `p2pd.proto`, proto2, package p2pclient.p2pd.pb): each control request opens
a new unix-socket connection to the daemon and sends one varint-length-delimited `Request`; the
daemon answers with one delimited `Response`. After a successful STREAM_OPEN the same
connection carries the libp2p stream's bytes. For STREAM_HANDLER the daemon connects to a unix
socket we listen on, once per inbound stream, sends a delimited `StreamInfo`, then the bytes.

Only the messages the interop tests need are encoded, by hand (field numbers from the .proto):
Request{type=1, connect=2, streamOpen=3, streamHandler=4}, ConnectRequest{peer=1, addrs=2,
timeout=3}, StreamOpenRequest{peer=1, proto=2, timeout=3}, StreamHandlerRequest{addr=1,
proto=2, balanced=3}, Response{type=1, error=2, streamInfo=3, identify=4},
IdentifyResponse{id=1, addrs=2}, StreamInfo{peer=1, addr=2, proto=3}, ErrorResponse{msg=1}.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio
from multiaddr import Multiaddr

REQ_IDENTIFY = 0
REQ_CONNECT = 1
REQ_STREAM_OPEN = 2
REQ_STREAM_HANDLER = 3
RESP_OK = 0
# Largest control message we accept from the daemon (identify with many addresses is < 4 KiB).
MAX_CONTROL_MESSAGE = 1 << 20


class DaemonError(Exception):
    """The daemon answered ERROR, or spoke something we cannot parse."""


# ------------------------------------------------------------------------- protobuf wire


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_varint(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _field_bytes(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _parse(data: bytes) -> dict[int, list[int | bytes]]:
    fields: dict[int, list[int | bytes]] = {}
    pos = 0

    def varint() -> int:
        nonlocal pos
        shift = result = 0
        while True:
            if pos >= len(data) or shift > 63:
                raise DaemonError("truncated varint in a daemon message")
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return result

    while pos < len(data):
        key = varint()
        number, wire_type = key >> 3, key & 7
        value: int | bytes
        if wire_type == 0:
            value = varint()
        elif wire_type == 2:
            length = varint()
            value = data[pos : pos + length]
            pos += length
        elif wire_type == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire_type == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise DaemonError(f"unsupported protobuf wire type {wire_type}")
        fields.setdefault(number, []).append(value)
    return fields


def _one(fields: dict[int, list[int | bytes]], number: int, default: int | bytes) -> int | bytes:
    values = fields.get(number)
    return values[-1] if values else default


class _Conn:
    """A unix stream with a read buffer, for delimited messages followed by raw bytes."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buf = bytearray()

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise DaemonError("daemon closed the connection")
        self._buf += data

    async def read_message(self) -> bytes:
        while True:
            length = shift = used = 0
            for i, byte in enumerate(self._buf):
                length |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    used = i + 1
                    break
            if used:
                if length > MAX_CONTROL_MESSAGE:
                    raise DaemonError(f"daemon message of {length} bytes is too large")
                if len(self._buf) >= used + length:
                    msg = bytes(self._buf[used : used + length])
                    del self._buf[: used + length]
                    return msg
            await self._fill()

    async def write_message(self, msg: bytes) -> None:
        await self.stream.send_all(_varint(len(msg)) + msg)

    async def receive_some(self, max_bytes: int = 1 << 20) -> bytes:
        if self._buf:
            data = bytes(self._buf[:max_bytes])
            del self._buf[:max_bytes]
            return data
        return await self.stream.receive_some(max_bytes)

    async def receive_exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            data = await self.receive_some(min(n - len(out), 1 << 20))
            if not data:
                raise DaemonError(f"stream ended after {len(out)} of {n} bytes")
            out += data
        return bytes(out)

    async def send_all(self, data: bytes | memoryview) -> None:
        await self.stream.send_all(data)

    async def aclose(self) -> None:
        await self.stream.aclose()


# Multiaddr protocol code of /unix (multicodec table).
P_UNIX = 400


def unix_multiaddr_bytes(path: Path) -> bytes:
    """Binary `/unix/<abs path>` as go-multiaddr wants it: the value keeps its leading slash
    (py-multiaddr 0.2.0 drops it, and go then reads a relative path)."""
    value = str(path.resolve()).encode()
    return _varint(P_UNIX) + _varint(len(value)) + value


@dataclass(frozen=True)
class StreamInfo:
    peer: bytes
    addr: bytes
    proto: str


def _check(response: bytes) -> dict[int, list[int | bytes]]:
    fields = _parse(response)
    if _one(fields, 1, RESP_OK) != RESP_OK:
        err = _parse(bytes(_one(fields, 2, b"")))  # type: ignore[arg-type]
        raise DaemonError(f"daemon error: {bytes(_one(err, 1, b'')).decode(errors='replace')}")  # type: ignore[arg-type]
    return fields


def _stream_info(data: bytes) -> StreamInfo:
    fields = _parse(data)
    return StreamInfo(
        peer=bytes(_one(fields, 1, b"")),  # type: ignore[arg-type]
        addr=bytes(_one(fields, 2, b"")),  # type: ignore[arg-type]
        proto=bytes(_one(fields, 3, b"")).decode(),  # type: ignore[arg-type]
    )


# One daemon connection: after STREAM_OPEN, or per inbound stream of a STREAM_HANDLER.
DaemonConn = _Conn
StreamCallback = Callable[[StreamInfo, DaemonConn], Awaitable[None]]


class DaemonClient:
    """Requests to one p2pd control socket."""

    def __init__(self, control_path: Path) -> None:
        self.control_path = control_path

    async def _request(self, request: bytes) -> tuple[_Conn, dict[int, list[int | bytes]]]:
        conn = _Conn(await trio.open_unix_socket(str(self.control_path)))
        try:
            await conn.write_message(request)
            return conn, _check(await conn.read_message())
        except BaseException:
            await conn.aclose()
            raise

    async def identify(self) -> tuple[bytes, list[Multiaddr]]:
        conn, fields = await self._request(_field_varint(1, REQ_IDENTIFY))
        await conn.aclose()
        ident = _parse(bytes(_one(fields, 4, b"")))  # type: ignore[arg-type]
        addrs = [Multiaddr(bytes(a)) for a in ident.get(2, [])]  # type: ignore[arg-type]
        return bytes(_one(ident, 1, b"")), addrs  # type: ignore[arg-type]

    async def connect(self, peer: bytes, addrs: list[Multiaddr], timeout_s: int = 10) -> None:
        body = _field_bytes(1, peer)
        for addr in addrs:
            body += _field_bytes(2, addr.to_bytes())
        body += _field_varint(3, timeout_s)
        conn, _ = await self._request(_field_varint(1, REQ_CONNECT) + _field_bytes(2, body))
        await conn.aclose()

    async def stream_open(self, peer: bytes, protos: list[str]) -> tuple[StreamInfo, _Conn]:
        body = _field_bytes(1, peer)
        for proto in protos:
            body += _field_bytes(2, proto.encode())
        body += _field_varint(3, 10)
        request = _field_varint(1, REQ_STREAM_OPEN) + _field_bytes(3, body)
        conn, fields = await self._request(request)
        return _stream_info(bytes(_one(fields, 3, b""))), conn  # type: ignore[arg-type]

    @contextlib.asynccontextmanager
    async def stream_handler(
        self, listen_path: Path, protos: list[str], callback: StreamCallback
    ) -> AsyncIterator[None]:
        """Serve `protos` through `callback` while the context is open."""
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(str(listen_path))
        sock.listen(16)
        listener = trio.SocketListener(sock)

        async def serve_one(stream: trio.SocketStream) -> None:
            conn = _Conn(stream)
            try:
                info = _stream_info(await conn.read_message())
                await callback(info, conn)
            finally:
                await conn.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, serve_one, [listener])
            body = _field_bytes(1, unix_multiaddr_bytes(listen_path))
            for proto in protos:
                body += _field_bytes(2, proto.encode())
            body += _field_varint(3, 0)
            request = _field_varint(1, REQ_STREAM_HANDLER) + _field_bytes(4, body)
            conn, _ = await self._request(request)
            await conn.aclose()
            try:
                yield
            finally:
                nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def run_daemon(binary: Path, workdir: Path) -> AsyncIterator[DaemonClient]:
    """Start p2pd on loopback only (no bootstrap, NAT, relay or DHT) and stop it after."""
    control = workdir / "p2pd.sock"
    args = [
        str(binary),
        f"-listen=/unix{control}",
        "-hostAddrs=/ip4/127.0.0.1/tcp/0",
        "-noise=1",
        "-tls=1",
        "-muxer=yamux",
        "-relay=0",
        "-autonat=0",
        "-natPortMap=0",
        "-connManager=0",
        "-q",
    ]
    log = (workdir / "p2pd.log").open("wb")
    proc = await trio.lowlevel.open_process(args, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        with trio.fail_after(20):
            # The daemon announces nothing when ready; its control socket appearing is the sign.
            while not control.exists():
                if proc.poll() is not None:
                    raise DaemonError(f"p2pd exited with {proc.returncode}; see {log.name}")
                await trio.sleep(0.02)
        yield DaemonClient(control)
    finally:
        with trio.CancelScope(shield=True):
            proc.terminate()
            with trio.move_on_after(5):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(control)
