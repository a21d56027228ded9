"""A fuzzing client of a running daemon's local API (p2p/daemon/API.md): its Unix socket
and, when given, its TCP port, while the owner's `status` requests are timed.

Attacks, each bounded in count and time: the malformed requests together, then the
floods of connections together (which end the oldest waiting connections, by design):

  leave     connect and close at once
  half      half a request line, then leave
  garbage   random bytes ending in a newline
  oversize  a line over the 64 KiB a request may take
  deep      a 30,000-deep JSON array as the request (bad_request; on TCP unauthorized)
  slow      a valid request one byte every 0.2 s, past the daemon's 2 s for a line
  many      1,000 connections opened together, held silent, then closed
  holders   (TCP) tokenless connections that say nothing, 70 held at once and each
            replaced after 4.5 s: the attack that took every client slot of both listeners
  tokenless (TCP) well-formed requests without the token, and malformed ones

What it reports: the answers each attack got (by error code), and the owner's status
latencies on the socket, asked from a process of its own (every one must succeed, each
within a second).

    .venv/bin/python bench/api_fuzz.py STORE [--tcp HOST:PORT] [--seconds S]

Imported by tests/p2p/test_daemon_fuzz.py and bench/floods.py (``run_fuzz``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from p2p.daemon import api
from p2p.daemon.client import DaemonClient

# Each attack's connections at once, and how long the whole run lasts by default.
MANY = 1000
HOLDERS = 70
HOLDER_LIFE = 4.5
SECONDS = 6.0
# The owner asks for its node's status this often; each answer must come within OWNER_LIMIT.
OWNER_EVERY = 0.2
OWNER_LIMIT = 1.0
# Connecting or reading an answer never waits longer than this (the daemon answers in ms).
WAIT = 5.0


@dataclass
class Report:
    answers: dict[str, Counter[str]] = field(default_factory=dict)
    owner: list[float] = field(default_factory=list)  # seconds per status
    owner_failures: list[str] = field(default_factory=list)

    def saw(self, attack: str, answer: str) -> None:
        self.answers.setdefault(attack, Counter())[answer] += 1

    def summary(self) -> dict[str, Any]:
        return {
            "answers": {k: dict(v) for k, v in sorted(self.answers.items())},
            "owner_statuses": len(self.owner),
            "owner_max_s": round(max(self.owner, default=0.0), 3),
            "owner_failures": self.owner_failures,
        }


@dataclass(frozen=True)
class Target:
    socket_path: Path
    tcp: tuple[str, int] | None = None


async def _connect(target: Target, tcp: bool) -> trio.SocketStream:
    with trio.fail_after(WAIT):
        if tcp:
            assert target.tcp is not None
            return await trio.open_tcp_stream(*target.tcp)
        return await trio.open_unix_socket(str(target.socket_path))


async def _answer(stream: trio.SocketStream) -> str:
    """The code of the daemon's answer: an error's code, ``closed`` (nothing), ``result``."""
    data = b""
    with trio.move_on_after(WAIT):
        try:
            while b"\n" not in data:
                more = await stream.receive_some(65536)
                if not more:
                    break
                data += more
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    if b"\n" not in data:
        return "closed"
    event = json.loads(data.split(b"\n", 1)[0])
    return str(event.get("code") or event.get("event"))


async def _one(report: Report, target: Target, tcp: bool, attack: str, payload: bytes) -> None:
    name = f"{attack}/{'tcp' if tcp else 'socket'}"
    try:
        stream = await _connect(target, tcp)
    except (OSError, trio.TooSlowError):
        report.saw(name, "connect_failed")
        return
    async with stream:
        try:
            if attack == "leave":
                report.saw(name, "left")
                return
            if attack == "half":
                await stream.send_all(payload[: len(payload) // 2])
                report.saw(name, "left")
                return
            if attack == "slow":
                for byte in payload:
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(0.2)
            else:
                await stream.send_all(payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            report.saw(name, "cut_off")
            return
        report.saw(name, await _answer(stream))


def _payloads(rng: random.Random) -> dict[str, bytes]:
    status = b'{"api": 1, "op": "status"}\n'
    return {
        "leave": b"",
        "half": status,
        "garbage": rng.randbytes(200).replace(b"\n", b" ") + b"\n",
        "oversize": b"[" + b" " * (api.MAX_REQUEST_BYTES + 10) + b"]\n",
        "deep": b"[" * 30_000 + b"]" * 30_000 + b"\n",
        "slow": status,
    }


async def _attacks(report: Report, target: Target, tcp: bool, rng: random.Random) -> None:
    payloads = _payloads(rng)
    # Fewer at once than a listener keeps waiting (256), so that each is answered: the
    # 1,000-connection attack, which ends the oldest to make room, comes after.
    counts = {"leave": 100, "half": 50, "garbage": 50, "oversize": 10, "deep": 10, "slow": 10}
    async with trio.open_nursery() as nursery:
        for attack, count in counts.items():
            for _ in range(count):
                nursery.start_soon(_one, report, target, tcp, attack, payloads[attack])
        if tcp:
            for line in (
                b'{"api": 1, "op": "status"}\n',
                b'{"api": 1, "op": "put", "path": "/etc/shadow"}\n',
                b'{"api": 1, "op": "status", "token": "' + b"0" * 64 + b'"}\n',
                b"not json\n",
                b'{"api": 1, "op": \n',
            ):
                for _ in range(5):
                    nursery.start_soon(_one, report, target, tcp, "tokenless", line)


async def _many(report: Report, target: Target, tcp: bool, hold: float) -> None:
    """MANY connections opened together, held silent for ``hold`` seconds, then closed."""
    name = f"many/{'tcp' if tcp else 'socket'}"
    streams: list[trio.SocketStream] = []

    async def open_one() -> None:
        try:
            streams.append(await _connect(target, tcp))
        except (OSError, trio.TooSlowError):
            report.saw(name, "connect_failed")

    async with trio.open_nursery() as nursery:
        for _ in range(MANY):
            nursery.start_soon(open_one)
    report.saw(name, f"opened_{len(streams) // 100 * 100}+")
    await trio.sleep(hold)
    for stream in streams:
        await stream.aclose()


async def _holders(report: Report, target: Target, seconds: float) -> None:
    """HOLDERS silent tokenless TCP connections, each replaced after HOLDER_LIFE."""

    async def hold() -> None:
        end = trio.current_time() + seconds
        while trio.current_time() < end:
            try:
                stream = await _connect(target, True)
            except (OSError, trio.TooSlowError):
                report.saw("holders/tcp", "connect_failed")
                await trio.sleep(0.1)
                continue
            async with stream:
                report.saw("holders/tcp", "held")
                with trio.move_on_after(HOLDER_LIFE):
                    try:
                        while await stream.receive_some(4096):
                            pass
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass

    async with trio.open_nursery() as nursery:
        for _ in range(HOLDERS):
            nursery.start_soon(hold)


def owner_loop(socket_path: Path, seconds: float) -> None:
    """The owner: a `status` on the socket every OWNER_EVERY for ``seconds``, in a process
    of its own (the attacks' CPU and GIL in this one must not count as the daemon's);
    prints one JSON line: the latencies and what failed."""
    client = DaemonClient(socket_path)
    took: list[float] = []
    failures: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.monotonic()
        try:
            doc = client.status()
            took.append(time.monotonic() - began)
            if "peer_id" not in doc:
                failures.append("a status without a peer ID")
            elif took[-1] > OWNER_LIMIT:
                failures.append(f"status took {took[-1]:.2f} s")
        except Exception as exc:  # any failure of the owner's request is the finding
            failures.append(f"status failed: {exc}")
        time.sleep(OWNER_EVERY)
    print(json.dumps({"took": took, "failures": failures}))


async def _owner(report: Report, target: Target, seconds: float) -> None:
    done = await trio.run_process(
        [sys.executable, __file__, "--owner", str(target.socket_path), str(seconds)],
        capture_stdout=True, check=False,
    )  # fmt: skip
    try:
        seen = json.loads(done.stdout)
    except ValueError:
        report.owner_failures.append(f"the owner process failed ({done.returncode})")
        return
    report.owner.extend(seen["took"])
    report.owner_failures.extend(seen["failures"])


async def run_fuzz(target: Target, seconds: float = SECONDS, seed: int = 0) -> Report:
    """Every attack on the socket (and the TCP port, if given) while the owner asks for
    status; returns what each attack was answered and the owner's latencies."""
    report = Report()
    rng = random.Random(seed)
    listeners = (False, True) if target.tcp else (False,)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_owner, report, target, seconds + 4.0)
        # First the malformed requests, each answered; then the floods of connections.
        async with trio.open_nursery() as answered:
            for tcp in listeners:
                answered.start_soon(_attacks, report, target, tcp, rng)
        async with trio.open_nursery() as floods:
            for tcp in listeners:
                floods.start_soon(_many, report, target, tcp, min(3.0, seconds / 2))
            if target.tcp is not None:
                floods.start_soon(_holders, report, target, seconds)
    return report


def main(argv: list[str]) -> None:
    if argv[0] == "--owner":
        owner_loop(Path(argv[1]), float(argv[2]))
        return
    store = Path(argv[0])
    tcp = None
    seconds = SECONDS
    if "--tcp" in argv:
        host, _, port = argv[argv.index("--tcp") + 1].rpartition(":")
        tcp = (host, int(port))
    if "--seconds" in argv:
        seconds = float(argv[argv.index("--seconds") + 1])
    report = trio.run(run_fuzz, Target(api.socket_path(store), tcp), seconds)
    print(json.dumps(report.summary(), indent=2))
    sys.exit(1 if report.owner_failures else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
