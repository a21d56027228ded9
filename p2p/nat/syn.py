"""The TCP half of a hole punch: SYNs from our listen port that outlive a router's reset
or ICMP refusal, and a record of what became of each.

Theory of operation
===================

1. Both peers dial each other's public address from their own listen port at about the
   same moment (DCUtR's SYNC: the responder on receipt, the initiator half a relay RTT
   later). A SYN that reaches the other router before the other peer's SYN has left it
   finds no mapping there: it is *early*. At most one side's SYN is early: if ours left
   first, theirs leaves after our router already maps our port to theirs.
2. A router that drops the early SYN silently leaves our socket in SYN_SENT and our own
   router's mapping open: their SYN comes in through it into our socket (a simultaneous
   open) and both connects succeed. So a pending SYN is never replaced: closing it could
   leave a moment with no SYN of ours on the port, and a SYN of ours that their side
   already took would, replaced, reset the connection it began.
3. A router that answers the early SYN with a TCP reset, or with an ICMP port (or host)
   unreachable, ends our connect (ECONNREFUSED). The reset also moves our own router's
   conntrack entry to CLOSE, in which state it turns their SYN away. So a new SYN leaves
   from the same port at once (a SYN from our side of a closed entry starts a new one),
   and again after each refusal for half a second, then on a spaced, random schedule
   until the punch window closes (``SynSchedule`` says why each number). Their router
   stops refusing once their SYN has left (our next SYN then meets its mapping) or once
   it rate-limits its ICMP errors (Linux sends about six at once, then one a second):
   either way our SYN then waits in SYN_SENT for theirs, as in rule 2.
4. The moment between a refusal and our next SYN must be as short as the machine
   allows. A Linux router tracks the sequence number of our latest SYN; if their SYN
   arrives in that moment, our listener (on the same port, SO_REUSEPORT) answers it with
   a new sequence number, which the router takes for an invalid packet and drops, and
   the pair is lost for the two minutes the router remembers it. So the SYNs of a window
   run in a thread of their own that waits on the socket, the next socket is bound
   beforehand and its SYN sent before the refused one is looked at, and while punches
   run the GIL is handed between threads every ``PUNCH_SWITCH_INTERVAL``
   (``QuickHandoff``). A connection our listener does take (a router that tracks less
   strictly) is the punched one: ``p2p.nat.holepunch`` upgrades it in the role our dial
   would have had, and our next SYNs find the port pair taken (``busy``).
5. Every SYN's fate is counted (``SynTrace``): connected, reset, ICMP (type, code and the
   address that sent it: with ``IP_RECVERR`` Linux queues the ICMP error on the socket,
   and a reset queues nothing), port busy, or unanswered when the window closed; and a
   connection whose handshake then failed. A failed punch reports those counts and how
   long it waited (``SynTrace.describe``), never a guessed cause.

The schedule and the trace are sans-IO (time is an argument); :func:`send_syns` is the
thin layer that opens the sockets.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import random
import select
import socket
import struct
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import trio

# Linux's IP_RECVERR (linux/in.h); Python's socket module does not export it.
IP_RECVERR = 11
# struct sock_extended_err (linux/errqueue.h): errno, origin, ICMP type, ICMP code, pad,
# info, data; then the offender's sockaddr_in.
_EXTENDED_ERR = struct.Struct("=IBBBBII")
_ORIGIN_ICMP = 2
# One queued error: the 16-byte struct and a sockaddr_in (16 bytes); room to spare.
_ERRQUEUE_ANCILLARY = 512

# Connect errors after which a new SYN from the same port may still meet the peer's.
# ECONNREFUSED: a reset, or ICMP port unreachable; EHOSTUNREACH/ENETUNREACH: ICMP host or
# network unreachable, or administratively prohibited; EADDRNOTAVAIL: the port pair is
# taken (our listener accepted their SYN, or a closed connection's TIME_WAIT holds it);
# ECONNRESET/ETIMEDOUT for a SYN the kernel gave up on. Anything else (EACCES, EINVAL: a
# local setup error) ends the punch at once.
RETRYABLE = frozenset(
    {
        errno.ECONNREFUSED,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EADDRNOTAVAIL,
        errno.ECONNRESET,
        errno.ETIMEDOUT,
    }
)


@dataclass(frozen=True)
class SynSchedule:
    """When to send the next SYN after a refusal (rule 3).

    During the burst (``burst_s`` from the window's first SYN, at most ``burst_syns``
    SYNs) a refused SYN is followed by the next at once: a SYN is refused one round trip
    after it left, so there is always one of ours on its way, and the moment with none
    (between the refusal and the next SYN) is as short as the process makes it. Any gap
    is a chance for the peer's SYN to arrive with no SYN of ours to meet it (rule 4), and
    behind a Linux router a connection our listener accepts then rarely works: the
    router tracked our last SYN's sequence number, and the listener's SYN-ACK carries
    another. The burst ends after half a second: the peer's SYN left long since unless
    its process stalled, and on a LAN-short path an unbounded burst is a SYN every 0.1
    ms. Then each refusal waits a random delay in ``spaced``, 0.1-0.3 s: about twenty
    more SYNs in a 5 s window for a peer that is late, not a hundred at a router that
    will refuse them all (an endpoint-dependent NAT); the randomness keeps two peers
    whose SYNs are refused in turn from staying in lock step. A SYN that finds
    the port pair taken (``busy``: our listener took their SYN, or a closed connection's
    TIME_WAIT holds the pair) waits in ``busy_wait`` too: retrying at once would spin.
    ``max_syns`` bounds the SYNs of one window whatever the clock does."""

    burst_s: float = 0.5
    burst_syns: int = 64
    spaced: tuple[float, float] = (0.1, 0.3)
    busy_wait: tuple[float, float] = (0.02, 0.06)
    max_syns: int = 200

    def __post_init__(self) -> None:
        for low, high in (self.spaced, self.busy_wait):
            if not 0 <= low <= high:
                raise ValueError("a SYN schedule's delays are ranges (low, high), 0 <= low <= high")
        if self.burst_s < 0 or self.burst_syns < 0 or self.max_syns < 1:
            raise ValueError("burst_s and burst_syns must be >= 0 and max_syns >= 1")

    def delay(self, outcome: str, syns: int, since_first: float, rng: random.Random) -> float:
        """Seconds to wait before the next SYN, after the ``syns``-th SYN of the window
        (``since_first`` seconds after the first) ended with ``outcome``."""
        if outcome == "busy":
            return rng.uniform(*self.busy_wait)
        if since_first < self.burst_s and syns <= self.burst_syns:
            return 0.0
        return rng.uniform(*self.spaced)


# Used when a punch is made with retries turned off (a test's and a bench's control).
NO_RETRY = SynSchedule(max_syns=1)
DEFAULT_SCHEDULE = SynSchedule()


@dataclass
class SynTrace:
    """What became of the SYNs sent to one address (rule 5); times are ``now`` values."""

    dest: str
    syns: int = 0
    resets: int = 0
    icmp: Counter[str] = field(default_factory=Counter)  # "type/code from addr" -> count
    busy: int = 0
    other: Counter[str] = field(default_factory=Counter)  # errno name -> count
    first_at: float | None = None
    connected_at: float | None = None
    pending_since: float | None = None  # the last SYN, not answered yet
    unanswered: int = 0  # SYNs that were still pending when their dial was cancelled
    windows: int = 0  # punch windows (dial rounds) that sent SYNs here
    connections: int = 0  # SYNs that connected (ours, or theirs at our listener)
    handshakes_failed: int = 0  # of those, the ones whose Noise + yamux handshake failed

    def sent(self, now: float) -> None:
        self.syns += 1
        if self.first_at is None:
            self.first_at = now
        self.pending_since = now

    def connected(self, now: float) -> None:
        self.connected_at = now
        self.connections += 1
        self.pending_since = None

    def handshake_failed(self) -> None:
        """A connection made by the punch did not finish its handshake."""
        self.handshakes_failed += 1
        self.connected_at = None

    def refused(self, outcome: str, now: float) -> None:
        """``outcome``: "reset", "busy", "icmp <type>/<code> from <addr>" or an errno name."""
        self.pending_since = None
        if outcome == "reset":
            self.resets += 1
        elif outcome == "busy":
            self.busy += 1
        elif outcome.startswith("icmp "):
            self.icmp[outcome[5:]] += 1
        else:
            self.other[outcome] += 1

    def abandoned(self, now: float) -> None:
        """The window closed with a SYN still unanswered (silence)."""
        if self.pending_since is not None:
            self.unanswered += 1
            self.pending_since = None

    def refusals_from_dest(self) -> int:
        """Resets, and ICMP errors sent by the address we dialled (its router's public
        address): the peer's side turning our SYN away, not a router on the way."""
        ip = self.dest.rsplit(":", 1)[0]
        return self.resets + sum(n for what, n in self.icmp.items() if what.endswith(f" {ip}"))

    def refusals_on_the_way(self) -> int:
        """ICMP errors from a router on the way (our own, for a private address of the
        peer that only its LAN can reach): the address is no way to the peer."""
        return sum(self.icmp.values()) - (self.refusals_from_dest() - self.resets)

    def describe(self) -> str:
        """One clause: how many SYNs went to ``dest`` and what answered them."""
        seen = []
        if self.resets:
            seen.append(f"{self.resets} TCP reset{_s(self.resets)}")
        for what, n in sorted(self.icmp.items()):
            seen.append(f"{n} ICMP {_icmp_name(what)}")
        if self.busy:
            seen.append(f"{self.busy} found the port pair taken")
        for name, n in sorted(self.other.items()):
            seen.append(f"{n} {name}")
        if self.unanswered:
            seen.append(f"{self.unanswered} unanswered (silence)")
        if self.connections:
            seen.append(f"{self.connections} connected")
        if self.handshakes_failed:
            seen.append(f"{self.handshakes_failed} of those did not finish the handshake")
        answers = ", ".join(seen) if seen else "no answer"
        windows = f" in {self.windows} window{_s(self.windows)}" if self.windows > 1 else ""
        return f"{self.syns} SYN{_s(self.syns)} to {self.dest}{windows}: {answers}"


