"""The local API: a `blob serve` on a store answers `blob get` and `blob status` on that
store over a 0600 Unix socket, and commands work as before once it is gone."""

from __future__ import annotations

import json
import socket
import stat
import time
from pathlib import Path

import pytest

from p2p.daemon import api
from p2p.daemon.client import connect
from tests.p2p.conftest import Cluster, blob_here, random_file, run_blob, wait_until


def test_requests_are_bounded_and_versioned() -> None:
    """Only a well-formed request of API 1 is read, and a line is bounded before it is
    parsed: a client can neither crash the daemon nor make it hold unbounded memory."""
    assert api.decode_request(b'{"api": 1, "op": "status"}') == api.Request("status")
    for line, code in (
        (b'{"api": 2, "op": "status"}', "unsupported_version"),
        (b'{"op": "status"}', "unsupported_version"),
        (b'{"api": 1, "op": "rm"}', "bad_request"),
        (b"[1]", "bad_request"),
        (b"not json", "bad_request"),
        (b" " * (api.MAX_REQUEST_BYTES + 1), "bad_request"),
    ):
        with pytest.raises(api.ApiError) as caught:
            api.decode_request(line)
        assert caught.value.code == code, line[:40]
    reader = api.LineReader(limit=8)
    assert reader.feed(b"ab\ncd") == [b"ab"]
    assert reader.feed(b"\n") == [b"cd"]
    with pytest.raises(api.ApiError):
        reader.feed(b"x" * 9)
    too_many = api.Request("fetch", {"id": "0" * 64, "providers": ["/x"] * 65})
    with pytest.raises(api.ApiError, match="at most"):
        api.fetch_args(too_many)


def test_a_socket_left_by_a_killed_daemon_is_no_daemon(tmp_path: Path) -> None:
    """A socket file nobody listens on (a daemon killed with -9) must not make commands
    fail or hang: they run on their own."""
    path = api.socket_path(tmp_path)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()
    assert path.exists()
    assert connect(tmp_path) is None


def test_a_store_whose_socket_path_just_fits_gets_its_api(tmp_path: Path) -> None:
    """The socket is bound under a staging name and renamed: a staging name longer than
    ``api.sock`` turned the API off for stores whose socket path fit (a test's store
    under pytest-xdist's longer temp paths lost its API)."""
    from p2p.daemon.server import bind_socket

    def root_for(length: int) -> Path:
        pad = length - len(str(api.socket_path(tmp_path / "x")))
        root = tmp_path / ("x" * (1 + pad))
        root.mkdir()
        assert len(str(api.socket_path(root))) == length
        return root

    fits = root_for(api.MAX_SOCKET_PATH)
    sock = bind_socket(api.socket_path(fits))
    assert sock is not None
    sock.close()
    assert [p.name for p in fits.iterdir()] == ["api.sock"]  # no staging name left
    assert bind_socket(api.socket_path(root_for(api.MAX_SOCKET_PATH + 1))) is None


def test_get_and_status_use_the_running_daemon(cluster: Cluster, tmp_path: Path) -> None:
    """The fetch runs in the store's `blob serve` (its JSON says "via": "daemon"), status
    names the provider it is connected to, and with the daemon stopped the same get runs
    on its own node again."""
    blob_id = cluster.put_here("a", random_file(tmp_path / "w.bin", 1 << 20, seed=3))
    source = cluster.serve("a")
    daemon = cluster.serve("b")
    sock = api.socket_path(cluster.store("b"))
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600

    began = time.monotonic()
    got = cluster.get("b", blob_id, "--peer", source.addr)
    warm_wall = time.monotonic() - began
    assert got["via"] == "daemon"
    assert got["peers"][source.peer_id]["bytes"] == 1 << 20
    done = run_blob(cluster.store("b"), cluster.key("b"), "status", "--json")
    status = json.loads(done.stdout)
    assert status["peer_id"] == daemon.peer_id
    assert [c["peer"] for c in status["connections"]] == [source.peer_id]
    assert status["store"]["blobs"] == 1

    daemon.stop()
    assert wait_until(lambda: not sock.exists(), 10)
    assert blob_here(cluster.store("b"), cluster.key("b"), "rm", blob_id).returncode == 0
    began = time.monotonic()
    alone = cluster.get("b", blob_id, "--peer", source.addr)
    own_wall = time.monotonic() - began
    assert "via" not in alone and alone["source"] == "network"
    print(f"1 MiB get wall time: via daemon {warm_wall:.2f} s, own node {own_wall:.2f} s")
    missing = run_blob(cluster.store("b"), cluster.key("b"), "status", check=False)
    assert missing.returncode == 3 and "no node is serving" in missing.stderr


