"""Transport stack benchmark: one bulk transfer between two processes, per stack.

    .venv/bin/python bench/stack.py [--size-mib 1024] [--reps 3] [--json-out FILE] [--only ...]

Rows (sender = this process, receiver = a child process, 127.0.0.1):
  raw_tcp            blocking sockets, sendall / recv_into of 1 MiB
  lean_pipe          blocking sockets, ChaCha20-Poly1305 over 1 MiB frames, BLAKE3 of each
                     1 MiB chunk on the receiver (the floor a blob fetch is held to)
  libp2p_default     py-libp2p 0.8.1 Noise + yamux, one stream, 1 MiB writes and reads
  fast_stream        blobnet's p2p.transport.fast Noise + yamux, one stream, 1 MiB writes, receiver
                     uses read_into (straight into its buffer)
  fast_stream_blake3 as fast_stream, plus BLAKE3 of each 1 MiB chunk on the receiver
  fast_stream_store  as fast_stream, but the receiver does a fetch's store work: each chunk
                     lands in a pooled buffer and is verified and written into a partial blob
                     of a real store by a worker thread, exactly as the downloader does, and
                     the blob is published at the end. Between fast_stream_blake3 and a blob
                     fetch, it splits what the store costs from what the protocol costs
  bare_fetch         a blob fetch's essential work in plain blocking Python: chunks read from
                     a file, blobnet's wire format (Noise, yamux, chunk headers), each chunk
                     verified and written with O_DIRECT (bench/bare_fetch.py): the pure-Python
                     floor for a fetch

Each rep times the transfer only (connection set up beforehand), from the first byte sent to
the receiver's acknowledgement that it has everything; the figure is MiB/s (reported as MB/s),
the median of the reps, with each side's CPU seconds (median) and MiB per CPU-second of both
sides together: on a shared or one-core machine that last figure is the steadier one. Ratios
are to lean_pipe and to libp2p_default. The `measure_*` functions are importable
(bench/transfer.py uses them). With BENCH_STATS=1 the fast receivers print, per rep, how
many Noise frames were decrypted straight into the reader's buffer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MIB = 1 << 20
CHUNK = MIB
REPO_ROOT = Path(__file__).resolve().parents[1]
_ACK = struct.Struct(">d")  # receiver CPU seconds for the rep
_LEN = struct.Struct(">Q")
_FRAME = struct.Struct(">I")
# A fixed key for the lean pipe: it measures cost, not secrecy.
LEAN_KEY = bytes(range(32))
# Child start-up (imports, key generation, listen) must not take longer than this.
CHILD_START_TIMEOUT_S = 60


@dataclass
class Rep:
    mb_s: float
    seconds: float
    sender_cpu_s: float
    receiver_cpu_s: float


@dataclass
class Row:
    name: str
    size_mib: int
    reps: list[Rep]

    @property
    def median_mb_s(self) -> float:
        return statistics.median(r.mb_s for r in self.reps)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _payload() -> memoryview:
    # The same bytes in both processes, so a receiver can know each chunk's hash up front.
    return memoryview(random.Random(CHUNK).randbytes(CHUNK))


# ----------------------------------------------------------------------------- children


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        n = sock.recv_into(view[pos:])
        if n == 0:
            raise EOFError("sender went away")
        pos += n


def _child_blocking(mode: str, reps: int) -> None:
    from blake3 import blake3
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    server = socket.create_server(("127.0.0.1", 0))
    print(f"READY {server.getsockname()[1]}", flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    aead = ChaCha20Poly1305(LEAN_KEY)
    head = memoryview(bytearray(8))
    frame = memoryview(bytearray(CHUNK + 16))
    plain = memoryview(bytearray(CHUNK))
    for _ in range(reps):
        _recv_exactly(conn, head)
        (size,) = _LEN.unpack(head)
        cpu0 = _cpu()
        left = size
        nonce = 0
        while left:
            if mode == "raw_tcp":
                n = conn.recv_into(plain[: min(left, CHUNK)])
                if n == 0:
                    raise EOFError("sender went away")
                left -= n
                continue
            _recv_exactly(conn, head[:4])
            (flen,) = _FRAME.unpack(head[:4])
            _recv_exactly(conn, frame[:flen])
            n = aead.decrypt_into(
                struct.pack("<4xQ", nonce), frame[:flen], None, plain[: flen - 16]
            )
            nonce += 1
            blake3(plain[:n]).digest()
            left -= n
        conn.sendall(_ACK.pack(_cpu() - cpu0))
    conn.close()


def _child_libp2p(mode: str, reps: int, directory: Path | None) -> None:
    import trio
    from libp2p.custom_types import TProtocol

    sys.path.insert(0, str(REPO_ROOT))
    from blake3 import blake3
    from multiaddr import Multiaddr

    from p2p.transport.fast import read_exactly_into

    proto = TProtocol("/blobnet-bench/sink/1.0.0")
    host = _make_host("default" if mode == "libp2p_default" else "fast")
    hashing = mode == "fast_stream_blake3"
    done = trio.Event()
    served = 0

    async def sink(stream: Any) -> None:
        nonlocal served
        buf = memoryview(bytearray(CHUNK))
        head = bytearray(8)
        assert await read_exactly_into(stream, head) == 8
        (size,) = _LEN.unpack(head)
        cpu0 = _cpu()
        left = size
        if mode == "fast_stream_store":
            await _receive_into_store(stream, size, directory)
            left = 0
        while left:
            want = min(left, CHUNK)
            if mode == "libp2p_default":
                data = await stream.read(want)
                left -= len(data)
                continue
            got = await read_exactly_into(stream, buf[:want])
            if got != want:
                raise EOFError("sender went away")
            if hashing:
                blake3(buf[:got]).digest()
            left -= got
        await stream.write(_ACK.pack(_cpu() - cpu0))
        muxed: Any = getattr(stream, "muxed_conn", None)
        if os.environ.get("BENCH_STATS") and hasattr(muxed, "direct_frames"):
            print(f"frames {muxed.frames_received} direct {muxed.direct_frames}", file=sys.stderr)
        await stream.close()
        served += 1
        if served == reps:
            done.set()

    async def main() -> None:
        host.set_stream_handler(proto, sink)
        async with host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            addr = host.get_addrs()[0]
            print(f"READY {addr}", flush=True)
            await done.wait()
            await trio.sleep(0.2)

    trio.run(main)


async def _receive_into_store(stream: Any, size: int, directory: Path | None) -> None:
    """Receive `size` bytes of `_payload()` chunks as the downloader does (pooled buffers;
    each chunk hashed on arrival where the downloader does so, verified and written by
    `PartialBlob.write_chunk` from a ChunkWriter) into a fresh store under `directory`, and
    publish the blob."""
    import tempfile

    import trio
    from blake3 import blake3

    from blobstore import Manifest, Store
    from p2p.blob.buffers import ChunkBuffers
    from p2p.fetch.chunk_writer import ChunkWriter
    from p2p.fetch.download_parts import BUFFER_POOL_BYTES, HASH_ON_ARRIVAL, MIN_BUFFERS
    from p2p.transport.fast import read_exactly_into

    payload = _payload()
    hashes = blake3(payload).digest() * (size // CHUNK)
    if size % CHUNK:
        hashes += blake3(payload[: size % CHUNK]).digest()
    manifest = Manifest(size=size, chunk_size=CHUNK, hashes=hashes)
    with tempfile.TemporaryDirectory(prefix="blobnet-bench-store-", dir=directory) as root:
        store = Store.open(root)
        partial = await trio.to_thread.run_sync(store.begin_partial, manifest)
        buffers = ChunkBuffers(CHUNK, max(MIN_BUFFERS, BUFFER_POOL_BYTES // CHUNK))

        async def write(
            writer: ChunkWriter, index: int, body: memoryview, digest: bytes | None
        ) -> None:
            try:
                if not await writer.write(index, body, digest):
                    raise RuntimeError(f"chunk {index} was already written")
            finally:
                buffers.release(body)

        try:
            async with ChunkWriter(partial) as writer, trio.open_nursery() as writers:
                for index in range(manifest.num_chunks):
                    body = memoryview(await buffers.acquire())[: manifest.chunk_span(index)[1]]
                    if await read_exactly_into(stream, body) != len(body):
                        raise EOFError("sender went away")
                    digest = blake3(body).digest() if HASH_ON_ARRIVAL else None
                    writers.start_soon(write, writer, index, body, digest)
            await trio.to_thread.run_sync(partial.publish)
        finally:
            await trio.to_thread.run_sync(partial.close)
        if not store.has(manifest.blob_id):
            raise RuntimeError("the received blob was not published")


def _make_host(kind: str) -> Any:
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair

    kp = create_new_key_pair()
    if kind == "default":
        return new_host(key_pair=kp)
    import p2p.transport.fast as fast

    host = new_host(key_pair=kp, sec_opt=fast.security_options(kp), muxer_opt=fast.muxer_options())
    fast.install(host)
    return host


# ------------------------------------------------------------------------------ senders


class _Child:
    def __init__(self, mode: str, reps: int, extra: tuple[str, ...] = ()) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--reps", str(reps)]
        cmd += extra
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + CHILD_START_TIMEOUT_S
        line = ""
        while not line.startswith("READY ") and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"benchmark child for {mode} exited with {self.proc.returncode}")
        if not line.startswith("READY "):
            raise RuntimeError(f"benchmark child for {mode} did not start")
        self.address = line.split(" ", 1)[1].strip()

    def close(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def _send_blocking(mode: str, size: int, reps: int, directory: Path | None = None) -> list[Rep]:
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    child = _Child(mode, reps)
    out: list[Rep] = []
    try:
        sock = socket.create_connection(("127.0.0.1", int(child.address)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = _payload()
        aead = ChaCha20Poly1305(LEAN_KEY)
        frame = memoryview(bytearray(4 + CHUNK + 16))
        ack = memoryview(bytearray(_ACK.size))
        for _ in range(reps):
            sock.sendall(_LEN.pack(size))
            cpu0, t0 = _cpu(), time.perf_counter()
            left = size
            nonce = 0
            while left:
                n = min(left, CHUNK)
                if mode == "raw_tcp":
                    sock.sendall(payload[:n])
                else:
                    _FRAME.pack_into(frame, 0, n + 16)
                    aead.encrypt_into(
                        struct.pack("<4xQ", nonce), payload[:n], None, frame[4 : 4 + n + 16]
                    )
                    nonce += 1
                    sock.sendall(frame[: 4 + n + 16])
                left -= n
            _recv_exactly(sock, ack)
            dt = time.perf_counter() - t0
            (rcpu,) = _ACK.unpack(ack)
            out.append(Rep(size / MIB / dt, dt, _cpu() - cpu0, rcpu))
        sock.close()
    finally:
        child.close()
    return out


def _send_libp2p(mode: str, size: int, reps: int, directory: Path | None = None) -> list[Rep]:
    import trio
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    from p2p.transport.fast import read_exactly_into

    proto = TProtocol("/blobnet-bench/sink/1.0.0")
    child = _Child(mode, reps, ("--dir", str(directory)) if directory else ())
    out: list[Rep] = []

    async def main() -> None:
        host = _make_host("default" if mode == "libp2p_default" else "fast")
        payload = _payload()
        async with host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            info = info_from_p2p_addr(Multiaddr(child.address))
            await host.connect(info)
            for _ in range(reps):
                stream = await host.new_stream(info.peer_id, [proto])
                await stream.write(_LEN.pack(size))
                cpu0, t0 = _cpu(), time.perf_counter()
                left = size
                while left:
                    n = min(left, CHUNK)
                    await stream.write(payload[:n] if n < CHUNK else payload)
                    left -= n
                ack = bytearray(_ACK.size)
                if await read_exactly_into(stream, ack) != _ACK.size:
                    raise EOFError("receiver closed without acknowledging")
                dt = time.perf_counter() - t0
                (rcpu,) = _ACK.unpack(ack)
                out.append(Rep(size / MIB / dt, dt, _cpu() - cpu0, rcpu))
                await stream.close()
            await host.close()

    try:
        trio.run(main)
    finally:
        child.close()
    return out


def _send_bare_fetch(size: int, reps: int, directory: Path | None) -> list[Rep]:
    import bare_fetch  # bench/bare_fetch.py, next to this file

    extra = ("--dir", str(directory)) if directory else ()
    runs = bare_fetch.send(size, reps, lambda: _Child("bare_fetch", reps, extra), directory)
    return [Rep(size / MIB / dt, dt, scpu, rcpu) for dt, scpu, rcpu in runs]


# Each sender takes (mode, size, reps, directory); only fast_stream_store uses the directory.
MODES: dict[str, Callable[[str, int, int, Path | None], list[Rep]]] = {
    "raw_tcp": _send_blocking,
    "lean_pipe": _send_blocking,
    "libp2p_default": _send_libp2p,
    "fast_stream": _send_libp2p,
    "fast_stream_blake3": _send_libp2p,
    "fast_stream_store": _send_libp2p,
}
ROWS = [*MODES, "bare_fetch"]


def run_row(mode: str, size: int, reps: int = 3, directory: Path | None = None) -> Row:
    """Run `reps` transfers of `size` bytes for one stack (one child process). Only
    bare_fetch and fast_stream_store touch the disk, in `directory` (default: the system's
    temp directory)."""
    if mode == "bare_fetch":
        return Row(mode, size // MIB, _send_bare_fetch(size, reps, directory))
    return Row(mode, size // MIB, MODES[mode](mode, size, reps, directory))


def _median_mb_s(mode: str, size: int, reps: int) -> float:
    return run_row(mode, size, reps).median_mb_s


def measure_raw_tcp(size: int, reps: int = 1) -> float:
    """MB/s (MiB/s) of `size` bytes over blocking loopback TCP; median of `reps`."""
    return _median_mb_s("raw_tcp", size, reps)


def measure_lean_pipe(size: int, reps: int = 1) -> float:
    """MB/s of the lean encrypted pipe (ChaCha20-Poly1305 1 MiB frames + BLAKE3 per MiB)."""
    return _median_mb_s("lean_pipe", size, reps)


def measure_libp2p_default(size: int, reps: int = 1) -> float:
    """MB/s of one py-libp2p default-stack stream (Noise + yamux), 1 MiB writes."""
    return _median_mb_s("libp2p_default", size, reps)


def measure_fast_stream(size: int, reps: int = 1) -> float:
    """MB/s of one blobnet fast-path stream, 1 MiB writes, receiver reading into its buffer."""
    return _median_mb_s("fast_stream", size, reps)


def measure_bare_fetch(size: int, reps: int = 1) -> float:
    """MB/s of a fetch's essential work in plain blocking Python (bench/bare_fetch.py)."""
    return _median_mb_s("bare_fetch", size, reps)


