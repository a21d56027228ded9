"""The simulator's network (bench.sim.fluid): max-min fair rates, congestion windows, and
the local levelling against the exact allocation."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Generator
from typing import Any

import pytest
import simpy

from bench.sim.fluid import Host, Network, max_min

MB = 1_000_000


def _net(exact_every: float = 0.5, initial_window: float = 10 * 8948) -> Network:
    return Network(simpy.Environment(), exact_every=exact_every, initial_window=initial_window)


def test_max_min_gives_the_bottlenecked_flow_its_share_and_the_rest_to_the_others() -> None:
    """a's uplink (10) is shared by a->b and a->c; c's uplink (5) limits c->b; b's downlink
    (10) is shared by a->b and c->b: max-min is 5 / 5 / 5, not 5 / 2.5 / 2.5 (per-link
    equal shares) nor anything over a link."""
    net = _net()
    a, b, c = (net.add_host(Host(n, up, down, 0.01)) for n, up, down in (
        ("a", 10 * MB, 10 * MB), ("b", 10 * MB, 10 * MB), ("c", 5 * MB, 100 * MB)))  # fmt: skip
    for p in (net.pipe(a, b), net.pipe(a, c), net.pipe(c, b)):
        p.cap = 1e12  # no window limit
    rates = max_min([net.pipe(a, b), net.pipe(a, c), net.pipe(c, b)])
    assert rates[net.pipe(a, b)] == pytest.approx(5 * MB)
    assert rates[net.pipe(a, c)] == pytest.approx(5 * MB)
    assert rates[net.pipe(c, b)] == pytest.approx(5 * MB)
    # A window-capped pipe leaves the rest of its link to the others.
    net.pipe(a, c).cap = 1 * MB
    rates = max_min([net.pipe(a, b), net.pipe(a, c), net.pipe(c, b)])
    assert rates[net.pipe(a, c)] == pytest.approx(1 * MB)
    assert rates[net.pipe(a, b)] == pytest.approx(5 * MB)  # b's downlink: 5 + 5


def test_a_cold_connection_ramps_up_and_one_idle_past_its_rto_starts_cold_again() -> None:
    """Slow start: 10 MB over a 20 ms path from a 10-segment window takes several RTTs
    more than at the link's rate; sent again at once it keeps its window, sent again after
    an idle second (over its RTO) it ramps again."""
    net = _net(exact_every=0)
    env = net.env
    a = net.add_host(Host("a", 100 * MB, 100 * MB, 0.005))  # 20 ms RTT: 2 MB in flight
    b = net.add_host(Host("b", 100 * MB, 100 * MB, 0.005))
    done: list[float] = []
    pipe = net.pipe(a, b)

    def send(then: list[float]) -> None:
        start = env.now

        def end() -> None:
            done.append(env.now - start)
            if then:
                env.process(_at(env, then[0], lambda: send(then[1:])))

        net.send(pipe, [10 * MB], lambda j: None, end)

    send([0.0, 1.0])  # again at once (warm), then after an idle second (cold)
    env.run(until=60)
    # At the link's rate, plus the one-way delay and the full queue's 50 ms.
    link_time = 10 * MB / (100 * MB) + 0.01 + net.queue_s
    assert done[0] > link_time + 0.05  # several round trips of ramp
    assert done[1] == pytest.approx(link_time, rel=0.05)
    assert done[2] > link_time + 0.05


@pytest.mark.parametrize("seed", range(3))
def test_local_levelling_never_oversubscribes_a_link_and_ends_near_max_min(seed: int) -> None:
    """Random pipes start and stop; after every event no link carries more than its
    capacity, and the local allocation moves the transfers' ends little from exact
    max-min on every event (their sum within 5%)."""
    exact = _random_transfers(seed, exact_every=0.0)
    local = _random_transfers(seed, exact_every=0.5)
    assert len(exact) == len(local) == 60
    assert sum(local.values()) == pytest.approx(sum(exact.values()), rel=0.05)


def _random_transfers(seed: int, exact_every: float) -> dict[int, float]:
    rng = random.Random(seed)
    net = _net(exact_every=exact_every)
    env = net.env
    hosts = [
        net.add_host(Host(f"h{k}", rng.uniform(1, 20) * MB, rng.uniform(1, 20) * MB, 0.01))
        for k in range(12)
    ]
    ends: dict[int, float] = {}

    def check() -> None:
        for h in hosts:
            for link in (h.up, h.down):
                assert link.used <= link.cap * (1 + 1e-9) + 1e-6

    def start(k: int, src: Host, dst: Host, size: int) -> None:
        def end() -> None:
            ends[k] = env.now

        net.send(net.pipe(src, dst, k % 3), [size], lambda j: check(), end)
        check()

    for k in range(60):
        src, dst = rng.sample(hosts, 2)
        at = rng.uniform(0, 5)
        env.process(
            _at(env, at, functools.partial(start, k, src, dst, rng.randint(1, 8) * MB // 4))
        )
    env.run(until=120)
    return ends


def _at(env: simpy.Environment, at: float, fn: Callable[[], None]) -> Generator[Any, Any, None]:
    yield env.timeout(at)
    fn()
