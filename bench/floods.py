"""Hostile floods against a real ``blob serve`` process, with figures against the goals.

Scenarios (each on a fresh server over its own store, every flooder in this process, each
flooding address a 127.0.0.x of its own so the server sees other machines; the legitimate
``blob get`` is a separate process dialling from 127.0.0.1):

  burst   600 silent sockets from 40 addresses for 3 s, three times over (each burst's
          dropped handshakes once leaked a resource-manager slot apiece: 512 locked every
          peer out); then a legit get.
  greedy  1,000 silent sockets from 63 addresses plus 64 identities from 8 addresses, each
          holding 16 unread gets of 16 MiB chunks; a legit get during the flood, timed
          against the same get from the idle server.
  greedy-only
          the greedy identities alone, with no silent sockets: 64 identities from 8
          addresses, each holding 16 unread gets (the 1,024-stream total), timed the same way.
  silent  the greedy scenario's 1,000 silent sockets from 63 addresses alone, each reopened
          when the server closes it: from 6 s to 14 s into the flood, the sockets opened a
          second and the server's CPU time (of one CPU).
  dht     4 identities x 10 ADD_PROVIDER messages naming themselves with 370,000
          addresses each (under py-libp2p's 4 MiB frame cap, over blobnet's 64 KiB
          request limit), DHT on; server RSS after, and a legit get.
  names   4,176 valid, never-expiring name records from 17 free keys, pushed by 72 free
          identities (each under its per-minute rate) at the 4,096-name cache; then a new
          publisher's name.
  combined
          the greedy flood as the hostile round ran it: 1,000 silent sockets from 40
          addresses plus the 64 greedy identities; the first legit get during it against
          idle, the owner's `blob status`, the node's threads and descriptors after.
  api-holders
          70 tokenless connections to `serve --api-listen`'s TCP port, each replaced after
          4.5 s, for 15 s; the owner's `blob status` on the socket throughout.
  fifo-puts
          42 local-API puts of FIFOs without a writer, their clients gone after 2 s; then
          the owner's status and a peer's get.
  metrics-slowloris
          1,500 connections to `--metrics` that send `GET /metr` and stall; then 5 s of
          scrapes from 8 scrapers as fast as they go.

The last four report the first legit get against idle (goal: 2x), the owner's `blob status`
(a real process; goal: each under 1 s) and the node's threads and descriptors back to their
count before the flood within 10 s of its end.

Goals: a legit get within 5 s after a flood stops (and within 2x the idle server's time
during the greedy flood), the server under 1 GiB RSS during the greedy flood and under
512 MiB after the DHT flood.

    .venv/bin/python bench/floods.py [--pin] [combined|api-holders|fifo-puts|metrics-slowloris|
                                              burst|greedy|greedy-only|silent|dht|names ...]

--pin stands the flooders on machines of their own: this process (every flooder) keeps to
the last CPU, the server and the legit gets to the others, in the idle measurement as in
the flooded one. Without it, on a small machine, the flood's own sockets and handshakes
take CPU from the server and the get, and the ratio measures the machine, not the
server's defences. (Needs 2 CPUs or more; said and ignored otherwise.)
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio
import varint
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.transport.tcp.tcp import TCP
from multiaddr import Multiaddr

from p2p.blob import messages
from p2p.transport.host import build_host

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import start_serve, stop_serve  # bench/serving.py, next to this file

MiB = 1024 * 1024
CHUNK = 16 * MiB
BLOB_SIZE = 64 * MiB
# After a flood stops, the node's threads and descriptors must be back within this long.
SETTLE_LIMIT = 10.0
# The owner's `blob status` must answer within this long during every flood.
STATUS_GOAL = 1.0
# --pin: the CPUs the server and the legit gets keep to (None: no pinning).
NODE_CPUS: set[int] | None = None
KAD = TProtocol("/ipfs/kad/1.0.0")


def _on_node_cpus() -> None:
    """Popen's preexec_fn: the child keeps to NODE_CPUS (--pin)."""
    if NODE_CPUS is not None:
        os.sched_setaffinity(0, NODE_CPUS)


