"""Announcements over floodsub between nodes in a star around one subscriber."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from p2p.node import open_node

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


async def test_message_reaches_every_subscriber_through_the_hub(tmp_path: Path) -> None:
    async with (
        open_node(tmp_path / "hub", dht=False, pubsub=True) as hub,
        open_node(tmp_path / "b", dht=False, pubsub=True, bootstrap=hub.addrs) as b,
        open_node(tmp_path / "c", dht=False, pubsub=True, bootstrap=hub.addrs) as c,
    ):
        subs = {name: await node.subscribe("run/1") for name, node in (("hub", hub), ("c", c))}
        await b.subscribe("run/1")
        got: dict[str, bytes] = {}
        with trio.fail_after(30):
            # Subscriptions propagate asynchronously: publish until both have heard it.
            while len(got) < 2:
                await b.publish("run/1", b"update 7 from b")
                with trio.move_on_after(0.5):
                    for name, sub in subs.items():
                        if name not in got:
                            got[name] = (await sub.get()).data
        assert got == {"hub": b"update 7 from b", "c": b"update 7 from b"}


async def test_node_without_pubsub_says_so(tmp_path: Path) -> None:
    async with open_node(tmp_path / "a", dht=False) as a:
        with pytest.raises(RuntimeError, match="pubsub"):
            await a.subscribe("x")
