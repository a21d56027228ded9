"""The WAN model the forwarder applies to every packet: a sans-IO core.

Bytes in, packets out, time as an argument: :meth:`Emulator.receive` takes one IPv4
packet read from host ``src``'s TUN device at time ``now``; :meth:`Emulator.due` hands
back the packets whose delivery time has come, each with the host whose TUN device must
receive it; :meth:`Emulator.next_due` says when the shell must wake next. Nothing here
reads a clock, sleeps or touches a file descriptor (``forwarder.py`` does), so the tests
drive it on made-up times.

Theory of operation
===================

Every host sits on its own access link to a core with no queueing of its own. A packet
from host *i* to host *j* takes this path:

1. **Loss.** With probability ``loss`` (host *i*'s, else the testbed's) it is dropped on
   arrival, before it costs anything.
2. **Uplink of i.** A drop-tail FIFO drained at ``up`` bytes/s. Its state is one number,
   the time the link is next free (``up_free``). A packet arriving at ``now`` finds
   ``(up_free - now) * up`` bytes queued ahead of it; if those plus its own size exceed
   the queue's capacity it is dropped, else it leaves at ``max(now, up_free) + size / up``
   (its serialisation time), which becomes the new ``up_free``.
3. **Propagation.** ``delay_i + delay_j + extra(i, j)`` seconds, one way. So
   RTT(i, j) = 2 (delay_i + delay_j) + extra(i, j) + extra(j, i).
4. **Downlink of j.** The same drop-tail FIFO at ``down`` bytes/s, but decided at the
   packet's *arrival* there (step 3's time, not ``now``): packets from several senders
   meet in this queue, so it must see them in arrival order. They wait in a heap keyed
   by arrival time; :meth:`due` moves each from the heap through the downlink when its
   arrival time has come, in that order.
5. **Delivery** at the time the downlink has serialised it.

Invariants:

1. Per (source, destination) pair, packets are delivered in the order they were
   received, or dropped: each stage is FIFO and the propagation delay is constant.
2. A link never carries more than its rate: the departures of its packets are spaced by
   at least their serialisation times (the ``*_free`` clocks only move forward).
3. A packet is dropped only by loss, a full queue or a destination outside the testbed,
   and each drop is counted under its cause.
4. ``due(now)`` returns every packet due at or before ``now`` and no later one.

A rate of ``None`` is an unshaped link: no serialisation time, no queue. Timing is done
in float seconds of whatever monotonic clock the caller uses.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

IPV4_HEADER_MIN = 20

# The smallest drop-tail queue any link gets, in bytes: two 9000-byte packets. A queue
# shorter than one packet would drop every packet arriving behind another, whatever
# queue_s says for a very slow link.
MIN_QUEUE_BYTES = 2 * 9000


@dataclass(frozen=True)
class LinkSpec:
    """One host's access link, in the units the core computes in."""

    addr: bytes  # the host's IPv4 address, 4 bytes
    delay_s: float  # one-way, host to core
    up_bytes_per_s: float | None  # None: unshaped
    down_bytes_per_s: float | None
    queue_s: float  # drop-tail queue capacity, in seconds of the link's rate
    loss: float  # probability a packet from this host is dropped

    def __post_init__(self) -> None:
        if len(self.addr) != 4:
            raise ValueError(f"address must be 4 bytes, got {self.addr!r}")
        if self.delay_s < 0 or self.queue_s < 0:
            raise ValueError("delay and queue must not be negative")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        for rate in (self.up_bytes_per_s, self.down_bytes_per_s):
            if rate is not None and rate <= 0:
                raise ValueError(f"a rate must be positive or None, got {rate}")


def queue_capacity(rate: float, queue_s: float) -> float:
    return max(rate * queue_s, MIN_QUEUE_BYTES)


@dataclass
class Counters:
    """What happened to the packets, per host index."""

    sent_packets: list[int]  # what the host handed to its link (counted before any drop)
    sent_bytes: list[int]
    uplink_bytes: list[int]  # what left the host's uplink: sent, less lost and dropped
    delivered_packets: list[int]
    delivered_bytes: list[int]
    lost: list[int]  # random loss, counted at the sender
    dropped_up: list[int]  # uplink queue full
    dropped_down: list[int]  # downlink queue full, counted at the receiver
    unroutable: int = 0  # not IPv4, or to an address outside the testbed

    @classmethod
    def zero(cls, n: int) -> Counters:
        z = [0] * n
        return cls(z[:], z[:], z[:], z[:], z[:], z[:], z[:], z[:])

    def as_dict(self, names: Sequence[str]) -> dict[str, object]:
        per_host = {
            name: {
                key: getattr(self, key)[i]
                for key in (
                    "sent_packets",
                    "sent_bytes",
                    "uplink_bytes",
                    "delivered_packets",
                    "delivered_bytes",
                    "lost",
                    "dropped_up",
                    "dropped_down",
                )
            }
            for i, name in enumerate(names)
        }
        return {"hosts": per_host, "unroutable": self.unroutable}


