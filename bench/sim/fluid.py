"""The simulated network: hosts with access links, TCP connections as fluid pipes that share
those links max-min fairly, and small messages with their latency.

Theory of operation
1. A host has an uplink and a downlink (bytes/s) and a one-way delay to the core; the delay
   between two hosts is the sum of theirs (bench.wan's model: RTT = 2 (d_a + d_b)), and the
   core is never a bottleneck.
2. One direction of one TCP connection is a *pipe*. Its rate is capped by its congestion
   window over the RTT, the window at most ``window`` (stock Linux buffers: 4 MiB), and it
   shares the sender's uplink, the
   receiver's downlink and any extra shared link (a testbed's CPU, see `Network.shared`)
   max-min fairly with every other pipe that carries bytes now. The transfers on one pipe
   (a server's answers on several streams of one connection) share its rate equally.
3. A transfer is a list of chunk sizes; its bytes leave at its share of the pipe's rate, and
   each chunk's last byte reaches the receiver one-way delay (plus a queue's delay when a
   link on the way is saturated) after it left.
3b. The congestion window starts at ``initial_window`` (10 segments) and doubles every RTT
   in which the pipe runs at its window's rate (slow start; BBR's start-up doubles the same
   way), up to ``window``. A pipe idle for longer than its RTO (RTT + 200 ms) restarts with
   its window halved for every RTO it was idle, down to the initial window (Linux's
   ``tcp_slow_start_after_idle``, on by default: a fellow's connection that waits between
   one-chunk requests starts each of them cold).
4. Rates change only when a pipe starts or stops carrying bytes or its window grows. Then
   the links of that pipe
   are levelled again (`_relevel`: a water level over the pipes on the link, each bounded by
   its window and by what its other links leave free); every ``exact_every`` seconds the
   whole network gets the exact max-min allocation (progressive filling, `max_min`). The
   local step never puts a link over its capacity, but it may leave capacity idle that the
   exact allocation gives out: `tests/sim/test_sim_fluid.py` measures how little that
   changes a swarm against exact-on-every-event (``exact_every=0``).
5. A message (a request, a `status` answer, a manifest) takes the one-way delay, plus the
   queue's delay at each saturated link on its way, plus head-of-line: the bytes queued
   ahead of it on its own connection (at most the sender's socket buffer, which Linux
   sizes to about two congestion windows) at that connection's rate.

Left out, on purpose: loss and its recovery (no packet is lost; a full queue adds delay, rule
5), the congestion window's growth beyond what a pipe's share needs (it grows while the
window is what limits the pipe), queueing
delay of bulk bytes other than at saturated links, packet-level effects and the core
network. Time is SimPy's (``env.now``, seconds).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import simpy

MiB = 1 << 20
# The TCP window one connection holds in flight: stock Linux caps a socket's send buffer at
# 4 MiB (tcp_wmem max), which bench/wan sets in every namespace.
DEFAULT_WINDOW = 4 * MiB
# Linux's initial congestion window: 10 segments (of 1448 bytes at a 1500-byte MTU; bench/wan
# runs at 9000, 8948 bytes a segment).
DEFAULT_INITIAL_WINDOW = 10 * 1448
TESTBED_INITIAL_WINDOW = 10 * 8948
# Linux's minimum retransmission timeout: an idle connection restarts slow after RTT + this.
RTO_MIN = 0.2
# A drop-tail queue's delay when its link is saturated (bench/wan's default queue_ms).
DEFAULT_QUEUE_S = 0.05
# Exact max-min for the whole network at least this often (seconds of simulated time).
DEFAULT_EXACT_EVERY = 0.5
# Bytes left below this count as sent (float rounding over many rate changes).
_EPS = 1.0
# A rate change smaller than this fraction does not move a pipe's next event: it fires a
# little early (and is moved) or at most this fraction late.
_RESCHEDULE_TOLERANCE = 0.01
# A link counts as saturated (its queue full) from this fraction of its capacity.
_SATURATED = 0.98


def call_later(env: simpy.Environment, delay: float, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` ``delay`` seconds from now (a SimPy timeout with a callback)."""
    event = env.timeout(max(0.0, delay))
    event.callbacks.append(lambda _e: fn(*args))


