"""``blob publish`` beside a running ``blob serve``, then ``blob get PUBLISHER/NAME`` on
another machine: real processes over TCP on 127.0.0.1.

Needs the lead's glue (p2p/NAMES.md's commands registered in ``blob``, the catalog
installed at node start); skipped, saying so, until it is in.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from identity import load_or_create_key
from p2p import cli as blob_cli

from .conftest import Cluster, last_json, random_file, run_blob

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        "publish" not in blob_cli.cli.commands,
        reason="the catalog commands are not registered in `blob` yet (lead's glue)",
    ),
]


def test_get_by_name_fetches_the_named_blob_and_verifies_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    source = random_file(tmp_path / "adapter.safetensors", 2 * 1024 * 1024 + 3)
    blob_id = cluster.put("pub", source)
    server = cluster.serve("pub")
    publisher = load_or_create_key(cluster.key("pub")).peer_id
    assert server.peer_id == publisher

    # Published by a one-shot process on the serving node's store: the server answers
    # for it from the store's record cache.
    done = run_blob(
        cluster.store("pub"), cluster.key("pub"), "publish", "run-x/adapter", blob_id[:10],
        "--no-dht", "--json",
    )  # fmt: skip
    assert last_json(done.stdout)["id"] == blob_id
    ref = f"{publisher}/run-x/adapter"

    out = tmp_path / "fetched.safetensors"
    result = cluster.get("reader", ref, "--peer", server.addr, "-o", str(out))
    assert result["id"] == blob_id
    assert out.read_bytes() == source.read_bytes()

    missing = run_blob(
        cluster.store("reader"), cluster.key("reader"), "get", f"{publisher}/nothing",
        "--peer", server.addr, check=False,
    )  # fmt: skip
    assert missing.returncode == 3, missing.stderr
    assert "no valid record" in missing.stderr
