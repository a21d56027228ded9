"""A worker's links (training.outer.worker.links), built without a worker: the hello re-sent
to a worker new to us, the pause that makes every missing peer due, never alone, and the
traffic counted per round."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from libp2p.peer.id import ID

from identity import Authority, MachineKey, SoftwareSigner, TrustStore
from p2p.transport.meter import WireMeter
from training.outer.announce import Announcer, PeerDialer
from training.outer.messages import Hello, Ledger, encode_message
from training.outer.params import OuterNetError
from training.outer.worker.links import PAUSE_GAP, Links
from training.outer.worker.signals import Changes

AUTHORITY = Authority(SoftwareSigner(MachineKey.generate()))
TRUST = TrustStore(frozenset({AUTHORITY.public_key_bytes}))
KC = "cpu-test"


class Node:
    """What Links asks of a node: its peer ID, publishing, and who is connected."""

    def __init__(self, peer: str) -> None:
        self.peer_id = peer
        self.sent: list[bytes] = []
        self.connected: list[str] = []

    async def publish(self, topic: str, data: bytes) -> None:
        self.sent.append(data)

    def connected_peers(self) -> list[str]:
        return list(self.connected)


def links_of(node: Node, dialer: PeerDialer | None = None, alone_bound: float = 30.0) -> Links:
    return Links(
        node,  # type: ignore[arg-type]
        "topic",
        Announcer(),
        dialer or PeerDialer(),
        WireMeter(),
        Changes(),
        alone_bound=alone_bound,
        label="test",
    )


def peer() -> str:
    return MachineKey.generate().peer_id


def hello(peer_id: str) -> bytes:
    now = int(time.time())
    cert = AUTHORITY.admit(
        peer_id,
        operator=peer_id[-6:],
        kernel_class=KC,
        not_before=0,
        not_after=now + 3600,
        serial=1,
    )
    return encode_message(Hello("run-1", cert.encode()))


def test_a_worker_new_to_us_is_sent_our_hello_at_once() -> None:
    """Our hello may have gone out before another worker subscribed, and its start barrier
    waits for it: the first message heard from a worker new to us re-sends our hello at
    once (not after the announcer's back-off); more from it do not, nor anything once a
    round has closed and the hello is dropped."""
    me, friend, other = peer(), peer(), peer()
    node = Node(me)
    links = links_of(node)
    ledger = Ledger("run-1", me, TRUST)
    mine = hello(me)
    links.announcer.set("hello", mine, 0.0)
    handled: list[Any] = []
    delivered = 0

    class Stop(Exception):
        pass

    def heard(*messages: tuple[str, bytes]) -> list[bytes]:
        nonlocal delivered
        delivered += sum(len(d) for _, d in messages)
        queue = [SimpleNamespace(from_id=ID.from_base58(p).to_bytes(), data=d) for p, d in messages]

        async def get() -> SimpleNamespace:
            if not queue:
                raise Stop
            return queue.pop(0)

        node.sent.clear()
        with pytest.raises(Stop):
            trio.run(links.receive_loop, SimpleNamespace(get=get), ledger, handled.extend)
        return list(node.sent)

    assert heard((friend, hello(friend)), (friend, hello(friend))) == [mine]
    assert heard((other, b"\x00garbage")) == []  # not admitted: not a worker
    assert heard((other, hello(other))) == [mine]
    assert ledger.present == {friend, other}
    links.announcer.drop("hello")
    ledger.present.clear()
    assert heard((friend, hello(friend))) == []
    assert links.pubsub_bytes[1] == delivered  # every payload delivered, counted once


def test_a_pause_makes_every_missing_peer_due_at_once() -> None:
    """The event loop stopped for longer than PAUSE_GAP (SIGSTOP, a laptop lid): every
    peer heard of is dialled again at once, not after its back-off; a short stop is not
    a pause."""
    dialer = PeerDialer(first=1.0, cap=600.0)
    links = links_of(Node(peer()), dialer)
    other = peer()
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def main() -> None:
        dialer.learn(other, ["/ip4/127.0.0.1/tcp/1"], trio.current_time())
        for _ in range(6):
            dialer.failed(other, trio.current_time())  # due again in 32 s
        async with trio.open_nursery() as nursery:
            nursery.start_soon(links.meter_loop)
            await trio.testing.wait_all_tasks_blocked()
            clock.jump(PAUSE_GAP / 2)  # a stall, not a pause
            await trio.sleep(1.0)
            assert dialer.due(trio.current_time(), []) == []
            clock.jump(PAUSE_GAP + 1)  # the loop did not run: a pause
            await trio.sleep(1.0)
            assert dialer.due(trio.current_time(), []) == [(other, ("/ip4/127.0.0.1/tcp/1",))]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


def test_a_worker_alone_waits_for_a_peer_then_stops() -> None:
    """Never alone: a worker that trained with others (applied an update of theirs) and is
    connected to none waits for one before it proposes, and stops with an error when
    none comes within its bound. Before it trained with anyone it is never alone."""
    me, other = peer(), peer()
    node = Node(me)
    dialer = PeerDialer()
    links = links_of(node, dialer, alone_bound=30.0)
    dialer.learn(other, ["/ip4/127.0.0.1/tcp/1"], 0.0)
    assert not links.alone()  # nobody's update applied: round 0
    links.admitted([me])
    assert not links.alone()
    links.admitted([other])
    assert links.alone()
    node.connected = [other]
    assert not links.alone()
    node.connected = []

    async def comes_back() -> bool:
        async with trio.open_nursery() as nursery:

            async def connect() -> None:
                await trio.sleep(10.0)
                node.connected = [other]

            nursery.start_soon(connect)
            waited = await links.waited_for_peers(3)
        return waited and trio.current_time() < 30.0

    assert trio.run(comes_back, clock=trio.testing.MockClock(autojump_threshold=0))
    assert trio.run(links.waited_for_peers, 3) is False  # not alone: no wait
    node.connected = []

    async def never() -> None:
        await links.waited_for_peers(4)

    with pytest.raises(OuterNetError, match="round 4: no worker of the run is reachable"):
        trio.run(never, clock=trio.testing.MockClock(autojump_threshold=0))


def test_traffic_is_counted_from_the_last_mark() -> None:
    """Each round's record counts the announcement bytes since the previous round's, and
    the run's start marks where counting begins."""
    node = Node(peer())
    links = links_of(node)

    async def main() -> None:
        await links.publish(b"x" * 10)
        links.mark()
        await links.announce("update", b"y" * 7)
        await links.announce("update", b"y" * 7)  # unchanged: not published again
        links.pubsub_bytes[1] += 5
        assert links.traffic()[2:] == (7, 5)
        assert links.traffic()[2:] == (0, 0)

    trio.run(main)
    assert node.sent == [b"x" * 10, b"y" * 7]
