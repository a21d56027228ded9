"""A node's fetches (p2p.node.fetching.Fetches), built from the parts it is given, without
a node: a name goes through the resolver it was handed; a rotten local copy is hashed,
quarantined and fetched again (rule 3); peer exchange's caps apply where the scheduler's
settings leave them open. One real blob server over loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from libp2p.crypto.secp256k1 import create_new_key_pair
from multiaddr import Multiaddr

from blobstore import Store
from identity import MachineKey
from p2p.blob.server import BlobServer
from p2p.blob.swarm import FetchingBoard
from p2p.fetch.sched_records import SchedulerConfig
from p2p.fetch.scores import PeerScores
from p2p.fetch.striping import StripeConfig
from p2p.metrics import Metrics
from p2p.node.connections import Connections
from p2p.node.fetching import (
    SWARM_REQUEST_SECONDS,
    SWARM_UNMEASURED_BATCH_BYTES,
    Fetches,
    FetchRecords,
    FetchSettings,
)
from p2p.node.providing import ProviderRecords
from p2p.transport.host import build_host

LOOPBACK = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
DATA = bytes(range(256)) * 1024  # 4 chunks of 64 KiB
CHUNK = 64 * 1024


def test_peer_exchange_caps_requests_where_the_scheduler_leaves_them_open() -> None:
    plain = FetchSettings(peer_exchange=False).scheduler_config()
    assert plain == SchedulerConfig()
    swarm = FetchSettings().scheduler_config()
    assert swarm.max_request_seconds == SWARM_REQUEST_SECONDS
    assert swarm.unmeasured_batch_bytes == SWARM_UNMEASURED_BATCH_BYTES
    assert swarm.defer_to_partial_holders
    own = FetchSettings(scheduler=SchedulerConfig(max_request_seconds=2.0)).scheduler_config()
    assert own.max_request_seconds == 2.0


class Resolver:
    """Names one blob for every name, and says which names it was asked."""

    def __init__(self, blob_id: str) -> None:
        self.blob_id = blob_id
        self.asked: list[str] = []

    async def __call__(self, ref: str) -> str:
        self.asked.append(ref)
        return self.blob_id


@asynccontextmanager
async def fetches_from_a_seeder(
    tmp_path: Path, resolver: Resolver
) -> AsyncIterator[tuple[str, Fetches]]:
    """A blob server holding DATA, and Fetches on a bare host of their own."""
    seed_store = Store.open(tmp_path / "seed")
    seed_store.put_bytes(DATA, chunk_size=CHUNK)
    seeder = build_host(create_new_key_pair())
    BlobServer(seed_store).install(seeder)
    host = build_host(create_new_key_pair())
    store = Store.open(tmp_path / "fetcher")
    records = FetchRecords(Metrics())
    async with seeder.run(listen_addrs=LOOPBACK), host.run(listen_addrs=LOOPBACK):
        connections = Connections(host, None, stripe=StripeConfig())
        fetches = Fetches(
            store,
            connections,
            ProviderRecords(store, host, None, reprovide_interval=3600.0),
            records,
            settings=FetchSettings(discovery_timeout=2.0),
            scores=PeerScores(),
            board=FetchingBoard(),
            resolve_name=resolver,
        )
        yield f"{seeder.get_addrs()[0]}/p2p/{seeder.get_id()}", fetches


async def test_a_name_goes_to_the_resolver_and_its_blob_is_fetched(tmp_path: Path) -> None:
    blob_id = Store.open(tmp_path / "ids").put_bytes(DATA, chunk_size=CHUNK)
    resolver = Resolver(blob_id)
    publisher = MachineKey.generate().peer_id
    with trio.fail_after(60):
        async with fetches_from_a_seeder(tmp_path, resolver) as (addr, fetches):
            got = await fetches.fetch(f"{publisher}/weights", providers=[addr], announce=False)
    assert got == blob_id
    assert resolver.asked == [f"{publisher}/weights"]
    assert Store.open(tmp_path / "fetcher").path(blob_id).read_bytes() == DATA


async def test_a_rotten_local_copy_is_quarantined_and_fetched_again(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "fetcher")
    blob_id = store.put_bytes(DATA, chunk_size=CHUNK)
    path = store.path(blob_id)
    path.chmod(0o600)
    with path.open("r+b") as f:  # bit rot in the second chunk
        f.seek(CHUNK + 5)
        f.write(b"\xff")
    with trio.fail_after(60):
        async with fetches_from_a_seeder(tmp_path, Resolver(blob_id)) as (addr, fetches):
            await fetches.fetch(blob_id, providers=[addr], announce=False)
            metrics = fetches.records.metrics
    received = metrics.registry.get_sample_value(
        "blobnet_bytes_received_total", {"protocol": "blob"}
    )
    assert received == CHUNK  # the rotten chunk only: the good ones were kept
    assert store.verify(blob_id) == []
    assert store.path(blob_id).read_bytes() == DATA
