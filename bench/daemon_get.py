"""Wall time of `blob get` of a 1 MiB blob from a warm peer, through a running `blob serve`
on the fetcher's store (the local API) against a get that starts its own node.

Two `blob serve` processes on 127.0.0.1: A holds the blob, B is the fetcher's daemon (its
connection to A is warmed by one fetch first). Each run removes the blob from B's store
and times one `blob get ID --peer A --json` process from start to exit, `--no-daemon` for
the other column. Through the daemon, `blob get` takes the light path (p2p/cli/light.py:
no click, trio, store package or libp2p loaded), so its wall time is an interpreter's start
plus the daemon's fetch (`via_daemon_fetch_median_s`, the result's own `seconds`). The
machine's load average is printed beside the figures: on a loaded
machine interpreter start-up dominates both.

    python bench/daemon_get.py [--runs 5] [--json-out bench/figures/daemon-get-1mib.json]
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


def blob(store: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "p2p.cli", "--store", str(store), "--key",
            str(store.parent / f"{store.name}.key"), *args]  # fmt: skip


def timed_get(store: Path, blob_id: str, addr: str, *extra: str) -> tuple[float, dict[str, object]]:
    subprocess.run(blob(store, "rm", blob_id), capture_output=True, check=False)
    began = time.perf_counter()
    done = subprocess.run(
        blob(store, "get", blob_id, "--peer", addr, "--json", *extra),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return time.perf_counter() - began, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "one.bin"
        data.write_bytes(os.urandom(1 << 20))
        put = subprocess.run(
            blob(root / "a", "put", str(data), "--json"), capture_output=True, text=True, check=True
        )
        blob_id = json.loads(put.stdout)[0]["id"]
        source, info = start_serve(blob(root / "a", "serve", "--json", "--no-dht"))
        daemon, _ = start_serve(blob(root / "b", "serve", "--json", "--no-dht"))
        addr = str(info["addrs"][0])
        try:
            timed_get(root / "b", blob_id, addr)  # warm B's connection to A
            via, own, fetch = [], [], []
            for _ in range(args.runs):
                wall, result = timed_get(root / "b", blob_id, addr)
                assert result.get("via") == "daemon", result
                via.append(wall)
                fetch.append(float(result["seconds"]))  # type: ignore[arg-type]
                wall, result = timed_get(root / "b", blob_id, addr, "--no-daemon")
                assert "via" not in result, result
                own.append(wall)
        finally:
            for proc in (source, daemon):
                stop_serve(proc)
    figures = {
        "blob_bytes": 1 << 20,
        "runs": args.runs,
        "via_daemon_median_s": round(statistics.median(via), 3),
        "via_daemon_min_s": round(min(via), 3),
        "via_daemon_fetch_median_s": round(statistics.median(fetch), 3),
        "own_node_median_s": round(statistics.median(own), 3),
        "own_node_min_s": round(min(own), 3),
        "load_average_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(figures, indent=2))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
