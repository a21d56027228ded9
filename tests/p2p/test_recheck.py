"""A server hashes again the chunks a peer dropped the stream over (p2p.blob.recheck,
p2p.blob.server theory rule 6).

Regression: a server whose stored chunk rotted after it first hashed it kept serving it
from the page cache, unhashed, and logged nothing while every fetcher banned it. The
sans-IO tests hold the budget a lying peer could spend; the in-process one shows a peer
that resets streams after good chunks gets them hashed again and nothing quarantined; the
last test rots a chunk under a real `blob serve` process and fetches it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import Cluster, random_file, run_blob, wait_until
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from blobstore import Store
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.recheck import Rechecks, Sent
from p2p.blob.server import BlobServer
from p2p.transport.host import build_host

MiB = 1024 * 1024


def sent(blob: str, indices: range, at: float, length: int = MiB) -> list[Sent]:
    return [Sent(blob, i, length, at) for i in indices]


def test_only_the_last_chunks_sent_just_before_the_reset_are_checked() -> None:
    rechecks = Rechecks(window=5.0, per_stream=2, rate=MiB, burst=10 * MiB)
    chunks = [*sent("a", range(3), at=0.0), *sent("a", range(3, 6), at=8.0)]
    due = rechecks.due(chunks, now=10.0)
    assert [c.index for c in due] == [5, 4]  # newest first, within the window, 2 at most


def test_a_peer_resetting_every_stream_gets_only_the_byte_budget_hashed() -> None:
    """1,000 resets a second, each after 4 new chunks: what is hashed stays within the
    burst plus the rate times the time, however many chunks the peer is sent."""
    rechecks = Rechecks(rate=4 * MiB, burst=8 * MiB)
    hashed = 0
    for n in range(10_000):
        now = n / 1000
        hashed += sum(c.length for c in rechecks.due(sent("a", range(4 * n, 4 * n + 4), now), now))
    assert hashed <= 8 * MiB + 4 * MiB * 10
    assert rechecks.skipped > 30_000


async def test_a_peer_resetting_after_good_chunks_quarantines_nothing(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "store")
    blob_id = store.put_bytes(os.urandom(4 * 64 * 1024), chunk_size=64 * 1024)
    server = BlobServer(store)
    host = build_host(create_new_key_pair(), fast=False)
    server.install(host)
    liar = build_host(create_new_key_pair(), fast=False)
    listen = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
    async with host.run(listen_addrs=listen), liar.run(listen_addrs=listen):
        addr = Multiaddr(f"{host.get_addrs()[0]}/p2p/{host.get_id()}")
        await liar.connect(info_from_p2p_addr(addr))
        for _ in range(3):
            stream = await liar.new_stream(
                host.get_id(), [TProtocol(messages.Version.V1_0.protocol_id)]
            )
            conn = proto.ClientConnection()
            await stream.write(conn.send_request(messages.GetRequest(blob_id, ((0, 4),))))
            with trio.fail_after(20):
                while not isinstance(conn.next_event(), messages.End):
                    conn.receive_data(await stream.read(65536))
            await stream.reset()  # "that chunk was bad", four times over
        with trio.fail_after(20):
            while server.stats.rechecked < 4:  # noqa: ASYNC110 - the server's own counter
                await trio.sleep(0.05)
        assert server.stats.quarantined == 0
        assert store.has(blob_id)


async def read_every_chunk(addr: str, blob_id: str, chunks: int) -> None:
    """One `get` of every chunk of ``blob_id`` from the node at ``addr``, read to its end."""
    host = build_host(create_new_key_pair(), fast=False)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        info = info_from_p2p_addr(Multiaddr(addr))
        await host.connect(info)
        stream = await host.new_stream(info.peer_id, [TProtocol(messages.Version.V1_0.protocol_id)])
        conn = proto.ClientConnection()
        await stream.write(conn.send_request(messages.GetRequest(blob_id, ((0, chunks),))))
        with trio.fail_after(30):
            while not isinstance(event := conn.next_event(), messages.End):
                if event is None:
                    conn.receive_data(await stream.read(1 << 20))
        assert event.missing == ()
        await stream.close()


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_chunk_rotten_after_it_was_hashed_gets_the_blob_quarantined(
    cluster: Cluster, tmp_path: Path
) -> None:
    source = random_file(tmp_path / "model.bin", 4 * MiB)
    blob_id = cluster.put_here("seed", source)
    seed = cluster.serve("seed", "-v")
    # A first reader has the server hash every chunk (first reads) and keep them cached.
    trio.run(read_every_chunk, seed.addr, blob_id, 4)
    data = Store.open(cluster.store("seed")).path(blob_id)
    data.chmod(0o644)
    with data.open("r+b") as f:  # through the page cache, as a later read sees it
        f.seek(2 * MiB + 100)
        f.write(b"\x00" * 64)
    done = run_blob(
        cluster.store("second"), cluster.key("second"), "get", blob_id, "--peer", seed.addr,
        "--discovery-timeout", "1", check=False,
    )  # fmt: skip
    assert done.returncode != 0, "the rotten chunk was not sent: nothing tested"
    # Either the get was sent the rotten chunk and banned the server for it (whose reset
    # made the server hash it again), or the first reader's own stream end had the server
    # hash its chunks again after the rot was written and the blob was gone already.
    banned = "banned for bad data" in done.stderr
    assert banned or f"holds {blob_id}" in done.stderr, done.stderr

    def said() -> Any:
        return "is damaged on disk and no longer served" in seed.log_path.read_text()

    assert wait_until(said, 20), seed.log_path.read_text()[-2000:]
    assert Store.open(cluster.store("seed")).quarantine_reason(blob_id) is not None