def _s(n: int) -> str:
    return "" if n == 1 else "s"


_ICMP_NAMES = {"3/0": "net unreachable", "3/1": "host unreachable", "3/3": "port unreachable",
               "3/10": "host prohibited", "3/13": "administratively prohibited"}  # fmt: skip


def _icmp_name(what: str) -> str:
    """``"3/3 from 10.77.0.12"`` -> ``"port unreachable from 10.77.0.12"``."""
    code, _, origin = what.partition(" ")
    name = _ICMP_NAMES.get(code, f"type/code {code}")
    return f"{name} {origin}".strip()


def classify(err: int, queued: bytes | None) -> str:
    """A refused SYN's outcome from its errno and the ancillary data of the error the
    kernel queued for the socket (None: nothing queued)."""
    if queued is not None and len(queued) >= _EXTENDED_ERR.size:
        _errno, origin, icmp_type, icmp_code, _pad, _info, _data = _EXTENDED_ERR.unpack_from(queued)
        if origin == _ORIGIN_ICMP:
            offender = ""
            if len(queued) >= _EXTENDED_ERR.size + 8:
                ip = queued[_EXTENDED_ERR.size + 4 : _EXTENDED_ERR.size + 8]
                offender = f" from {socket.inet_ntoa(ip)}"
            return f"icmp {icmp_type}/{icmp_code}{offender}"
    if err == errno.ECONNREFUSED:
        return "reset"
    if err == errno.EADDRNOTAVAIL:
        return "busy"
    return errno.errorcode.get(err, str(err))


