"""Relays, NATed providers and fetchers on testbed hosts (issue 20): each a
:mod:`bench.wan.nat_agent` process in its host's namespace, listening on the host's own
address at ``PORT`` (one node per host, so one fixed port: hole punching dials from it).

    with Testbed(hosts) as tb:
        nat = NatNodes(tb)
        relay = nat.relay("relay")
        home = nat.provider("home", relay=relay, size=16 * MiB)
        result = nat.fetch("cafe", home.blob, [home.circuit_addrs[0]])
        nat.relayed_bytes(relay)  # what the relay carried

A fetch's result is :class:`p2p.nat.punch.NatFetch`'s JSON (``punches``, ``first_byte_s``,
``done_s``, ``bytes``) or ``{"error": ...}``; times count from the fetcher's node being
up (its Python start-up excluded), so they are what ``blob get`` would add to its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.wan.blobnodes import _readline
from bench.wan.measure import REPO_ROOT, python_env
from bench.wan.testbed import Testbed, TestbedError, stop_process

PORT = 4001
# A node's start-up (imports, key, listen, a reservation over a few RTTs) on a loaded
# 2-vCPU machine; a fetch adds its punch (bounded by its own timeout) and the transfer.
READY_TIMEOUT = 60.0
STATS_TIMEOUT = 10.0
MiB = 1 << 20


@dataclass
class Agent:
    host: str
    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    log: Path | None = None

    @property
    def peer_id(self) -> str:
        return str(self.ready["peer_id"])

    @property
    def blob(self) -> str:
        return str(self.ready.get("blob", ""))

    @property
    def addrs(self) -> list[str]:
        return list(self.ready.get("addrs", []))

    @property
    def circuit_addrs(self) -> list[str]:
        return list(self.ready.get("circuit_addrs", []))


@dataclass
class NatNodes:
    tb: Testbed
    logs: Path | None = None  # a directory for the agents' stderr (None: discarded)
    agents: list[Agent] = field(default_factory=list)

    def _argv(self, role: str, host: str, *args: str, port: int = PORT) -> list[str]:
        listen = f"/ip4/{self.tb.addr(host)}/tcp/{port}"
        return [sys.executable, "-m", "bench.wan.nat_agent", role, "--listen", listen, *args]

    def _spawn(
        self, role: str, host: str, *args: str, port: int = PORT
    ) -> tuple[subprocess.Popen[str], Path | None]:
        log = None if self.logs is None else self.logs / f"{host}-{role}.log"
        err: Any = subprocess.DEVNULL if log is None else log.open("ab")
        try:
            proc = self.tb.popen(
                host,
                self._argv(role, host, *args, port=port),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=python_env(),
                cwd=REPO_ROOT,
            )
        finally:
            if log is not None:
                err.close()
        return proc, log

    def _ready(self, role: str, host: str, proc: subprocess.Popen[str], log: Path | None) -> Agent:
        line = _readline(proc, READY_TIMEOUT)
        if not line:
            stop_process(proc)
            tail = log.read_text(errors="replace")[-800:] if log is not None else ""
            raise TestbedError(f"{role} on {host} did not start: {tail}")
        agent = Agent(host, proc, json.loads(line), log)
        self.agents.append(agent)
        return agent

    def _start(self, role: str, host: str, *args: str, port: int = PORT) -> Agent:
        return self._ready(role, host, *self._spawn(role, host, *args, port=port))

    def relay(self, host: str, *extra: str) -> Agent:
        """A relay on a public host; admits everyone unless ``--trust HEX`` is given."""
        return self._start("relay", host, *extra)

    def relay_addr(self, relay: Agent) -> str:
        return f"/ip4/{self.tb.addr(relay.host)}/tcp/{PORT}/p2p/{relay.peer_id}"

    def _provider_args(
        self, relay: Agent | None, size: int, seed: int, extra: Sequence[str]
    ) -> list[str]:
        args = ["--size", str(size), "--seed", str(seed), *extra]
        if relay is not None:
            args += ["--relay", self.relay_addr(relay)]
        return args

    def provider(
        self, host: str, *, relay: Agent | None, size: int, seed: int = 0, extra: Sequence[str] = ()
    ) -> Agent:
        """A node holding ``size`` seeded random bytes. With a ``relay`` it asks it for a
        dial-back and, if private, reserves (its ``ready`` then carries ``public``,
        ``detail``, ``addrs`` to hand out, ``circuit_addrs`` and ``problems``)."""
        return self._start("provider", host, *self._provider_args(relay, size, seed, extra))

    def providers(
        self,
        hosts: Sequence[str],
        *,
        relay: Agent | None,
        size: int,
        seed: int = 0,
        extra: Mapping[str, Sequence[str]] | None = None,
    ) -> list[Agent]:
        """Several providers started at once (each one's dial-back check takes seconds);
        ``extra``: more agent arguments per host."""
        extra = extra or {}
        spawned = [
            (
                host,
                *self._spawn(
                    "provider", host, *self._provider_args(relay, size, seed, extra.get(host, ()))
                ),
            )
            for host in hosts
        ]
        return [self._ready("provider", host, proc, log) for host, proc, log in spawned]

    def direct_addr(self, agent: Agent) -> str:
        return f"/ip4/{self.tb.addr(agent.host)}/tcp/{PORT}/p2p/{agent.peer_id}"

    def fetch(
        self,
        host: str,
        blob: str,
        providers: Sequence[str],
        *extra: str,
        timeout: float = 120.0,
        port: int = PORT,
    ) -> dict[str, Any]:
        """Run a fetcher on ``host`` to completion; its result line, plus ``spawned_at``
        (wall clock when its process was started: ``fetch_started_at`` and the result's
        times measure from inside, so start-up is ``fetch_started_at - spawned_at``).
        ``port``: the fetcher's listen port, which its hole punch dials from (a fresh one
        per try makes tries independent: the routers and the kernels keep a closed
        connection's state for a minute or two, by its addresses and ports)."""
        args = ["--blob", blob, *extra]
        for addr in providers:
            args += ["--provider", addr]
        spawned_at = time.time()
        agent = self._start("fetcher", host, *args, port=port)
        line = _readline(agent.proc, timeout)
        stop_process(agent.proc)
        if not line:
            tail = agent.log.read_text(errors="replace")[-800:] if agent.log else ""
            raise TestbedError(f"fetcher on {host} gave no result in {timeout:.0f} s: {tail}")
        result: dict[str, Any] = json.loads(line)
        result["spawned_at"] = spawned_at
        return result

    def relay_stats(self, relay: Agent) -> dict[str, Any]:
        """The relay's counters: ``relayed_bytes`` (every byte it carried in circuits,
        both directions) and ``refused`` (peer IDs it turned away)."""
        assert relay.proc.stdin is not None
        relay.proc.stdin.write("stats\n")
        relay.proc.stdin.flush()
        line = _readline(relay.proc, STATS_TIMEOUT)
        if not line:
            raise TestbedError("the relay did not answer for its counters")
        stats: dict[str, Any] = json.loads(line)
        return stats

    def stop(self) -> None:
        for agent in self.agents:
            stop_process(agent.proc)