def pin(argv: list[str]) -> list[str]:
    """Take --pin out of ``argv`` and, with it, split the CPUs (module docstring)."""
    global NODE_CPUS
    if "--pin" not in argv:
        return argv
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("floods: --pin needs 2 CPUs or more; running unpinned")
    else:
        NODE_CPUS = set(cpus[:-1])
        os.sched_setaffinity(0, {cpus[-1]})
        print(f"floods: server and gets on CPUs {sorted(NODE_CPUS)}, flooders on {cpus[-1]}")
    return [a for a in argv if a != "--pin"]


def blob(store: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "p2p.cli",
        "--store",
        str(store),
        "--key",
        str(store / "key"),
        *args,
    ]


class Server:
    def __init__(self, root: Path, *, dht: bool, extra: tuple[str, ...] = ()) -> None:
        self.store = root / "server"
        source = root / "model.bin"
        with source.open("wb") as f:
            f.write(os.urandom(BLOB_SIZE))
        put = subprocess.run(
            blob(self.store, "put", str(source), "--chunk-size", "16MiB", "--json"),
            capture_output=True, text=True, check=True, preexec_fn=_on_node_cpus,
        )  # fmt: skip
        self.blob_id = str(json.loads(put.stdout)[0]["id"])
        args = ["serve", "--json", "--listen", "/ip4/127.0.0.1/tcp/0", *extra]
        if not dht:
            args.append("--no-dht")
        self.log = (root / "serve.log").open("wb")
        self.proc, info = start_serve(
            blob(self.store, *args), stderr=self.log, preexec_fn=_on_node_cpus
        )
        self.addr = str(info["addrs"][0])
        self.port = int(self.addr.split("/")[4])

    def rss_mib(self, field: str = "VmRSS") -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def counts(self) -> tuple[int, int]:
        """The node's threads and open descriptors."""
        pid = self.proc.pid
        return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))

    def settle(self, baseline: tuple[int, int], limit: float = SETTLE_LIMIT) -> str:
        """How long the node's threads and descriptors took to come back to ``baseline``
        (polled every 0.2 s, at most ``limit`` seconds), said in words."""
        start = time.monotonic()
        while True:
            now = self.counts()
            back = now[0] <= baseline[0] and now[1] <= baseline[1]
            if back or time.monotonic() - start >= limit:
                break
            time.sleep(0.2)
        took = time.monotonic() - start
        where = f"threads {baseline[0]} -> {now[0]}, descriptors {baseline[1]} -> {now[1]}"
        return f"{where}: {'back' if back else 'NOT back'} in {took:.1f} s (goal: 10 s)"

    def stop(self) -> None:
        stop_serve(self.proc)
        self.log.close()


@contextmanager
def server(dht: bool = False, *extra: str) -> Iterator[tuple[Server, Path]]:
    root = Path(tempfile.mkdtemp(prefix="blobnet-floods-"))
    srv = Server(root, dht=dht, extra=extra)
    try:
        yield srv, root
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)


# tag -> (first byte, fetch seconds) of each successful legit get, as `blob get` reports them.
GETS: dict[str, tuple[float, float]] = {}


def detail(tag: str) -> str:
    first_byte, fetch = GETS.get(tag, (float("nan"), float("nan")))
    return f"(first byte at {first_byte:.1f} s, fetch {fetch:.1f} s)"


