"""Every py-libp2p attribute blobnet patches is still there (p2p.transport.patches, rule 2).

A py-libp2p that renames one fails here, by name, rather than leaving a host that runs
unpatched: the leak of resource-manager slots, the inbound handler that never gives a
slot back, or streams piled on one connection would come back silently.
"""

from __future__ import annotations

from typing import Any

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p.transport import patches
from p2p.transport.host import build_host


def instances() -> list[Any]:
    from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

    host = build_host(create_new_key_pair(), fast=False)
    network = host.get_network()
    kad = KadDHT(host, DHTMode.SERVER)
    dcutr = DCUtRProtocol(host)
    return [host, network, patches.resource_manager(network), kad, kad.provider_store, dcutr]


@pytest.mark.parametrize(
    ("owner", "name"),
    [(owner, name) for owner, name, _ in patches.TARGETS],
    ids=[f"{owner.__name__}.{name}" for owner, name, _ in patches.TARGETS],
)
def test_patched_attribute_exists(owner: type, name: str) -> None:
    (instance,) = [obj for obj in instances() if isinstance(obj, owner)]
    assert hasattr(instance, name), f"py-libp2p's {owner.__name__} lost {name}"


def test_every_target_says_why() -> None:
    for _, _, reason in patches.TARGETS:
        assert len(reason) > 20


def test_a_missing_attribute_fails_loudly() -> None:
    class NoManager:
        pass

    with pytest.raises(patches.PatchTargetMissing, match="_resource_manager"):
        patches.release_scopes_of_failed_upgrades(NoManager())
    with pytest.raises(patches.PatchTargetMissing, match="_handle_inbound_connection"):
        patches.route_inbound(NoManager(), lambda conn, maddr: None)


async def test_a_running_dcutr_is_found_on_its_host_and_forgotten() -> None:
    """DCUtRProtocol registers itself on its host under ``patches.DCUTR_ATTRIBUTE``;
    p2p.nat.punch finds a running one there and p2p.nat.relay takes a stopped one off."""
    from multiaddr import Multiaddr

    from p2p.nat.relay import nat_services

    host = build_host(create_new_key_pair(), fast=False)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        async with nat_services(host) as dcutr:
            assert patches.running_dcutr(host) is dcutr
        assert patches.running_dcutr(host) is None
