"""`blob demo`, the README's main job, on a small checkpoint (48 chunks: enough that node 3
gets chunks from both providers)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(300)]


def test_demo_moves_a_checkpoint_across_three_node_processes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "p2p.cli", "demo", "--size-mib", "48", "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["verified"] is True
    assert result["identical_to_source"] is True
    assert [row["step"] for row in result["steps"]] == [
        "node1 put",
        "node2 <- node1",
        "node3 <- node1+node2",
    ]
    last = result["steps"][-1]
    assert sum(p["bytes"] for p in last["peers"].values()) == result["size"]
    assert all(p["bytes"] > 0 for p in last["peers"].values())
    assert len(last["peers"]) == 2
