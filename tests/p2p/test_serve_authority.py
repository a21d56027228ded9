"""``blob serve --authority KEY`` serves only peers admitted by KEY: real processes over
127.0.0.1. An unadmitted fetcher is refused at once with a line that says which
certificate to pass; the same fetcher with its certificate fetches."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from identity import Authority, MachineKey
from identity.keyfile import create_key_file
from identity.signer import SoftwareSigner

from .conftest import Cluster, random_file, run_blob

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _certificate(authority: Authority, key: MachineKey, path: Path) -> Path:
    now = int(time.time())
    cert = authority.admit(
        key.peer_id, operator="op", kernel_class="cpu",
        not_before=now - 60, not_after=now + 3600, serial=now,
    )  # fmt: skip
    path.write_bytes(cert.encode())
    return path


def test_only_admitted_peers_are_served(cluster: Cluster, tmp_path: Path) -> None:
    """Guards the gate itself: without the server's admission check the unadmitted get
    below fetches the blob, and this test fails."""
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    blob_id = cluster.put_here("a", random_file(tmp_path / "w.bin", 256 * 1024, seed=5))
    create_key_file(cluster.key("a"))
    server = cluster.serve("a", "--authority", authority.public_key_bytes.hex())
    fetcher = create_key_file(cluster.key("b"))

    began = time.monotonic()
    refused = run_blob(
        cluster.store("b"), cluster.key("b"), "get", blob_id, "--peer", server.addr,
        "--no-daemon", check=False,
    )  # fmt: skip
    refused_s = time.monotonic() - began
    assert refused.returncode == 6, refused.stderr
    assert "unadmitted" in refused.stderr and "--certificate" in refused.stderr
    assert authority.public_key_bytes.hex()[:16] in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    print(f"unadmitted get refused after {refused_s:.2f} s (command wall time)")

    cert = _certificate(authority, fetcher, tmp_path / "b.cert")
    got = cluster.get("b", blob_id, "--peer", server.addr, "--certificate", str(cert))
    assert got["source"] == "network"
    assert got["peers"][server.peer_id]["bytes"] == 256 * 1024
