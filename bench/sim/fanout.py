"""Fan-out scenarios: one seeder, N fetchers, each given only the seeder (as a ticket gives
it), every fetch driven by the real scheduler (bench.sim.fetch).

- `wan_fan_out`: bench.wan.scenarios.fan_out in simulation (a seeder on a 100 Mbit/s
  uplink, N one-shot `blob get`s on 1 Gbit/s links with one-way delays of 20-40 ms), for
  calibration against the real processes.
- `internet_fan_out`: a checkpoint from one seeder to many long-lived nodes on mixed links
  in three regions, arriving at once or over a window, with fetchers that leave mid-fetch,
  liars that serve bad chunks, and a seeder that leaves once every chunk is held elsewhere
  (a fetcher arriving after that is given what a DHT lookup would return: up to
  ``DHT_PROVIDERS`` live holders, at random; the DHT itself is not simulated).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import simpy.core

from bench.sim.fetch import SimFetch, swarm_config
from bench.sim.fluid import TESTBED_INITIAL_WINDOW, call_later
from bench.sim.node import Blob, SimNode
from bench.sim.world import INTERNET_REGIONS, MBIT, Costs, World, sim_gc
from p2p.fetch.sched_records import SchedulerConfig
from p2p.fetch.striping import StripeConfig

MiB = 1 << 20
GiB = 1 << 30
# Providers a DHT lookup returns (Kademlia's k), for fetchers that arrive after the seeder
# left (`_run`).
DHT_PROVIDERS = 20
# Events between progress lines on stderr (internet_fan_out, progress=True).
PROGRESS_EVERY = 500_000


@dataclass
class FetcherResult:
    name: str
    region: str
    down_bps: float
    up_bps: float
    arrived: float
    manifest: float | None
    done: float | None
    left: float | None
    liar: bool
    churned: bool
    duplicate_bytes: int
    banned: int

    def seconds(self) -> float | None:
        return None if self.done is None else self.done - self.arrived


@dataclass
class FanOutResult:
    size: int
    seeder_up_bps: float
    fetchers: list[FetcherResult]
    seeder_sent: float
    seeder_left: float | None
    end: float
    wall_s: float
    events: int
    relevels: int
    exact_runs: int
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def one_transfer_s(self) -> float:
        """One copy at the seeder's uplink rate (bench.wan's yardstick)."""
        return self.size / self.seeder_up_bps

    def honest(self) -> list[FetcherResult]:
        return [f for f in self.fetchers if not f.liar and not f.churned]

    def all_hold_s(self) -> float | None:
        done = [f.done for f in self.fetchers if not f.churned]
        if any(d is None for d in done):
            return None
        return max(d for d in done if d is not None)

    def summary(self) -> dict[str, Any]:
        honest = self.honest()
        finished = [f for f in honest if f.done is not None]
        ratios = []  # time against one transfer at the fetcher's own downlink
        shares = []  # the fetcher's rate against its own downlink
        for f in finished:
            own = self.size / f.down_bps
            secs = f.seconds()
            assert secs is not None
            ratios.append(secs / own)
            shares.append(own / secs)
        hold = self.all_hold_s()
        return {
            "fetchers": len(self.fetchers),
            "honest": len(honest),
            "honest_finished": len(finished),
            "size": self.size,
            "all_hold_s": hold,
            "hold_ratio": None if hold is None else hold / self.one_transfer_s,
            "one_transfer_s": self.one_transfer_s,
            "seeder_sent_ratio": self.seeder_sent / self.size,
            "seeder_left_s": self.seeder_left,
            "worst_own_link_ratio": max(ratios, default=math.nan),
            "median_own_link_ratio": statistics.median(ratios) if ratios else math.nan,
            "min_downlink_share": min(shares, default=math.nan),
            "median_downlink_share": statistics.median(shares) if shares else math.nan,
            "under_half_downlink": sum(1 for s in shares if s < 0.5),
            "banned_liars_by_honest": sum(f.banned for f in honest),
            "duplicate_ratio": sum(f.duplicate_bytes for f in self.fetchers)
            / (self.size * max(1, len(self.fetchers))),
            "sim_end_s": self.end,
            "wall_s": self.wall_s,
            "events": self.events,
            "params": self.params,
        }


def _run(
    world: World,
    seeder: SimNode,
    blob: Blob,
    fetchers: list[tuple[SimNode, float, bool]],
    config: SchedulerConfig,
    stripes: StripeConfig | None,
    *,
    until: float,
    seeder_leaves: bool = False,
    churn_at: Callable[[SimNode], float | None] = lambda node: None,
    progress: bool = False,
) -> FanOutResult:
    """Start each fetcher at its time; run until every one is done, gone, or ``until``."""
    fetches: dict[str, SimFetch] = {}
    left: list[float | None] = [None]
    remaining = [len(fetchers)]

    def done(fetch: SimFetch) -> None:
        remaining[0] -= 1

    def entry() -> list[str]:
        """Whom a new fetcher is given: the seeder; once it has left, what a DHT lookup
        of the blob's providers would return instead (the DHT is not simulated): up to
        ``DHT_PROVIDERS`` live nodes, at random, that hold some of the blob."""
        if seeder.alive:
            return [seeder.name]
        holders = [n.name for n, _, _ in fetchers if n.alive and n.held.get(blob.blob_id, 0)]
        return world.rng.sample(holders, min(DHT_PROVIDERS, len(holders)))

    def start(node: SimNode) -> None:
        fetch = SimFetch(node, blob, entry(), config=config, stripes=stripes, on_done=done)
        fetches[node.name] = fetch
        fetch.start()
        leave = churn_at(node)
        if leave is not None:
            call_later(world.env, leave, churn, node, fetch)

    def churn(node: SimNode, fetch: SimFetch) -> None:
        if not fetch.done and node.alive:
            churned.add(node.name)
            node.leave()
            remaining[0] -= 1

    churned: set[str] = set()
    for node, at, _ in fetchers:
        call_later(world.env, at, start, node)
    if seeder_leaves:
        world.env.process(_seeder_watch(world, seeder, blob, [n for n, _, _ in fetchers], left))

    started = time.process_time()
    env = world.env
    events = 0
    with sim_gc():
        while remaining[0] > 0:
            try:
                if env.peek() > until:
                    break
                env.step()
            except simpy.core.EmptySchedule:
                break
            events += 1
            if progress and not events % PROGRESS_EVERY:
                print(
                    f"[sim] t={env.now:.1f} s: {len(fetchers) - remaining[0]}/{len(fetchers)} "
                    f"done, {events} events, {time.process_time() - started:.0f} s CPU",
                    file=sys.stderr,
                    flush=True,
                )
    wall = time.process_time() - started
    results = []
    for node, at, liar in fetchers:
        fetch = fetches.get(node.name)
        banned = 0
        if fetch is not None and fetch.scheduler is not None:
            banned = len(fetch.scheduler.banned_peers())
        results.append(
            FetcherResult(
                node.name,
                node.host.region,
                node.host.down.cap,
                node.host.up.cap,
                at,
                None if fetch is None else fetch.manifest_at,
                None if fetch is None else fetch.done_at,
                node.left_at,
                liar,
                node.name in churned,
                0 if fetch is None else fetch.duplicate_bytes,
                banned,
            )
        )
    return FanOutResult(
        blob.size,
        seeder.host.up.cap,
        results,
        seeder.host.up.sent,
        left[0],
        float(env.now),
        wall,
        events,
        world.net.relevels,
        world.net.exact_runs,
    )


def _seeder_watch(
    world: World, seeder: SimNode, blob: Blob, fetchers: list[SimNode], left: list[float | None]
) -> Any:
    """The seeder leaves once every chunk is held by some other live honest node (a
    liar's copy is no copy)."""
    n = blob.num_chunks
    full = (1 << n) - 1
    while True:
        yield world.env.timeout(1.0)
        bits = 0
        for node in fetchers:
            held = node.holds.get(blob.blob_id)
            if node.alive and not node.liar and held is not None:
                bits |= int.from_bytes(held, "little")
        if bits == full:
            left[0] = world.now
            seeder.leave()
            return


def wan_fan_out(
    workers: int,
    size: int,
    *,
    seeder_mbit: float = 100.0,
    worker_mbit: float = 1000.0,
    arrivals: list[float] | None = None,
    seed: int = 0,
    config: SchedulerConfig | None = None,
    stripes: StripeConfig | None = StripeConfig(),  # noqa: B008 (frozen)
    exact_every: float = 0.5,
    costs: Costs | None = None,
    cpu_bytes_per_s: float | None = None,
    chunk: int = MiB,
    linger: bool = True,
    until: float = 600.0,
) -> FanOutResult:
    """bench.wan.scenarios.fan_out, simulated: ``fan_out_hosts``' links and delays."""
    world = World(
        seed=seed,
        exact_every=exact_every,
        initial_window=TESTBED_INITIAL_WINDOW,  # MTU 9000
        costs=costs or Costs(),
        cpu_bytes_per_s=cpu_bytes_per_s,
    )
    host = world.host("seed", up_mbit=seeder_mbit, down_mbit=1000.0, delay_s=0.020)
    seeder = SimNode(world, "seed", host)
    blob = Blob("b" * 64, size, chunk)
    seeder.seed(blob)
    fetchers = []
    for k in range(workers):
        delay = 0.020 + 0.020 * k / max(1, workers - 1)
        h = world.host(f"w{k}", up_mbit=worker_mbit, down_mbit=worker_mbit, delay_s=delay)
        at = 0.0 if arrivals is None else arrivals[k]
        fetchers.append((SimNode(world, f"w{k}", h), at, False))
    result = _run(
        world,
        seeder,
        blob,
        fetchers,
        config or swarm_config(linger=linger),
        stripes,
        until=until,
    )
    result.params = {
        "scenario": "testbed",
        "workers": workers,
        "size": size,
        "seeder_mbit": seeder_mbit,
        "worker_mbit": worker_mbit,
        "seed": seed,
        "exact_every": exact_every,
    }
    return result


def internet_fan_out(
    fetchers: int,
    size: int,
    *,
    seeder_up_mbit: float = 1000.0,
    down_mbit: tuple[float, float] = (10.0, 1000.0),
    up_ratio: float = 1.0,
    stagger_s: float = 0.0,
    churn: float = 0.0,
    liars: float = 0.0,
    seeder_leaves: bool = False,
    seed: int = 0,
    config: SchedulerConfig | None = None,
    exact_every: float = 0.5,
    chunk: int = MiB,
    until: float = 7200.0,
) -> FanOutResult:
    """A checkpoint from one seeder (eu) to ``fetchers`` long-lived nodes spread evenly
    over eu, us and asia: downlinks log-uniform over ``down_mbit``, uplinks ``up_ratio``
    of them, access delays 2-10 ms; arrivals uniform over ``stagger_s``; a ``churn``
    share leaves at a uniform point of its own transfer time, a ``liars`` share serves
    bad chunks."""
    world = World(seed=seed, exact_every=exact_every, regions=INTERNET_REGIONS)
    rng = world.rng
    host = world.host(
        "seed", up_mbit=seeder_up_mbit, down_mbit=seeder_up_mbit, delay_s=0.002, region="eu"
    )
    seeder = SimNode(world, "seed", host)
    blob = Blob("c" * 64, size, chunk)
    seeder.seed(blob)
    regions = ("eu", "us", "asia")
    lo, hi = math.log(down_mbit[0]), math.log(down_mbit[1])
    nodes: list[tuple[SimNode, float, bool]] = []
    churners: dict[str, float] = {}
    names = [f"f{k:04d}" for k in range(fetchers)]
    liar_names = set(rng.sample(names, round(liars * fetchers)))
    honest_names = [n for n in names if n not in liar_names]
    churn_names = set(rng.sample(honest_names, round(churn * fetchers)))
    for k, name in enumerate(names):
        down = math.exp(rng.uniform(lo, hi))
        h = world.host(
            name,
            up_mbit=down * up_ratio,
            down_mbit=down,
            delay_s=rng.uniform(0.002, 0.010),
            region=regions[k % 3],
        )
        node = SimNode(world, name, h, liar=name in liar_names)
        at = rng.uniform(0.0, stagger_s) if stagger_s else 0.0
        if name in churn_names:
            churners[name] = rng.uniform(0.05, 0.95) * size / (down * MBIT)
        nodes.append((node, at, node.liar))
    result = _run(
        world,
        seeder,
        blob,
        nodes,
        config or swarm_config(),
        StripeConfig(),
        until=until,
        seeder_leaves=seeder_leaves,
        churn_at=lambda node: churners.get(node.name),
        progress=True,
    )
    result.params = {
        "scenario": "internet",
        "fetchers": fetchers,
        "size": size,
        "seeder_up_mbit": seeder_up_mbit,
        "down_mbit": down_mbit,
        "up_ratio": up_ratio,
        "stagger_s": stagger_s,
        "churn": churn,
        "liars": liars,
        "seeder_leaves": seeder_leaves,
        "seed": seed,
        "exact_every": exact_every,
    }
    return result