def _queued_error(sock: socket.socket) -> bytes | None:
    try:
        _data, ancillary, _flags, _addr = sock.recvmsg(
            0, _ERRQUEUE_ANCILLARY, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT
        )
    except OSError:  # nothing queued (a reset), or no error queue on this platform
        return None
    for level, kind, data in ancillary:
        if level == socket.IPPROTO_IP and kind == IP_RECVERR:
            return bytes(data)
    return None


# A SYN thread checks whether its window closed this often while it waits on a SYN.
POLL_SLICE_MS = 20
# How soon a woken SYN thread gets the GIL from a thread that holds it, while punches run
# (Python's default is 5 ms). Measured on the testbed (EIM routers answering an early
# SYN with ICMP, 30 punches each): 27 of 30 direct at the default, 30 of 30 at 0.2 ms;
# the three failures were the peer's SYN arriving while our next SYN waited for the GIL.
PUNCH_SWITCH_INTERVAL = 0.0002


class QuickHandoff:
    """Python's GIL switch interval at ``PUNCH_SWITCH_INTERVAL`` while any punch runs,
    as it was once none does. The interval is the interpreter's, so this is one object
    per process, counting the punches of every host in it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._saved = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._running == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, PUNCH_SWITCH_INTERVAL))
            self._running += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                sys.setswitchinterval(self._saved)


_QUICK_HANDOFF = QuickHandoff()


class SynsRefused(OSError):
    """Every SYN of a window was refused, or one failed for a local reason."""


def _new_socket(source: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # The listener holds the port with SO_REUSEPORT (py-libp2p's TCP listener).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
        except OSError:  # not Linux: resets and ICMP errors are then counted together
            pass
        sock.bind(source)
    except BaseException:
        sock.close()
        raise
    return sock


def _start_syn(sock: socket.socket, dest: tuple[str, int]) -> int:
    """Send the SYN (a non-blocking connect); 0 if it is on its way, else the errno of a
    refusal known at once (EADDRNOTAVAIL: the port pair is taken)."""
    err = sock.connect_ex(dest)
    return 0 if err in (0, errno.EINPROGRESS) else err


def _syn_loop(
    source: tuple[str, int],
    dest: tuple[str, int],
    trace: SynTrace,
    schedule: SynSchedule,
    rng: random.Random,
    stop: threading.Event,
) -> socket.socket | None:
    """The SYNs of one window, in a thread of their own (rule 3): a connected socket, or
    None once ``stop`` is set. Raises SynsRefused for a local error or ``max_syns``."""
    started = time.monotonic()
    opened: list[socket.socket] = []  # closed on the way out, but for the one returned

    def new_socket() -> socket.socket:
        sock = _new_socket(source)
        opened.append(sock)
        return sock

    pending = False  # a SYN of ours is on its way (unanswered when the window closes)
    try:
        current, spare = new_socket(), new_socket()
        err = _start_syn(current, dest)
        trace.sent(time.monotonic())
        pending, syns = True, 1
        poller = select.poll()
        while True:
            if err == 0:
                poller.register(current, select.POLLOUT)
                ready = poller.poll(POLL_SLICE_MS)
                poller.unregister(current)
                if stop.is_set():
                    return None
                if not ready:
                    continue
                err = current.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err == 0:
                    pending = False
                    trace.connected(time.monotonic())
                    with contextlib.suppress(OSError):
                        # On a connected socket IP_RECVERR would make a transient ICMP
                        # error (a route flapping) a hard one that ends the connection.
                        current.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 0)
                    opened.remove(current)
                    return current
            # The next SYN before anything else (rule 3); what refused this one after.
            pending = False
            retry = err in RETRYABLE and syns < schedule.max_syns
            kind = "busy" if err == errno.EADDRNOTAVAIL else "refused"
            delay = schedule.delay(kind, syns, time.monotonic() - started, rng) if retry else 0
            refused, next_err = current, 0
            if retry and delay == 0:
                current = spare
                next_err, pending = _start_syn(current, dest), True
            outcome = classify(err, _queued_error(refused))
            refused.close()
            opened.remove(refused)
            trace.refused(outcome, time.monotonic())
            if not retry:
                why = os.strerror(err) if err not in RETRYABLE else f"{syns} SYNs refused"
                raise SynsRefused(err, f"a SYN to {dest} failed: {why}")
            if not pending:
                if stop.wait(delay):
                    return None
                current = spare
                next_err, pending = _start_syn(current, dest), True
            spare = new_socket()
            err = next_err
            trace.sent(time.monotonic())
            syns += 1
    except OSError as exc:
        if isinstance(exc, SynsRefused):
            raise
        trace.refused(errno.errorcode.get(exc.errno or 0, "local error"), time.monotonic())
        raise SynsRefused(exc.errno, f"cannot send a SYN from {source}: {exc}") from None
    finally:
        if pending:
            trace.abandoned(time.monotonic())
        for sock in opened:
            sock.close()


async def send_syns(
    source: tuple[str, int],
    dest: tuple[str, int],
    trace: SynTrace,
    *,
    schedule: SynSchedule = DEFAULT_SCHEDULE,
    rng: random.Random | None = None,
    threads: trio.CapacityLimiter | None = None,
) -> trio.SocketStream:
    """A TCP connection from ``source`` (our listen address) to ``dest``, SYNs retried
    after refusals on ``schedule`` (rules 2-3). Runs until connected, cancelled (the
    punch window closed: a pending SYN is then counted unanswered), ``schedule.max_syns``
    refusals, or a local error (SynsRefused). ``threads`` bounds the SYN threads of its
    owner (a host's ``PunchBook``; None: trio's default limiter).

    The SYNs are sent from a thread that waits on the socket itself: a refused SYN's
    successor, made and bound beforehand, leaves as soon as the kernel wakes that thread
    and it holds the GIL (rule 3: a gap is a chance for the peer's SYN to find none of
    ours). While SYN threads run, the interpreter hands the GIL over every
    ``PUNCH_SWITCH_INTERVAL`` instead of every 5 ms (``QuickHandoff``)."""
    stop = threading.Event()
    loop = functools.partial(_syn_loop, source, dest, trace, schedule, rng or random.Random(), stop)
    try:
        with _QUICK_HANDOFF:
            sock = await trio.to_thread.run_sync(
                loop,
                abandon_on_cancel=True,  # type: ignore[call-arg]  # trio-stubs predate it
                limiter=threads,
            )
    finally:
        stop.set()  # cancelled: the thread sees it within POLL_SLICE_MS and closes its sockets
    if sock is None:
        raise SynsRefused(errno.ECANCELED, "stopped")
    sock.setblocking(False)
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))