class Link:
    """One direction of a host's access link (or a shared resource such as a CPU)."""

    __slots__ = ("cap", "name", "pipes", "sent", "used")

    def __init__(self, name: str, cap: float) -> None:
        self.name = name
        self.cap = float(cap)
        self.pipes: dict[Pipe, None] = {}  # pipes carrying bytes now (insertion order)
        self.used = 0.0  # sum of their rates
        self.sent = 0.0  # bytes that crossed it so far

    def saturated(self) -> bool:
        return self.used >= _SATURATED * self.cap

    def free(self) -> float:
        return max(0.0, self.cap - self.used)


class Host:
    """A simulated machine's access link and one-way delay to the core."""

    __slots__ = ("alive", "delay", "down", "name", "region", "up")

    def __init__(self, name: str, up: float, down: float, delay: float, region: str = "") -> None:
        self.name = name
        self.up = Link(f"{name}/up", up)
        self.down = Link(f"{name}/down", down)
        self.delay = delay
        self.region = region
        self.alive = True


class Transfer:
    """Bytes a sender writes on one pipe: chunks of ``sizes``, in order."""

    __slots__ = ("done", "left", "marks", "next", "on_chunk", "on_end", "on_sent", "pipe", "sent")

    def __init__(
        self,
        pipe: Pipe,
        sizes: Sequence[int],
        on_chunk: Callable[[int], None],
        on_end: Callable[[], None] | None,
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        self.pipe = pipe
        self.on_sent = on_sent  # at the sender, when the last byte has left
        marks: list[float] = []
        total = 0.0
        for size in sizes:
            total += size
            marks.append(total)
        self.marks = marks  # cumulative bytes at each chunk's end
        self.next = 0  # the next chunk to finish
        self.sent = 0.0
        self.left = total
        self.on_chunk = on_chunk
        self.on_end = on_end
        self.done = False


class Pipe:
    """One direction of one TCP connection (``lane``: several connections to one peer)."""

    __slots__ = (
        "cap",
        "cwnd",
        "dst",
        "idle_since",
        "lane",
        "links",
        "mark",
        "owd",
        "ramp_at",
        "rate",
        "rtt",
        "src",
        "transfers",
        "version",
        "wake_at",
    )

    def __init__(
        self, src: Host, dst: Host, lane: int, cwnd: float, rtt: float, links: tuple[Link, ...]
    ) -> None:
        self.src = src
        self.dst = dst
        self.lane = lane
        self.cwnd = cwnd  # congestion window, bytes
        self.rtt = rtt
        self.cap = cwnd / rtt
        self.idle_since = 0.0
        self.ramp_at = math.inf  # when its window next doubles (inf: not ramping)
        owd = rtt / 2
        self.owd = owd
        self.links = links
        self.rate = 0.0
        self.mark = 0.0  # time its transfers were last advanced
        self.transfers: list[Transfer] = []
        self.version = 0  # bumped whenever its next event moves
        self.wake_at = math.inf

    def backlog(self) -> float:
        return sum(t.left for t in self.transfers)


def water_level(cap: float, bounds: list[float]) -> float:
    """The level ``x`` at which ``sum(min(x, b))`` over ``bounds`` equals ``cap`` (inf
    when the bounds fit whole). Sorts ``bounds``."""
    bounds.sort()
    rem = cap
    k = len(bounds)
    for i, b in enumerate(bounds):
        share = rem / (k - i)
        if b >= share:
            return share
        rem -= b
    return math.inf


def max_min(pipes: Iterable[Pipe]) -> dict[Pipe, float]:
    """The exact max-min fair rates of ``pipes`` (progressive filling): every pipe is
    frozen at the lowest level at which one of its links is full or its own cap is met."""
    pipes = list(pipes)
    rem: dict[Link, float] = {}
    count: dict[Link, int] = {}
    on: dict[Link, list[Pipe]] = {}
    for p in pipes:
        for x in p.links:
            rem[x] = x.cap
            count[x] = count.get(x, 0) + 1
            on.setdefault(x, []).append(p)
    heap: list[tuple[float, int, Link]] = []
    ids = {x: i for i, x in enumerate(rem)}
    for x, c in count.items():
        heap.append((rem[x] / c, ids[x], x))
    heapq.heapify(heap)
    by_cap = sorted(pipes, key=lambda p: p.cap)
    rates: dict[Pipe, float] = {}
    ci = 0

    def freeze(p: Pipe, r: float) -> None:
        rates[p] = r
        for y in p.links:
            rem[y] -= r
            count[y] -= 1
            if count[y]:
                heapq.heappush(heap, (max(0.0, rem[y]) / count[y], ids[y], y))

    while len(rates) < len(pipes):
        while ci < len(by_cap) and by_cap[ci] in rates:
            ci += 1
        level = math.inf
        link = None
        while heap:
            share, _, x = heap[0]
            if not count[x] or abs(share - max(0.0, rem[x]) / count[x]) > 1e-9 * (1 + share):
                heapq.heappop(heap)  # stale
                continue
            level, link = share, x
            break
        if ci < len(by_cap) and by_cap[ci].cap <= level:
            freeze(by_cap[ci], by_cap[ci].cap)
            continue
        assert link is not None
        heapq.heappop(heap)
        for p in [p for p in on[link] if p not in rates]:
            freeze(p, level)
    return rates


class Network:
    """Hosts, pipes, transfers and messages on one SimPy environment (see the module)."""

    def __init__(
        self,
        env: simpy.Environment,
        *,
        window: float = DEFAULT_WINDOW,
        queue_s: float = DEFAULT_QUEUE_S,
        exact_every: float = DEFAULT_EXACT_EVERY,
        initial_window: float = DEFAULT_INITIAL_WINDOW,
        shared: Link | None = None,
        region_delay: Callable[[Host, Host], float] | None = None,
        handling_s: float = 0.0,
    ) -> None:
        self.env = env
        # One-way delay between two hosts' regions, on top of their own delays.
        self.region_delay = region_delay
        self.window = window
        self.initial_window = min(initial_window, window)
        self.queue_s = queue_s
        self.exact_every = exact_every
        # A link every pipe also crosses (a testbed's CPUs: every byte costs CPU time).
        self.shared = shared
        # Time a process takes to handle a message once it arrives (0: at once; a busy
        # machine's processes wait for a CPU, see bench/sim/calibrate).
        self.handling_s = handling_s
        self.hosts: dict[str, Host] = {}
        self._pipes: dict[tuple[str, str, int], Pipe] = {}
        self.active: dict[Pipe, None] = {}
        self.relevels = 0
        self.exact_runs = 0
        self._emptied: list[Pipe] = []
        if exact_every > 0:
            env.process(self._exact_loop())

    # --- topology ------------------------------------------------------------------------

    def add_host(self, host: Host) -> Host:
        if host.name in self.hosts:
            raise ValueError(f"host {host.name} exists")
        self.hosts[host.name] = host
        return host

    def owd(self, a: Host, b: Host) -> float:
        """One-way delay between two hosts."""
        extra = 0.0 if self.region_delay is None else self.region_delay(a, b)
        return a.delay + b.delay + extra

    def rtt(self, a: Host, b: Host) -> float:
        return 2.0 * self.owd(a, b)

    def pipe(self, src: Host, dst: Host, lane: int = 0) -> Pipe:
        key = (src.name, dst.name, lane)
        p = self._pipes.get(key)
        if p is None:
            rtt = max(self.rtt(src, dst), 1e-4)
            links = (src.up, dst.down) if self.shared is None else (src.up, dst.down, self.shared)
            p = self._pipes[key] = Pipe(src, dst, lane, self.initial_window, rtt, links)
        return p

    # --- transfers -----------------------------------------------------------------------

    def send(
        self,
        pipe: Pipe,
        sizes: Sequence[int],
        on_chunk: Callable[[int], None],
        on_end: Callable[[], None] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> Transfer:
        """Write chunks of ``sizes`` on ``pipe`` from now: ``on_chunk(j)`` runs when chunk
        j's last byte arrives, ``on_end()`` after the last one's (both at the receiver,
        and only while it is alive), ``on_sent()`` when the last byte has left."""
        t = Transfer(pipe, sizes, on_chunk, on_end, on_sent)
        if not sizes:
            t.done = True
            if on_sent is not None:
                call_later(self.env, 0.0, on_sent)
            if on_end is not None:
                self._later(pipe, on_end)
            return t
        now = self.env.now
        self._advance(pipe, now)
        pipe.transfers.append(t)
        if pipe not in self.active:
            pipe.mark = now
            self._activate(pipe)
        else:
            self._schedule(pipe, now)
        return t

    def cancel(self, t: Transfer) -> None:
        """Stop sending the rest of ``t`` (its stream was reset); no more callbacks."""
        if t.done:
            return
        pipe = t.pipe
        now = self.env.now
        self._advance(pipe, now)
        t.done = True
        if t in pipe.transfers:
            pipe.transfers.remove(t)
            if not pipe.transfers and pipe in self.active:
                self._deactivate(pipe)
            else:
                self._schedule(pipe, now)

    def message(
        self, src: Host, dst: Host, fn: Callable[..., Any], *args: Any, lane: int = 0
    ) -> float:
        """Deliver a small message from ``src`` to ``dst`` (``fn(*args)`` on arrival) on
        connection ``lane``; returns its delay. A dead receiver never gets it."""
        delay = self.message_delay(src, dst, lane)

        def arrive() -> None:
            if dst.alive:
                fn(*args)

        call_later(self.env, delay, arrive)
        return delay

    def message_delay(self, src: Host, dst: Host, lane: int = 0) -> float:
        delay = self.owd(src, dst) + self.handling_s
        if src.up.saturated():
            delay += self.queue_s
        if dst.down.saturated():
            delay += self.queue_s
        p = self._pipes.get((src.name, dst.name, lane))
        if p is not None and p.transfers and p.rate > 0:
            # Queued ahead in the sender's socket: Linux sizes the send buffer to about two
            # congestion windows (tcp_sndbuf_expand), at most its limit.
            self._advance(p, self.env.now)
            delay += min(self.window, 2.0 * p.cwnd, p.backlog()) / p.rate
        return delay

    def kill(self, host: Host) -> None:
        """``host`` leaves: every transfer it sends or receives stops (no callbacks)."""
        host.alive = False
        for p in list(self.active):
            if p.src is host or p.dst is host:
                for t in list(p.transfers):
                    self.cancel(t)

    # --- the fluid core ------------------------------------------------------------------

    def _advance(self, p: Pipe, now: float) -> None:
        """Move ``p``'s transfers to ``now`` at its current rate; chunks that finished are
        delivered one-way delay later, transfers that finished leave the pipe."""
        dt = now - p.mark
        p.mark = now
        if dt <= 0.0 or not p.transfers:
            return
        moved = p.rate * dt
        for x in p.links:
            x.sent += moved
        share = moved / len(p.transfers)
        finished = False
        for t in p.transfers:
            t.sent += share
            t.left -= share
            marks = t.marks
            while t.next < len(marks) and marks[t.next] <= t.sent + _EPS:
                self._deliver(p, t, t.next)
                t.next += 1
            if t.next == len(marks):
                finished = True
        if finished:
            for t in [t for t in p.transfers if t.next == len(t.marks)]:
                p.transfers.remove(t)
                t.done = True
                if t.on_sent is not None:
                    call_later(self.env, 0.0, t.on_sent)
                if t.on_end is not None:
                    self._later(p, t.on_end)
            if not p.transfers:
                # Not here: _advance runs inside rate changes; an empty pipe leaves the
                # allocation at once, but outside them (its rate is idle meanwhile).
                self._emptied.append(p)
                if len(self._emptied) == 1:
                    call_later(self.env, 0.0, self._flush_emptied)

    def _flush_emptied(self) -> None:
        emptied, self._emptied = self._emptied, []
        for p in emptied:
            if not p.transfers and p in self.active:
                self._deactivate(p)

    def _deliver(self, p: Pipe, t: Transfer, j: int) -> None:
        self._later(p, t.on_chunk, j)

    def _later(self, p: Pipe, fn: Callable[..., Any], *args: Any) -> None:
        delay = p.owd
        if p.dst.down.saturated():
            delay += self.queue_s
        dst = p.dst

        def arrive() -> None:
            if dst.alive:
                fn(*args)

        call_later(self.env, delay, arrive)

    def _next_time(self, p: Pipe, now: float) -> float:
        if not p.transfers or p.rate <= 0.0:
            return math.inf
        share = p.rate / len(p.transfers)
        need = min(t.marks[t.next] - t.sent for t in p.transfers)
        return now + max(0.0, need) / share

    def _schedule(self, p: Pipe, now: float) -> None:
        at = self._next_time(p, now)
        if at == p.wake_at:
            return
        p.version += 1
        p.wake_at = at
        if at < math.inf:
            call_later(self.env, at - now, self._wake, p, p.version)

    def _wake(self, p: Pipe, version: int) -> None:
        if version != p.version:
            return  # moved since
        now = self.env.now
        p.wake_at = math.inf
        self._advance(p, now)
        if p.transfers:
            self._schedule(p, now)

    def _set_rate(self, p: Pipe, rate: float, now: float) -> None:
        old = p.rate
        if rate == old:
            return
        self._advance(p, now)
        p.rate = rate
        if rate >= 0.99 * p.cap and p.cwnd < self.window and p.ramp_at == math.inf:
            p.ramp_at = at = now + p.rtt
            call_later(self.env, p.rtt, self._ramp, p, at)
        for x in p.links:
            x.used += rate - old
        if not p.transfers:
            return
        if old > 0 and abs(rate - old) <= _RESCHEDULE_TOLERANCE * old and p.wake_at < math.inf:
            return  # close enough: see _RESCHEDULE_TOLERANCE
        self._schedule(p, now)

    def _activate(self, p: Pipe) -> None:
        now = self.env.now
        idle = now - p.idle_since
        rto = p.rtt + RTO_MIN
        if p.cwnd > self.initial_window and idle > rto:
            p.cwnd = max(self.initial_window, p.cwnd / 2.0 ** min(64, int(idle / rto)))  # 3b
        p.cap = min(self.window, p.cwnd) / p.rtt
        self.active[p] = None
        for x in p.links:
            x.pipes[p] = None
        if self.exact_every <= 0:
            self._exact(now)
            return
        # p's fair share: the lowest water level over its links, others bounded as they are.
        target = p.cap
        for x in p.links:
            bounds = [self._bound(q, x) for q in x.pipes if q is not p]
            bounds.append(p.cap)
            target = min(target, water_level(x.cap, bounds))
        for x in p.links:
            self._relevel(x, now, reserve=(p, target))
        room = min([target, *(x.free() for x in p.links)])
        self._set_rate(p, room, now)
        self._schedule(p, now)

    def _deactivate(self, p: Pipe) -> None:
        now = self.env.now
        p.idle_since = now
        p.ramp_at = math.inf
        self.active.pop(p, None)
        for x in p.links:
            x.pipes.pop(p, None)
        self._set_rate(p, 0.0, now)
        p.version += 1
        p.wake_at = math.inf
        if self.exact_every <= 0:
            self._exact(now)
            return
        for x in p.links:
            self._relevel(x, now)

    def _ramp(self, p: Pipe, at: float) -> None:
        """One RTT of slow start: a pipe that ran at its window's rate doubles it (3b)."""
        if p.ramp_at != at or p not in self.active:
            return
        p.ramp_at = math.inf
        now = self.env.now
        if p.rate < 0.99 * p.cap:
            return  # its links, not its window, hold it back now
        p.cwnd = min(self.window, 2.0 * p.cwnd)
        p.cap = p.cwnd / p.rtt
        if self.exact_every <= 0:
            self._exact(now)
        else:
            for x in p.links:
                self._relevel(x, now)
        if p.rate >= 0.99 * p.cap and p.cwnd < self.window and p.ramp_at == math.inf:
            p.ramp_at = at = now + p.rtt
            call_later(self.env, p.rtt, self._ramp, p, at)

    def _bound(self, q: Pipe, at: Link) -> float:
        """What ``q`` could carry, seen from link ``at``: its cap, and on each other link its
        rate plus what that link leaves free."""
        b = q.cap
        for y in q.links:
            if y is not at:
                b = min(b, q.rate + y.free())
        return b

    def _relevel(self, x: Link, now: float, reserve: tuple[Pipe, float] | None = None) -> None:
        """Level the pipes on ``x`` again (``reserve``: one pipe held out at a rate)."""
        self.relevels += 1
        held = None if reserve is None else reserve[0]
        cap = x.cap - (0.0 if reserve is None else reserve[1])
        pipes = [q for q in x.pipes if q is not held]
        if not pipes:
            return
        bounds = [self._bound(q, x) for q in pipes]
        level = water_level(max(0.0, cap), list(bounds))
        targets = [min(level, b) for b in bounds]
        # Decreases first (they free room elsewhere), then increases within what is free.
        for q, r in zip(pipes, targets, strict=True):
            if r < q.rate:
                self._set_rate(q, r, now)
        for q, r in zip(pipes, targets, strict=True):
            if r > q.rate:
                room = min(y.free() for y in q.links)
                if held is not None and x in held.links:
                    room = min(room, max(0.0, cap - (x.used - held.rate)))
                self._set_rate(q, min(r, q.rate + room), now)

    def _exact(self, now: float) -> None:
        self.exact_runs += 1
        rates = max_min(self.active)
        for p, r in rates.items():
            if r < p.rate:
                self._set_rate(p, r, now)
        for p, r in rates.items():
            if r > p.rate:
                self._set_rate(p, r, now)
        for p in rates:
            if p.wake_at == math.inf:
                self._schedule(p, now)

    def _exact_loop(self) -> Any:
        while True:
            yield self.env.timeout(self.exact_every)
            if self.active:
                self._exact(self.env.now)
