"""A first chunk the seeder may decline (fewer round trips against swarming): a fetcher's first
request carries its manifest request and a `get` of chunk 0 together, a round trip before
the manifest could say what to ask. In a swarm each of N fetchers would so take chunk 0
from the seeder, the one chunk it then sends N times; so a swarming fetcher asks it as a
`try_get` (/blobnet/blob/1.5.0), which a seeder that others fetch from declines. The
decline is an `end` listing the chunk as missing, which says nothing about what the seeder
holds: the fetcher asks for that chunk later like any other."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import trio
from libp2p.peer.id import ID
from seeded import CHUNK, DATA, seeder_and_two_fetchers

from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.shell import BlobClient, open_optimistic

BLOB = "ef" * 32
SPAN = ((0, 1),)


# --- the wire ---------------------------------------------------------------------------


def test_a_try_get_is_its_own_message_on_1_5_and_unknown_before() -> None:
    client = proto.ClientConnection(
        messages.Version.V1_5, max_pipelined=messages.MAX_PIPELINED_REQUESTS
    )
    server = proto.ServerConnection(messages.Version.V1_5)
    frame = client.send_request(messages.GetRequest(BLOB, SPAN, tentative=True))
    assert msgpack.unpackb(frame[4:])["t"] == "try_get"
    server.receive_data(frame)
    asked = server.next_request()
    assert asked == messages.GetRequest(BLOB, SPAN, tentative=True)
    # Declined: `end` lists every requested chunk, and nothing was sent.
    client.receive_data(server.send_response(messages.End(server.unsent_indices())))
    assert client.next_event() == messages.End((0,))
    assert server.counts_fellows  # 1.5.0 keeps 1.4.0's count in `status`

    # A 1.4.0 server does not know the message: the client broke the protocol.
    old = proto.ServerConnection(messages.Version.V1_4)
    old.receive_data(frame)
    with pytest.raises(messages.RemoteProtocolError, match="unknown message type 'try_get'"):
        old.next_request()
    # ... and our client does not send it there.
    with pytest.raises(messages.LocalProtocolError, match=r"1\.5\.0"):
        proto.ClientConnection(messages.Version.V1_4).send_request(
            messages.GetRequest(BLOB, SPAN, tentative=True)
        )


def test_a_try_get_is_checked_like_a_get() -> None:
    server = proto.ServerConnection(messages.Version.V1_5)
    body = msgpack.packb(
        {"t": "try_get", "id": bytes.fromhex(BLOB), "r": [[2, 1]]}, use_bin_type=True
    )
    server.receive_data(len(body).to_bytes(4, "big") + body)
    with pytest.raises(messages.RemoteProtocolError, match="range"):
        server.next_request()


# --- what a seeder does -----------------------------------------------------------------


async def test_a_seeder_declines_a_try_get_while_others_fetch_from_it(tmp_path: Path) -> None:
    async with seeder_and_two_fetchers(tmp_path) as nodes:
        blob_id, seed, first, second = nodes.blob_id, nodes.seed, nodes.first, nodes.second
        with trio.fail_after(30):

            async def first_chunk(node: object, tentative: bool = True) -> object:
                """Ask chunk 0 as a fetch's first request does, manifest, then the get:
                the chunks that came, and what the answer called missing."""
                host = node.host  # type: ignore[attr-defined]
                peer = ID.from_base58(nodes.peer)
                stream = await open_optimistic(host, peer, messages.Version.V1_5.protocol_id)
                got: list[int] = []

                async def sink(index: int, body: memoryview) -> None:
                    assert bytes(body) == DATA[index * CHUNK : (index + 1) * CHUNK]
                    got.append(index)

                try:
                    client = BlobClient(stream, version=messages.Version.V1_5, pipelined=True)
                    await client.send_manifest(blob_id)
                    await client.send_get(blob_id, SPAN, tentative=tentative)
                    assert isinstance(await client.read_manifest(), bytes)
                    missing = await client.read_get(sink)
                finally:
                    await stream.reset()
                return got, missing

            assert await first_chunk(first) == ([0], ())  # alone with the seeder: sent
            assert seed.server.stats.tentative_declined == 0
            # The second fetcher asked about the blob too: now each is declined, and the
            # decline reads as nothing missing (the seeder holds chunk 0 all the same).
            assert await first_chunk(second) == ([], ())
            assert await first_chunk(first) == ([], ())
            assert seed.server.stats.tentative_declined == 2
            # A plain `get` is served whoever else fetches.
            assert await first_chunk(first, tentative=False) == ([0], ())
            assert seed.server.stats.tentative_declined == 2