@dataclass
class _Link:
    spec: LinkSpec
    up_free: float = 0.0
    down_free: float = 0.0
    # Packets through the downlink, waiting for their delivery time (non-decreasing).
    delivering: deque[tuple[float, bytes]] = field(default_factory=deque)


class Emulator:
    """Delay, rate, drop-tail queues and loss between the hosts of one testbed."""

    def __init__(
        self,
        links: Sequence[LinkSpec],
        *,
        extra_delay_s: Mapping[tuple[int, int], float] | None = None,
        seed: int = 0,
    ) -> None:
        self._links = [_Link(spec) for spec in links]
        self._index = {spec.addr: i for i, spec in enumerate(links)}
        if len(self._index) != len(links):
            raise ValueError("two hosts share an address")
        n = len(links)
        extra = extra_delay_s or {}
        for (i, j), value in extra.items():
            if not (0 <= i < n and 0 <= j < n) or value < 0:
                raise ValueError(f"bad extra delay {(i, j)}: {value}")
        self._prop = [
            [links[i].delay_s + links[j].delay_s + extra.get((i, j), 0.0) for j in range(n)]
            for i in range(n)
        ]
        # (arrival at the destination's downlink, tie-break, destination, packet)
        self._arriving: list[tuple[float, int, int, bytes]] = []
        self._seq = itertools.count()
        self._random = random.Random(seed)
        self.counters = Counters.zero(n)

    @property
    def links(self) -> list[LinkSpec]:
        return [link.spec for link in self._links]

    def one_way_s(self, src: int, dst: int) -> float:
        return self._prop[src][dst]

    def reconfigure(self, host: int, spec: LinkSpec) -> None:
        """Change one host's link from now on (queued packets keep their times)."""
        if spec.addr != self._links[host].spec.addr:
            raise ValueError("a host's address cannot change")
        old = self._links[host].spec
        self._links[host].spec = spec
        n = len(self._links)
        for k in range(n):
            self._prop[host][k] += spec.delay_s - old.delay_s
            self._prop[k][host] += spec.delay_s - old.delay_s

    def receive(self, src: int, packet: bytes, now: float) -> None:
        """A packet host ``src`` sent, read from its TUN device at ``now``."""
        counters = self.counters
        if len(packet) < IPV4_HEADER_MIN or packet[0] >> 4 != 4:
            counters.unroutable += 1
            return
        dst = self._index.get(packet[16:20])
        if dst is None or dst == src:
            counters.unroutable += 1
            return
        size = len(packet)
        counters.sent_packets[src] += 1
        counters.sent_bytes[src] += size
        link = self._links[src]
        spec = link.spec
        if spec.loss and self._random.random() < spec.loss:
            counters.lost[src] += 1
            return
        rate = spec.up_bytes_per_s
        if rate is None:
            leaves = now
        else:
            start = link.up_free if link.up_free > now else now
            if (start - now) * rate + size > queue_capacity(rate, spec.queue_s):
                counters.dropped_up[src] += 1
                return
            leaves = start + size / rate
            link.up_free = leaves
        counters.uplink_bytes[src] += size
        heapq.heappush(
            self._arriving, (leaves + self._prop[src][dst], next(self._seq), dst, packet)
        )

    def due(self, now: float) -> Iterator[tuple[int, bytes]]:
        """Packets to deliver at or before ``now``: (destination host, packet)."""
        arriving = self._arriving
        links = self._links
        counters = self.counters
        while arriving and arriving[0][0] <= now:
            at, _, dst, packet = heapq.heappop(arriving)
            link = links[dst]
            rate = link.spec.down_bytes_per_s
            if rate is None:
                link.delivering.append((at, packet))
                continue
            size = len(packet)
            start = link.down_free if link.down_free > at else at
            if (start - at) * rate + size > queue_capacity(rate, link.spec.queue_s):
                counters.dropped_down[dst] += 1
                continue
            link.down_free = start + size / rate
            link.delivering.append((link.down_free, packet))
        for dst, link in enumerate(links):
            delivering = link.delivering
            while delivering and delivering[0][0] <= now:
                packet = delivering.popleft()[1]
                counters.delivered_packets[dst] += 1
                counters.delivered_bytes[dst] += len(packet)
                yield dst, packet

    def next_due(self) -> float | None:
        """The earliest time at which :meth:`due` would return something new."""
        times = [link.delivering[0][0] for link in self._links if link.delivering]
        if self._arriving:
            times.append(self._arriving[0][0])
        return min(times) if times else None