def legit_get(srv: Server, root: Path, tag: str) -> tuple[bool, float]:
    """A real ``blob get`` process into a fresh store: (succeeded, seconds)."""
    store = root / f"get-{tag}"
    start = time.monotonic()
    out = str(root / f"out-{tag}")
    done = subprocess.run(
        blob(store, "get", srv.blob_id, "--peer", srv.addr, "-o", out, "--json"),
        capture_output=True, text=True, timeout=300, preexec_fn=_on_node_cpus,
    )  # fmt: skip
    seconds = time.monotonic() - start
    shutil.rmtree(store, ignore_errors=True)
    if done.returncode != 0 or os.environ.get("FLOODS_SHOW_GETS"):
        said = f"{done.stdout.strip()[-1500:]} {done.stderr.strip()[-800:]}"
        print(f"  get {tag}: rc {done.returncode}; {said}")
    if done.returncode == 0:
        # The wall time includes the interpreter's start (seconds on a loaded machine);
        # the fetch's own figures say what the server cost it.
        result = json.loads(done.stdout)
        GETS[tag] = (float(result.get("first_byte_s", 0.0)), float(result["seconds"]))
    return done.returncode == 0, seconds


def flooder_host(source_ip: str) -> Any:
    host = build_host(create_new_key_pair())
    for transport in host.get_network().transport_manager.get_transports():
        if isinstance(transport, TCP):
            transport.dial = functools.partial(transport.dial_with_source, source=(source_ip, 0))
    return host


async def silent_sockets(
    port: int,
    addresses: int,
    total: int,
    seconds: float,
    first: int,
    count: list[int] | None = None,
) -> int:
    """``total`` silent sockets spread over ``addresses`` source addresses, each reopened
    when the server closes it, for ``seconds``. Returns how many were opened (and keeps
    ``count[0]`` at it meanwhile)."""
    opened = 0

    async def one(source: str) -> None:
        nonlocal opened
        while True:
            try:
                sock = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
            except OSError:
                await trio.sleep(0.2)
                continue
            opened += 1
            if count is not None:
                count[0] = opened
            async with sock:
                try:
                    while await sock.receive_some(4096):
                        pass
                except trio.BrokenResourceError:
                    pass

    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for n in range(total):
                nursery.start_soon(
                    one,
                    f"127.0.{(first + n % addresses) // 250}.{(first + n % addresses) % 250 + 2}",
                )
    return opened


