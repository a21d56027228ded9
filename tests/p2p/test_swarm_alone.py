"""A seeder says who else fetches from it: /blobnet/blob/1.4.0's
`status` answer counts the other peers that asked the server about the blob lately. A
fetcher its seeder calls alone, knowing no fellow, drops the swarm's opening caps there: they
would cost a lone fetch across a continent a quarter of its rate. Until the seeder has
said so twice, it is owed at most an eighth of the blob (the first of fetchers started
together hears "alone" once). The first answer that counts anyone puts the caps back, and
so does the first fellow the fetcher learns of."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from libp2p.peer.id import ID
from seeded import seeder_and_two_fetchers

from blobstore import Manifest, Store
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.shell import BlobClient, StreamLost, open_optimistic
from p2p.blob.swarm import FELLOW_WINDOW, SwarmBook
from p2p.fetch.download_parts import ALONE_ANSWERS, Changes
from p2p.fetch.download_probes import _CountProbe
from p2p.fetch.download_watch import ProviderWatch
from p2p.fetch.sched_records import ALONE_ONCE_SHARE, SchedulerConfig, bitmap_of
from p2p.fetch.scheduler import Scheduler
from p2p.node.node import open_node

BLOB = "ef" * 32
SWARM = SchedulerConfig(
    max_chunks_per_request=4,
    defer_to_partial_holders=True,
    unmeasured_batch_bytes=2,
    max_request_seconds=0.25,
)


# --- the wire ---------------------------------------------------------------------------


def test_a_1_4_status_answer_carries_the_count_and_1_3_does_not() -> None:
    client = proto.ClientConnection(messages.Version.V1_4)
    server = proto.ServerConnection(messages.Version.V1_4)
    assert server.counts_fellows
    server.receive_data(client.send_request(messages.StatusRequest(BLOB)))
    assert server.next_request() == messages.StatusRequest(BLOB)
    with pytest.raises(messages.LocalProtocolError, match=r"1\.4\.0"):
        server.send_response(messages.StatusResponse(10, bytes(2), bytes(2)))  # no count
    answer = messages.StatusResponse(10, b"\x05\x02", b"\x02\x00", fellows=3)
    client.receive_data(server.send_response(answer))
    assert client.next_event() == answer
    # The same answer on a 1.3.0 stream is refused before it leaves.
    old = proto.ServerConnection(messages.Version.V1_3)
    old.receive_data(
        proto.ClientConnection(messages.Version.V1_3).send_request(messages.StatusRequest(BLOB))
    )
    old.next_request()
    assert not old.counts_fellows
    with pytest.raises(messages.LocalProtocolError, match=r"1\.4\.0"):
        old.send_response(answer)


@pytest.mark.parametrize(
    ("fellows_stream", "fields", "why"),
    [
        (True, {}, "missing keys"),  # a 1.4.0 answer without its count
        (False, {"f": 0}, "unexpected keys"),  # a 1.3.0 answer with one
        (True, {"f": -1}, "out of range"),
        (True, {"f": messages.MAX_FELLOWS_COUNTED + 1}, "out of range"),
        (True, {"f": True}, "must be an integer"),
    ],
)
def test_a_count_that_breaks_the_rules_is_the_servers_fault(
    fellows_stream: bool, fields: dict[str, object], why: str
) -> None:
    client = proto.ClientConnection(
        messages.Version.V1_4 if fellows_stream else messages.Version.V1_3
    )
    client.send_request(messages.StatusRequest(BLOB))
    body = msgpack.packb(
        {"t": "status", "n": 10, "bits": bytes(2), "soon": bytes(2), **fields}, use_bin_type=True
    )
    client.receive_data(len(body).to_bytes(4, "big") + body)
    with pytest.raises(messages.RemoteProtocolError, match=why):
        client.next_event()


# --- what a server counts ---------------------------------------------------------------


def test_the_count_is_the_other_peers_seen_within_the_window() -> None:
    book = SwarmBook()
    book.seen(BLOB, "old", 0.0)
    book.seen(BLOB, "a", 5.0)
    book.seen(BLOB, "b", 8.0)
    book.seen("00" * 32, "c", 9.0)  # another blob
    assert book.fellows(BLOB, 9.0, "a", FELLOW_WINDOW) == 2  # old and b, not the asker
    assert book.fellows(BLOB, 12.0, "a", FELLOW_WINDOW) == 1  # old is past the window
    assert book.fellows(BLOB, 30.0, "a", FELLOW_WINDOW) == 0
    assert book.fellows("11" * 32, 9.0, "a", FELLOW_WINDOW) == 0
    gone = {"b"}  # b ended its fetch and hung up
    assert book.fellows(BLOB, 9.0, "a", FELLOW_WINDOW, lambda peer: peer not in gone) == 1


async def test_a_seeder_counts_the_askers_fellows_on_1_4_and_says_nothing_on_1_3(
    tmp_path: Path,
) -> None:
    async with seeder_and_two_fetchers(tmp_path) as nodes:
        blob_id, first, second, peer = nodes.blob_id, nodes.first, nodes.second, nodes.peer
        with trio.fail_after(30):

            async def ask(node: object, protocol_id: str, fellows: bool = False) -> object:
                host = node.host  # type: ignore[attr-defined]
                stream = await open_optimistic(host, ID.from_base58(peer), protocol_id)
                try:
                    client = BlobClient(
                        stream,
                        version=(messages.Version.V1_4 if fellows else messages.Version.V1_3),
                    )
                    return await client.status(blob_id)
                finally:
                    await stream.reset()

            full = bitmap_of(range(4), 4)
            alone = await ask(first, messages.Version.V1_4.protocol_id, fellows=True)
            assert alone == messages.StatusResponse(4, full, bytes(1), fellows=0)
            await ask(second, messages.Version.V1_3.protocol_id)  # a fellow asks, on any version
            assert await ask(first, messages.Version.V1_4.protocol_id, fellows=True) == (
                messages.StatusResponse(4, full, bytes(1), fellows=1)
            )
            assert await ask(first, messages.Version.V1_3.protocol_id) == messages.StatusResponse(
                4, full, bytes(1)
            )
            # The fellow's fetch ends and it hangs up: the seeder no longer counts it.
            await second.host.disconnect(ID.from_base58(peer))
            for _ in range(100):
                reply = await ask(first, messages.Version.V1_4.protocol_id, fellows=True)
                if isinstance(reply, messages.StatusResponse) and reply.fellows == 0:
                    break
                await trio.sleep(0.05)
            assert reply == messages.StatusResponse(4, full, bytes(1), fellows=0)


# --- what a fetcher does with it --------------------------------------------------------


def _live(s: Scheduler, peer: str) -> list[int]:
    """Chunk counts of the requests `peer` is given now, until the scheduler says no."""
    sizes = []
    while (ticket := s.next_request(peer, 0.0)) is not None:
        sizes.append(len(ticket.indices))
    return sizes


def test_a_seeder_alone_with_us_gets_full_requests_on_every_connection() -> None:
    capped = Scheduler(256, lambda i: 1, config=SWARM)
    capped.add_peer("seed", 0.0)
    capped.set_connections("seed", 4)
    assert _live(capped, "seed") == [2, 2]  # the opening caps: two requests of two chunks

    lone = Scheduler(256, lambda i: 1, config=SWARM)
    lone.add_peer("seed", 0.0)
    lone.set_connections("seed", 4)
    lone.set_alone("seed", True)
    assert _live(lone, "seed") == [4] * 6  # 1.5 requests per connection, full batches
    lone._check_invariants()


def test_a_seeder_that_said_alone_once_is_owed_at_most_an_eighth_of_the_blob() -> None:
    # Three fetchers started together: the first to ask hears "nobody else" and is not
    # alone. On that one answer it is owed at most an eighth of the blob, spread over its
    # connections (two full batches left six of eight lanes idle across an ocean); on
    # the second (0.5 s later, p2p.fetch.download_parts.ALONE_ANSWERS) the requests are full ones.
    s = Scheduler(64, lambda i: 1, config=SWARM)
    s.add_peer("seed", 0.0)
    s.set_connections("seed", 4)
    s.set_alone("seed", True, once=True)
    assert _live(s, "seed") == [2, 2, 2, 2]  # 64 / ALONE_ONCE_SHARE chunks in all
    assert 64 // ALONE_ONCE_SHARE == 8
    s.set_alone("seed", True)
    assert _live(s, "seed") == [4, 4]  # full batches: six live requests now, as alone
    s._check_invariants()


def test_the_caps_come_back_with_a_fellow_or_a_count() -> None:
    s = Scheduler(256, lambda i: 1, config=SWARM)
    s.add_peer("seed", 0.0)
    s.set_connections("seed", 4)
    s.set_alone("seed", True)
    assert s.inflight_limit("seed") == 6
    # Peer exchange found a fellow fetcher: the seeder is not ours alone, whatever it said.
    s.add_peer("fellow", 0.0, bitmap_of([0, 1], 256))
    assert s.inflight_limit("seed") == 2
    s.remove_peer("fellow", "gone")
    assert s.inflight_limit("seed") == 6
    s.set_alone("seed", False)  # the seeder's next answer counted someone
    assert s.inflight_limit("seed") == 2


def test_a_shared_seeder_holds_what_its_rate_and_path_need_whatever_its_connections() -> None:
    """A seeder that others fetch from too gets requests for what its measured rate and
    RTT hold, not one or two per striped connection: each request queued at a slow uplink
    is seconds its other fetchers wait behind, and chunks they may take from it again
    (three fetchers of 32 MiB from a 100 Mbit/s seeder striped four ways, two pipelined
    requests each: it sent 1.45-2.29x the blob, median 1.86; 1.38-1.62 with this)."""
    for depth in (1, 2):
        s = Scheduler(256, lambda i: 1, config=SWARM)
        s.add_peer("seed", 0.0)
        s.set_connections("seed", 4, depth=depth)
        s.add_peer("fellow", 0.0, bitmap_of([0, 1], 256))
        s.on_rtt("seed", 0.1)
        ticket = s.next_request("seed", 0.0)
        assert ticket is not None
        s.on_chunk(ticket.request_id, min(ticket.indices), 1, 1.0)  # measured: 1 chunk/s
        assert s.inflight_limit("seed") == SWARM.min_inflight_requests_per_peer == 2
        s.set_alone("seed", True)
        s.remove_peer("fellow", "gone")  # ours alone again: every connection gets its share
        assert s.inflight_limit("seed") == (6 if depth == 1 else 8)


async def test_an_old_seeder_keeps_the_caps(tmp_path: Path) -> None:
    """A server before 1.4.0 refuses the proposal: the fetcher learns nothing and the
    caps stay (the stream fails at its first answer; nothing else does)."""
    chunk = 64 * 1024
    data = bytes(4 * chunk)
    store = Store.open(tmp_path / "seed")
    store.put_bytes(data, chunk_size=chunk)
    async with (
        open_node(store, dht=False) as seed,
        open_node(tmp_path / "asker", dht=False) as asker,
    ):
        seed.host.remove_stream_handler(messages.Version.V1_4.protocol_id)
        with trio.fail_after(30):
            peer = await asker.connect(seed.addrs[0])
            stream = await open_optimistic(
                asker.host, ID.from_base58(peer), messages.Version.V1_4.protocol_id
            )
            with pytest.raises(StreamLost):
                await BlobClient(stream, version=messages.Version.V1_4).status(
                    Manifest.of_bytes(data, chunk).blob_id
                )


class _Seeder:
    """A seeder's status stream that answers the fetcher counts given, one per ask."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts
        self.stream = self
        self.asked = 0

    async def status(self, blob_id: str) -> messages.StatusResponse:
        await trio.lowlevel.checkpoint()
        self.asked += 1
        return messages.StatusResponse(4, bytes([15]), bytes(1), fellows=self.counts.pop(0))

    async def reset(self) -> None:
        await trio.lowlevel.checkpoint()


