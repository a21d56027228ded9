"""Discovery over the Kademlia DHT between real node processes on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest

from blobstore import Store

from .conftest import Cluster, random_file

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(300)]


def test_node_without_peers_finds_provider_through_dht(cluster: Cluster, tmp_path: Path) -> None:
    source = random_file(tmp_path / "update.bin", 3 * 1024 * 1024 + 5)
    blob_id = cluster.put_here("n3", source)  # a local write: no process of its own needed
    boot = cluster.serve("boot", dht=True)
    # Six nodes bootstrapping to the boot node, started together (each start is an
    # interpreter start; nothing here depends on their order).
    nodes = [
        cluster.serve(f"n{i}", "--bootstrap", boot.addr, dht=True, wait=False) for i in range(6)
    ]
    for node in nodes:
        node.ready()
    n3, n5 = nodes[3], nodes[5]

    result = cluster.get("fresh", blob_id, "--bootstrap", boot.addr)
    assert result["id"] == blob_id
    assert result["peers"][n3.peer_id]["bytes"] == source.stat().st_size
    assert Store.open(cluster.store("fresh")).path(blob_id).read_bytes() == source.read_bytes()

    # A blob put beside a running node is provided without a restart (the node notices new
    # blobs in its store within its poll interval, p2p.node.NEW_BLOB_POLL).
    later = random_file(tmp_path / "later.bin", 1024 * 1024, seed=2)
    later_id = cluster.put_here("n5", later)
    result = cluster.get("fresh2", later_id, "--bootstrap", boot.addr, "--discovery-timeout", "40")
    assert result["peers"][n5.peer_id]["bytes"] == later.stat().st_size
