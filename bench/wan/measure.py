"""Raw path measurements on a running testbed, with the probes of :mod:`bench.wan.probe`
run as processes inside the hosts: TCP throughput over N connections, TCP round-trip
times, UDP delivery counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.wan.testbed import Testbed, TestbedError

REPO_ROOT = Path(__file__).resolve().parents[2]
# Seconds a probe's ready line may take (a Python start-up on a loaded machine).
READY_TIMEOUT = 30.0
PROBE_PORT = 5201


def python_env() -> dict[str, str]:
    """The environment for Python processes in a host: this repository importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def probe_argv(mode: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "bench.wan.probe", mode, *args]


def _ready(proc: subprocess.Popen[str], what: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line or not json.loads(line).get("ready"):
        err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
        raise TestbedError(f"{what} did not start: {line!r} {err.strip()}")


def _result(proc: subprocess.Popen[str], what: str, timeout: float) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise TestbedError(f"{what} took over {timeout:.0f} s") from None
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise TestbedError(f"{what} failed ({proc.returncode}): {err.strip()[-500:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _spawn(tb: Testbed, host: str, argv: list[str]) -> subprocess.Popen[str]:
    return tb.popen(
        host,
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
    )


def tcp_rate(
    tb: Testbed,
    src: str,
    dst: str,
    nbytes: int,
    *,
    conns: int = 1,
    port: int = PROBE_PORT,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Send ``nbytes`` from ``src`` to ``dst`` over ``conns`` TCP connections. Returns
    the sink's figures (``rate_bytes_per_s``: first byte to last byte at the receiver)
    plus the source's wall ``source_seconds`` (first connect to last ack)."""
    got = tcp_rate_from(tb, {src: nbytes}, dst, conns=conns, port=port, timeout=timeout)
    return {**got, "source_seconds": got["source_seconds"][src]}


def tcp_rate_from(
    tb: Testbed,
    shares: dict[str, int],
    dst: str,
    *,
    conns: int = 1,
    port: int = PROBE_PORT,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Send ``shares[src]`` bytes from every ``src`` at once to ``dst``, each over ``conns``
    TCP connections, into one sink: what raw TCP gets from several providers together.
    ``rate_bytes_per_s`` runs from the first byte received to the last, over all of them;
    ``source_seconds`` is each source's first connect to last ack."""
    total = sum(shares.values())
    sink = _spawn(
        tb, dst, probe_argv("sink", "--port", str(port), "--conns", str(conns * len(shares)))
    )
    _ready(sink, "TCP sink")
    sources = {}
    for src, nbytes in shares.items():
        argv = probe_argv(
            "source", "--host", tb.addr(dst), "--port", str(port),
            "--conns", str(conns), "--bytes", str(nbytes),
        )  # fmt: skip
        sources[src] = _spawn(tb, src, argv)
    sent = {src: _result(proc, f"TCP source {src}", timeout) for src, proc in sources.items()}
    got = _result(sink, "TCP sink", timeout)
    if any(s["errors"] for s in sent.values()) or got["errors"] or got["bytes"] != total:
        raise TestbedError(f"TCP probe failed: sources {sent}, sink {got}")
    seconds = {src: s["seconds"] for src, s in sent.items()}
    return {**got, "source_seconds": seconds, "conns": conns}


def tcp_rtts_ms(
    tb: Testbed, a: str, b: str, *, count: int = 10, port: int = PROBE_PORT + 1
) -> list[float]:
    """``count`` one-byte TCP round trips from ``a`` to ``b`` and back, in ms."""
    server = _spawn(tb, b, probe_argv("echo-server", "--port", str(port)))
    _ready(server, "echo server")
    client = _spawn(
        tb, a, probe_argv("echo", "--host", tb.addr(b), "--port", str(port), "--count", str(count))
    )
    rtts: list[float] = _result(client, "echo", 60.0)["rtts_ms"]
    _result(server, "echo server", 10.0)
    return rtts


def udp_delivered(
    tb: Testbed, src: str, dst: str, *, count: int, port: int = PROBE_PORT + 2
) -> int:
    """Send ``count`` paced UDP datagrams; how many distinct ones arrived."""
    sink = _spawn(tb, dst, probe_argv("udp-sink", "--port", str(port), "--idle", "1.0"))
    _ready(sink, "UDP sink")
    source = _spawn(
        tb,
        src,
        probe_argv(
            "udp-source", "--host", tb.addr(dst), "--port", str(port), "--count", str(count)
        ),
    )  # fmt: skip
    _result(source, "UDP source", 60.0)
    distinct: int = _result(sink, "UDP sink", 60.0)["distinct"]
    return distinct


def observed_from(
    tb: Testbed, src: str, dst: str, *, local_port: int, port: int = PROBE_PORT + 3
) -> str:
    """The ``ip:port`` that ``dst`` sees a TCP connection from ``src``'s ``local_port``
    come from (``dst`` must be reachable: a public host)."""
    server = _spawn(tb, dst, probe_argv("observe-server", "--port", str(port)))
    _ready(server, "observe server")
    client = _spawn(
        tb,
        src,
        probe_argv(
            "observe", "--host", tb.addr(dst), "--port", str(port),
            "--local-port", str(local_port),
        ),
    )  # fmt: skip
    seen: str = _result(client, "observe", 30.0)["seen"]
    _result(server, "observe server", 10.0)
    return seen


def punch(
    tb: Testbed, a: str, b: str, *, port: int = PROBE_PORT + 4, timeout: float = 5.0
) -> tuple[bool, bool]:
    """A TCP simultaneous open between ``a`` and ``b``, each from ``port`` to the other's
    public address at ``port`` (what hole punching tries when mappings keep the port).
    Whether each side got a connection."""
    procs = []
    for me, peer in ((a, b), (b, a)):
        argv = probe_argv(
            "punch", "--local-port", str(port), "--peer-host", tb.public_addr(peer),
            "--peer-port", str(port), "--timeout", str(timeout),
        )  # fmt: skip
        procs.append(_spawn(tb, me, argv))
    ok = [bool(_result(p, "punch", timeout + 30.0)["connected"]) for p in procs]
    return ok[0], ok[1]
