"""NAT traversal as a user meets it: real ``blob relay``, ``blob share --relay`` / ``blob serve
--relay`` and ``blob get`` processes on NATed testbed hosts, 80 ms RTT between any two.

The story: home (behind an endpoint-independent NAT) shares a blob with ``--relay``: the
relay's dial-back fails, so home reserves and its ticket names only its circuit address;
it also provides the blob on the DHT (bootstrapped from the relay) with that address.
cafe (behind another such NAT) fetches with the ticket; dorm (public) fetches by ID alone,
finding home on the DHT. Both hole-punch and take the whole blob over the direct
connection: the relay's own byte counter (printed when it stops) and its host's sent
bytes show it carried signalling only. office and shop sit behind symmetric NATs: shop's
``blob get`` of office's ticket fails in one line saying the punch failed, exit 6.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.wan import Host, Testbed
from bench.wan.blobnodes import _readline
from bench.wan.measure import REPO_ROOT, python_env
from bench.wan.testbed import stop_processes
from blobstore import Store
from identity import Authority, MachineKey
from identity.keyfile import create_key_file
from identity.signer import SoftwareSigner
from p2p.blob.ticket import Ticket

pytestmark = [pytest.mark.usefixtures("nat_capable"), pytest.mark.slow, pytest.mark.timeout(150)]

SIZE = 4 * 1024 * 1024  # eight times what a default relay lets through one circuit
# What one relayed connection carries besides the blob (Noise, yamux, identify, DCUtR):
# about 3 KB measured; one blob chunk is 1 MiB.
SIGNALLING_BYTES = 64 * 1024
RELAY_PORT = 4001
# Start-up of a node process (imports, key, listen; a provider's 5 s dial-back and its
# reservation) on a loaded 2-vCPU machine, and a fetch (start-up, punch, 4 MiB).
READY_TIMEOUT = 90.0
FETCH_TIMEOUT = 120.0
# A failing punch waits out its whole timeout; an EIM punch takes about 1 s at 80 ms.
FAILING_PUNCH_TIMEOUT = "4"


class Procs:
    """``blob`` processes in testbed hosts, each with its own store and key."""

    def __init__(self, tb: Testbed, root: Path, authority: Authority) -> None:
        self.tb, self.root, self.authority = tb, root, authority
        self.procs: list[subprocess.Popen[str]] = []

    def _dir(self, host: str) -> Path:
        path = self.root / host
        if not path.exists():
            path.mkdir()
            key = create_key_file(path / "machine.key")
            now = int(time.time())
            cert = self.authority.admit(
                key.peer_id, operator=host, kernel_class="cpu",
                not_before=now - 60, not_after=now + 3600, serial=now,
            )  # fmt: skip
            (path / "cert").write_bytes(cert.encode())
        return path

    def cert(self, host: str) -> str:
        return str(self._dir(host) / "cert")

    def put(self, host: str, data: bytes) -> str:
        return Store.open(self._dir(host) / "store").put_bytes(data)

    def start(self, host: str, *args: str) -> subprocess.Popen[str]:
        d = self._dir(host)
        argv = [sys.executable, "-m", "p2p.cli", "--store", str(d / "store")]
        argv += ["--key", str(d / "machine.key"), *args]
        proc = self.tb.popen(
            host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=python_env(), cwd=REPO_ROOT,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def ready(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        line = _readline(proc, READY_TIMEOUT)
        if not line:
            stop_processes([proc])
            assert proc.stderr is not None
            raise AssertionError(f"no ready line: {proc.stderr.read()[-1500:]}")
        info: dict[str, Any] = json.loads(line)
        return info

    def finish(self, proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any] | None, str]:
        try:
            out, err = proc.communicate(timeout=FETCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            stop_processes([proc])
            raise AssertionError("blob get did not finish") from None
        lines = out.strip().splitlines()
        return proc.returncode, json.loads(lines[-1]) if lines else None, err

    def stop(self) -> None:
        stop_processes(self.procs)


def _sent(tb: Testbed) -> dict[str, int]:
    return {name: int(h["sent_bytes"]) for name, h in tb.stats()["hosts"].items()}


def test_natted_providers_are_fetched_from_directly_or_fail_in_one_line(tmp_path: Path) -> None:
    hosts = {
        "relay": Host(delay_ms=20.0),
        "dorm": Host(delay_ms=20.0),  # public, finds home through the DHT
        "home": Host(delay_ms=20.0, nat="eim"),
        "cafe": Host(delay_ms=20.0, nat="eim"),
        "office": Host(delay_ms=20.0, nat="symmetric"),
        "shop": Host(delay_ms=20.0, nat="symmetric"),
    }
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    with Testbed(hosts) as tb:
        run = Procs(tb, tmp_path, authority)
        try:
            relay = run.start(
                "relay", "relay", "--json", "--authority", authority.public_key_bytes.hex(),
                "--listen", f"/ip4/{tb.addr('relay')}/tcp/{RELAY_PORT}",
            )  # fmt: skip
            relay_info = run.ready(relay)
            relay_addr = relay_info["addrs"][0]
            assert tb.addr("relay") in relay_addr

            blob = random.Random(1).randbytes(SIZE)
            (tmp_path / "blob.bin").write_bytes(blob)
            office_blob = run.put("office", random.Random(2).randbytes(SIZE))
            nat = ["--relay", relay_addr, "--bootstrap", relay_addr]
            home = run.start(
                "home", "share", str(tmp_path / "blob.bin"), "--json", *nat,
                "--certificate", run.cert("home"),
            )  # fmt: skip
            office = run.start(
                "office", "serve", "--json", "--no-dht", "--relay", relay_addr,
                "--certificate", run.cert("office"),
            )  # fmt: skip
            home_info, office_info = run.ready(home), run.ready(office)

            # Behind NAT: private, reserved, and only the circuit address handed out.
            for info in (home_info, office_info):
                assert info["public"] is False, info
                circuit = f"{relay_addr}/p2p-circuit/p2p/{info['peer_id']}"
                assert info["addrs"] == info["circuit_addrs"] == [circuit]
            blob_id = home_info["id"]
            assert Ticket.decode(home_info["ticket"]).addrs == (
                f"{relay_addr}/p2p-circuit/p2p/{home_info['peer_id']}",
            )
            office_ticket = Ticket(office_blob, tuple(office_info["addrs"])).encode()

            sent = _sent(tb)
            fetch = ["--json", "--no-upload", "--no-progress"]
            cafe = run.start(
                "cafe", "get", home_info["ticket"], *fetch, "--certificate", run.cert("cafe"),
                "-o", str(tmp_path / "cafe.bin"),
            )  # fmt: skip
            # cafe and dorm punch to home at the same time: py-libp2p's relay closed one
            # circuit's streams when another circuit to the same peer ended (p2p.nat.relay,
            # AdmittedRelay._relay_data), so one of them never punched.
            dorm = run.start(
                "dorm", "get", blob_id, *fetch, "--bootstrap", relay_addr,
                "--certificate", run.cert("dorm"),
            )  # fmt: skip
            shop = run.start(
                "shop", "get", office_ticket, *fetch, "--certificate", run.cert("shop"),
                "--punch-timeout", FAILING_PUNCH_TIMEOUT,
            )  # fmt: skip
            results = {name: run.finish(p) for name, p in (("cafe", cafe), ("dorm", dorm))}
            shop_code, _, shop_err = run.finish(shop)
            after = _sent(tb)

            for name, (code, result, err) in results.items():
                assert code == 0 and result is not None, (name, err)
                assert result["id"] == blob_id
                # The whole blob came from home, over the punched connection.
                assert result["peers"][home_info["peer_id"]]["bytes"] == SIZE, (name, result)
                assert "Traceback" not in err
            assert (tmp_path / "cafe.bin").read_bytes() == blob
            assert after["home"] - sent["home"] >= 2 * SIZE

            # Symmetric NATs: the punch fails, the fetch says so in one line, exit 6.
            assert shop_code == 6, shop_err
            [line] = shop_err.strip().splitlines()
            assert "hole punching" in line and office_info["peer_id"] in line

            # The relay carried signalling only: its own counter, and its host's bytes.
            relay.send_signal(signal.SIGTERM)
            code, stats, err = run.finish(relay)
            assert code == 0 and stats is not None, err
            assert stats["relayed_bytes"] < 3 * SIGNALLING_BYTES, stats
            assert after["relay"] - sent["relay"] < 3 * SIGNALLING_BYTES
        finally:
            run.stop()