class _Probes:
    def __init__(self, client: _Seeder) -> None:
        self.client = client

    async def take_count(self, peer: str) -> Any:
        await trio.lowlevel.checkpoint()
        return _CountProbe(client=self.client, status=await self.client.status(BLOB))


def test_a_fetcher_takes_alone_from_two_answers_and_a_count_ends_it() -> None:
    # The downloader's side of the rule: the first "nobody" frees the caps within a share
    # of the blob, the second frees them, and the first answer counting anyone ends it.
    seeder = _Seeder([0, 0, 0, 2])
    calls: list[tuple[bool, bool]] = []

    class Recorder:
        done = False

        def set_alone(self, peer: str, alone: bool, *, once: bool = False) -> None:
            calls.append((alone, once))

        def still_used(self, peer: str) -> bool:
            return True

    watch = ProviderWatch(
        network=None,  # type: ignore[arg-type]  # the count probe brings the stream
        blob_id=BLOB,
        num_chunks=4,
        chunk_length=lambda index: 1,
        scheduler=Recorder(),  # type: ignore[arg-type]
        changes=Changes(),
        probes=_Probes(seeder),  # type: ignore[arg-type]
    )
    trio.run(watch.watch_alone, "seed", clock=trio.testing.MockClock(autojump_threshold=0))
    assert calls == [(True, True), (True, False), (False, False)]
    assert seeder.asked == 4 and ALONE_ANSWERS == 2
