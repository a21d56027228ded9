"""Announcements over gossipsub: a mesh that survives losing any one node, and a burst
above py-libp2p's default spam limit that still arrives whole."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel

from p2p.node import gossip
from p2p.node.node import open_node

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


async def _until_heard(sender: Any, topic: str, subs: dict[str, Any], data: bytes) -> set[str]:
    """Publish ``data`` until every subscription has heard it (subscriptions and the mesh
    form asynchronously); returns who heard it."""
    got: set[str] = set()
    with trio.move_on_after(30):
        while len(got) < len(subs):
            await sender.publish(topic, data)
            with trio.move_on_after(0.5):
                for name, sub in subs.items():
                    while name not in got:
                        if (await sub.get()).data == data:
                            got.add(name)
    return got


async def test_message_crosses_the_mesh_after_the_first_node_dies(tmp_path: Path) -> None:
    """The first node is what everyone bootstrapped to; with it gone, the others still hear
    each other, relayed through the mesh (a star around the hub, as floodsub makes it,
    would lose them)."""
    first_addrs: list[str] = []
    started, stop, stopped = trio.Event(), trio.Event(), trio.Event()

    async def first_node() -> None:
        async with open_node(tmp_path / "first", dht=False, pubsub=True) as first:
            await first.subscribe("run/1")
            first_addrs.extend(first.addrs)
            started.set()
            await stop.wait()
        stopped.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first_node)
        await started.wait()
        async with AsyncExitStack() as stack:
            b = await stack.enter_async_context(
                open_node(tmp_path / "b", dht=False, pubsub=True, bootstrap=first_addrs)
            )
            c = await stack.enter_async_context(
                open_node(
                    tmp_path / "c", dht=False, pubsub=True, bootstrap=[*first_addrs, *b.addrs]
                )
            )
            d = await stack.enter_async_context(
                open_node(
                    tmp_path / "d", dht=False, pubsub=True, bootstrap=[*first_addrs, *c.addrs]
                )
            )
            subs = {"c": await c.subscribe("run/1"), "d": await d.subscribe("run/1")}
            await b.subscribe("run/1")
            assert await _until_heard(b, "run/1", subs, b"before") == {"c", "d"}
            stop.set()
            await stopped.wait()
            # d is not connected to b: what it hears from b went through c.
            assert b.peer_id not in d.connected_peers()
            assert await _until_heard(b, "run/1", subs, b"after") == {"c", "d"}


async def test_a_burst_above_the_default_spam_limit_arrives_whole(tmp_path: Path) -> None:
    """100 messages in well under a second, read only after the last is sent: py-libp2p's
    default limit (10 per second per forwarding peer and topic) would drop 90 of them, and
    its default subscription queue (32) all but 32, both without an error."""
    assert gossip.MAX_MESSAGES_PER_TOPIC_PER_SECOND >= 100
    async with (
        open_node(tmp_path / "a", dht=False, pubsub=True) as a,
        open_node(tmp_path / "b", dht=False, pubsub=True, bootstrap=a.addrs) as b,
    ):
        sub = await b.subscribe("burst")
        await a.subscribe("burst")
        assert await _until_heard(a, "burst", {"b": sub}, b"ready") == {"b"}
        await trio.sleep(1.1)  # the warm-up's messages leave the one-second window
        sent = [f"m{i}".encode() for i in range(100)]
        t0 = trio.current_time()
        for data in sent:
            await a.publish("burst", data)
            await trio.lowlevel.checkpoint()  # the sender's per-peer queue (32) drains
        assert trio.current_time() - t0 < 1.0
        got: list[bytes] = []
        with trio.move_on_after(10):
            while len(got) < len(sent):
                data = (await sub.get()).data
                if data != b"ready":
                    got.append(data)
        assert got == sent


def test_router_settings_are_the_ones_documented() -> None:
    settings = gossip.router_settings()
    assert settings["spam_protection_enabled"] is True
    assert settings["max_messages_per_topic_per_second"] == 2 * 64 * 4
    assert settings["heartbeat_interval"] == 1
    assert settings["adaptive_gossip_enabled"] is False


async def test_node_without_pubsub_says_so(tmp_path: Path) -> None:
    async with open_node(tmp_path / "a", dht=False) as a:
        with pytest.raises(RuntimeError, match="pubsub"):
            await a.subscribe("x")
