"""Raw network probes run inside testbed hosts: what the path itself gives, with no
blobnet code on it. Standard library only; every mode prints one JSON line.

``python -m bench.wan.probe MODE ...``:

- ``sink --port P --conns N``: accept N TCP connections, read each to the byte count its
  sender announces, then ack each with one byte. Prints ``{"ready": true}`` once
  listening, then the result: bytes and seconds from the first byte received to the
  last (the path's throughput, without handshake or ack).
- ``source --host H --port P --conns N --bytes B``: send B bytes split over N parallel
  connections; prints the seconds from the first connect to the last ack.
- ``echo-server --port P`` / ``echo --host H --port P --count K``: K one-byte TCP round
  trips on one connection (after its handshake); prints each RTT in ms.
- ``udp-sink --port P --idle S`` / ``udp-source --host H --port P --count K``: K
  datagrams, paced; the sink counts what arrives until S seconds pass with nothing.
- ``observe-server --port P --count K`` / ``observe --host H --port P --local-port L``:
  the server tells each of K clients the address and port it sees them come from (what
  a NAT mapped them to).
- ``punch --local-port L --peer-host H --peer-port P --timeout S``: a TCP simultaneous
  open from port L to the peer's public address, as hole punching does; prints whether
  a connection came up within S seconds.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time
from typing import Any

HEADER = struct.Struct("!Q")  # bytes the sender will send on this connection
SEND_BLOCK = 1 << 20
RECV_BLOCK = 1 << 20
# Nothing the probes do takes this long on any path the testbed emulates; past it the
# probe gives up rather than hang a test or a bench.
IO_TIMEOUT = 120.0
# One connection's share is bounded so a typo cannot ask for a petabyte.
MAX_BYTES = 1 << 40
UDP_PAYLOAD = 1200
UDP_PACE_S = 0.0002  # between datagrams: keeps the sender well under any link's rate


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _listener(port: int, backlog: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(backlog)
    sock.settimeout(IO_TIMEOUT)
    return sock


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionError("peer closed early")
        data += more
    return data


def sink(port: int, conns: int) -> None:
    listener = _listener(port, conns)
    _emit({"ready": True})
    accepted = [listener.accept()[0] for _ in range(conns)]
    first: list[float] = []
    last: list[float] = []
    received = [0] * conns
    errors: list[str] = []

    def drain(k: int, conn: socket.socket) -> None:
        try:
            conn.settimeout(IO_TIMEOUT)
            (expect,) = HEADER.unpack(_recv_exact(conn, HEADER.size))
            if expect > MAX_BYTES:
                raise ValueError(f"sender announced {expect} bytes")
            buf = bytearray(RECV_BLOCK)
            view = memoryview(buf)
            got = 0
            while got < expect:
                n = conn.recv_into(view, min(RECV_BLOCK, expect - got))
                if n == 0:
                    raise ConnectionError(f"closed after {got} of {expect} bytes")
                if got == 0:
                    first.append(time.monotonic())
                got += n
            last.append(time.monotonic())
            received[k] = got
        except (OSError, ValueError) as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=drain, args=(k, c)) for k, c in enumerate(accepted)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for conn in accepted:
        try:
            conn.sendall(b"k")
        except OSError as exc:
            errors.append(repr(exc))
        conn.close()
    total = sum(received)
    seconds = max(last) - min(first) if first and last else 0.0
    _emit(
        {
            "bytes": total,
            "seconds": seconds,
            "rate_bytes_per_s": total / seconds if seconds > 0 else 0.0,
            "per_conn": received,
            "errors": errors,
        }
    )


def source(host: str, port: int, conns: int, total: int) -> None:
    block = memoryview(bytes(SEND_BLOCK))
    shares = [total // conns + (1 if k < total % conns else 0) for k in range(conns)]
    errors: list[str] = []
    start = time.monotonic()

    def push(share: int) -> None:
        try:
            with socket.create_connection((host, port), timeout=IO_TIMEOUT) as conn:
                conn.sendall(HEADER.pack(share))
                left = share
                while left:
                    n = min(left, SEND_BLOCK)
                    conn.sendall(block[:n])
                    left -= n
                if conn.recv(1) != b"k":
                    raise ConnectionError("no ack")
        except OSError as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=push, args=(share,)) for share in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - start
    _emit({"bytes": total, "seconds": seconds, "errors": errors})


def echo_server(port: int) -> None:
    listener = _listener(port, 1)
    _emit({"ready": True})
    conn, _ = listener.accept()
    conn.settimeout(IO_TIMEOUT)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = conn.recv(1)
        if not data:
            break
        conn.sendall(data)
    _emit({"done": True})


def echo(host: str, port: int, count: int) -> None:
    rtts = []
    with socket.create_connection((host, port), timeout=IO_TIMEOUT) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            t0 = time.monotonic()
            conn.sendall(b"e")
            if conn.recv(1) != b"e":
                raise ConnectionError("echo lost")
            rtts.append((time.monotonic() - t0) * 1000)
    _emit({"rtts_ms": rtts})


def udp_sink(port: int, idle: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind(("0.0.0.0", port))
    _emit({"ready": True})
    sock.settimeout(IO_TIMEOUT)
    got = 0
    sequence: set[int] = set()
    while True:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        got += 1
        sequence.add(int.from_bytes(data[:8], "big"))
        sock.settimeout(idle)
    _emit({"datagrams": got, "distinct": len(sequence)})


def udp_source(host: str, port: int, count: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    pad = bytes(UDP_PAYLOAD - 8)
    for k in range(count):
        sock.sendto(k.to_bytes(8, "big") + pad, (host, port))
        time.sleep(UDP_PACE_S)
    _emit({"sent": count})


def _bound(local_port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("0.0.0.0", local_port))
    return sock


def observe_server(port: int, count: int) -> None:
    listener = _listener(port, count)
    _emit({"ready": True})
    seen = []
    for _ in range(count):
        conn, (ip, peer_port) = listener.accept()
        with conn:
            conn.sendall(f"{ip}:{peer_port}\n".encode())
        seen.append(f"{ip}:{peer_port}")
    _emit({"seen": seen})


def observe(host: str, port: int, local_port: int) -> None:
    with _bound(local_port) as sock:
        sock.settimeout(IO_TIMEOUT)
        sock.connect((host, port))
        line = sock.makefile("r").readline().strip()
    _emit({"seen": line})


def punch(local_port: int, peer_host: str, peer_port: int, timeout: float) -> None:
    started = time.monotonic()
    connected = False
    error = ""
    with _bound(local_port) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect((peer_host, peer_port))
            sock.sendall(b"p")
            connected = sock.recv(1) == b"p"
        except OSError as exc:
            error = repr(exc)
    _emit({"connected": connected, "seconds": time.monotonic() - started, "error": error})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wan.probe")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("sink")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--conns", type=int, default=1)
    p = sub.add_parser("source")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--conns", type=int, default=1)
    p.add_argument("--bytes", type=int, required=True)
    p = sub.add_parser("echo-server")
    p.add_argument("--port", type=int, required=True)
    p = sub.add_parser("echo")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=10)
    p = sub.add_parser("udp-sink")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--idle", type=float, default=1.0)
    p = sub.add_parser("udp-source")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=1000)
    p = sub.add_parser("observe-server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=1)
    p = sub.add_parser("observe")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--local-port", type=int, required=True)
    p = sub.add_parser("punch")
    p.add_argument("--local-port", type=int, required=True)
    p.add_argument("--peer-host", required=True)
    p.add_argument("--peer-port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    if getattr(args, "conns", 1) < 1 or not 0 < getattr(args, "bytes", 1) <= MAX_BYTES:
        parser.error("--conns must be >= 1 and --bytes in 1..2**40")
    if args.mode == "sink":
        sink(args.port, args.conns)
    elif args.mode == "source":
        source(args.host, args.port, args.conns, args.bytes)
    elif args.mode == "echo-server":
        echo_server(args.port)
    elif args.mode == "echo":
        echo(args.host, args.port, args.count)
    elif args.mode == "udp-sink":
        udp_sink(args.port, args.idle)
    elif args.mode == "udp-source":
        udp_source(args.host, args.port, args.count)
    elif args.mode == "observe-server":
        observe_server(args.port, args.count)
    elif args.mode == "observe":
        observe(args.host, args.port, args.local_port)
    else:
        punch(args.local_port, args.peer_host, args.peer_port, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
