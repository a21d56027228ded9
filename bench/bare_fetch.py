"""The ``bare_fetch`` row of bench/stack.py: a blob fetch's essential work in plain Python.

A blob fetch does more than the lean pipe: the provider reads each chunk from its store,
the bytes travel as blobnet's wire format (Noise frames of at most 64 KiB, yamux DATA
frames, a chunk header per chunk), and the fetcher checks each chunk against its manifest
hash and writes it to disk with ``O_DIRECT``. This row does exactly that work and nothing
else: blocking sockets, one connection, no event loop, no multiplexing logic, no flow
control, no scheduler, one writer thread so the disk overlaps the network. It is the floor
for the fetch in pure Python, so ``blob_fetch / bare_fetch`` says how much the real stack
(trio, py-libp2p, yamux, the blob protocol, crash-safe bookkeeping) costs on top of it, and
``bare_fetch / lean_pipe`` what the fetch's unavoidable extra work costs against the lean
pipe.

The sender (this process) first writes a source file of ``size`` bytes (not timed) and
sends the child the BLAKE3 of every chunk, as a manifest would give them.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import msgpack
from blake3 import blake3

from p2p.blob.messages import LENGTH_PREFIX_SIZE, encode_chunk_header
from p2p.transport.fast.noise_frames import TAG_LEN, CipherState, FrameReader, FrameWriter
from p2p.transport.fast.yamux_core import HEADER as YAMUX_HEADER
from p2p.transport.fast.yamux_core import HEADER_LEN as YAMUX_HEADER_LEN
from p2p.transport.fast.yamux_core import TYPE_DATA

MIB = 1 << 20
CHUNK = MIB
KEY = bytes(range(32))
STREAM_ID = 1
# Chunk buffers the receiver rotates through: one being filled while the writer thread
# still owns the others.
BODY_BUFFERS = 4
_LEN = struct.Struct(">Q")
_ACK = struct.Struct(">d")


class BadChunk(Exception):
    """The bench's own integrity check failed: the row's result would be meaningless."""


def _cpu() -> float:
    return time.process_time()


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    if sock.recv_into(view, len(view), socket.MSG_WAITALL) != len(view):
        raise EOFError("peer went away")


def _open_direct(path: Path) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:  # tmpfs and some others refuse O_DIRECT
        return os.open(path, flags, 0o600)


# ------------------------------------------------------------------------------ receiver


class _Receiver:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.cipher = CipherState(KEY)
        self.frames = FrameReader(4 * MIB)
        self.small = memoryview(bytearray(4096))

    def frame(self) -> memoryview:
        while (frame := self.frames.next_frame()) is None:
            n = self.sock.recv_into(self.frames.recv_space())
            if n == 0:
                raise EOFError("sender went away")
            self.frames.commit(n)
        return frame

    def chunk_into(self, body: memoryview) -> tuple[int, int]:
        """Receive one chunk (its headers, then its body straight into ``body``); return
        (index, length). The yamux headers and the chunk header are decoded and checked,
        as the real fetcher does."""
        frame = self.frame()
        n = self.cipher.decrypt_into(frame, self.small[: len(frame) - TAG_LEN])
        head = self.small[:n]
        _, typ, _, sid, header_len = YAMUX_HEADER.unpack_from(head, 0)
        at = YAMUX_HEADER_LEN + header_len
        if typ != TYPE_DATA or sid != STREAM_ID or n != at + YAMUX_HEADER_LEN:
            raise BadChunk("unexpected frame where a chunk header belongs")
        fields = msgpack.unpackb(head[YAMUX_HEADER_LEN + LENGTH_PREFIX_SIZE : at])
        _, typ, _, sid, length = YAMUX_HEADER.unpack_from(head, at)
        if typ != TYPE_DATA or sid != STREAM_ID or length != fields["n"] or length > len(body):
            raise BadChunk("unexpected chunk body header")
        pos = 0
        while pos < length:
            frame = self.frame()
            pos += self.cipher.decrypt_into(frame, body[pos : pos + len(frame) - TAG_LEN])
        return fields["i"], length


def child(reps: int, directory: Path | None = None) -> None:
    """The receiver: listens, prints READY, then verifies and writes ``reps`` transfers
    into a file in ``directory`` (default: the system's temp directory)."""
    server = socket.create_server(("127.0.0.1", 0))
    print(f"READY {server.getsockname()[1]}", flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bodies = [memoryview(mmap.mmap(-1, CHUNK)) for _ in range(BODY_BUFFERS)]
    with (
        tempfile.TemporaryDirectory(prefix="bare-fetch-", dir=directory) as tmp,
        ThreadPoolExecutor(1) as disk,
    ):
        fd = _open_direct(Path(tmp) / "data")
        try:
            head = memoryview(bytearray(_LEN.size))
            for _ in range(reps):
                receiver = _Receiver(conn)
                _recv_exactly(conn, head)
                (size,) = _LEN.unpack(head)
                chunks = -(-size // CHUNK)
                hashes = memoryview(bytearray(32 * chunks))
                _recv_exactly(conn, hashes)
                cpu0 = _cpu()
                writes: list[Future[int] | None] = [None] * BODY_BUFFERS
                for i in range(chunks):
                    slot = i % BODY_BUFFERS
                    pending = writes[slot]
                    if pending is not None:
                        pending.result()
                    body = bodies[slot]
                    index, length = receiver.chunk_into(body)
                    if index != i or blake3(body[:length]).digest() != hashes[32 * i : 32 * i + 32]:
                        raise BadChunk(f"chunk {i} failed its check")
                    writes[slot] = disk.submit(os.pwrite, fd, body[:length], i * CHUNK)
                for pending in writes:
                    if pending is not None:
                        pending.result()
                os.fsync(fd)
                conn.sendall(_ACK.pack(_cpu() - cpu0))
        finally:
            os.close(fd)
    conn.close()


# -------------------------------------------------------------------------------- sender


def _write_source(path: Path, size: int) -> bytes:
    """Write ``size`` bytes of distinct chunks; return their BLAKE3 hashes, concatenated."""
    hashes = bytearray()
    block = bytearray(os.urandom(CHUNK))
    with open(path, "wb") as f:
        for i in range(-(-size // CHUNK)):
            n = min(CHUNK, size - i * CHUNK)
            block[:8] = i.to_bytes(8, "little")
            f.write(block[:n])
            hashes += blake3(block[:n]).digest()
    return bytes(hashes)


class Child(Protocol):
    """The receiving process, as bench/stack.py starts it: ``address`` is its port."""

    address: str

    def close(self) -> None: ...


def send(
    size: int, reps: int, start_child: Callable[[], Child], directory: Path | None = None
) -> list[tuple[float, float, float]]:
    """Run ``reps`` transfers to a child started by ``start_child()`` once the source file
    is written (in ``directory``); returns (seconds, sender CPU s, receiver CPU s) per rep."""
    out: list[tuple[float, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="bare-fetch-src-", dir=directory) as tmp:
        source = Path(tmp) / "blob"
        hashes = _write_source(source, size)
        child_proc = start_child()
        try:
            sock = socket.create_connection(("127.0.0.1", int(child_proc.address)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            fd = os.open(source, os.O_RDONLY)
            # Page-aligned: on this VM's AMD EPYC a kernel copy into a buffer that starts
            # 1-31 bytes past a cache line (as a bytearray's data may) costs about 5x more.
            body = memoryview(mmap.mmap(-1, CHUNK))
            ack = memoryview(bytearray(_ACK.size))
            try:
                for _ in range(reps):
                    writer = FrameWriter(CipherState(KEY), 2 * CHUNK + 64 * 1024)
                    sock.sendall(_LEN.pack(size) + hashes)
                    cpu0, t0 = _cpu(), time.perf_counter()
                    for i in range(-(-size // CHUNK)):
                        n = min(CHUNK, size - i * CHUNK)
                        got = os.preadv(fd, [body[:n]], i * CHUNK)
                        if got != n:
                            raise BadChunk(f"short read of chunk {i}")
                        header = encode_chunk_header(i, n)
                        pieces: list[bytes | memoryview] = [
                            YAMUX_HEADER.pack(0, TYPE_DATA, 0, STREAM_ID, len(header)) + header,
                            YAMUX_HEADER.pack(0, TYPE_DATA, 0, STREAM_ID, n),
                            body[:n],
                        ]
                        sock.sendall(writer.seal(pieces))
                    _recv_exactly(sock, ack)
                    dt = time.perf_counter() - t0
                    out.append((dt, _cpu() - cpu0, _ACK.unpack(ack)[0]))
            finally:
                os.close(fd)
                sock.close()
        finally:
            child_proc.close()
    return out
