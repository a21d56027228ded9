"""The inbound gate's choice of which pending handshake to drop (p2p.transport.host, rule 1)
when more addresses flood it than it has pending slots, sans-IO.

Regression: 1,000 silent sockets from 63 addresses, each reconnecting as soon as it was
dropped, against 64 pending slots: each address held one or two, so a real peer's own
handshakes (one connection, then 7 more for a striped fetch) were as often the ones
dropped; `blob get` could not connect ("timed out after 15 s") or striped nothing.
"""

from __future__ import annotations

from p2p.transport.host import InboundGate


def test_a_peer_striping_survives_a_reconnecting_flood_from_many_addresses() -> None:
    gate = InboundGate(max_pending=64, max_pending_per_ip=16)
    dropped: list[str] = []
    tokens: dict[int, str] = {}

    def flood(n: int, now: float) -> None:
        ip = f"10.0.0.{n % 63}"
        admission = gate.admit(ip, now, lambda: dropped.append(ip))
        assert admission.token is not None
        tokens[admission.token] = ip

    for n in range(1000):  # the flood fills the table and churns through it
        flood(n, n / 1000)
    # The peer dials once, then 7 more connections at once, while the flood goes on.
    for k in range(8):
        gate.admit("192.0.2.1", 1.0 + k / 1000, lambda: dropped.append("peer"))
    for n in range(1000, 3000):
        flood(n, 1.0 + n / 1000)
    assert "peer" not in dropped
    assert gate.pending_per_ip["192.0.2.1"] == 8


def test_one_address_holding_many_slots_is_still_the_one_dropped() -> None:
    """Without reconnects to tell them apart, the address with the most pending loses."""
    gate = InboundGate(max_pending=4, max_pending_per_ip=10)
    dropped: list[str] = []
    for k in range(3):
        gate.admit("loris", k, lambda: dropped.append("loris"))
    gate.admit("peer", 3.0, lambda: dropped.append("peer"))
    gate.admit("newcomer", 4.0, lambda: dropped.append("newcomer"))
    assert dropped == ["loris"]
