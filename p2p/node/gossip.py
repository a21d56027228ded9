"""The node's publish/subscribe router: gossipsub, with its limits set for the outer loop.

Why gossipsub and these settings
--------------------------------
1. A mesh, not a star: every subscriber keeps ``DEGREE`` (4-12) mesh peers per topic and
   relays what it hears to them, and gossips the IDs of recent messages (IHAVE) to the
   rest each heartbeat, so a peer that missed a message asks for it (IWANT). Killing any
   one node leaves the others connected through the mesh; no node is a hub.
2. py-libp2p 0.8.1's spam protection drops, silently apart from a log warning, every
   message past ``max_messages_per_topic_per_second`` (default 10) that one forwarding
   peer relays on one topic within a second, and lowers that peer's score. A forwarder
   relays everyone's messages, so its rate is the sum over the run's workers. The outer
   loop sends at most ``OUTER_BURST`` messages per worker at a round boundary (update,
   closure, state, milestone; announcements then back off exponentially), for at most
   ``MAX_RUN_WORKERS`` workers: the limit is their product, with a factor of two for
   re-publications that coincide. A faster sender than that is spam by this definition.
3. Heartbeats every ``HEARTBEAT_S`` second: the mesh is repaired (a dead peer replaced,
   a late subscriber grafted) and IHAVE gossip sent within a second, not the library's
   120 s. Adaptive gossip, which would stretch the heartbeat to 30-60 s when the network
   looks "unhealthy" (few peers, as in every small run), is off.
4. Eclipse protection wants mesh peers on at least 3 distinct IPs; on one machine (tests,
   ``blob outer run``) every peer shares 127.0.0.1, so it is off; on the internet the
   certificate-gated run membership, not IP diversity, is what keeps Sybils out.
5. A subscription is a bounded queue that py-libp2p also drops from silently when full
   (32 messages by default). It holds ``SUBSCRIPTION_QUEUE`` here: one second of messages
   at the spam limit, so a reader that stalls for a second (a worker's event loop while
   its torch thread holds the GIL) loses nothing a legitimate run sends. (The sender's
   per-peer queue holds 32 RPCs and drains whenever the publisher yields; the outer loop
   never publishes more than ``OUTER_BURST`` at once.)
"""

from __future__ import annotations

from typing import Any

# Mesh degree and bounds: the libp2p gossipsub spec's defaults (D=6, D_lo=4, D_hi=12).
DEGREE = 6
DEGREE_LOW = 4
DEGREE_HIGH = 12
# The most workers one outer-loop run admits (training.outer.launch bounds --workers by it).
MAX_RUN_WORKERS = 64
# Messages one worker publishes at a round boundary before its back-off starts.
OUTER_BURST = 4
# Per forwarding peer, per topic, per second (point 2 of the module docstring).
MAX_MESSAGES_PER_TOPIC_PER_SECOND = 2 * MAX_RUN_WORKERS * OUTER_BURST
# Seconds between mesh heartbeats (point 3); an int, as py-libp2p requires.
HEARTBEAT_S = 1
# Messages a subscription buffers before dropping (point 5).
SUBSCRIPTION_QUEUE = MAX_MESSAGES_PER_TOPIC_PER_SECOND
# Recent message IDs gossiped per heartbeat: a peer that missed a message within the last
# GOSSIP_WINDOW heartbeats still asks for it.
GOSSIP_WINDOW = 3
GOSSIP_HISTORY = 5


def router_settings() -> dict[str, Any]:
    """The gossipsub router's keyword arguments (tests check them against the limits)."""
    return {
        "degree": DEGREE,
        "degree_low": DEGREE_LOW,
        "degree_high": DEGREE_HIGH,
        "heartbeat_interval": HEARTBEAT_S,
        "heartbeat_initial_delay": 0.1,
        "gossip_window": GOSSIP_WINDOW,
        "gossip_history": GOSSIP_HISTORY,
        "spam_protection_enabled": True,
        "max_messages_per_topic_per_second": float(MAX_MESSAGES_PER_TOPIC_PER_SECOND),
        "adaptive_gossip_enabled": False,
        "eclipse_protection_enabled": False,
    }


def make_pubsub(host: Any) -> Any:
    """The pubsub service a node runs over ``host``: gossipsub, its router running as a
    child service of the pubsub (so the node's one service context starts and stops both).
    """
    # libp2p (seconds): training.outer.params imports this module's MAX_RUN_WORKERS on
    # `blob --help`; only a node that runs pubsub needs the router.
    from libp2p.pubsub import pubsub as pubsub_module
    from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
    from libp2p.pubsub.pubsub import Pubsub

    # py-libp2p reads this module constant when a topic is subscribed; no argument sets it.
    pubsub_module.SUBSCRIPTION_CHANNEL_SIZE = max(
        pubsub_module.SUBSCRIPTION_CHANNEL_SIZE, SUBSCRIPTION_QUEUE
    )

    router = GossipSub([PROTOCOL_ID_V11, PROTOCOL_ID], **router_settings())

    class _GossipPubsub(Pubsub):  # type: ignore[misc]
        async def run(self) -> None:
            self.manager.run_daemon_child_service(router)
            await super().run()

    return _GossipPubsub(host, router)
