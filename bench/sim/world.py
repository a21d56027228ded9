"""One simulation's world: the SimPy environment, the network, the nodes, a seeded RNG and
the region delays (the testbed's three continents, or a region matrix for the internet).

Regions. bench/wan gives each host one delay to a core, so two hosts of one region are as
far apart as their delays say (eu-eu 130 ms on THREE_CONTINENTS). For internet-scale
scenarios a host's delay is its access delay and the regions add a one-way delay matrix:
`INTERNET_REGIONS` (eu-us 80 ms, us-asia 150 ms, eu-asia 200 ms RTT, as the testbed's
preset, and 20-30 ms within a region).
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import simpy

from bench.sim.fluid import (
    DEFAULT_INITIAL_WINDOW,
    DEFAULT_QUEUE_S,
    DEFAULT_WINDOW,
    Host,
    Link,
    Network,
)

if TYPE_CHECKING:
    from bench.sim.node import SimNode

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
# Allocations between young-generation collections while a simulation runs. A run holds
# millions of long-lived objects (nodes, schedulers, bitmaps) and allocates short-lived
# events by the million; at CPython's default (700) the collector's full passes took half
# of a 1,000-fetcher run's CPU (cProfile, 2026-12-08). Cycles are still collected.
SIM_GC_THRESHOLD = (200_000, 50, 1000)


@contextmanager
def sim_gc() -> Iterator[None]:
    """Collect garbage rarely while a simulation runs (see ``SIM_GC_THRESHOLD``)."""
    saved = gc.get_threshold()
    gc.collect()
    gc.freeze()  # what exists before the run (imports, the world) is never scanned again
    gc.set_threshold(*SIM_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*saved)
        gc.unfreeze()


# One-way delays between regions, seconds (RTT = 2 x (access delays + this)).
INTERNET_REGIONS: Mapping[tuple[str, str], float] = {
    ("eu", "eu"): 0.010,
    ("us", "us"): 0.015,
    ("asia", "asia"): 0.015,
    ("eu", "us"): 0.040,
    ("us", "asia"): 0.075,
    ("eu", "asia"): 0.100,
}


def region_delay(regions: Mapping[tuple[str, str], float], a: str, b: str) -> float:
    if not regions:
        return 0.0
    return regions.get((a, b), regions.get((b, a), 0.0))


@dataclass
class Costs:
    """What the protocol's round trips cost the shells (bench.sim.calibrate sets them
    against the testbed's real runs)."""

    # A new connection: TCP's handshake, Noise XX and the muxer's negotiation (the first
    # stream's protocol is proposed optimistically, with its first request).
    dial_rtts: float = 2.0
    # A message's handling time at its receiver (0 on an idle machine; on bench/wan's
    # testbed sharing two busy vCPUs, the wait for a CPU).
    handling_s: float = 0.0


@dataclass
class World:
    """Everything one run shares."""

    seed: int = 0
    window: float = DEFAULT_WINDOW
    initial_window: float = DEFAULT_INITIAL_WINDOW
    queue_s: float = DEFAULT_QUEUE_S
    exact_every: float = 0.5
    regions: Mapping[tuple[str, str], float] = field(default_factory=dict)
    costs: Costs = field(default_factory=Costs)
    # Bytes per second of the shared CPU every transfer also crosses (None: no CPU limit).
    cpu_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        self.env = simpy.Environment()
        self.rng = random.Random(self.seed)
        shared = None if self.cpu_bytes_per_s is None else Link("cpu", self.cpu_bytes_per_s)
        self.net = Network(
            self.env,
            window=self.window,
            queue_s=self.queue_s,
            exact_every=self.exact_every,
            initial_window=self.initial_window,
            shared=shared,
            region_delay=lambda a, b: region_delay(self.regions, a.region, b.region),
            handling_s=self.costs.handling_s,
        )
        self.nodes: dict[str, SimNode] = {}

    @property
    def now(self) -> float:
        return float(self.env.now)

    def host(
        self, name: str, *, up_mbit: float, down_mbit: float, delay_s: float, region: str = ""
    ) -> Host:
        return self.net.add_host(Host(name, up_mbit * MBIT, down_mbit * MBIT, delay_s, region))

    def dial_s(self, a: Host, b: Host) -> float:
        """How long ``a`` takes to connect to ``b``."""
        return self.costs.dial_rtts * self.net.rtt(a, b)
