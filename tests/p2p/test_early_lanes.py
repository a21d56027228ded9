"""A far provider's bulk lanes are dialled as soon as the first connection's TCP connect
shows the path is long: the fetcher knows the RTT a round trip before
that connection's Noise handshake ends, and the lanes, dialled then, are up a round trip
before the fetch would have dialled them itself. The fetch then waits for them and dials
no more.

Two real nodes over loopback; a stripe config for which every path counts as long."""

from __future__ import annotations

from pathlib import Path

import trio

from blobstore import Store
from p2p.fetch.striping import StripeConfig
from p2p.node.node import NodeConfig, open_node

CHUNK = 64 * 1024
# Loopback is far for this config: three lanes from any measured RTT.
FAR = StripeConfig(predial_rtt_s=0.0, predial_all_rtt_s=10.0, predial_connections=3)


async def test_lanes_are_dialled_beside_the_first_handshake_and_the_fetch_uses_them(
    tmp_path: Path,
) -> None:
    data = bytes(range(256)) * (2 * CHUNK // 256)  # 2 chunks: done before growth could act
    store = Store.open(tmp_path / "seed")
    blob_id = store.put_bytes(data, chunk_size=CHUNK)
    config = NodeConfig(dht=False, stripe=FAR)
    async with (
        open_node(store, dht=False) as seed,
        open_node(tmp_path / "early", config=config) as early,
        open_node(tmp_path / "fetching", config=config) as fetching,
        open_node(tmp_path / "plain", config=config) as plain,
    ):
        events: list[str] = []
        for node, name in ((early, "early"), (fetching, "fetching"), (plain, "plain")):
            original = node.connections.add_connection

            async def counting(peer: str, original: object = original, name: str = name) -> bool:
                events.append(f"{name} lane")
                if name == "fetching":
                    await trio.sleep(0.5)  # lanes still coming when the fetch starts
                return await original(peer)  # type: ignore[operator]

            node.connections.add_connection = counting  # type: ignore[method-assign]
        addr = str(seed.addrs[0])
        with trio.fail_after(30):
            peer = await early.connect(addr, lanes=True)
            events.append("connected")
            # Dialled before `connect` returned: while the first handshake was going on.
            assert events == ["early lane"] * 3 + ["connected"]
            await early.wait_lanes(peer)
            assert early.connection_count(peer) == 1 + 3

            # A fetch dials its provider with lanes, and while they are still coming it
            # waits for them instead of dialling its own.
            await fetching.fetch(blob_id, providers=[addr], announce=False)
            assert fetching.store.path(blob_id).read_bytes() == data
            await fetching.wait_lanes(peer)
            assert events.count("fetching lane") == 3
            assert fetching.connection_count(peer) == 1 + 3

            # A peer dialled for anything but a fetch gets no lanes.
            await plain.connect(addr)
            await trio.sleep(0.2)
            assert "plain lane" not in events
            assert plain.connection_count(peer) == 1
