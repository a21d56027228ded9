"""Striping one provider over several TCP connections (sans-IO): :class:`StripeConfig`
says when a download opens another connection to a provider, :class:`StripeGrowth` decides
it from the bytes and round-trip times it is told, with time as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StripeConfig:
    """When a download opens another TCP connection to one provider."""

    # A stock kernel caps one TCP connection's buffers at a few MiB (tcp_wmem 4 MiB), so at
    # 200 ms one connection carries ~13 MB/s and eight ~75 MB/s (research/update-2026-12):
    # eight fill a gigabit link across continents; more mostly add handshakes and state.
    max_connections: int = 8
    # A step is judged over at least this long, and over `settle_rtts` round trips: a new
    # TCP connection needs several RTTs of slow start before it carries its share.
    min_settle_s: float = 0.3
    # Eight RTTs: a new connection's slow start needs about six (from a 10-segment initial
    # window to a few MiB at a 9000-byte MTU) before it carries its share.
    settle_rtts: float = 8.0
    # The first step needs no new connection to ramp up: as soon as the one connection
    # holds `min_bytes_in_flight` (judged over this many RTTs), the path is long and fat.
    first_settle_rtts: float = 3.0
    # Each step multiplies the connections by this much (1 -> 4 -> 8): every step costs a
    # dial and a settle, ~2.5 s at 200 ms, so few steps matter more than a fine count.
    growth_factor: int = 4
    # A step's rate is judged over at least this many bytes, not a handful of chunks.
    min_window_bytes: int = 8 << 20
    # On a path this long (intercontinental: stock buffers cap one connection at ~4 MiB /
    # RTT, 84 MB/s at 50 ms) the first step is taken at once, before any rate is known:
    # dials cost ~5 RTTs each, so waiting to measure one connection first costs seconds.
    # What follows is judged as usual (an idle link's extra connections cost a handshake).
    predial_rtt_s: float = 0.05
    predial_connections: int = 4
    # On a path this long (200 ms eu-asia, 150 ms us-asia) the first step goes straight to
    # ``max_connections``: one connection carries ~4 MiB / RTT, 27 MB/s at 150 ms, and the
    # step 4 -> 8 cost a settle of 8 RTTs plus a dial, ~2.5 s at 200 ms, in which most of
    # a 256 MiB fetch was gone (WAN bench: 0.65x raw 8-conn). A long thin path pays a few
    # idle handshakes.
    predial_all_rtt_s: float = 0.15
    # The rate must grow by this fraction over the previous step's for another step: a
    # link already full (or a CPU-bound loopback) stops growing after one extra connection.
    min_gain: float = 0.15
    # Grow only while each connection holds at least this much in flight (its rate x RTT):
    # a connection limited by its socket buffers holds a few MiB (stock tcp_wmem max is
    # 4 MiB), while a LAN or loopback connection at full speed holds far less and gains
    # nothing from company but CPU cost.
    min_bytes_in_flight: int = 1 << 20

    def early_lanes(self, rtt: float | None) -> int:
        """Bulk connections worth opening at once to a provider ``rtt`` away, before any
        rate is measured: ``predial_connections`` from ``predial_rtt_s``,
        ``max_connections`` from ``predial_all_rtt_s``, else none (growth decides)."""
        if rtt is None or rtt < self.predial_rtt_s or self.max_connections < 2:
            return 0
        if rtt >= self.predial_all_rtt_s:
            return self.max_connections
        return min(self.max_connections, self.predial_connections)

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if not self.min_settle_s > 0 or self.settle_rtts < 0 or self.first_settle_rtts < 0:
            raise ValueError("min_settle_s must be positive and the settle RTTs not negative")
        if self.min_gain < 0:
            raise ValueError("min_gain must not be negative")
        if self.growth_factor < 2:
            raise ValueError("growth_factor must be at least 2")


class StripeGrowth:
    """Sans-IO: how many connections one download should stripe one provider over.

    The provider starts on one connection. After each step has settled (``min_settle_s``,
    and ``settle_rtts`` round trips; ``first_settle_rtts`` before the first step, when no
    new connection is ramping up), the rate measured over the second half of the step
    (the first half is the new connections' slow start) is compared with the previous
    step's: the first step multiplies the connections by ``growth_factor``, later ones
    do so again only if the rate grew by ``min_gain``, so 1 -> 4 -> 8 on a path limited
    by per-connection buffers, and 1 -> 4 and stop where the link is the limit. No step
    is taken while a connection holds less than ``min_bytes_in_flight`` (rate x RTT per
    connection): a LAN or a loopback, where one connection is never buffer-limited, keeps
    one connection. A step in which the provider ran out of work (``busy`` False) says
    nothing about the path and is measured again. A failed dial ends growth for this
    download. On a path of ``predial_rtt_s`` or more the first step, to
    ``predial_connections`` (``max_connections`` from ``predial_all_rtt_s``), is taken at
    once, before anything is measured.
    """

    def __init__(self, config: StripeConfig, now: float, connections: int = 1) -> None:
        self._cfg = config
        self.connections = max(1, connections)
        self.pending = 0  # dials asked for and not yet reported
        self.stopped = self.connections >= config.max_connections
        self._baseline: float | None = None  # rate of the previous step
        self._start = now
        self._marked = False
        self._mark = now
        self._bytes = 0
        self._rtt: float | None = None  # the last RTT `decide` was told
        self._predialled = False

    def _settle(self, rtt: float | None) -> float:
        rtts = self._cfg.first_settle_rtts if self._baseline is None else self._cfg.settle_rtts
        return max(self._cfg.min_settle_s, rtts * (rtt or 0.0))

    def on_bytes(self, nbytes: int, now: float, rtt: float | None = None) -> None:
        """`nbytes` of this provider's chunks arrived at `now`."""
        if rtt is None:
            rtt = self._rtt
        if not self._marked and now - self._start >= self._settle(rtt) / 2:
            self._marked = True
            self._mark = now
            self._bytes = 0
            return  # what arrived by the mark belongs to the ramp
        if self._marked:
            self._bytes += nbytes

    def decide(self, now: float, rtt: float | None, busy: bool) -> int:
        """How many connections to dial now (0 for none). `busy`: the provider had work
        queued the whole time (requests in flight and chunks left in the pool)."""
        self._rtt = rtt
        if self.stopped or self.pending:
            return 0
        if (
            not self._predialled
            and busy
            and rtt is not None
            and rtt >= self._cfg.predial_rtt_s
            and self.connections < self._cfg.predial_connections
        ):
            self._predialled = True
            self.pending = self._cfg.early_lanes(rtt) - self.connections
            return self.pending
        settle = self._settle(rtt)
        if now - self._start < settle:
            return 0
        if not busy or not self._marked or now <= self._mark:
            self._restart(now)
            return 0
        if self._bytes < self._cfg.min_window_bytes:
            return 0  # too few bytes yet to tell a rate from a burst
        rate = self._bytes / (now - self._mark)
        baseline = self._baseline
        if rate <= 0.0 or (baseline is not None and rate < baseline * (1 + self._cfg.min_gain)):
            self.stopped = True
            return 0
        if rate / self.connections * (rtt or 0.0) < self._cfg.min_bytes_in_flight:
            # Not buffer-limited (yet): measure again, the rate may still be ramping up.
            self._baseline = rate if baseline is not None else None
            self._restart(now)
            return 0
        self._baseline = rate
        want = (
            min(self._cfg.max_connections, self.connections * self._cfg.growth_factor)
            - self.connections
        )
        self.pending = want
        return want

    def on_dialled(self, ok: bool, now: float) -> None:
        """One dial asked for by `decide` ended (`ok`: the connection is usable)."""
        self.pending = max(0, self.pending - 1)
        if ok:
            self.connections += 1
        else:
            self.stopped = True
        if self.connections >= self._cfg.max_connections:
            self.stopped = True
        if not self.pending:
            self._restart(now)

    def next_check(self, now: float, rtt: float | None) -> float:
        """When `decide` may next say something new."""
        return max(now, self._start + self._settle(rtt))

    def _restart(self, now: float) -> None:
        self._start = now
        self._marked = False
        self._bytes = 0
