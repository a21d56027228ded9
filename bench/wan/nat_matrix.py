"""Hole punching across a matrix of routers (the bench's table and the NAT tests' routers).

A cell is a kind of router pair: how each maps ports (``eim``: one public port per
socket, whatever it talks to; ``symmetric``: a new one per connection), how it turns
away an early SYN (``drop``, ``reset``, ``icmp``), and a twist (a carrier-grade NAT in
front of the provider, an asymmetric path, mappings forgotten after 30 s idle). Every
cell has its own provider (``<cell>p``) and fetcher (``<cell>f``) host behind such
routers, all on one testbed with one public relay run with raised limits, so a fetch
whose punch fails falls back to the relay (``--allow-relayed``), as a user who allows it
sees.

Each try is a fresh fetcher process (a new key and a new port: tries share no router or
kernel state) fetching the provider's blob from its circuit address only. Per try: did
the blob come over a direct connection, did the punch succeed in the first window of
the first exchange (its SYNs' trace saw one window), the time from the fetcher's node
being up to the first verified byte, and the bytes the relay carried meanwhile.

Why the NATed hosts are 1 ms from the core and the relay 20 ms: the two peers' SYNs
leave at moments DCUtR derives from relay round trips; on a path much shorter than the
relay's, a few milliseconds of scheduling noise make one SYN early, which is the case a
resetting or refusing router punishes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from bench.wan.natnodes import Agent, MiB, NatNodes
from bench.wan.testbed import Host

NEAR_MS = 1.0  # NATed hosts' one-way delay to the core (see the module docstring)
RELAY_MS = 20.0
SIZE = 1 * MiB
# The punch timeout of every try: the default of `blob get` (p2p.nat.punch), so a failing
# cell shows how long a user waits before the relay takes over.
PUNCH_TIMEOUT = 30.0
# Idle cells: each try starts this long after the last one ended, past the routers' 30 s.
IDLE_S = 30
IDLE_WAIT_S = IDLE_S + 5.0
FIRST_PORT = 4100  # fetchers listen on FIRST_PORT + try (module docstring)
FETCH_TIMEOUT = 120.0
# The relay's circuits carry a fallback fetch: over p2p.nat.punch's MIN_RELAYED_FETCH_BYTES
# (a relay that allows less is refused for a fetch at once).
RELAY_MAX_BYTES = 64 * MiB


@dataclass(frozen=True)
class Cell:
    name: str  # 1-10 of [a-z0-9]: host names are <name>p and <name>f
    title: str
    provider: Host
    fetcher: Host
    idle_wait_s: float = 0.0  # quiet time before each try (the idle cell)
    expect_direct: bool = True  # False: symmetric mapping, the relay is the way


def _nat(mapping: str, inbound: str, **kw: Any) -> Host:
    return Host(delay_ms=kw.pop("delay_ms", NEAR_MS), nat=mapping, nat_inbound=inbound, **kw)


def cells() -> list[Cell]:
    """The matrix: three early-SYN answers under both mappings, then the twists."""
    out = []
    for mapping, short in (("eim", "eim"), ("symmetric", "sym")):
        for inbound in ("drop", "reset", "icmp"):
            out.append(
                Cell(
                    f"{short}{inbound}",
                    f"{mapping}, early SYN {'dropped' if inbound == 'drop' else inbound}",
                    _nat(mapping, inbound),
                    _nat(mapping, inbound),
                    expect_direct=mapping == "eim",
                )
            )
    out.append(
        Cell(
            "cgn",
            "eim, provider behind a carrier-grade NAT too, resets",
            _nat("eim", "reset", nat_layers=2),
            _nat("eim", "reset"),
        )
    )
    out.append(
        Cell(
            "asym",
            "eim, one-way 150 ms (provider) and 20 ms (fetcher), resets",
            _nat("eim", "reset", delay_ms=150.0),
            _nat("eim", "reset", delay_ms=20.0),
        )
    )
    out.append(
        Cell(
            "idle",
            f"eim, mappings forgotten after {IDLE_S} s idle, each try after {IDLE_WAIT_S:.0f} s",
            _nat("eim", "drop", nat_idle_s=IDLE_S),
            _nat("eim", "drop", nat_idle_s=IDLE_S),
            idle_wait_s=IDLE_WAIT_S,
        )
    )
    return out


def matrix_hosts(chosen: Iterable[Cell]) -> dict[str, Host]:
    hosts = {"relay": Host(delay_ms=RELAY_MS)}
    for cell in chosen:
        hosts[f"{cell.name}p"] = cell.provider
        hosts[f"{cell.name}f"] = cell.fetcher
    return hosts


def start_relay(nat: NatNodes) -> Agent:
    """The public relay, with circuits big enough for a fallback fetch."""
    return nat.relay("relay", "--max-bytes", str(RELAY_MAX_BYTES))


def run_cell(
    nat: NatNodes,
    relay: Agent,
    cell: Cell,
    tries: int,
    *,
    extra: tuple[str, ...] = (),
    punch_timeout: float = PUNCH_TIMEOUT,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """``tries`` fetches from the cell's provider by fresh fetchers; one row each.
    ``extra``: agent arguments for both sides (``--no-syn-retry``, the control)."""
    [provider] = nat.providers([f"{cell.name}p"], relay=relay, size=SIZE, extra={
        f"{cell.name}p": list(extra)})  # fmt: skip
    rows = []
    for i in range(tries):
        if cell.idle_wait_s:
            time.sleep(cell.idle_wait_s)
        before = nat.relay_stats(relay)["relayed_bytes"]
        result = nat.fetch(
            f"{cell.name}f", provider.blob, provider.circuit_addrs,
            "--timeout", str(punch_timeout), "--allow-relayed", *extra,
            timeout=FETCH_TIMEOUT, port=FIRST_PORT + i,
        )  # fmt: skip
        relayed = nat.relay_stats(relay)["relayed_bytes"] - before
        row = try_row(cell, i, result, relayed)
        if report is not None:
            report(row)
        rows.append(row)
    return rows


def try_row(cell: Cell, i: int, result: dict[str, Any], relayed: int) -> dict[str, Any]:
    punch = (result.get("punches") or [{}])[0]
    direct = punch.get("path") == "direct" and "error" not in result
    return {
        "cell": cell.name,
        "try": i,
        "fetched": "error" not in result and result.get("bytes") == SIZE,
        "path": punch.get("path") or "failed",
        "direct": direct,
        "first_try": direct and punch.get("windows", 0) <= 1,
        "windows": punch.get("windows", 0),
        "syns": punch.get("syns", 0),
        "punch_s": (
            punch["direct_s"] - punch["relayed_s"]
            if punch.get("direct_s") is not None and punch.get("relayed_s") is not None
            else None
        ),
        "first_byte_s": result.get("first_byte_s"),
        "relayed_bytes": relayed,
        "reason": result.get("error") or punch.get("reason", ""),
        "seen": punch.get("seen", ""),
    }


def summarize(cell: Cell, rows: list[dict[str, Any]]) -> dict[str, Any]:
    direct = [r for r in rows if r["direct"]]
    firsts = [r["first_byte_s"] for r in direct if r["first_byte_s"] is not None]
    fallback = [r["first_byte_s"] for r in rows if not r["direct"] and r["first_byte_s"]]
    relayed_direct = [r["relayed_bytes"] for r in direct]
    return {
        "cell": cell.name,
        "title": cell.title,
        "tries": len(rows),
        "direct": len(direct),
        "first_try": sum(r["first_try"] for r in rows),
        "fetched": sum(r["fetched"] for r in rows),
        "first_direct_byte_s": _stats(firsts),
        "first_relayed_byte_s": _stats(fallback),
        "relayed_bytes_when_direct": max(relayed_direct) if relayed_direct else None,
        "relayed_bytes_max": max((r["relayed_bytes"] for r in rows), default=0),
        "reasons": sorted({r["reason"] for r in rows if r["reason"]})[:3],
    }


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
    }
