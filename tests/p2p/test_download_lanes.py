"""A download's lanes (p2p.fetch.download_lanes), built alone over a real scheduler and a
network that only counts connections: lane 0 turns control lane once a provider is
striped (rule 9), bulk lanes pipeline unless the provider refused 1.1.0 (rule 10), and the
workers wanted follow the lanes and the scheduler's limit."""

from __future__ import annotations

from typing import Any

from p2p.fetch.download_lanes import Lanes
from p2p.fetch.download_parts import PIPELINE_DEPTH, Changes
from p2p.fetch.scheduler import Scheduler


class Connections:
    """A striped network's connection counts, and nothing more."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}

    def connection_count(self, peer: str) -> int:
        return self.count.get(peer, 1)

    async def open_blob_stream_on(self, peer: str, lane: int, **kwargs: Any) -> Any:
        raise AssertionError("no stream is opened here")

    async def add_connection(self, peer: str) -> bool:
        raise AssertionError("no connection is dialled here")

    def connection_rtt(self, peer: str) -> float | None:
        return None


class Probes:
    def __init__(self, planned: dict[str, int], serial: set[str]) -> None:
        self.planned, self.serial = planned, serial

    def planned_lanes(self, peer: str) -> int:
        return self.planned.get(peer, 0)


def lanes(network: Connections | None, probes: Probes | None = None) -> tuple[Lanes, Scheduler]:
    scheduler = Scheduler(64, lambda i: 1 << 16)
    scheduler.add_peer("p", 0.0)
    return Lanes(scheduler, Changes(), network, probes=probes), scheduler  # type: ignore[arg-type]


def test_one_connection_carries_everything_one_request_at_a_time() -> None:
    part, scheduler = lanes(None)
    part.start("p")
    assert part.load("p") == [1] and part.depth("p") == 1
    assert not part.striped_now("p")
    assert part.take("p") == 0 and part.load("p") == [2]
    part.release("p", 0)
    assert part.load("p") == [1]
    assert part.workers_wanted("p") == scheduler.inflight_limit("p") - 1


def test_a_striped_provider_keeps_lane_0_for_control_and_pipelines_its_bulk_lanes() -> None:
    network = Connections()
    part, scheduler = lanes(network)
    part.start("p")
    network.count["p"] = 3
    part.set_connections("p")
    assert part.load("p") == [1, 0, 0]
    assert part.striped_now("p") and part.depth("p") == PIPELINE_DEPTH
    stats = scheduler.stats_of("p")
    assert stats is not None and stats.connections == 2  # the bulk lanes only
    # One worker per bulk lane: the first worker leaves lane 0 for the quietest bulk lane.
    assert part.workers_wanted("p") == min(scheduler.inflight_limit("p"), 2)
    assert part.leave_control_lane("p") == 1 and part.load("p") == [0, 1, 0]
    assert part.take("p") == 2 and part.load("p") == [0, 1, 1]
    # Every bulk lane has its worker: another on lane 0 has nowhere to go and ends.
    part.load("p")[0] += 1  # type: ignore[index]
    assert part.leave_control_lane("p") is None


def test_a_provider_that_refused_pipelining_gets_one_request_per_stream() -> None:
    network = Connections()
    network.count["p"] = 3
    part, _ = lanes(network, Probes({}, serial={"p"}))  # refused with the manifest request
    part.start("p")
    assert part.depth("p") == 1
    other, _ = lanes(network)
    other.start("p")
    assert other.depth("p") == PIPELINE_DEPTH
    other.refused_pipelining("p")
    assert other.depth("p") == 1 and "p" in other.serial


def test_while_far_lanes_are_dialled_one_worker_waits_on_the_control_lane() -> None:
    network = Connections()
    part, _ = lanes(network, Probes({"p": 4}, serial=set()))
    part.start("p")
    assert part.lanes_coming("p")
    assert part.workers_wanted("p") == 0  # the first worker is that one
    network.count["p"] = 5
    part.set_connections("p")
    assert not part.lanes_coming("p")
    assert part.workers_wanted("p") > 0


def test_growth_is_only_for_a_striped_network_with_a_config() -> None:
    assert not lanes(None)[0].grows
    assert not lanes(Connections())[0].grows
    part = Lanes(Scheduler(1, lambda i: 1), Changes(), Connections(), object())  # type: ignore[arg-type]
    assert part.grows
