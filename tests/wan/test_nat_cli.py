"""``blob relay`` as a user runs it (the command is added to the ``blob`` group here, as
the CLI's owner will): usage errors exit 2 with one line, a relay prints one ready line
with its limits and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from identity import MachineKey

pytestmark = pytest.mark.timeout(60)

RUN_BLOB_WITH_RELAY = (
    "import sys\n"
    "from p2p.cli.app import cli, main\n"
    "from p2p.cli.relay import relay\n"
    "cli.add_command(relay)\n"
    "main(sys.argv[1:])\n"
)


def _blob(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", RUN_BLOB_WITH_RELAY, "--store", str(tmp_path / "store")]
    argv += ["--key", str(tmp_path / "machine.key"), "relay", *args]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )


def test_a_relay_without_an_authority_or_with_a_zero_limit_is_a_usage_error(
    tmp_path: Path,
) -> None:
    authority = MachineKey.generate().public_key_bytes.hex()
    for args in ([], ["--authority", authority, "--max-circuit-bytes", "0"]):
        proc = _blob(tmp_path, *args)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 2, err
        assert len(err.strip().splitlines()) <= 3 and "Traceback" not in err


def test_the_help_states_the_relays_real_default_limits(tmp_path: Path) -> None:
    from p2p.nat import relay

    proc = _blob(tmp_path, "--help")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    text = " ".join(out.split())
    for option, value in (
        ("--max-circuit-bytes", relay.CIRCUIT_MAX_BYTES),
        ("--max-circuit-seconds", relay.CIRCUIT_MAX_SECONDS),
        ("--max-reservations", relay.MAX_RESERVATIONS),
        ("--max-circuits-per-peer", relay.MAX_CIRCUITS_PER_PEER),
    ):
        stated = text.split(option, 1)[1].split("[default: ", 1)[1].split("]")[0]
        assert stated.split(",")[0] == str(value), option


def test_a_relay_prints_its_address_and_limits_and_stops_on_sigterm(tmp_path: Path) -> None:
    authority = MachineKey.generate().public_key_bytes.hex()
    proc = _blob(
        tmp_path, "--authority", authority, "--listen", "/ip4/127.0.0.1/tcp/0",
        "--max-circuit-bytes", "65536", "--json", "--no-dht",
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["peer_id"].startswith("12D3KooW")
        assert ready["addrs"] and all("/ip4/127.0.0.1/tcp/" in a for a in ready["addrs"])
        assert ready["max_circuit_bytes"] == 65536
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "stopping on SIGTERM" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
