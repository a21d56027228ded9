"""A simulated fetch gives up on a provider that takes a request and never answers: the
request's deadline fires (one timer per fetch, at the scheduler's earliest deadline), the
scheduler counts the failure, and the chunks come from the seeder instead. Simulated time,
a fraction of a second."""

from __future__ import annotations

from typing import Any

from bench.sim.fetch import SimFetch, swarm_config
from bench.sim.node import Blob, SimNode
from bench.sim.world import World

MiB = 1 << 20


class SilentNode(SimNode):
    """A peer that holds the blob, answers `have` and `status`, and swallows every `get`."""

    def request(self, client: Any, req: Any) -> None:
        if req.kind == "get":
            return
        super().request(client, req)


def test_a_provider_that_never_answers_a_get_fails_by_its_deadline() -> None:
    world = World(seed=0)
    blob = Blob("d" * 64, 32 * MiB, MiB)
    seeder = SimNode(world, "seed", world.host("seed", up_mbit=8, down_mbit=8, delay_s=0.01))
    seeder.seed(blob)
    silent = SilentNode(
        world, "mute", world.host("mute", up_mbit=1000, down_mbit=1000, delay_s=0.01)
    )
    silent.seed(blob)
    node = SimNode(world, "f", world.host("f", up_mbit=1000, down_mbit=1000, delay_s=0.01))
    fetch = SimFetch(node, blob, ["seed", "mute"], config=swarm_config())
    fetch.start()
    world.env.run(until=120.0)
    assert fetch.done, fetch.failed
    assert fetch.scheduler is not None
    stats = fetch.scheduler.stats_of("mute")
    assert stats is not None and stats.failures >= 1 and stats.last_error == "deadline", stats
