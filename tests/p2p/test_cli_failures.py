"""A new user's mistakes with `blob get` and `blob serve`, each answered at once with one
line that says what is wrong, and the README's exit code; no warnings, no tracebacks.

Nodes, and commands whose answer needs the network, are processes of their own; mistakes
found before any node starts, and local commands, run in this process (``blob_here``)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Cluster, NodeProcess, blob_cmd, blob_here, random_file, run_blob

# Half of a 30 s --discovery-timeout, which these failures must not wait out; generous
# for a loaded 2-vCPU machine, where starting a `blob` process alone can take 4 s.
FAST = 15.0
UNKNOWN = "ab" * 32
OTHER_PEER_ID = "12D3KooWD1UBHk5aaWC5rVxrVVWBPVKPHfgxR8RdtDHeSN1zFESg"


def blob(cluster: Cluster, name: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = run_blob(cluster.store(name), cluster.key(name), *args, check=False, timeout=60)
    return done, time.monotonic() - start


def here(cluster: Cluster, name: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """``blob`` as ``blob`` does, in this process: for answers found before any dial."""
    start = time.monotonic()
    done = blob_here(cluster.store(name), cluster.key(name), *args)
    return done, time.monotonic() - start


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "WARNING" not in done.stderr
    return lines[0]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_get_mistakes_fail_fast_in_one_line(cluster: Cluster, tmp_path: Path) -> None:
    random_file(tmp_path / "w.bin", 10_000)
    cluster.put_here("a", tmp_path / "w.bin")
    a = cluster.serve("a")
    host_port = a.addr.split("/p2p/")[0]

    # Nowhere to fetch from: a usage error (2), since no network work could succeed.
    done, took = here(cluster, "b", "get", UNKNOWN, "--discovery-timeout", "30")
    assert done.returncode == 2 and took < FAST
    assert "--peer" in one_line(done) and "ticket" in done.stderr

    # A peer without the blob answers not_found at once; nobody waits for the DHT.
    done, took = blob(cluster, "b", "get", UNKNOWN, "--peer", a.addr, "--discovery-timeout", "30")
    assert done.returncode == 6 and took < FAST
    assert UNKNOWN in one_line(done)

    # A malformed address is a usage error, in plain words.
    done, _ = here(cluster, "b", "get", UNKNOWN, "--peer", "/ip4/1.2.3/tcp/4/p2p/xyz")
    line = one_line(done)
    assert done.returncode == 2 and "not IPv4" in line and "Protocol(" not in line
    done, _ = here(cluster, "b", "get", UNKNOWN, "--peer", host_port)
    assert done.returncode == 2 and "lacks /p2p/" in one_line(done)

    # An upload limit with uploads off, or one too low to serve anyone, says so.
    done, _ = here(
        cluster, "b", "get", UNKNOWN, "--peer", a.addr, "--no-upload", "--upload-limit", "5"
    )
    assert done.returncode == 2 and "--no-upload" in one_line(done)
    done, _ = here(cluster, "b", "get", UNKNOWN, "--peer", a.addr, "--upload-limit", "0.01")
    assert done.returncode == 2 and "--upload-limit" in one_line(done)

    # The output directory is checked before any dial: the unreachable peer is not
    # what gets reported.
    dead = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{OTHER_PEER_ID}"
    done, _ = here(cluster, "b", "get", UNKNOWN, "--peer", dead, "-o", "/nonexistent/dir/x")
    assert done.returncode == 3 and "/nonexistent/dir does not exist" in one_line(done)

    # A live address with another peer's ID says who answered there.
    done, took = blob(cluster, "b", "get", UNKNOWN, "--peer", f"{host_port}/p2p/{OTHER_PEER_ID}")
    line = one_line(done)
    assert done.returncode == 6 and took < FAST
    assert "peer ID mismatch" in line and a.peer_id in line and OTHER_PEER_ID in line

    # An unreachable peer: which one and why, and no logging lines before the error.
    done, took = blob(cluster, "b", "get", UNKNOWN, "--peer", dead)
    line = one_line(done)
    assert done.returncode == 6 and took < FAST
    assert dead in line and "connection refused" in line


def test_a_peer_with_our_own_id_is_named_with_the_fix(cluster: Cluster, tmp_path: Path) -> None:
    """Local processes share the default machine key, hence one peer ID: dialling
    "another" node with our own ID is refused before any network work, suggesting --key."""
    random_file(tmp_path / "w.bin", 10_000)
    cluster.put_here("a", tmp_path / "w.bin")
    a = cluster.serve("a")
    same_key = blob_here(cluster.store("b"), cluster.key("a"), "get", UNKNOWN, "--peer", a.addr)
    line = one_line(same_key)
    assert same_key.returncode == 2
    assert "own peer ID" in line and a.peer_id in line and "--key" in line
    serve = run_blob(
        cluster.store("c"), cluster.key("a"), "serve", "--bootstrap", a.addr, check=False
    )
    assert serve.returncode == 2 and "own peer ID" in one_line(serve)


def test_global_options_after_the_command_and_json_everywhere(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Argument parsing only: ``blob``'s ``main`` in this process."""
    store, key = cluster.store("a"), cluster.key("a")
    blob_id = cluster.put_here("a", random_file(tmp_path / "w.bin", 10_000))
    # `blob ls --store X --key Y --json`: the global options after the subcommand.
    from p2p.cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main(["ls", "--store", str(store), "--key", str(key), "--json"])
    assert exit_info.value.code == 0
    assert [row["id"] for row in json.loads(capsys.readouterr().out)] == [blob_id]
    addr = f"/ip4/127.0.0.1/tcp/4001/p2p/{OTHER_PEER_ID}"
    # `--json` before the subcommand is the subcommand's --json; `ticket` has one too.
    with pytest.raises(SystemExit) as exit_info:
        main(["--json", "ticket", blob_id, "--addr", addr, "--store", str(store)])
    assert exit_info.value.code == 0
    before = capsys.readouterr().out
    after = blob_here(store, key, "ticket", blob_id, "--addr", addr, "--json")
    assert json.loads(before) == json.loads(after.stdout)
    info = json.loads(after.stdout)
    assert info["id"] == blob_id and info["addrs"] == [addr] and info["ticket"].startswith("blob1")