def test_a_download_limit_paces_the_daemons_fetches(cluster: Cluster, tmp_path: Path) -> None:
    """serve --download-limit caps what its fetches receive: 4 MiB at 2 MB/s takes at
    least 1.05 s (a 1 MiB burst and one chunk taken on credit, then the rate), where
    unpaced it takes a few tens of ms here."""
    size = 4 << 20
    blob_id = cluster.put_here("a", random_file(tmp_path / "w.bin", size, seed=4))
    source = cluster.serve("a")
    cluster.serve("b", "--download-limit", "2")
    got = cluster.get("b", blob_id, "--peer", source.addr)
    assert got["via"] == "daemon" and got["peers"][source.peer_id]["bytes"] == size
    floor = (size - (2 << 20)) / 2e6
    assert floor * 0.95 <= got["seconds"] < 30, got


def test_a_relay_answers_status_and_metrics(cluster: Cluster) -> None:
    """`blob relay` runs the local API too: its role, and the bytes it relayed as a metric."""
    from identity import Authority, MachineKey
    from identity.signer import SoftwareSigner

    from .conftest import LISTEN, NodeProcess, blob_cmd

    authority = Authority(SoftwareSigner(MachineKey.generate()))
    (cluster.root / "relay").mkdir(parents=True, exist_ok=True)
    cmd = blob_cmd(
        cluster.store("relay"), cluster.key("relay"), "relay", "--json", "--no-dht",
        "--listen", LISTEN, "--authority", authority.public_key_bytes.hex(),
    )  # fmt: skip
    relay = NodeProcess(cmd, "relay", cluster.root / "relay" / "relay.log")
    cluster.nodes.append(relay)
    daemon = connect(cluster.store("relay"))
    assert daemon is not None
    status = daemon.status()
    assert status["role"] == "relay" and status["relayed_bytes"] == 0
    assert "blobnet_relay_bytes_total 0.0" in daemon.metrics()


def test_a_plain_program_attaches_to_the_daemon(cluster: Cluster, tmp_path: Path) -> None:
    """open_blocking on a store that a serve runs on drives that daemon (same peer ID, no
    second node); on a store without one it is a BlockingNode of its own."""
    from p2p.daemon.attach import AttachedNode, open_blocking
    from p2p.node.blocking import BlockingNode

    blob_id = cluster.put_here("a", random_file(tmp_path / "w.bin", 64 * 1024, seed=6))
    source = cluster.serve("a")
    daemon = cluster.serve("b")
    with open_blocking(cluster.store("b")) as node:
        assert isinstance(node, AttachedNode) and node.peer_id == daemon.peer_id
        assert node.fetch(blob_id, providers=[source.addr]) == blob_id
        assert node.store.has(blob_id)
    assert isinstance(open_blocking(tmp_path / "elsewhere"), BlockingNode)


def test_resolve_runs_in_the_daemon(cluster: Cluster, tmp_path: Path) -> None:
    """blob resolve on a store a serve runs on asks that daemon ("via": "daemon"), which
    dials the named peer and finds the record there; an unknown name is exit 3 as
    without a daemon."""
    blob_id = cluster.put_here("a", random_file(tmp_path / "w.bin", 4096, seed=8))
    published = run_blob(
        cluster.store("a"), cluster.key("a"), "publish", "run/w", blob_id, "--no-dht", "--json"
    )
    ref = json.loads(published.stdout)["ref"]
    source = cluster.serve("a")
    cluster.serve("b")
    done = run_blob(
        cluster.store("b"), cluster.key("b"), "resolve", ref, "--peer", source.addr, "--json"
    )
    record = json.loads(done.stdout)
    assert record["via"] == "daemon" and record["id"] == blob_id
    missing = run_blob(
        cluster.store("b"), cluster.key("b"), "resolve", f"{source.peer_id}/nope",
        "--wait", "0.5", check=False,
    )  # fmt: skip
    assert missing.returncode == 3, missing.stderr
