"""Turns to start an inbound handshake, paced per source address.

Theory of operation
A socket that connects and never handshakes costs the server an accept, a handshake start
and, when the inbound gate drops it, a close; its flooder reconnects at once. So each
source address may start handshakes at ``TURNS_PER_SECOND_PER_IP`` a second after a burst of
``TURN_BURST_PER_IP`` (a generic cell rate: ``HandshakePacer``), and:

1. A handshake that ends in a connection gives its turn back (``HandshakePacer.give_back``),
   so the rate binds only sockets that never handshake: peers behind one NAT, or a fetch
   opening its stripes, connect as fast as their handshakes complete. (The caller gives
   back, too, the turn of a socket it refused before any handshake for reasons of its own;
   see ``p2p.transport.host``, rule 6.)
2. A socket over its address's rate is not closed (its flooder would reconnect at once,
   and the server spend its time accepting and closing): it is *held* unread, in its
   address's queue, first come first served, until a turn comes, either by the rate or
   given back by a handshake of its address that connected. The one whose turn comes is
   woken then, not at a time fixed when it arrived: a burst of more than
   ``TURN_BURST_PER_IP`` sockets from one address that all connect is served at the speed
   of its handshakes.
3. A socket is held at most ``MAX_TURN_WAIT``, then closed without a handshake; one whose
   peer has left is closed within ``GONE_CHECK_INTERVAL``; a socket that gives up takes no
   turn. At most ``MAX_HELD_SOCKETS`` are held in all (a quarter of
   the process's file limit if that is less), and ``MAX_HELD_PER_IP`` from one address; past
   either a socket over its rate is closed at once.

``HandshakePacer`` decides (sans-IO: the caller passes ``now`` and is told which held
sockets go, and when the next one of an address would by the rate alone);
``HandshakeTurns`` is its trio shell, a task per held socket sleeping until its ticket is
released or, for the first of its address's queue, until the rate's next turn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

# Handshakes per source address and second once its burst is spent, a connection giving
# its turn back (rule 1). A peer dials once, plus one connection per stripe of a fetch
# (8), and redials after a failure seconds later; the burst fits two such peers dialling
# at the same moment. A flooder's reconnecting silent sockets each cost the server an
# accept, a handshake start and a close: unpaced, 1,000 of them from 63 addresses kept one
# CPU busy (bench/figures/floods-greedy.md).
TURNS_PER_SECOND_PER_IP = 1.0
TURN_BURST_PER_IP = 16
# How long a socket over its address's rate is held before it is closed unanswered (rule
# 3). While held, its flooder cannot reconnect: a flood of S silent sockets costs
# S / MAX_TURN_WAIT closes a second, not as many as the server can accept. A real dialler
# past its address's burst is woken as soon as a turn comes back, and gives up sooner
# anyway (blob get after 15 s).
MAX_TURN_WAIT = 30.0
# How often a held socket looks whether its peer has left (a non-blocking peek): one that
# has is closed then, so after a flood ends the node's descriptors are back to their
# baseline within seconds, not MAX_TURN_WAIT. 2,048 held sockets cost ~680 peeks a second.
GONE_CHECK_INTERVAL = 3.0
# Sockets held, in all: each is a file descriptor, a sleeping task and the kernel's buffers
# of an unread socket, no CPU. 2,048 hold a flood of 1,000 sockets with room; a quarter of
# the process's file limit bounds it further, so held sockets never starve connections of
# descriptors.
MAX_HELD_SOCKETS = 2048
# ... from one source address: twice the connections one address may hold established
# (MAX_CONNECTIONS_PER_IP, 128), more than it can use, so one address cannot take more
# than an eighth of MAX_HELD_SOCKETS from the others.
MAX_HELD_PER_IP = 256
# Addresses whose rate is remembered at most; past it those whose burst is back in full
# are forgotten, then all but the half furthest over their rate (never one with a queue).
MAX_ADDRESSES_TRACKED = 4096


@dataclass(frozen=True)
class Arrival:
    """What the pacer decided for a new socket: ``go`` (start its handshake now), else held
    as ``ticket`` (until ``HandshakePacer.release`` names it), else (no ticket) closed at
    once, the held sockets being at their cap."""

    go: bool
    ticket: int | None = None


def held_socket_cap(max_held: int = MAX_HELD_SOCKETS) -> int:
    """``max_held``, or a quarter of the process's soft file limit if that is less."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return max_held
    if soft == resource.RLIM_INFINITY:
        return max_held
    return max(1, min(max_held, soft // 4))


class HandshakePacer:
    """Per source address: a generic cell rate of handshake turns and a queue of held
    tickets (sans-IO; see the module's theory of operation)."""

    def __init__(
        self,
        *,
        per_second: float = TURNS_PER_SECOND_PER_IP,
        burst: int = TURN_BURST_PER_IP,
        max_held: int | None = None,
        max_held_per_ip: int = MAX_HELD_PER_IP,
        max_tracked: int = MAX_ADDRESSES_TRACKED,
    ) -> None:
        self.interval = 1.0 / per_second
        self.burst = burst
        self.max_held = held_socket_cap() if max_held is None else max_held
        self.max_held_per_ip = max_held_per_ip
        self.max_tracked = max_tracked
        # Per address, when its next turn would be on its rate (the cell rate's
        # theoretical arrival time); an address absent, or at or before now, has its
        # whole burst.
        self._tat: dict[str, float] = {}
        self._queues: dict[str, deque[int]] = {}
        self._address_of: dict[int, str] = {}
        self._next = 0
        self.arrived = 0  # sockets asked about
        self.held = 0  # tickets queued now
        self.paced = 0  # sockets ever held
        self.paced_out = 0  # ... that gave up without a turn
        self.refused = 0  # sockets over their rate closed at once (held sockets at a cap)

    def arrive(self, ip: str, now: float) -> Arrival:
        """A new socket from ``ip``: its turn now, or a ticket to wait on, or neither."""
        self.arrived += 1
        queue = self._queues.get(ip)
        if not queue and self._conforms(ip, now):
            self._take(ip, now)
            return Arrival(go=True)
        if self.held >= self.max_held or (queue and len(queue) >= self.max_held_per_ip):
            self.refused += 1
            return Arrival(go=False)
        self._next += 1
        ticket = self._next
        self._queues.setdefault(ip, deque()).append(ticket)
        self._address_of[ticket] = ip
        self.held += 1
        self.paced += 1
        return Arrival(go=False, ticket=ticket)

    def release(self, ip: str, now: float) -> list[int]:
        """The held tickets of ``ip`` whose turn has come by ``now``, first come first, each
        taking its turn (no longer held)."""
        queue = self._queues.get(ip)
        released: list[int] = []
        while queue and self._conforms(ip, now):
            ticket = queue.popleft()
            del self._address_of[ticket]
            self.held -= 1
            self._take(ip, now)
            released.append(ticket)
        if queue is not None and not queue:
            del self._queues[ip]
        return released

    def give_back(self, ip: str, now: float) -> list[int]:
        """A turn of ``ip`` is given back (rule 1: its handshake ended in a connection), and
        the held tickets it lets go are released (``release``)."""
        tat = self._tat.get(ip)
        if tat is not None:
            self._tat[ip] = max(now, tat - self.interval)
        return self.release(ip, now)

    def leave(self, ticket: int) -> bool:
        """A held ticket gives up (its wait is over, or its task ended) without a turn.
        False if it was not held (released already, or never)."""
        ip = self._address_of.pop(ticket, None)
        if ip is None:
            return False
        queue = self._queues[ip]
        queue.remove(ticket)
        if not queue:
            del self._queues[ip]
        self.held -= 1
        self.paced_out += 1
        return True

    def head(self, ip: str) -> int | None:
        """The first held ticket of ``ip``'s queue, if any: the next to be released."""
        queue = self._queues.get(ip)
        return queue[0] if queue else None

    def turn_at(self, ip: str) -> float:
        """When ``ip``'s next turn comes by the rate alone (its head's wake-up time; a turn
        given back brings it sooner)."""
        return self._tat.get(ip, float("-inf")) - (self.burst - 1) * self.interval

    def _conforms(self, ip: str, now: float) -> bool:
        return self.turn_at(ip) <= now

    def _take(self, ip: str, now: float) -> None:
        self._tat[ip] = max(self._tat.get(ip, now), now) + self.interval
        if len(self._tat) > self.max_tracked:
            self._forget(now)

    def _forget(self, now: float) -> None:
        self._tat = {ip: t for ip, t in self._tat.items() if t > now or ip in self._queues}
        if len(self._tat) > self.max_tracked:
            by_tat = sorted(self._tat.items(), key=lambda item: item[1])
            kept = dict(by_tat[-(self.max_tracked // 2) :])
            kept.update((ip, self._tat[ip]) for ip in self._queues)
            self._tat = kept


class HandshakeTurns:
    """The trio shell of a ``HandshakePacer``: ``wait_turn`` holds a socket's handler until
    its turn, woken by an event of its own as soon as its ticket is released."""

    def __init__(
        self, pacer: HandshakePacer | None = None, *, max_wait: float = MAX_TURN_WAIT
    ) -> None:
        self.pacer = pacer if pacer is not None else HandshakePacer()
        self.max_wait = max_wait
        self._wake: dict[int, trio.Event] = {}
        self._released: set[int] = set()

    async def wait_turn(self, ip: str, gone: Callable[[], bool] = lambda: False) -> bool:
        """Until a socket from ``ip`` may start its handshake (True), or must be closed
        without one (False: held ``max_wait`` without a turn, no room to hold it, or
        ``gone()``, asked every ``GONE_CHECK_INTERVAL`` while held: its peer has left)."""
        now = trio.current_time()
        arrival = self.pacer.arrive(ip, now)
        if arrival.ticket is None:
            return arrival.go
        ticket = arrival.ticket
        give_up = now + self.max_wait
        try:
            while ticket not in self._released:
                if now >= give_up:
                    return False
                wake = self._wake[ticket] = trio.Event()
                until = min(give_up, now + GONE_CHECK_INTERVAL)
                if self.pacer.head(ip) == ticket:
                    until = min(until, self.pacer.turn_at(ip))
                with trio.move_on_at(until):
                    await wake.wait()
                now = trio.current_time()
                if ticket not in self._released:
                    self._let_go(ip, self.pacer.release(ip, now))
                if ticket not in self._released and gone():
                    return False
            return True
        finally:
            self._wake.pop(ticket, None)
            if ticket in self._released:
                self._released.discard(ticket)
            elif self.pacer.leave(ticket):
                self._wake_head(ip)

    def give_back(self, ip: str) -> None:
        """A turn of ``ip`` is given back (``HandshakePacer.give_back``): the held socket it
        lets go is woken now."""
        self._let_go(ip, self.pacer.give_back(ip, trio.current_time()))

    def _let_go(self, ip: str, released: list[int]) -> None:
        for ticket in released:
            self._released.add(ticket)
            self._wake[ticket].set()
        if released:
            self._wake_head(ip)

    def _wake_head(self, ip: str) -> None:
        """The head of ``ip``'s queue changed: it wakes to sleep until the rate's turn."""
        head = self.pacer.head(ip)
        if head is not None and head in self._wake:
            self._wake[head].set()
