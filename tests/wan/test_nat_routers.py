"""Hole punching through routers that turn an early SYN away loudly, on the testbed.

The story: two peers behind endpoint-independent NATs 2 ms apart, a relay 40 ms from
each, so one peer's SYN nearly always reaches the other's router before the other's own
SYN has left it. A router that drops it silently is the easy case (tests/wan/
test_nat_relay.py). One that answers it with a TCP reset (OpenWrt's default) or an ICMP
port unreachable kills the early dial, and a reset also closes the early side's own
mapping, so the late SYN is turned away too. The punch sends its SYN again at once after
each refusal (p2p.nat.syn), so each fetch here ends direct, through a resetting router in
its first punch window, with the relay carrying signalling only. A port pair lost to the
race no retry wins (p2p.nat.holepunch rule 6, staged here) leaves the fetch its second
port pair, still in the first window. Behind endpoint-dependent NATs that reset, the
punch fails, and says so: how long it waited, and the resets its SYNs met.

The routers themselves come first: what a stranger's SYN meets at each kind, and a
carrier-grade NAT in front of a home router keeping the port through both.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from bench.wan import Host, Testbed
from bench.wan.natnodes import Agent, MiB, NatNodes

pytestmark = [pytest.mark.usefixtures("nat_capable"), pytest.mark.slow, pytest.mark.timeout(180)]

SIZE = 1 * MiB
NEAR_MS = 1.0
# Tries per router, how many must end direct, and how many in their first window. With
# one SYN a window (retries off) 4 of 10 punches got through a resetting router and 4 of 10
# an ICMP one (bench/figures/nat-matrix.md; 0 and 1 of 5 in this test): 5 of 6 direct then
# pass by chance once in 25. With the retries and two port pairs (p2p.nat.holepunch rule
# 6), measured 2026-12-08 (`bench/wan_nat.py --matrix --cells eimicmp --matrix-tries 36`,
# shared machine): ICMP 35 of 36 direct, all 35 in the first window (one pair only, in the
# same session: 32 of 36 in the first window); resets 12 of 12, all in the first window.
# One miss is allowed, and it must say what its SYNs met. The loss that the second pair
# is for is staged in its own test (fails with one pair).
TRIES = 6
DIRECT = 5
FIRST_WINDOW = {"reset": 5, "icmp": 5}
# The punch's three windows (5 s each, py-libp2p's rounds) and a margin.
PUNCH_TIMEOUT = "16"
# The failing punch's timeout: short, the line is what is tested.
FAILING_PUNCH_TIMEOUT = 4.0
# What a relayed connection carries besides the blob: ~3 KB measured; one chunk is 1 MiB.
SIGNALLING_BYTES = 64 * 1024


class Net(NamedTuple):
    tb: Testbed
    nat: NatNodes
    relay: Agent
    providers: dict[str, Agent]


def _hosts() -> dict[str, Host]:
    def near(mapping: str, inbound: str, **kw: Any) -> Host:
        return Host(delay_ms=NEAR_MS, nat=mapping, nat_inbound=inbound, **kw)

    return {
        "relay": Host(delay_ms=20.0),
        "pub": Host(delay_ms=NEAR_MS),
        "resetp": near("eim", "reset"),
        "resetf": near("eim", "reset"),
        "icmpp": near("eim", "icmp"),
        "icmpf": near("eim", "icmp"),
        "symp": near("symmetric", "reset"),
        "symf": near("symmetric", "reset"),
        "cgn": near("eim", "drop", nat_layers=2, nat_idle_s=30),
    }


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    import shutil

    from bench.wan import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(str(unavailable_reason()))
    # This module-scoped fixture is set up before the function-scoped nat_capable.
    if shutil.which("nft") is None:
        pytest.skip("NAT hosts need the `nft` command (Debian package nftables)")
    with Testbed(_hosts()) as tb:
        nat = NatNodes(tb, logs=tmp_path_factory.mktemp("natlogs"))
        relay = nat.relay("relay")
        started = nat.providers(["resetp", "icmpp", "symp"], relay=relay, size=SIZE)
        try:
            yield Net(tb, nat, relay, {agent.host: agent for agent in started})
        finally:
            nat.stop()


_STRANGER = r"""
import json, socket, sys
s = socket.socket()
s.setsockopt(socket.IPPROTO_IP, 11, 1)  # IP_RECVERR: an ICMP error is queued
s.settimeout(2.0)
try:
    s.connect((sys.argv[1], 4999))
    print(json.dumps("connected"))
except TimeoutError:
    print(json.dumps("silence"))
