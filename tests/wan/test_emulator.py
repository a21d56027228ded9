"""The link model on made-up times: delays add up to the configured RTT, rates space
packets by their serialisation time, full queues drop at the tail, two senders share
one downlink, loss drops about its share; no namespaces needed."""

from __future__ import annotations

import itertools

import pytest

from bench.wan.emulator import MIN_QUEUE_BYTES, Emulator, LinkSpec


def _addr(i: int) -> bytes:
    return bytes([10, 77, 0, 10 + i])


def _packet(src: int, dst: int, size: int, tag: int = 0) -> bytes:
    """A minimal IPv4 header (version, addresses) padded to ``size``; ``tag`` in byte 4."""
    header = bytes([0x45, 0, 0, 0, tag % 256]) + bytes(7) + _addr(src) + _addr(dst)
    return header + bytes(size - len(header))


def _link(i: int, *, delay: float = 0.0, up: float | None = None, down: float | None = None,
          queue: float = 0.05, loss: float = 0.0) -> LinkSpec:  # fmt: skip
    return LinkSpec(_addr(i), delay, up, down, queue, loss)


def _drain(emu: Emulator, until: float, step: float = 1e-4) -> list[tuple[float, int, bytes]]:
    """Every delivery up to ``until``, stamped with the first tick it was due at."""
    out = []
    t = 0.0
    while t <= until:
        out += [(t, dst, pkt) for dst, pkt in emu.due(t)]
        t += step
    return out


def test_one_way_delay_is_the_sum_of_both_hosts_delays_and_the_pair_extra() -> None:
    emu = Emulator([_link(0, delay=0.010), _link(1, delay=0.030)], extra_delay_s={(0, 1): 0.005})
    emu.receive(0, _packet(0, 1, 100), now=1.0)
    assert emu.next_due() == pytest.approx(1.045)
    assert list(emu.due(1.0449)) == []
    assert [dst for dst, _ in emu.due(1.045)] == [1]
    emu.receive(1, _packet(1, 0, 100), now=2.0)  # the extra was for 0 -> 1 only
    assert emu.next_due() == pytest.approx(2.040)


def test_uplink_rate_spaces_packets_by_their_serialisation_time() -> None:
    rate = 1_000_000.0  # bytes/s: a 1000-byte packet takes 1 ms
    emu = Emulator([_link(0, up=rate, queue=1.0), _link(1)])
    for k in range(10):
        emu.receive(0, _packet(0, 1, 1000, tag=k), now=0.0)
    times = [t for t, _, _ in _drain(emu, 0.02)]
    assert len(times) == 10
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(gap == pytest.approx(0.001, abs=2e-4) for gap in gaps)
    assert times[-1] == pytest.approx(0.010, abs=2e-4)


def test_a_full_uplink_queue_drops_the_tail_and_counts_it() -> None:
    rate = 1_000_000.0
    queue_s = 0.0505  # room for 50 packets of 1000 bytes (plus a float's rounding)
    assert rate * queue_s > MIN_QUEUE_BYTES
    emu = Emulator([_link(0, up=rate, queue=queue_s), _link(1)])
    for k in range(80):
        emu.receive(0, _packet(0, 1, 1000, tag=k), now=0.0)
    delivered = _drain(emu, 0.2)
    assert len(delivered) == 50
    assert emu.counters.dropped_up[0] == 30
    assert emu.counters.sent_bytes[0] == 80 * 1000  # what the host tried to send
    assert emu.counters.uplink_bytes[0] == 50 * 1000  # what its link carried
    # FIFO: the survivors are the first 50, in order
    assert [pkt[4] for _, _, pkt in delivered] == list(range(50))


def test_two_senders_share_the_receivers_downlink() -> None:
    down = 1_000_000.0
    emu = Emulator([_link(0), _link(1), _link(2, down=down, queue=1.0)])
    for k in range(20):
        emu.receive(0, _packet(0, 2, 1000, tag=k), now=0.0)
        emu.receive(1, _packet(1, 2, 1000, tag=100 + k), now=0.0)
    delivered = _drain(emu, 0.1)
    assert len(delivered) == 40
    # 40 KB through a 1 MB/s downlink: 40 ms, whoever sent them
    assert delivered[-1][0] == pytest.approx(0.040, abs=2e-4)
    from_0 = [pkt[4] for _, _, pkt in delivered if pkt[4] < 100]
    assert from_0 == list(range(20))  # per-pair order kept through the shared queue


def test_unshaped_links_deliver_after_the_delay_only() -> None:
    emu = Emulator([_link(0, delay=0.001), _link(1, delay=0.001)])
    for k in range(100):
        emu.receive(0, _packet(0, 1, 9000, tag=k), now=0.0)
    assert len(list(emu.due(0.002))) == 100


def test_loss_drops_about_its_share_and_nothing_else() -> None:
    emu = Emulator([_link(0, loss=0.1), _link(1)], seed=1)
    for k in range(5000):
        emu.receive(0, _packet(0, 1, 100, tag=k), now=0.0)
    delivered = len(list(emu.due(1.0)))
    assert emu.counters.lost[0] + delivered == 5000
    assert 4400 < delivered < 4600  # 4500 expected; sd ~21


def test_packets_outside_the_testbed_are_dropped_as_unroutable() -> None:
    emu = Emulator([_link(0), _link(1)])
    emu.receive(0, _packet(0, 1, 100)[:12] + bytes([10, 77, 0, 10, 8, 8, 8, 8]), now=0.0)
    emu.receive(0, b"\x60" + bytes(39), now=0.0)  # IPv6
    emu.receive(0, b"\x45", now=0.0)  # truncated
    assert emu.counters.unroutable == 3
    assert emu.next_due() is None


def test_reconfigure_changes_the_delay_for_new_packets() -> None:
    emu = Emulator([_link(0, delay=0.010), _link(1)])
    emu.reconfigure(0, _link(0, delay=0.050))
    emu.receive(0, _packet(0, 1, 100), now=0.0)
    assert emu.next_due() == pytest.approx(0.050)