def measure_fast_stream_blake3(size: int, reps: int = 1) -> float:
    """As measure_fast_stream, with BLAKE3 of each received 1 MiB chunk."""
    return _median_mb_s("fast_stream_blake3", size, reps)


def _table(rows: list[Row]) -> str:
    by = {r.name: r.median_mb_s for r in rows}
    lean, default = by.get("lean_pipe"), by.get("libp2p_default")
    lines = [
        "| stack | MiB | MB/s median | reps MB/s | x lean_pipe | x libp2p_default | "
        "sender CPU s | receiver CPU s | MB per CPU-s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        med = r.median_mb_s
        reps = " / ".join(f"{x.mb_s:.0f}" for x in r.reps)
        x_lean = f"{med / lean:.2f}" if lean else "-"
        x_def = f"{med / default:.1f}" if default else "-"
        scpu = statistics.median(x.sender_cpu_s for x in r.reps)
        rcpu = statistics.median(x.receiver_cpu_s for x in r.reps)
        per_cpu = r.size_mib / (scpu + rcpu) if scpu + rcpu > 0 else 0.0
        lines.append(
            f"| {r.name} | {r.size_mib} | {med:.1f} | {reps} | {x_lean} | {x_def} | "
            f"{scpu:.2f} | {rcpu:.2f} | {per_cpu:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Transport stack benchmark (see module doc)")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=sorted(ROWS), help="run only these rows")
    parser.add_argument("--json-out", type=Path, help="also write the results as JSON")
    parser.add_argument(
        "--dir",
        type=Path,
        help="where bare_fetch and fast_stream_store put their files (default /tmp)",
    )
    parser.add_argument("--child", choices=sorted(ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.child in ("raw_tcp", "lean_pipe"):
            _child_blocking(args.child, args.reps)
        elif args.child == "bare_fetch":
            import bare_fetch  # bench/bare_fetch.py, next to this file

            bare_fetch.child(args.reps, args.dir)
        else:
            _child_libp2p(args.child, args.reps, args.dir)
        return 0
    size = args.size_mib * MIB
    rows = []
    for mode in args.only or ROWS:
        print(f"running {mode} ({args.size_mib} MiB x {args.reps})...", file=sys.stderr)
        rows.append(run_row(mode, size, args.reps, args.dir))
    print(_table(rows))
    if args.json_out:
        doc = {
            "size_mib": args.size_mib,
            "reps": args.reps,
            "rows": [{**asdict(r), "median_mb_s": r.median_mb_s} for r in rows],
        }
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
