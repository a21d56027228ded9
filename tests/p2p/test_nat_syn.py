"""The SYN schedule, the record of what SYNs met, the punch book and a failed punch's line
(p2p.nat.syn, p2p.nat.holepunch, p2p.nat.punch.punch_failure): sans-IO, no sockets.

The story: after a refusal the next SYN leaves at once for half a second (a gap is a
chance for the peer's SYN to find no SYN of ours), then on a random spaced schedule; a
taken port pair is never retried at once; an ICMP error is told from a reset by what the
kernel queued; and a failed punch says how long it waited and what its SYNs met, naming
an endpoint-dependent NAT only as one reading of refusals that lasted the whole window.
"""

from __future__ import annotations

import errno
import random
import socket
import struct

import pytest
from libp2p.peer.id import ID

from p2p.nat.holepunch import MAX_TRACED_ADDRS, MAX_TRACED_PEERS, PunchBook
from p2p.nat.punch import punch_failure
from p2p.nat.syn import NO_RETRY, SynSchedule, SynTrace, classify

PEER = ID(b"\x00\x05peer1")
OTHER = ID(b"\x00\x05peer2")


def test_refusals_in_the_burst_are_retried_at_once_and_later_ones_spaced_at_random() -> None:
    schedule = SynSchedule()
    rng = random.Random(1)
    assert schedule.delay("reset", 1, 0.0, rng) == 0.0
    assert schedule.delay("icmp 3/3 from 10.0.0.1", 30, 0.4, rng) == 0.0
    late = [schedule.delay("reset", 5, 0.6, rng) for _ in range(50)]
    assert all(schedule.spaced[0] <= d <= schedule.spaced[1] for d in late)
    assert len(set(late)) > 1  # random: two peers do not stay in lock step
    many = schedule.delay("reset", schedule.burst_syns + 1, 0.1, rng)
    assert schedule.spaced[0] <= many <= schedule.spaced[1]


def test_a_taken_port_pair_is_never_retried_at_once() -> None:
    schedule = SynSchedule()
    rng = random.Random(2)
    waits = [schedule.delay("busy", 1, 0.0, rng) for _ in range(20)]
    assert min(waits) >= schedule.busy_wait[0] > 0


def test_a_schedule_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="ranges"):
        SynSchedule(spaced=(0.3, 0.1))
    with pytest.raises(ValueError, match="max_syns"):
        SynSchedule(max_syns=0)
    assert NO_RETRY.max_syns == 1


def test_punches_hand_the_gil_over_quickly_and_put_the_interval_back() -> None:
    """While any punch runs, a woken SYN thread waits at most PUNCH_SWITCH_INTERVAL for
    the GIL (p2p.nat.syn rule 4); the interpreter's own interval comes back after the
    last one, however they nest."""
    import sys

    from p2p.nat.syn import PUNCH_SWITCH_INTERVAL, QuickHandoff

    before = sys.getswitchinterval()
    handoff = QuickHandoff()
    with handoff:
        assert sys.getswitchinterval() == pytest.approx(PUNCH_SWITCH_INTERVAL)
        with handoff:
            assert sys.getswitchinterval() == pytest.approx(PUNCH_SWITCH_INTERVAL)
        assert sys.getswitchinterval() == pytest.approx(PUNCH_SWITCH_INTERVAL)
    assert sys.getswitchinterval() == before


def _icmp_queued(icmp_type: int, code: int, offender: str) -> bytes:
    err = struct.pack("=IBBBBII", errno.ECONNREFUSED, 2, icmp_type, code, 0, 0, 0)
    return err + struct.pack("=HH4s8x", socket.AF_INET, 0, socket.inet_aton(offender))