async def greedy_identity(srv: Server, source: str, gets: int, stats: dict[str, int]) -> None:
    host = flooder_host(source)
    request = messages.encode_request(messages.GetRequest(srv.blob_id, ((0, BLOB_SIZE // CHUNK),)))
    async with host.run(listen_addrs=[]):
        try:
            with trio.fail_after(60):
                info = info_from_p2p_addr(Multiaddr(f"{srv.addr}"))
                await host.connect(info)

                async def unread() -> None:
                    stream = await host.new_stream(
                        info.peer_id, [TProtocol(messages.Version.V1_0.protocol_id)]
                    )
                    await stream.write(request)
                    stats["gets"] += 1

                async with trio.open_nursery() as nursery:
                    for _ in range(gets):
                        nursery.start_soon(unread)
        except Exception:
            stats["refused"] += 1
        stats["settled"] += 1
        await trio.sleep_forever()


def provider_message(peer_id_bytes: bytes, key: bytes, addresses: int) -> bytes:
    message = Message()
    message.type = Message.MessageType.ADD_PROVIDER
    message.key = key
    peer = message.providerPeers.add()
    peer.id = peer_id_bytes
    # /ip4/a.b.c.d/tcp/port, built as bytes: 0x04 + 4 bytes, 0x06 + 2 bytes.
    peer.addrs.extend(
        b"\x04" + struct.pack(">I", 0x0A000000 + i) + b"\x06" + struct.pack(">H", 4001)
        for i in range(addresses)
    )
    return message.SerializeToString()


async def dht_flooder(srv: Server, source: str, messages: int, addresses: int) -> int:
    host = flooder_host(source)
    sent = 0
    async with host.run(listen_addrs=[]):
        info = info_from_p2p_addr(Multiaddr(srv.addr))
        await host.connect(info)
        for n in range(messages):
            data = provider_message(
                host.get_id().to_bytes(), os.urandom(32) + bytes([n]), addresses
            )
            try:
                stream = await host.new_stream(info.peer_id, [KAD])
                await stream.write(varint.encode(len(data)) + data)
                with trio.move_on_after(30):
                    await stream.read(1024)
                await stream.close()
                sent += 1
            except Exception:
                pass
    return sent


def burst() -> None:
    with server() as (srv, root):
        ok, idle = legit_get(srv, root, "idle")
        print(f"burst: idle server get {'ok' if ok else 'FAILED'} in {idle:.1f} s")
        for n in range(3):
            opened = trio.run(silent_sockets, srv.port, 40, 600, 3.0, 10)
            print(f"burst {n + 1}: {opened} silent sockets from 40 addresses in 3 s")
        ok, after = legit_get(srv, root, "after")
        print(
            f"burst: get after the bursts {'ok' if ok else 'FAILED'} in {after:.1f} s "
            f"(goal: within 5 s); server RSS {srv.rss_mib():.0f} MiB"
        )


def greedy(silent: bool = True) -> None:
    """The greedy identities, with the silent sockets on top unless ``silent`` is false."""
    name = "greedy" if silent else "greedy-only"
    with server() as (srv, root):
        ok, idle = legit_get(srv, root, "idle")
        print(f"{name}: idle server get {'ok' if ok else 'FAILED'} in {idle:.1f} s")
        stats = {"gets": 0, "refused": 0, "settled": 0}
        result: dict[str, Any] = {}

        async def run() -> None:
            async with trio.open_nursery() as nursery:
                if silent:
                    nursery.start_soon(silent_sockets, srv.port, 63, 1000, 3600.0, 100)
                for i in range(64):
                    nursery.start_soon(greedy_identity, srv, f"127.0.0.{10 + i % 8}", 16, stats)
                with trio.fail_after(120):
                    while stats["settled"] < 64:  # noqa: ASYNC110 - our own counter
                        await trio.sleep(0.2)
                ok, seconds = await trio.to_thread.run_sync(legit_get, srv, root, "flood")
                result.update(ok=ok, seconds=seconds, peak=srv.rss_mib("VmHWM"))
                nursery.cancel_scope.cancel()

        trio.run(run)
        print(
            f"{name}: {stats['gets']} unread gets held by {64 - stats['refused']} identities; "
            f"get during the flood {'ok' if result['ok'] else 'FAILED'} in "
            f"{result['seconds']:.1f} s = {result['seconds'] / idle:.2f}x idle (goal: 2x); "
            f"server peak RSS {result['peak']:.0f} MiB (goal: < 1024)"
        )
        ok, after = legit_get(srv, root, "after")
        print(f"{name}: get after the flood {'ok' if ok else 'FAILED'} in {after:.1f} s")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def silent() -> None:
    with server() as (srv, _root):
        count = [0]

        async def run() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(silent_sockets, srv.port, 63, 1000, 3600.0, 100, count)
                await trio.sleep(6.0)
                cpu, opened, start = cpu_seconds(srv.proc.pid), count[0], time.monotonic()
                await trio.sleep(8.0)
                took = time.monotonic() - start
                busy = (cpu_seconds(srv.proc.pid) - cpu) / took
                print(
                    f"silent: {opened} sockets opened in the first 6 s; from 6 s to 14 s "
                    f"{(count[0] - opened) / took:.0f} a second, server CPU {busy:.0%}"
                )
                nursery.cancel_scope.cancel()

        trio.run(run)


def dht() -> None:
    with server(dht=True) as (srv, root):
        before = srv.rss_mib()

        async def run() -> int:
            sent = 0
            async with trio.open_nursery() as nursery:
                counts: list[int] = []

                async def one(i: int) -> None:
                    counts.append(await dht_flooder(srv, f"127.0.1.{10 + i}", 10, 370_000))

                for i in range(4):
                    nursery.start_soon(one, i)
            sent = sum(counts)
            return sent

        start = time.monotonic()
        sent = trio.run(run)
        took = time.monotonic() - start
        peak = srv.rss_mib("VmHWM")
        time.sleep(20)
        after = srv.rss_mib()
        ok, seconds = legit_get(srv, root, "after")
        print(
            f"dht: {sent} ADD_PROVIDER messages of 370,000 addresses in {took:.1f} s; server RSS "
            f"{before:.0f} MiB before, peak {peak:.0f}, {after:.0f} MiB 20 s after "
            f"(goal: < 512); get after {'ok' if ok else 'FAILED'} in {seconds:.1f} s"
        )


async def push_records(srv: Server, source: str, records: list[bytes]) -> list[str]:
    """Push each record over the names protocol from one fresh identity; the answers."""
    from libp2p.peer.id import ID

    from p2p.names import protocol as wire

    host = flooder_host(source)
    answers = []
    async with host.run(listen_addrs=[]):
        info = info_from_p2p_addr(Multiaddr(srv.addr))
        await host.connect(info)
        for record in records:
            request = wire.PutRequest(record)
            try:
                with trio.fail_after(30):
                    stream = await host.new_stream(
                        ID.from_base58(str(info.peer_id)), [TProtocol(wire.PROTOCOL_ID)]
                    )
                    await stream.write(wire.encode(request))
                    head = b""
                    while len(head) < wire.LENGTH_PREFIX_SIZE:
                        head += await stream.read(wire.LENGTH_PREFIX_SIZE - len(head))
                    size = int.from_bytes(head, "big")
                    body = b""
                    while len(body) < size:
                        body += await stream.read(size - len(body))
                    reply = wire.decode_response(body, request)
                    await stream.close()
                answers.append(
                    reply.reason if isinstance(reply, wire.PutResponse) and not reply.ok else "ok"
                )
            except Exception as exc:
                answers.append(type(exc).__name__)
    return answers


def names() -> None:
    """4,200 valid, never-expiring records from 17 free keys, pushed by 72 free identities
    (58 each, under the 60 a minute each may push); then a new publisher's name."""
    from identity import MachineKey, SoftwareSigner
    from p2p.names.record import sign_record

    with server() as (srv, _root):
        before = srv.rss_mib()
        now = int(time.time())
        keys = [SoftwareSigner(MachineKey.generate()) for _ in range(17)]
        records = [
            sign_record(keys[i % 17], name=f"flood/{i}", blob_id="a" * 64, seq=1, time=now).encode()
            for i in range(72 * 58)
        ]

        async def run() -> list[str]:
            answers: list[str] = []

            async def one(i: int) -> None:
                answers.extend(
                    await push_records(srv, f"127.0.2.{10 + i}", records[i * 58 : (i + 1) * 58])
                )

            async with trio.open_nursery() as nursery:
                for i in range(72):
                    nursery.start_soon(one, i)
            return answers

        start = time.monotonic()
        answers = trio.run(run)
        took = time.monotonic() - start
        legit = SoftwareSigner(MachineKey.generate())
        record = sign_record(legit, name="run-1/adapter", blob_id="b" * 64, seq=1, time=now)
        (answer,) = trio.run(push_records, srv, "127.0.0.1", [record.encode()])
        accepted = sum(1 for a in answers if a == "ok")
        print(
            f"names: {len(answers)} flood records pushed in {took:.0f} s, {accepted} accepted; "
            f"a new publisher's name: {answer}; server RSS {before:.0f} -> {srv.rss_mib():.0f} "
            f"MiB (goal: < 512)"
        )


def connect_times(port: int, count: int = 5) -> str:
    """How long plain TCP connects to the server's port take from 127.0.0.1 (a SYN the
    kernel dropped for a full accept queue is sent again after 1 s, then 3 s)."""
    import socket as stdsocket

    took = []
    for _ in range(count):
        start = time.monotonic()
        with stdsocket.create_connection(("127.0.0.1", port), timeout=30):
            took.append(time.monotonic() - start)
    return "TCP connects took " + ", ".join(f"{t * 1000:.0f}" for t in took) + " ms"


def owner_status(srv: Server) -> tuple[str, float]:
    """The owner's `blob status` (a real process, the light path): (outcome, seconds)."""
    start = time.monotonic()
    done = subprocess.run(
        blob(srv.store, "status", "--json"), capture_output=True, text=True, timeout=60,
        preexec_fn=_on_node_cpus,
    )  # fmt: skip
    seconds = time.monotonic() - start
    if done.returncode == 0:
        return "ok", seconds
    return f"exit {done.returncode}: {done.stderr.strip()[-200:]}", seconds


async def statuses(srv: Server, seconds: float, every: float = 0.5) -> list[tuple[str, float]]:
    """The owner's `blob status`, one after another (``every`` apart) for ``seconds``."""
    seen: list[tuple[str, float]] = []
    end = trio.current_time() + seconds
    while trio.current_time() < end:
        seen.append(await trio.to_thread.run_sync(owner_status, srv))
        await trio.sleep(every)
    return seen


def said(seen: list[tuple[str, float]]) -> str:
    """Statuses in words: how many answered, the slowest, what failed."""
    ok = [t for outcome, t in seen if outcome == "ok"]
    failed = sorted({outcome for outcome, _ in seen if outcome != "ok"})
    worst = max((t for _, t in seen), default=0.0)
    return (
        f"owner's blob status {len(ok)}/{len(seen)} ok, slowest {worst:.2f} s "
        f"(goal: {STATUS_GOAL:g} s)" + (f"; failures: {failed}" if failed else "")
    )


def combined() -> None:
    """The combined flood: 1,000 silent sockets from 40 addresses plus 64 identities x 16
    unread 16 MiB gets from 8 addresses; the first legit get against idle, the owner's
    status, and the node's threads and descriptors once the flood stops."""
    with server() as (srv, root):
        ok, idle = legit_get(srv, root, "idle")
        baseline = srv.counts()
        print(
            f"combined: idle get {'ok' if ok else 'FAILED'} in {idle:.1f} s {detail('idle')}; "
            f"{baseline[0]} threads, {baseline[1]} descriptors"
        )
        stats = {"gets": 0, "refused": 0, "settled": 0}
        result: dict[str, Any] = {}

        async def run() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(silent_sockets, srv.port, 40, 1000, 3600.0, 100)
                for i in range(64):
                    nursery.start_soon(greedy_identity, srv, f"127.0.0.{10 + i % 8}", 16, stats)
                with trio.fail_after(120):
                    while stats["settled"] < 64:  # noqa: ASYNC110 - our own counter
                        await trio.sleep(0.2)
                cpu, start = cpu_seconds(srv.proc.pid), time.monotonic()
                result["first"] = await trio.to_thread.run_sync(legit_get, srv, root, "first")
                took = time.monotonic() - start
                result["cpu"] = (cpu_seconds(srv.proc.pid) - cpu) / took
                result["status"] = await statuses(srv, 3.0)
                result["connects"] = await trio.to_thread.run_sync(connect_times, srv.port)
                result["second"] = await trio.to_thread.run_sync(legit_get, srv, root, "second")
                result["peak"] = srv.rss_mib("VmHWM")
                result["during"] = srv.counts()
                nursery.cancel_scope.cancel()

        trio.run(run)
        for name in ("first", "second"):
            ok, seconds = result[name]
            print(
                f"combined: {name} get during the flood {'ok' if ok else 'FAILED'} in "
                f"{seconds:.1f} s {detail(name)} = {seconds / idle:.2f}x idle (goal: 2x)"
                + (f"; server CPU meanwhile {result['cpu']:.0%}" if name == "first" else "")
            )
        threads, fds = result["during"]
        print(
            f"combined: {stats['gets']} unread gets held by {64 - stats['refused']} "
            f"identities; {said(result['status'])}; {result['connects']}; peak RSS "
            f"{result['peak']:.0f} MiB; during: {threads} threads, {fds} descriptors"
        )
        print(f"combined: after the flood, {srv.settle(baseline)}")


def api_holders() -> None:
    """70 tokenless TCP connections to the local API, each replaced after 4.5 s, for 15 s
    (they took every client slot of both listeners): the owner's status on the socket
    throughout, a legit get, and the node's threads and descriptors after."""
    with server(False, "--api-listen", "127.0.0.1:0") as (srv, root):
        ok, idle = legit_get(srv, root, "idle")
        status = json.loads(subprocess.run(
            blob(srv.store, "status", "--json"), capture_output=True, text=True, check=True,
        ).stdout)  # fmt: skip
        host, port = str(status["api_tcp"]).rsplit(":", 1)
        baseline = srv.counts()
        held = [0]
        result: dict[str, Any] = {}

        async def hold(end: float) -> None:
            while trio.current_time() < end:
                try:
                    stream = await trio.open_tcp_stream(host, int(port))
                except OSError:
                    await trio.sleep(0.1)
                    continue
                held[0] += 1
                async with stream:
                    with trio.move_on_after(4.5):
                        try:
                            while await stream.receive_some(4096):
                                pass
                        except trio.BrokenResourceError:
                            pass

        async def run() -> None:
            end = trio.current_time() + 15.0
            async with trio.open_nursery() as nursery:
                for _ in range(70):
                    nursery.start_soon(hold, end)
                await trio.sleep(1.0)
                result["get"] = await trio.to_thread.run_sync(legit_get, srv, root, "held")
                result["status"] = await statuses(srv, 12.0, every=0.1)
                result["during"] = srv.counts()

        trio.run(run)
        ok, seconds = result["get"]
        print(
            f"api-holders: {held[0]} tokenless connections in 15 s; get during "
            f"{'ok' if ok else 'FAILED'} in {seconds:.1f} s = {seconds / idle:.2f}x idle "
            f"(goal: 2x); {said(result['status'])}; during: {result['during'][0]} threads, "
            f"{result['during'][1]} descriptors"
        )
        print(f"api-holders: after, {srv.settle(baseline)}")


def fifo_puts() -> None:
    """42 API puts of FIFOs that have no writer, their clients gone after 2 s (they held
    every thread the daemon and its blob server shared): what they were answered, then
    the owner's status, a peer's get, and the node's threads and descriptors."""
    import socket as stdsocket

    from p2p.daemon import api

    with server() as (srv, root):
        ok, idle = legit_get(srv, root, "idle")
        baseline = srv.counts()
        fifos = []
        for i in range(42):
            fifo = root / f"fifo-{i}"
            os.mkfifo(fifo)
            fifos.append(fifo)
        answers: dict[str, int] = {}
        start = time.monotonic()
        for fifo in fifos:
            sock = stdsocket.socket(stdsocket.AF_UNIX)
            sock.settimeout(2.0)
            sock.connect(str(api.socket_path(srv.store)))
            sock.sendall(api.Request("put", {"path": str(fifo)}).encode())
            answer = "no answer in 2 s"
            data = b""
            deadline = time.monotonic() + 2.0
            try:
                # Progress events (heartbeats) may come forever: the client leaves at 2 s.
                while b'"error"' not in data and b'"result"' not in data:
                    if time.monotonic() > deadline:
                        break
                    more = sock.recv(65536)
                    if not more:
                        break
                    data += more
                for line in data.splitlines():
                    event = json.loads(line)
                    if event.get("event") in ("error", "result"):
                        answer = str(event.get("code") or "stored")
            except TimeoutError:
                pass
            sock.close()
            answers[answer] = answers.get(answer, 0) + 1
        took = time.monotonic() - start
        seen = trio.run(statuses, srv, 2.0)
        ok, seconds = legit_get(srv, root, "after")
        print(
            f"fifo-puts: 42 puts answered {answers} in {took:.1f} s; {said(seen)}; get after "
            f"{'ok' if ok else 'FAILED'} in {seconds:.1f} s = {seconds / idle:.2f}x idle "
            f"(goal: 2x)"
        )
        for fifo in fifos:  # a writer ends any read still waiting
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        print(f"fifo-puts: after, {srv.settle(baseline)}")


def metrics_slowloris() -> None:
    """1,500 connections to --metrics that send `GET /metr` and stall (each held a thread
    and a descriptor in the node for good): the node's threads and descriptors while they
    stay, a scrape and a get meanwhile; then 5 s of scrapes as fast as 8 scrapers go (527
    a second took 76% of a core), the node's CPU and a get during them."""
    import re
    import socket as stdsocket
    import urllib.request

    with server(False, "--metrics", "127.0.0.1:0") as (srv, root):
        ok, idle = legit_get(srv, root, "idle")
        deadline = time.monotonic() + 10
        while "/metrics" not in (srv.store.parent / "serve.log").read_text():
            if time.monotonic() > deadline:
                raise SystemExit("no metrics line")
            time.sleep(0.1)
        url = re.findall(r"http://\S+/metrics", (srv.store.parent / "serve.log").read_text())[0]
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        baseline = srv.counts()
        stalled = []
        for _ in range(1500):
            sock = stdsocket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"GET /metr")
            stalled.append(sock)
        opened = time.monotonic()
        during = srv.counts()
        start = time.monotonic()
        with urllib.request.urlopen(url, timeout=30) as answer:
            answer.read()
        scrape_s = time.monotonic() - start
        ok, seconds = legit_get(srv, root, "slowloris")
        seen = trio.run(statuses, srv, 2.0)
        back = srv.settle(baseline, max(0.0, 10.0 - (time.monotonic() - opened)) + 5.0)
        print(
            f"metrics-slowloris: 1,500 stalled requests; node {during[0]} threads, {during[1]} "
            f"descriptors right after (baseline {baseline[0]}, {baseline[1]}); a scrape in "
            f"{scrape_s:.2f} s; get {'ok' if ok else 'FAILED'} in {seconds:.1f} s = "
            f"{seconds / idle:.2f}x idle; {said(seen)}"
        )
        print(f"metrics-slowloris: with the 1,500 still open, {back}")
        for sock in stalled:
            sock.close()
        scrapes = [0]

        async def scraper(end: float) -> None:
            while trio.current_time() < end:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                    while await stream.receive_some(65536):
                        pass
                scrapes[0] += 1

        async def flood() -> tuple[bool, float]:
            async with trio.open_nursery() as nursery:
                end = trio.current_time() + 5.0
                for _ in range(8):
                    nursery.start_soon(scraper, end)
                return await trio.to_thread.run_sync(legit_get, srv, root, "scrapes")

        cpu, start = cpu_seconds(srv.proc.pid), time.monotonic()
        ok, seconds = trio.run(flood)
        took = time.monotonic() - start
        busy = (cpu_seconds(srv.proc.pid) - cpu) / took
        print(
            f"metrics-slowloris: then {scrapes[0] / took:.0f} scrapes a second for {took:.1f} s, "
            f"node CPU {busy:.0%} (scrapes and the get together); get during them "
            f"{'ok' if ok else 'FAILED'} in {seconds:.1f} s = {seconds / idle:.2f}x idle"
        )


SCENARIOS = {
    "combined": combined,
    "api-holders": api_holders,
    "fifo-puts": fifo_puts,
    "metrics-slowloris": metrics_slowloris,
    "burst": burst,
    "greedy": greedy,
    "greedy-only": functools.partial(greedy, silent=False),
    "silent": silent,
    "dht": dht,
    "names": names,
}


if __name__ == "__main__":
    chosen = pin(sys.argv[1:]) or list(SCENARIOS)
    unknown = [name for name in chosen if name not in SCENARIOS]
    if unknown:
        sys.exit(
            f"floods: no scenario {unknown[0]!r}; usage: floods.py [--pin] "
            f"[{' | '.join(SCENARIOS)}] ..."
        )
    for name in chosen:
        SCENARIOS[name]()
