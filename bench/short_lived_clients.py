"""Short-lived clients against one `blob serve`: what they leave in its DHT routing table,
and whether a later fetcher notices.

One `blob serve` with the DHT holds a 512 KiB blob. N one-shot `blob get ID --bootstrap
SERVER` processes follow, one after another, each from a fresh store with a fresh key (so
a fresh peer ID and a node of its own: the daemon path does not apply). Then a plain
Python program fetches the blob through a `BlockingNode` bootstrapped on the server. The
goal (README, "Running a fleet"): the server's routing table holds no dead client
(`dht_peers` 0 once they are gone) and the BlockingNode prints nothing on stderr.

    python bench/short_lived_clients.py [--gets 50] [--json-out FILE]

tests/p2p/test_fleet_logs.py runs the same scenario with 3 gets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import start_serve, stop_serve  # bench/serving.py, next to this file

BLOCKING_FETCH = """
import sys
from p2p import BlockingNode
with BlockingNode(
    sys.argv[1], listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[sys.argv[2]], dht_server=False
) as node:
    node.fetch(sys.argv[3])
"""


def blob(store: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "p2p.cli", "--store", str(store), "--key",
            str(store.parent / f"{store.name}.key"), *args]  # fmt: skip


def dht_peers(store: Path) -> int:
    done = subprocess.run(
        blob(store, "status", "--json"), capture_output=True, text=True, check=True
    )
    return int(json.loads(done.stdout)["dht_peers"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gets", type=int, default=50)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "w.bin"
        data.write_bytes(os.urandom(512 * 1024))
        server_store = root / "server"
        put = subprocess.run(
            blob(server_store, "put", str(data), "--json"), capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        blob_id = json.loads(put.stdout)[0]["id"]
        server, info = start_serve(
            blob(server_store, "serve", "--json", "--listen", "/ip4/127.0.0.1/tcp/0")
        )
        addr = str(info["addrs"][0])
        walls: list[float] = []
        failures = 0
        try:
            for i in range(args.gets):
                began = time.perf_counter()
                done = subprocess.run(
                    blob(root / f"c{i}", "get", blob_id, "--bootstrap", addr, "--json"),
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                walls.append(time.perf_counter() - began)
                failures += done.returncode != 0
            # The server drops a client from its table when it disconnects.
            deadline = time.monotonic() + 10
            peers_after_gets = dht_peers(server_store)
            while peers_after_gets and time.monotonic() < deadline:
                time.sleep(0.2)
                peers_after_gets = dht_peers(server_store)
            began = time.perf_counter()
            blocking = subprocess.run(
                [sys.executable, "-c", BLOCKING_FETCH, str(root / "bn"), addr, blob_id],
                capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
            blocking_s = time.perf_counter() - began
            peers_at_end = dht_peers(server_store)
        finally:
            stop_serve(server)
    figures = {
        "gets": args.gets,
        "get_failures": failures,
        "get_wall_median_s": round(statistics.median(walls), 3),
        "get_wall_max_s": round(max(walls), 3),
        "server_dht_peers_after_gets": peers_after_gets,
        "blocking_fetch_rc": blocking.returncode,
        "blocking_fetch_stderr_bytes": len(blocking.stderr),
        "blocking_fetch_s": round(blocking_s, 3),
        "server_dht_peers_at_end": peers_at_end,
        "load_average_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(figures, indent=2))
    if blocking.stderr:
        print(blocking.stderr[-2000:], file=sys.stderr)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
