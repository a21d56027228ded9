"""The node's publish/subscribe router: built here so the outer loop can tune it in one place."""

from __future__ import annotations

from typing import Any


def make_pubsub(host: Any) -> Any:
    """The pubsub service a node runs over ``host``."""
    from libp2p.pubsub.floodsub import PROTOCOL_ID as FLOODSUB_ID
    from libp2p.pubsub.floodsub import FloodSub
    from libp2p.pubsub.pubsub import Pubsub

    return Pubsub(host, FloodSub([FLOODSUB_ID]))
