"""``blob serve --relay`` and ``blob get`` of a ticket that names only a circuit address,
as real processes over 127.0.0.1 (the NAT commands; the NAT testbed has the real NATs, see
tests/wan/test_nat_cli_fetch.py).

A provider told to act as if private (``--assume-private``) reserves on an admitting
relay and hands out only its circuit address: its ready line, its ticket. A fetcher given
that ticket reaches it through the relay and upgrades (on loopback DCUtR's first direct
dial wins); the relay cuts circuits at 64 KiB, so a 3 MiB blob that arrives whole did not
cross it. The mistakes a user can make with the new options are one-line usage errors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from identity import Authority, MachineKey
from identity.keyfile import create_key_file
from identity.signer import SoftwareSigner
from p2p.blob.ticket import Ticket

from .conftest import LISTEN, Cluster, NodeProcess, blob_cmd, random_file, run_blob

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SIZE = 3 * 1024 * 1024
RELAY_CIRCUIT_BYTES = 64 * 1024  # far less than the blob
PEER = "12D3KooWGxP5jFCb1ZfeytT77zTWxzNbaBDCWUzozFeUwnRSbsES"
ADDR = f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"


def _certificate(authority: Authority, key: MachineKey, path: Path) -> Path:
    now = int(time.time())
    cert = authority.admit(
        key.peer_id,
        operator="op",
        kernel_class="cpu",
        not_before=now - 60,
        not_after=now + 3600,
        serial=now,
    )
    path.write_bytes(cert.encode())
    return path


def _relay(cluster: Cluster, authority: Authority) -> NodeProcess:
    (cluster.root / "relay").mkdir(parents=True, exist_ok=True)
    cmd = blob_cmd(
        cluster.store("relay"), cluster.key("relay"), "relay", "--json", "--no-dht",
        "--listen", LISTEN, "--authority", authority.public_key_bytes.hex(),
        "--max-circuit-bytes", str(RELAY_CIRCUIT_BYTES),
    )  # fmt: skip
    node = NodeProcess(cmd, "relay", cluster.root / "relay" / "relay.log")
    cluster.nodes.append(node)
    return node


def test_a_private_provider_hands_out_its_circuit_and_a_ticket_to_it_fetches_directly(
    cluster: Cluster, tmp_path: Path
) -> None:
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    relay = _relay(cluster, authority)
    keys = {}
    for name in ("prov", "fetch"):
        (tmp_path / name).mkdir()
        keys[name] = create_key_file(cluster.key(name))
    blob_id = cluster.put("prov", random_file(tmp_path / "blob.bin", SIZE))
    prov_cert = _certificate(authority, keys["prov"], tmp_path / "prov.cert")
    prov = cluster.serve(
        "prov", "--relay", relay.addr, "--certificate", str(prov_cert), "--assume-private"
    )
    circuit = f"{relay.addr}/p2p-circuit/p2p/{prov.peer_id}"
    assert prov.addrs == [circuit]  # the ready line names only the circuit

    ticket = run_blob(
        cluster.store("prov"), cluster.key("prov"), "ticket", blob_id, "--addr", circuit
    ).stdout.strip()
    assert Ticket.decode(ticket).addrs == (circuit,)
    fetch_cert = _certificate(authority, keys["fetch"], tmp_path / "fetch.cert")
    out = tmp_path / "out.bin"
    result = cluster.get("fetch", ticket, "--certificate", str(fetch_cert), "-o", str(out))
    assert result["id"] == blob_id
    assert out.read_bytes() == (tmp_path / "blob.bin").read_bytes()
    assert result["peers"][prov.peer_id]["bytes"] == SIZE  # all of it from prov
    assert 0 < result["first_byte_s"] < result["first_byte_s"] + result["seconds"]
    # The swarm bench reads when the blob was complete (a fetcher may linger after it).
    assert result["first_byte_at"] <= result["done_at"] <= time.time()


def _blob_here(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[int, str]:
    """``blob ARGS`` in this process (mistakes are found before any node starts)."""
    from p2p.cli import app as blob_cli

    argv = ["--store", str(tmp_path / "store"), "--key", str(tmp_path / "key"), *args]
    with pytest.raises(SystemExit) as done:
        blob_cli.main(argv)
    code = done.value.code
    return (code if isinstance(code, int) else 1), capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["serve", "--relay", "/ip4/127.0.0.1/tcp/1"], 2, "--relay"),
        (["serve", "--relay", f"{ADDR}/p2p-circuit/p2p/{PEER}"], 2, "circuit"),
        (["get", "ab" * 32, "--peer", ADDR, "--seed-for", "-1"], 2, "--seed-for"),
        (["get", "ab" * 32, "--seed-for", "5", "--no-upload"], 2, "--seed-for"),
        (["get", "ab" * 32, "--peer", ADDR, "--certificate", "none.cert"], 3, "certificate"),
    ],
)
def test_nat_and_seeding_mistakes_are_one_line_errors(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    args: list[str],
    code: int,
    words: str,
) -> None:
    got, err = _blob_here(capsys, tmp_path, *args)
    assert got == code, err
    assert words in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_get_seed_for_serves_what_it_fetched_until_ctrl_c_ends_it_with_exit_0(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A fetcher that stays (``--seed-for``) serves the swarm's tail: with the
    original provider gone, a third node fetches from it; Ctrl-C during seeding is a
    server's normal end (exit 0), its result line already out."""
    import json
    import signal
    import socket
    import subprocess

    blob_id = cluster.put("seed", random_file(tmp_path / "blob.bin", SIZE))
    seed = cluster.serve("seed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "mid").mkdir()
    mid = subprocess.Popen(
        blob_cmd(
            cluster.store("mid"), cluster.key("mid"), "get", blob_id, "--json",
            "--peer", seed.addr, "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--seed-for", "120",
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert mid.stdout is not None
        result = json.loads(mid.stdout.readline())  # printed before seeding starts
        assert result["id"] == blob_id
        seed.stop()  # only the seeding fetcher holds the blob now
        mid_peer = create_peer_id(cluster.key("mid"))
        late = cluster.get("late", blob_id, "--peer", f"/ip4/127.0.0.1/tcp/{port}/p2p/{mid_peer}")
        assert late["peers"][mid_peer]["bytes"] == SIZE
        assert mid.poll() is None  # still seeding
        mid.send_signal(signal.SIGINT)
        _, err = mid.communicate(timeout=30)
        assert mid.returncode == 0, err
        assert "seeding" in err and "stopping on SIGINT" in err
    finally:
        if mid.poll() is None:
            mid.kill()
            mid.communicate()


def create_peer_id(key_path: Path) -> str:
    from identity.keyfile import load_key_file

    return load_key_file(key_path).peer_id


def test_get_listens_on_loopback_only_when_everyone_it_names_is_on_this_machine() -> None:
    """Fellow fetchers on other machines fetch from a ``blob get`` and hole punching
    dials from its listen port, so it listens on every interface unless every peer it
    names (directly, in a ticket, as a relay or bootstrap peer) is local."""
    from p2p.cli.common import DEFAULT_LISTEN, fetch_listen
    from p2p.cli.nat import NAT_DEFAULT_LISTEN

    remote = f"/ip4/10.1.2.3/tcp/4001/p2p/{PEER}"
    assert fetch_listen([], [ADDR, f"{ADDR}/p2p-circuit/p2p/{PEER}"]) == DEFAULT_LISTEN
    assert fetch_listen([], [ADDR, remote]) == NAT_DEFAULT_LISTEN
    assert fetch_listen([], [f"/dns4/example.org/tcp/1/p2p/{PEER}"]) == NAT_DEFAULT_LISTEN
    assert fetch_listen(["/ip4/127.0.0.1/tcp/9"], [remote]) == ("/ip4/127.0.0.1/tcp/9",)
    assert fetch_listen([], []) == DEFAULT_LISTEN  # nothing named: a local get
