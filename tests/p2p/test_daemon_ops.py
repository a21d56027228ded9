"""The local API beyond fetch and status: `put`, `publish` and `catalog` done by a running
`blob serve` (JSON with "via": "daemon"), the TCP listener and its token, and the light
path's command-line reading."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from blobstore.exitcodes import ExitCode
from p2p.cli.light import parse
from p2p.daemon import api
from p2p.daemon.client import DaemonClient, DaemonRefused, Endpoint, connect

from .conftest import Cluster, random_file, run_blob


def test_the_light_paths_exit_statuses_are_the_stores() -> None:
    """api and client import no blobstore (it would cost the light path ~60 ms), so they
    spell the exit statuses out: they must stay ExitCode's."""
    assert api.EXIT_REJECTED == ExitCode.REJECTED
    assert api.EXIT_USAGE == ExitCode.USAGE
    assert api.EXIT_NOT_FOUND == ExitCode.NOT_FOUND
    assert api.EXIT_NETWORK == ExitCode.NETWORK
    assert api.EXIT_INTERRUPTED == ExitCode.INTERRUPTED


@pytest.mark.parametrize(
    ("argv", "taken"),
    [
        (["--store", "s", "get", "ab" * 32, "--peer", "/ip4/1.2.3.4/tcp/1/p2p/x", "--json"], True),
        (["get", "ab" * 32, "--store=s", "-vv"], True),
        (["--api", "127.0.0.1:1", "status"], True),
        (["put", "a", "b", "--tag", "t"], True),  # refused later: --tag names one blob
        (["publish", "run/w", "abcdef12", "--seq", "3"], True),
        (["get", "ab" * 32, "-o", "out.bin"], False),  # writing files: the full get's
        (["get", "ab" * 32, "--include", "*.json"], False),
        (["get", "ab" * 32, "--download-limit", "2"], False),  # needs a node of its own
        (["publish", "run/w", "abcdef12", "--cert", "c"], False),
        (["resolve", "x/y", "--authority", "k"], False),
        (["status", "--help"], False),
        (["get"], False),
        (["get", "a", "b"], False),
        (["ls"], False),
        (["get", "ab" * 32, "--api", "127.0.0.1:1"], False),  # --api only before the command
        (["get", "--", "-x"], False),
        (["get", "ab" * 32, "--peer"], False),
    ],
)
def test_the_light_path_takes_only_what_it_knows(argv: list[str], taken: bool) -> None:
    """Anything the light path does not read goes to the full program (p2p.cli.light rule
    1), so no option is silently dropped on the way to a daemon."""
    assert (parse(argv) is not None) == taken


def test_put_publish_and_catalog_run_in_the_daemon(cluster: Cluster, tmp_path: Path) -> None:
    """On a store a serve runs on, `blob put` is the daemon's (it provides the blob on the
    DHT at once: a client that knows only the bootstrap peer finds and fetches it from the
    daemon), and `publish` and `catalog` are too (the daemon's key publishes): each JSON
    says "via": "daemon"."""
    bootstrap = cluster.serve("a", dht=True)
    daemon = cluster.serve("b", "--bootstrap", bootstrap.addr, dht=True)
    store, key = cluster.store("b"), cluster.key("b")
    data = random_file(tmp_path / "w.bin", 300 * 1024, seed=11)

    done = run_blob(store, key, "put", str(data), "--tag", "w", "--json")
    [put] = json.loads(done.stdout)
    assert put["via"] == "daemon" and put["provided"] is True, put
    assert put["path"] == str(data) and put["tag"] == "w" and put["size"] == 300 * 1024
    blob_id = put["id"]

    got = cluster.get("c", blob_id, "--bootstrap", bootstrap.addr)
    assert "via" not in got and got["peers"][daemon.peer_id]["bytes"] == 300 * 1024, got

    done = run_blob(store, key, "publish", "run/w", "w", "--no-dht", "--json")
    published = json.loads(done.stdout)
    assert published["via"] == "daemon" and published["id"] == blob_id
    assert published["publisher"] == daemon.peer_id  # the daemon's key signed it
    done = run_blob(store, key, "catalog", daemon.peer_id, "--json")
    [listed] = json.loads(done.stdout)
    assert listed["via"] == "daemon" and listed["name"] == "run/w" and listed["id"] == blob_id

    missing = run_blob(store, key, "put", str(tmp_path / "nope.bin"), check=False)
    assert missing.returncode == ExitCode.NOT_FOUND, missing.stderr
    assert missing.stderr.startswith("blob: error: no such file"), missing.stderr
    malformed = run_blob(store, key, "get", "ab" * 32, "--peer", "/ip4/1.2.3.4/tcp/1", check=False)
    assert malformed.returncode == ExitCode.USAGE and "lacks /p2p/" in malformed.stderr