except ConnectionRefusedError:
    try:
        s.recvmsg(0, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        print(json.dumps("icmp"))
    except OSError:
        print(json.dumps("reset"))
"""


def _stranger_meets(tb: Testbed, target: str) -> str:
    done = tb.run(
        "pub", [sys.executable, "-c", _STRANGER, tb.public_addr(target)],
        timeout=30, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return str(done.stdout.strip().strip('"'))


def test_each_router_kind_answers_a_strangers_syn_as_configured(net: Net) -> None:
    """A SYN from outside, to a port nobody asked for: the reset router answers with a
    TCP reset, the ICMP one with ICMP port unreachable, the carrier's NAT says nothing."""
    assert _stranger_meets(net.tb, "resetf") == "reset"
    assert _stranger_meets(net.tb, "icmpf") == "icmp"
    assert _stranger_meets(net.tb, "cgn") == "silence"


def test_a_carrier_grade_nat_keeps_the_port_through_both_routers_and_forgets_idle_ones(
    net: Net,
) -> None:
    from bench.wan.measure import observed_from

    assert observed_from(net.tb, "cgn", "pub", local_port=40000) == (
        f"{net.tb.public_addr('cgn')}:40000"
    )
    for router in net.tb.routers("cgn"):
        timeout = subprocess.run(
            ["ip", "netns", "exec", router, "sysctl", "-n",
             "net.netfilter.nf_conntrack_tcp_timeout_established"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
        assert timeout.stdout.strip() == "30"
    assert len(net.tb.routers("cgn")) == 2


def test_router_settings_are_checked_up_front() -> None:
    with pytest.raises(ValueError, match="nat_inbound"):
        Host(nat="eim", nat_inbound="tarpit")
    with pytest.raises(ValueError, match="nat_layers"):
        Host(nat="eim", nat_layers=3)
    with pytest.raises(ValueError, match="nat_idle_s"):
        Host(nat="eim", nat_idle_s=0)


def _fetch(net: Net, kind: str, port: int, timeout: str) -> tuple[dict[str, Any], int]:
    provider = net.providers[f"{kind}p"]
    before = net.nat.relay_stats(net.relay)["relayed_bytes"]
    result = net.nat.fetch(
        f"{kind}f", provider.blob, provider.circuit_addrs, "--timeout", timeout, port=port
    )
    return result, net.nat.relay_stats(net.relay)["relayed_bytes"] - before


@pytest.mark.parametrize("kind", ["reset", "icmp"])
def test_a_punch_through_routers_that_refuse_an_early_syn_ends_direct(net: Net, kind: str) -> None:
    direct = first_window = 0
    for attempt in range(TRIES):
        result, relayed = _fetch(net, kind, 4100 + attempt, PUNCH_TIMEOUT)
        assert relayed < SIGNALLING_BYTES
        if "error" in result:  # a miss allowed: a line that says what was seen
            assert "\n" not in result["error"]
            assert re.search(r"\d+ SYNs? to ", result["error"]), result
            continue
        [punch] = result["punches"]
        assert punch["path"] == "direct", punch
        assert result["bytes"] == SIZE
        direct += 1
        first_window += punch["windows"] == 1  # the first window of the first exchange
    assert direct >= DIRECT, f"{direct} of {TRIES} punches ended direct"
    assert first_window >= FIRST_WINDOW[kind], f"{first_window} of {TRIES} in the first window"


_SYN = r"""
import socket, sys
local, port, dest, dest_port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
wait = float(sys.argv[5])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
s.bind((local, port))
s.settimeout(wait)
try:
    s.connect((dest, dest_port))
except OSError as exc:
    print(type(exc).__name__)
s.close()
"""


def _syn(net: Net, host: str, port: int, to: str, to_port: int, wait: float) -> str:
    done = net.tb.run(
        host, [sys.executable, "-c", _SYN, net.tb.addr(host), str(port),
               net.tb.public_addr(to), str(to_port), str(wait)],
        timeout=30, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return str(done.stdout.strip())


def test_a_port_pair_lost_to_the_syn_sent2_race_leaves_the_punch_its_second_pair(
    net: Net,
) -> None:
    """The race p2p.nat.holepunch rule 6 describes, lost on purpose before the fetch: the
    provider's SYN from its port to the fetcher's is refused (ICMP), then the fetcher's
    SYN to it arrives more than 4 ms of ISN clock later and the provider's listener
    answers; its router now holds that port pair in SYN_SENT2 and forwards nothing of the
    provider's on it. The fetch from that port still ends direct in its first window, over
    the second port pair the fetcher punches from."""
    port = 4150
    provider = net.providers["icmpp"]
    assert _syn(net, "icmpp", 4001, "icmpf", port, 2.0) == "ConnectionRefusedError"
    assert _syn(net, "icmpf", port, "icmpp", 4001, 0.5) == "TimeoutError"  # answer dropped
    result = net.nat.fetch(
        "icmpf", provider.blob, provider.circuit_addrs, "--timeout", PUNCH_TIMEOUT, port=port
    )
    assert "error" not in result, result
    [punch] = result["punches"]
    assert punch["path"] == "direct" and punch["windows"] == 1, punch


def test_a_failed_punch_says_what_its_syns_met_and_how_long_it_waited(net: Net) -> None:
    """Endpoint-dependent NATs that reset: our SYN leaves from a port their router has
    not seen, so every one is reset, to the end. The line says so, and the wait it names
    is the wait it had, not the timeout it was given nor a cause it did not see."""
    result, relayed = _fetch(net, "sym", 4200, str(FAILING_PUNCH_TIMEOUT))
    error = result["error"]
    assert "\n" not in error
    waited = float(re.search(r"failed after ([0-9.]+) s", error).group(1))  # type: ignore[union-attr]
    assert FAILING_PUNCH_TIMEOUT - 0.2 <= waited <= FAILING_PUNCH_TIMEOUT + 1.0
    assert "(the time allowed ran out)" in error
    assert re.search(r"\d+ SYNs? to 10\.77\.0\.\d+:4001: \d+ TCP resets?", error), error
    assert "refused our SYNs to the end" in error
    assert relayed < SIGNALLING_BYTES