def test_serve_on_the_wildcard_address_prints_dialable_ones(
    cluster: Cluster, tmp_path: Path
) -> None:
    blob_id = cluster.put_here("a", random_file(tmp_path / "w.bin", 10_000))
    serve = ["serve", "--json", "--no-dht", "--listen", "/ip4/0.0.0.0/tcp/0"]
    (tmp_path / "logs").mkdir()
    a = NodeProcess(
        blob_cmd(cluster.store("a"), cluster.key("a"), *serve), "a", tmp_path / "logs" / "a.log"
    )
    cluster.nodes.append(a)  # stopped with the cluster
    assert a.addrs and not any("/0.0.0.0/" in addr for addr in a.addrs)
    loopback = [addr for addr in a.addrs if addr.startswith("/ip4/127.0.0.1/")]
    assert loopback, a.addrs
    got = cluster.get("b", blob_id, "--peer", loopback[0])
    assert got["id"] == blob_id and got["source"] == "network"


def test_get_with_a_named_peer_repairs_a_rotten_local_copy(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A damaged local copy is not exported as it is (exit 4) when a good peer is named:
    `get --peer GOOD` finds the rot, quarantines the copy and fetches it again."""
    from blobstore import Store

    original = random_file(tmp_path / "w.bin", 300_000)
    blob_id = cluster.put_here("a", original)
    assert cluster.put_here("b", original) == blob_id
    path = Store.open(cluster.store("b")).path(blob_id)
    path.chmod(0o600)
    with path.open("r+b") as f:  # bit rot in b's copy
        f.seek(1234)
        byte = f.read(1)
        f.seek(1234)
        f.write(bytes([byte[0] ^ 0xFF]))
    a = cluster.serve("a")
    out = tmp_path / "out.bin"
    done, _ = blob(cluster, "b", "get", blob_id, "--peer", a.addr, "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "corrupt" in done.stderr and "Traceback" not in done.stderr
    assert out.read_bytes() == original.read_bytes()
    verify, _ = here(cluster, "b", "verify", blob_id)
    assert verify.returncode == 0, verify.stderr


def test_a_second_server_with_the_same_key_is_warned(cluster: Cluster) -> None:
    """Two `blob serve` with one key ran side by side without a word: one peer ID at two
    addresses, each holding different blobs. The second now says so."""
    cluster.serve("a")
    cmd = blob_cmd(cluster.store("b"), cluster.key("a"), "serve", "--json", "--no-dht")
    second = NodeProcess([*cmd, "--listen", "/ip4/127.0.0.1/tcp/0"], "b", cluster.root / "b.log")
    cluster.nodes.append(second)
    log = (cluster.root / "b.log").read_text()
    assert "another server on this machine already runs with key" in log, log
    first_log = "".join(p.read_text() for p in (cluster.root / "a").glob("node-*.log"))
    assert "already runs" not in first_log
