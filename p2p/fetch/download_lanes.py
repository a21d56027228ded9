"""A download's lanes: the connections each provider's stream workers use, how many
requests each stream keeps outstanding, and a full provider's striping growth (rules 9
and 10 of ``p2p.fetch.downloader``)."""

from __future__ import annotations

import logging

import trio

from p2p.fetch.download_parts import PIPELINE_DEPTH, Changes, StripedNetwork
from p2p.fetch.download_probes import HaveProbes
from p2p.fetch.scheduler import Scheduler
from p2p.fetch.striping import StripeConfig, StripeGrowth

log = logging.getLogger(__name__)


def quiet_lane(lanes: list[int]) -> int:
    """The bulk connection with the fewest workers' streams (the lowest on a tie), taken:
    lane 0 only while it is the only one."""
    first = 1 if len(lanes) > 1 else 0
    lane = min(range(first, len(lanes)), key=lambda i: (lanes[i], i))
    lanes[lane] += 1
    return lane


class Lanes:
    """Each provider's connections (lanes) and the streams its workers hold on each.

    ``striped``: the network, where it can open several connections to one peer (else
    every provider has one lane and one request per stream); ``stripe_config``: how a full
    provider's connections grow (None: they do not); ``probes``: where the lanes dialled
    early and the providers that refused to pipeline the manifest request are known."""

    def __init__(
        self,
        scheduler: Scheduler,
        changes: Changes,
        striped: StripedNetwork | None,
        stripe_config: StripeConfig | None = None,
        probes: HaveProbes | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._changes = changes
        self._striped = striped
        self._stripe_config = stripe_config
        self._probes = probes
        # Streams each provider's workers hold open, per connection (lane).
        self._load: dict[str, list[int]] = {}
        # Providers that refused 1.1.0: their streams carry one request at a time.
        self.serial: set[str] = set()
        self._growth: dict[str, StripeGrowth] = {}

    @property
    def grows(self) -> bool:
        """Whether a full provider's connections may grow (`grow`)."""
        return self._striped is not None and self._stripe_config is not None

    def start(self, peer: str) -> None:
        """``peer``'s task begins, its first worker's stream on lane 0."""
        self._load[peer] = [1]
        if self._probes is not None and peer in self._probes.serial:
            self.serial.add(peer)  # it refused to pipeline the manifest request
        self.set_connections(peer)

    def load(self, peer: str) -> list[int] | None:
        """The streams ``peer``'s workers hold, per lane (None before its task begins)."""
        return self._load.get(peer)

    def set_connections(self, peer: str) -> None:
        count = 1 if self._striped is None else self._striped.connection_count(peer)
        lanes = self._load.setdefault(peer, [0])
        lanes.extend([0] * (count - len(lanes)))
        # Once striped, lane 0 is the control lane (rule 9): no bulk there.
        self._scheduler.set_connections(peer, count if count == 1 else count - 1, self.depth(peer))

    def refused_pipelining(self, peer: str) -> None:
        """``peer`` does not speak 1.1.0: one request at a time on its streams (rule 10)."""
        self.serial.add(peer)
        self.set_connections(peer)

    def depth(self, peer: str) -> int:
        """Requests a stream worker keeps outstanding on its stream to ``peer`` (rule 10)."""
        lanes = self._load.get(peer)
        if self._striped is None or lanes is None or len(lanes) <= 1 or peer in self.serial:
            return 1
        return PIPELINE_DEPTH

    def take(self, peer: str) -> int:
        """A lane for a new worker of ``peer`` (`quiet_lane`)."""
        return quiet_lane(self._load[peer])

    def release(self, peer: str, lane: int) -> None:
        """A worker of ``peer`` left ``lane``."""
        lanes = self._load.get(peer)
        if lanes is not None:
            lanes[lane] -= 1

    def striped_now(self, peer: str) -> bool:
        """``peer`` has bulk lanes: lane 0 is for control streams from now on."""
        lanes = self._load.get(peer)
        return lanes is not None and len(lanes) > 1

    def leave_control_lane(self, peer: str) -> int | None:
        """Move a worker off ``peer``'s control lane to the bulk lane it should take, or
        None where every bulk lane of a pipelined provider has its worker (it ends)."""
        lanes = self._load[peer]
        if self.depth(peer) > 1 and min(lanes[1:]) > 0:
            return None
        lanes[0] -= 1
        return quiet_lane(lanes)

    def lanes_coming(self, peer: str) -> bool:
        """Extra connections to ``peer`` are being dialled and none is up yet."""
        lanes = self._load.get(peer)
        planned = 0 if self._probes is None else self._probes.planned_lanes(peer)
        return planned > 0 and (lanes is None or len(lanes) == 1)

    def workers_wanted(self, peer: str) -> int:
        """Stream workers ``peer`` lacks: it should have one per live request it may hold,
        or on a pipelined striped provider one per bulk lane (rule 10)."""
        limit = self._scheduler.inflight_limit(peer)
        lanes = self._load[peer]
        if self.lanes_coming(peer):
            # One chunk on the control lane meanwhile: a second would halve the speed
            # of the first through a new connection's slow start.
            return 1 - sum(lanes)
        if self.depth(peer) == 1:
            return limit - sum(lanes)
        return min(limit, len(lanes) - 1) - sum(lanes[1:])

    def on_bytes(self, peer: str, length: int, now: float) -> None:
        """``peer`` delivered ``length`` new bytes (its growth measures its rate)."""
        growth = self._growth.get(peer)
        if growth is not None:
            growth.on_bytes(length, now)

    async def grow(self, peer: str) -> None:
        """Open more connections to ``peer`` while they raise its rate (StripeGrowth)."""
        striped, config = self._striped, self._stripe_config
        assert striped is not None and config is not None
        scheduler = self._scheduler
        if self._probes is not None:
            await self._probes.lanes_dialled(peer)
            self.set_connections(peer)
            self._changes.notify()
        now = trio.current_time()
        # Growth counts bulk lanes; the first connection is one until the first step.
        count = striped.connection_count(peer)
        growth = StripeGrowth(config, now, count - 1 if count > 1 else 1)
        self._growth[peer] = growth

        async def dial(counted: bool = True) -> None:
            ok = await striped.add_connection(peer)
            if counted:
                growth.on_dialled(ok, trio.current_time())
            self.set_connections(peer)
            self._changes.notify()

        async with trio.open_nursery() as dials:
            while not growth.stopped and not scheduler.done:
                stats = scheduler.stats_of(peer)
                if stats is None or stats.banned or stats.dropped:
                    return
                now = trio.current_time()
                busy = stats.inflight > 0 and scheduler.fetchable_count > 0
                more = growth.decide(now, stats.rtt_s, busy)
                if more:
                    log.info(
                        "provider %s: %d more connection(s) at %.1f MB/s, RTT %.0f ms",
                        peer,
                        more,
                        stats.rate_bytes_per_s / 1e6,
                        (stats.rtt_s or 0.0) * 1e3,
                    )
                if more and striped.connection_count(peer) == 1:
                    # The first step: lane 0 becomes the control lane, so one more
                    # connection than the step's bulk ones (growth counts bulk lanes).
                    dials.start_soon(dial, False)
                for _ in range(more):
                    dials.start_soon(dial)
                wake = growth.next_check(now, stats.rtt_s)
                await trio.sleep(max(wake - now, config.min_settle_s / 4))