def test_an_icmp_error_is_told_from_a_reset_by_what_the_kernel_queued() -> None:
    queued = _icmp_queued(3, 3, "10.77.0.12")
    assert classify(errno.ECONNREFUSED, queued) == "icmp 3/3 from 10.77.0.12"
    assert classify(errno.ECONNREFUSED, None) == "reset"
    assert classify(errno.EADDRNOTAVAIL, None) == "busy"
    assert classify(errno.EHOSTUNREACH, None) == "EHOSTUNREACH"
    local = struct.pack("=IBBBBII", errno.ECONNREFUSED, 1, 0, 0, 0, 0, 0)  # not ICMP
    assert classify(errno.ECONNREFUSED, local) == "reset"


def _trace(dest: str = "10.77.0.12:4001") -> SynTrace:
    trace = SynTrace(dest)
    trace.windows = 1
    return trace


def test_a_trace_says_what_its_syns_met() -> None:
    trace = _trace()
    for outcome in ("reset", "reset", "icmp 3/3 from 10.77.0.12", "busy"):
        trace.sent(0.0)
        trace.refused(outcome, 0.01)
    trace.sent(0.02)
    trace.abandoned(5.0)
    line = trace.describe()
    assert line.startswith("5 SYNs to 10.77.0.12:4001: ")
    assert "2 TCP resets" in line and "1 ICMP port unreachable from 10.77.0.12" in line
    assert "1 found the port pair taken" in line and "1 unanswered (silence)" in line
    assert trace.refusals_from_dest() == 3


def test_icmp_from_a_router_on_the_way_is_not_the_peer_refusing() -> None:
    private = _trace("10.77.101.2:4001")
    private.sent(0.0)
    private.refused("icmp 3/0 from 10.77.102.1", 0.001)
    assert private.refusals_from_dest() == 0
    assert private.refusals_on_the_way() == 1
    assert "net unreachable from 10.77.102.1" in private.describe()


def test_the_book_expects_the_peer_at_our_listener_while_a_dial_runs() -> None:
    book = PunchBook()
    dest = ("10.77.0.12", 4001)
    assert book.claim(dest) is None
    book.start(PEER, dest, initiator=True)
    expected = book.claim(dest)
    assert expected is not None and expected.peer == PEER and expected.initiator
    assert book.dialling(dest)
    book.stop(dest)
    assert book.claim(dest) is None and not book.dialling(dest)


def test_the_book_orders_traces_by_what_answered_and_stays_bounded() -> None:
    book = PunchBook()
    private = book.start(PEER, ("10.77.101.2", 4001), initiator=False)
    for _ in range(3):
        private.sent(0.0)
        private.refused("icmp 3/0 from 10.77.102.1", 0.001)
    public = book.start(PEER, ("10.77.0.12", 4001), initiator=False)
    public.sent(0.0)
    assert [t.dest for t in book.traces(PEER)] == ["10.77.0.12:4001", "10.77.101.2:4001"]
    public.refused("reset", 0.01)
    public.sent(0.01)
    public.connected(0.02)
    assert book.traces(PEER)[0] is public
    for port in range(MAX_TRACED_ADDRS + 4):
        book.start(OTHER, ("10.77.0.9", port), initiator=True)
    assert len(book.traces(OTHER)) == MAX_TRACED_ADDRS
    for n in range(MAX_TRACED_PEERS + 5):
        book.start(ID(b"\x00\x05p%04d" % n), ("10.77.0.8", 1), initiator=True)
    assert book.traces(PEER) == []  # the oldest peers went first
    book.begin(OTHER)
    assert book.traces(OTHER) == []


