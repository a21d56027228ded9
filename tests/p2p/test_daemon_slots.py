"""p2p.daemon.slots: one listener's pending connections and clients, sans-IO."""

from __future__ import annotations

from p2p.daemon.slots import ListenerSlots


def test_a_newcomer_past_the_pending_limit_ends_the_one_waiting_longest() -> None:
    """Rule 2: silent connections never keep a new one from being read; the oldest goes."""
    slots = ListenerSlots("socket", max_pending=3, max_clients=2)
    dropped: list[int] = []
    keys = [slots.arrive(lambda n=n: dropped.append(n)) for n in range(3)]
    assert slots.pending == 3 and dropped == []
    slots.arrive(lambda: dropped.append(3))
    assert dropped == [0] and slots.pending == 3 and slots.evicted == 1
    slots.read(keys[1])  # its line came: no longer pending, never dropped
    slots.arrive(lambda: dropped.append(4))
    assert dropped == [0] and slots.pending == 3
    slots.arrive(lambda: dropped.append(5))
    assert dropped == [0, 2]
    slots.read(keys[0])  # already dropped: reading it again changes nothing
    assert slots.pending == 3


def test_clients_are_counted_per_listener() -> None:
    """Rules 1 and 3: each listener has its own clients; one past the limit is refused
    until a place is given back."""
    socket_side = ListenerSlots("socket", max_pending=8, max_clients=2)
    tcp_side = ListenerSlots("tcp port", max_pending=8, max_clients=2)
    assert tcp_side.take() and tcp_side.take() and not tcp_side.take()
    assert socket_side.take() and socket_side.take()
    assert not socket_side.take()
    socket_side.leave()
    assert socket_side.take()
