"""Discovery over the Kademlia DHT between real node processes on 127.0.0.1."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from blobstore import Store

from .conftest import Cluster, blob_cmd, last_json, random_file

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(300)]

FETCH_TIMEOUT = 180.0


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

    # A blob put beside a running node is provided without a restart: the node finds it
    # in its store within p2p.node.providing.NEW_BLOB_POLL. Two fresh nodes fetch at once: one the
    # blob n3 held from the start, one the new blob, searching the DHT until n5 provides it.
    later = random_file(tmp_path / "later.bin", 1024 * 1024, seed=2)
    later_id = cluster.put_here("n5", later)
    fetches = [
        ("fresh", blob_id, ()),
        ("fresh2", later_id, ("--discovery-timeout", "40")),
    ]
    procs = [
        subprocess.Popen(
            blob_cmd(cluster.store(name), cluster.key(name), "get", ref, "--json",
                     "--bootstrap", boot.addr, *extra),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, ref, extra in fetches
    ]  # fmt: skip
    try:
        outs = [proc.communicate(timeout=FETCH_TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    results: list[Any] = []
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err
        results.append(last_json(out))

    assert results[0]["id"] == blob_id
    assert results[0]["peers"][n3.peer_id]["bytes"] == source.stat().st_size
    assert Store.open(cluster.store("fresh")).path(blob_id).read_bytes() == source.read_bytes()
    assert results[1]["id"] == later_id
    assert results[1]["peers"][n5.peer_id]["bytes"] == later.stat().st_size
    assert Store.open(cluster.store("fresh2")).path(later_id).read_bytes() == later.read_bytes()