def test_a_failed_punch_says_how_long_it_waited_and_what_its_syns_met() -> None:
    refused = _trace()
    for _ in range(30):
        refused.sent(0.0)
        refused.refused("reset", 0.01)
    line = punch_failure("P", 21.4, timed_out=False, traces=[refused])
    assert line.startswith(
        "hole punching to P failed after 21.4 s (DCUtR gave up after its rounds)"
    )
    assert "30 SYNs to 10.77.0.12:4001: 30 TCP resets" in line
    assert "their side refused our SYNs to the end" in line
    assert "\n" not in line

    silent = _trace()
    silent.sent(0.0)
    silent.abandoned(4.0)
    line = punch_failure("P", 4.0, timed_out=True, traces=[silent])
    assert "failed after 4.0 s (the time allowed ran out)" in line
    assert "1 unanswered (silence)" in line and "no answer" in line

    line = punch_failure("P", 19.0, timed_out=False, traces=[refused], retried=False)
    assert "retries are off" in line and "refused our SYNs to the end" not in line

    line = punch_failure("P", 10.0, timed_out=False, traces=[])
    assert "no SYN was sent" in line


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_punched_socket_our_listener_accepts_is_upgraded_in_our_dial_role() -> None:
    """The peer's SYN reached our listener between two SYNs of ours (p2p.nat.holepunch
    rule 3). Here we are the peer that dials as the Noise initiator and the other side
    dials as the responder: the listener's usual inbound upgrade would make both of us
    responders, each waiting for the other's first message, and the connection would
    never come up. The book claims the socket and upgrades it as our dial would have."""
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.host.ping import ID as PING_PROTOCOL
    from libp2p.host.ping import perform_ping_roundtrip
    from multiaddr import Multiaddr

    from p2p.nat.holepunch import punch_book
    from p2p.nat.relay import direct_connection, nat_services
    from p2p.transport.host import build_host

    ours, theirs = (build_host(create_new_key_pair()) for _ in range(2))
    listen = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
    async with (
        ours.run(listen_addrs=listen),
        theirs.run(listen_addrs=listen),
        nat_services(ours),
    ):
        our_addr = ours.get_addrs()[0].decapsulate(Multiaddr(f"/p2p/{ours.get_id()}"))
        their_port = int(theirs.get_addrs()[0].value_for_protocol("tcp"))
        book = punch_book(ours)
        book.start(theirs.get_id(), ("127.0.0.1", their_port), initiator=True)
        # Their punch dial: from their listen port, upgraded as the Noise responder.
        with trio.fail_after(20):
            await theirs.get_network().dial_addr_as_responder(
                our_addr, ours.get_id(), ("127.0.0.1", their_port)
            )
        # The connection works both ways: a ping each way over it.
        with trio.fail_after(10):
            for a, b in ((ours, theirs), (theirs, ours)):
                stream = await a.new_stream(b.get_id(), [PING_PROTOCOL])
                assert await perform_ping_roundtrip(stream) >= 0
                await stream.close()
        assert direct_connection(ours, theirs.get_id()) is not None
        assert book.claimed == 1


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_the_dcutr_initiator_punches_from_a_second_listen_port_it_advertises() -> None:
    """p2p.nat.holepunch rule 6: before its first exchange the initiator listens on one
    more port, once; its CONNECT (py-libp2p's observed addresses) names both ports, and
    each dial leaves from both."""
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from multiaddr import Multiaddr

    from p2p.nat.holepunch import PUNCH_PORTS, open_punch_ports, punch_book
    from p2p.nat.relay import nat_services
    from p2p.transport.host import build_host

    ours = build_host(create_new_key_pair())
    async with ours.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]), nat_services(ours):
        [first] = [int(a.value_for_protocol("tcp")) for a in ours.get_transport_addrs()]
        extra = await open_punch_ports(ours)
        assert len(extra) == PUNCH_PORTS - 1 and first not in extra
        assert await open_punch_ports(ours) == extra  # once per host
        with trio.fail_after(5):
            stream = await trio.open_tcp_stream("127.0.0.1", extra[0])  # it listens
            await stream.aclose()
        from p2p.transport import patches

        dcutr = patches.running_dcutr(ours)
        advertised = [Multiaddr(a) for a in await dcutr._get_observed_addrs()]
        ports = {int(a.value_for_protocol("tcp")) for a in advertised}
        assert ports == {first, *extra}
        sources = punch_book(ours).sources(("127.0.0.1", first))
        assert sources == [("127.0.0.1", first), *(("127.0.0.1", p) for p in extra)]
