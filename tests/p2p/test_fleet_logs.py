"""What an operator reads and what short-lived clients leave behind, with real processes
over 127.0.0.1: a `blob serve` with the DHT, several one-shot `blob get --bootstrap` runs
against it, then a BlockingNode fetch through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from p2p.daemon.client import connect

from .conftest import Cluster, random_file, run_blob, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

GETS = 3  # each a fresh peer ID; bench/short_lived_clients.py runs the goal's 50

BLOCKING_FETCH = """
import sys
from p2p import BlockingNode
with BlockingNode(
    sys.argv[1], listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[sys.argv[2]], dht_server=False
) as node:
    node.fetch(sys.argv[3])
"""


def test_short_lived_clients_leave_no_trace_and_transfers_are_logged(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Guards two things. One-shot gets run as DHT clients and the server forgets a client
    when it disconnects: without either, each get stays in the server's routing table as a
    dead peer (dht_peers grows by one per get) and later fetchers dial it in vain, which
    py-libp2p reports on stderr. And one log line per blob on each side at -v, plus the
    server's summary when it stops."""
    blob_id = cluster.put_here("a", random_file(tmp_path / "w.bin", 512 * 1024, seed=9))
    server = cluster.serve("a", "-v", dht=True)
    for i in range(GETS):
        done = run_blob(
            cluster.store(f"c{i}"), cluster.key(f"c{i}"), "get", blob_id,
            "--bootstrap", server.addr, "--json", "-v",
        )  # fmt: skip
        if i == 0:
            assert f"fetched {blob_id[:12]}: {512 * 1024} bytes from {server.peer_id}" in (
                done.stderr
            )
    daemon = connect(cluster.store("a"))
    assert daemon is not None
    assert wait_until(lambda: daemon.status()["dht_peers"] == 0, 10), daemon.status()

    blocking = subprocess.run(
        [sys.executable, "-c", BLOCKING_FETCH, str(tmp_path / "bn"), server.addr, blob_id],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert blocking.returncode == 0, blocking.stderr
    assert blocking.stderr == ""
    assert wait_until(lambda: daemon.status()["dht_peers"] == 0, 10), daemon.status()

    server.stop()
    log = server.log_path.read_text()
    assert log.count(f"served {blob_id[:12]} to ") >= GETS, log[-2000:]
    assert f"served {GETS + 1} chunk(s)" in log, log[-2000:]
