"""Peers behind NAT on the testbed: a public relay, providers and fetchers
behind endpoint-independent (EIM) and symmetric NATs, 80 ms RTT between any two hosts.

The story: a NATed provider reserves a slot on the relay and is reachable only at its
circuit address. A fetcher reaches it through the relay, the two hole-punch (DCUtR), the
relayed connection is closed and the blob crosses the direct connection: the relay's own
byte counter and the testbed's per-host counters both show the blob never touched the
relay. Behind symmetric NATs the punch fails; the fetch says so in one line and takes the
blob from another provider, or, with none, fails with that line (a relay with signalling
limits is not used for the blob even when the user allows relayed fetches)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from bench.wan import Host, Testbed
from bench.wan.natnodes import Agent, MiB, NatNodes

pytestmark = [pytest.mark.usefixtures("nat_capable"), pytest.mark.slow, pytest.mark.timeout(120)]

SIZE = 16 * MiB
SEED = 7
# What a relayed connection carries besides the blob: Noise + yamux set-up, identify
# both ways, DCUtR's messages. Measured ~2.6 KB; a single blob chunk is 1 MiB.
SIGNALLING_BYTES = 64 * 1024
# A failing punch (symmetric NAT) waits out its whole timeout: short enough to keep those
# tests quick, four times what an EIM punch takes at 80 ms RTT (about one second,
# measured by bench/wan_nat.py). A punch that succeeds ends when the direct connection
# is up, so the EIM tests give DCUtR its full worst case (25 s) and cost nothing more:
# on a loaded machine an EIM punch past 4 s is slow, not broken.
FAILING_PUNCH_TIMEOUT = "4"
PUNCH_TIMEOUT = "30"


class Net(NamedTuple):
    tb: Testbed
    nat: NatNodes
    agents: dict[str, Agent]  # the relay; providers home (EIM), office (symmetric), pub


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    from bench.wan import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(str(unavailable_reason()))
    # This module-scoped fixture is set up before the function-scoped nat_capable.
    if shutil.which("nft") is None:
        pytest.skip("NAT hosts need the `nft` command (Debian package nftables)")
    hosts = {
        "relay": Host(delay_ms=20.0),
        "pub": Host(delay_ms=20.0),
        "uni": Host(delay_ms=20.0),
        "home": Host(delay_ms=20.0, nat="eim"),
        "cafe": Host(delay_ms=20.0, nat="eim"),
        "office": Host(delay_ms=20.0, nat="symmetric"),
        "shop": Host(delay_ms=20.0, nat="symmetric"),
        "lab": Host(delay_ms=20.0, nat="eim"),  # a provider that announces on the DHT
        "dorm": Host(delay_ms=20.0),  # a public fetcher that asks the DHT
    }
    with Testbed(hosts) as tb:
        nat = NatNodes(tb, logs=tmp_path_factory.mktemp("natlogs"))
        relay = nat.relay("relay", "--dht")
        dht = ["--dht", "--bootstrap", nat.relay_addr(relay)]
        started = nat.providers(
            ["home", "office", "pub", "lab"], relay=relay, size=SIZE, seed=SEED, extra={"lab": dht}
        )
        agents = {"relay": relay, **{agent.host: agent for agent in started}}
        assert agents["home"].blob == agents["office"].blob == agents["pub"].blob
        try:
            yield Net(tb, nat, agents)
        finally:
            nat.stop()


def _sent(tb: Testbed) -> dict[str, int]:
    return {name: int(h["sent_bytes"]) for name, h in tb.stats()["hosts"].items()}


def _fetch(
    net: Net, host: str, providers: list[str], *extra: str, punch_timeout: str = PUNCH_TIMEOUT
) -> tuple[dict[str, Any], int, dict[str, int]]:
    """Run one fetch; its result, the bytes the relay carried meanwhile, and the bytes
    each host sent meanwhile."""
    tb, nat, agents = net
    relay = agents["relay"]
    relayed = nat.relay_stats(relay)["relayed_bytes"]
    sent = _sent(tb)
    result = nat.fetch(host, agents["home"].blob, providers, "--timeout", punch_timeout, *extra)
    after = _sent(tb)
    return (
        result,
        nat.relay_stats(relay)["relayed_bytes"] - relayed,
        {name: after[name] - sent[name] for name in after},
    )


def test_a_node_learns_whether_it_is_reachable_and_natted_ones_advertise_circuits(
    net: Net,
) -> None:
    """The relay dials each node back on a fresh connection: the NATs drop that SYN, so
    home and office learn they are private, reserve, and hand out only their circuit
    address (short tickets); pub is public and hands out its own address."""
    home, office, pub = (net.agents[name] for name in ("home", "office", "pub"))
    for natted in (home, office):
        assert natted.ready["public"] is False, natted.ready["detail"]
        [circuit] = natted.circuit_addrs
        assert circuit.endswith(f"/p2p-circuit/p2p/{natted.peer_id}")
        assert natted.ready["addrs"] == [circuit]
        assert circuit in natted.ready["node_addrs"]  # identify and DHT records name it
    assert pub.ready["public"] is True, pub.ready["detail"]
    assert pub.circuit_addrs == []
    assert pub.ready["addrs"] == [net.nat.direct_addr(pub)]


def test_two_eim_natted_peers_fetch_directly_after_hole_punching(net: Net) -> None:
    home = net.agents["home"]
    result, relayed, sent = _fetch(net, "cafe", home.circuit_addrs)
    assert "error" not in result, result
    [punch] = result["punches"]
    assert punch["path"] == "direct", punch
    assert result["bytes"] == SIZE
    # The blob crossed the direct connection: the relay carried signalling only, and sent
    # next to nothing while home's uplink carried the whole blob.
    assert relayed < SIGNALLING_BYTES
    assert sent["relay"] < SIGNALLING_BYTES
    assert sent["home"] >= SIZE


def test_a_public_peer_fetches_from_a_natted_provider(net: Net) -> None:
    result, relayed, sent = _fetch(net, "uni", net.agents["home"].circuit_addrs)
    assert "error" not in result, result
    assert result["punches"][0]["path"] == "direct"
    assert result["bytes"] == SIZE
    assert relayed < SIGNALLING_BYTES
    assert sent["home"] >= SIZE


def test_a_natted_provider_found_through_the_dht_is_fetched_from_directly(net: Net) -> None:
    """lab announces the blob on the DHT (bootstrapped from the relay) with its circuit
    address; dorm, given no provider at all, finds it there and hole-punches to it."""
    lab = net.agents["lab"]
    assert lab.ready["public"] is False
    relay = net.agents["relay"]
    result, relayed, sent = _fetch(
        net, "dorm", [], "--dht", "--bootstrap", net.nat.relay_addr(relay), "--discover"
    )
    assert "error" not in result, result
    [punch] = result["punches"]
    assert punch["peer"] == lab.peer_id and punch["path"] == "direct", punch
    assert result["bytes"] == SIZE
    assert sent["lab"] >= SIZE
    assert relayed < SIGNALLING_BYTES


def test_symmetric_nat_pair_fails_over_to_another_provider_with_a_one_line_reason(
    net: Net,
) -> None:
    office = net.agents["office"]
    result, relayed, sent = _fetch(
        net,
        "shop",
        [*office.circuit_addrs, net.nat.direct_addr(net.agents["pub"])],
        punch_timeout=FAILING_PUNCH_TIMEOUT,
    )
    assert "error" not in result, result
    [punch] = result["punches"]
    assert punch["path"] == "failed"
    assert "hole punching" in punch["reason"] and "\n" not in punch["reason"]
    assert result["bytes"] == SIZE
    # The blob came from pub, not through the relay and not from office.
    assert sent["pub"] >= SIZE
    assert sent["office"] < SIGNALLING_BYTES
    assert relayed < SIGNALLING_BYTES


def test_symmetric_nat_pair_with_no_other_provider_fails_in_one_line_even_if_relaying_is_allowed(
    net: Net,
) -> None:
    """The user allows fetching through a relay, but this relay keeps the default
    signalling limits: the fetch fails at once, in one line saying both why the punch
    failed and why the relay cannot carry the blob, instead of being cut mid-blob."""
    result, relayed, _ = _fetch(
        net,
        "shop",
        net.agents["office"].circuit_addrs,
        "--allow-relayed",
        punch_timeout=FAILING_PUNCH_TIMEOUT,
    )
    error = result["error"]
    assert "hole punching" in error and "cuts circuits at 524288 bytes" in error
    assert "\n" not in error
    assert relayed < SIGNALLING_BYTES
