"""``blob publish`` beside a running ``blob serve``, then ``blob get PUBLISHER/NAME`` on
another machine: real processes over TCP on 127.0.0.1.

Needs the lead's glue (p2p/names/NAMES.md's commands registered in ``blob``, the catalog
installed at node start); skipped, saying so, until it is in.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from identity import load_or_create_key
from p2p.cli import app as blob_cli

from .conftest import Cluster, blob_cmd, last_json, random_file, run_blob

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
    blob_id = cluster.put_here("pub", source)  # a local write, in this process
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

    # Two readers at once (independent fetches): the named blob, and a name never published.
    out = tmp_path / "fetched.safetensors"
    reading = [
        subprocess.Popen(
            blob_cmd(cluster.store(reader), cluster.key(reader), "get", ref, "--peer", server.addr,
                     *extra),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for reader, ref, extra in (
            ("reader", ref, ("-o", str(out), "--json")),
            ("reader2", f"{publisher}/nothing", ()),
        )
    ]  # fmt: skip
    try:
        (got, err), (_, missing) = (proc.communicate(timeout=180) for proc in reading)
    finally:
        for proc in reading:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    assert reading[0].returncode == 0, err
    assert last_json(got)["id"] == blob_id
    assert out.read_bytes() == source.read_bytes()
    assert reading[1].returncode == 3, missing
    assert "no valid record" in missing