def test_the_tcp_api_wants_the_token(cluster: Cluster, tmp_path: Path) -> None:
    """serve --api-listen opens the API on loopback TCP with a token file of mode 0600 in
    the store: a request without the token or with another is refused whatever it asks,
    one with it is answered (a put reads under --api-put-dir only); a non-loopback
    address is refused unless forced."""
    data = random_file(tmp_path / "w.bin", 4096, seed=12)
    cluster.serve("b", "--api-listen", "127.0.0.1:0", "--api-put-dir", str(tmp_path))
    store, key = cluster.store("b"), cluster.key("b")
    local = connect(store)
    assert local is not None
    addr = local.status()["api_tcp"]
    host, port = addr.rsplit(":", 1)
    token_file = api.token_path(store)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600

    (tmp_path / "wrong").write_text("0" * 64 + "\n")
    for token in (None, "0" * 64):
        client = DaemonClient(Endpoint(host=host, port=int(port), token=token))
        with pytest.raises(DaemonRefused) as refused:
            client.request("put", path=str(data))
        assert refused.value.code == "unauthorized"
    wrong = run_blob(
        store, key, "--api", addr, "--api-token", str(tmp_path / "wrong"), "status", check=False
    )
    assert wrong.returncode == 1 and "token" in wrong.stderr, wrong.stderr

    done = run_blob(store, key, "--api", addr, "put", str(data), "--json")
    assert json.loads(done.stdout)[0]["via"] == "daemon"
    status = json.loads(run_blob(store, key, "--api", addr, "status", "--json").stdout)
    assert status["peer_id"] == local.status()["peer_id"]

    refused = run_blob(
        cluster.store("x"), cluster.key("x"), "serve", "--api-listen", "0.0.0.0:0", check=False
    )
    assert refused.returncode == ExitCode.USAGE and "loopback" in refused.stderr


class _ObservedHost:
    """A host as py-libp2p shapes it: ``get_addrs`` (the class's) adds what identify
    observers confirmed to the transport addresses; the node patches the instance's."""

    def __init__(self, transport: list[str], confirmed: list[str]) -> None:
        self.transport = transport
        self.confirmed = confirmed
        self.get_addrs = lambda: [f"{a}/p2p/12D3KooWx" for a in transport]  # the node's patch

    def get_transport_addrs(self) -> list[str]:
        return self.transport

    def get_addrs(self) -> list[str]:
        return [f"{a}/p2p/12D3KooWx" for a in (*self.transport, *self.confirmed)]


def test_status_shows_what_peers_observed_and_the_reachability_it_implies() -> None:
    """Observed addresses are the host's confirmed identify observations (not our own
    listen addresses, not the instance's patched list); seen at an address we listen on
    means public, seen only elsewhere means a NAT rewrote it, nothing seen says nothing."""
    from p2p.daemon.status import observed_addrs, observed_reachability

    listen = ["/ip4/10.0.0.5/tcp/4001"]
    natted = _ObservedHost(listen, ["/ip4/203.0.113.7/tcp/61000"])
    assert observed_addrs(natted) == ["/ip4/203.0.113.7/tcp/61000"]
    assert observed_reachability(listen, observed_addrs(natted)) == "behind_nat"
    direct = _ObservedHost(["/ip4/0.0.0.0/tcp/4001"], ["/ip4/198.51.100.2/tcp/4001"])
    assert observed_reachability(["/ip4/198.51.100.2/tcp/4001"], observed_addrs(direct)) == (
        "public"
    )
    assert observed_addrs(_ObservedHost(listen, [])) == []
    assert observed_reachability(listen, []) is None
    from p2p.cli.light import render

    doc = {
        "peer_id": "p", "role": "serve", "version": "0", "uptime_s": 1, "listen_addrs": listen,
        "addrs": listen, "reachability": "behind_nat", "observed_addrs": observed_addrs(natted),
        "store": {"root": "/s", "blobs": 0, "bytes": 0}, "dht_peers": 0, "connections": [],
        "connections_direct": 0, "connections_relayed": 0, "transfers": [], "names": [],
        "serving": {"bytes_sent": 0, "streams": {}, "refusals": 0}, "bad_chunks_by_peer": {},
    }  # fmt: skip
    text = render(doc)
    assert "observed   /ip4/203.0.113.7/tcp/61000" in text and "reach      behind_nat" in text


def test_get_download_limit_caps_that_one_get(cluster: Cluster, tmp_path: Path) -> None:
    """get --download-limit paces a single get as serve's paces a daemon: 4 MiB at 2 MB/s
    takes at least 1.05 s (a 1 MiB burst and one chunk on credit, then the rate), where
    unpaced it takes a few tens of ms here. A daemon on the store is passed by: its cap is
    node-wide."""
    size = 4 << 20
    blob_id = cluster.put_here("a", random_file(tmp_path / "w.bin", size, seed=13))
    source = cluster.serve("a")
    cluster.serve("b")
    got = cluster.get("b", blob_id, "--peer", source.addr, "--download-limit", "2")
    assert "via" not in got and got["peers"][source.peer_id]["bytes"] == size, got
    floor = (size - (2 << 20)) / 2e6
    assert floor * 0.95 <= got["seconds"] < 30, got
