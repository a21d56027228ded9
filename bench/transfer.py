"""Blob transfer benchmark: a verified blob fetch into the store, against limits measured in
the same run on the same machine.

    .venv/bin/python bench/transfer.py [--size-mib 1024] [--runs 3] [--multi-size-mib 1024]
                                       [--json-out bench/results/transfer.json]

Rows (medians of --runs, MB/s = MiB/s):
  raw_tcp          blocking loopback TCP between two processes (bench/stack.py)
  lean_pipe        ChaCha20-Poly1305 frames + BLAKE3 per MiB, blocking sockets (bench/stack.py)
  libp2p_default   one py-libp2p 0.8.1 Noise + yamux stream, 1 MiB writes (bench/stack.py)
  fast_stream      one stream over blobnet's own Noise + yamux (bench/stack.py)
  fast_stream_blake3  the same, with BLAKE3 of each MiB on the receiver: the lean pipe's
                   work over libp2p, so fast_stream_blake3/lean_pipe is what the Noise and
                   yamux layers cost, and blob_fetch/fast_stream_blake3 what the blob layer
                   (store reads and writes, requests, per-chunk work) costs on top
  fast_stream_store  the same stream, its receiver doing a fetch's store work (pooled
                   buffers, each chunk verified and written into a partial blob as the
                   downloader does, published at the end): with
                   fast_stream_blake3 and blob_fetch it splits the fetch's cost into
                   transport, store and blob protocol
  bare_fetch       a fetch's essential work in plain blocking Python: chunks read from a
                   file, blobnet's wire format, each chunk verified and written with
                   O_DIRECT (bench/bare_fetch.py). The pure-Python floor for a fetch:
                   bare_fetch/lean_pipe is what the fetch's extra work (disk read and write,
                   64 KiB Noise frames, headers) costs at best, blob_fetch/bare_fetch what
                   the real stack costs on top
  blob_fetch       `blob get` from one `blob serve` process: manifest, have, chunk ranges,
                   every chunk verified and written into a fresh store, published by rename
  blob_fetch_3     the same blob from three serving processes at once

The fetch rate is the transfer time the fetcher reports (from the first request to the
published blob), not process start-up; the fetcher's peak RSS comes from wait4(). Every
row also prints the CPU it cost per MiB moved, both ends together: for the stack rows the
sender's and receiver's CPU during the transfer, for a fetch the fetcher's CPU from its
request for the manifest to publication (`cpu_s` in `blob get --json`; start-up and
imports excluded) plus the serving processes' during the fetch, from /proc. On a machine
with about one usable core the rate follows from that cost, so it says where a fetch
stands against the lean pipe even when the machine's speed swings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stack  # bench/stack.py, next to this file

MIB = 1 << 20
READY_TIMEOUT = 60.0
FETCH_TIMEOUT = 900.0


def blob(store: Path, key: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "p2p.cli", "--store", str(store), "--key", str(key), *args]


def make_file(path: Path, size: int) -> None:
    block = os.urandom(8 * MIB)
    with path.open("wb") as out:
        left = size
        while left > 0:
            n = min(left, len(block))
            out.write(block[:n])
            left -= n
            # Vary blocks so chunks are distinct (dedup must not flatter the figures).
            block = block[1:] + block[:1]


def serve(store: Path, key: Path, log: Path) -> tuple[subprocess.Popen[str], str]:
    with log.open("wb") as err:
        proc = subprocess.Popen(
            blob(store, key, "serve", "--json", "--no-dht"),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"serve did not start; see {log}")
    return proc, str(json.loads(line)["addrs"][0])


def fetch(store: Path, key: Path, blob_id: str, peers: list[str]) -> dict[str, Any]:
    args = ["get", blob_id, "--json", "--no-progress", "--no-dht"]
    for peer in peers:
        args += ["--peer", peer]
    proc = subprocess.Popen(blob(store, key, *args), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + FETCH_TIMEOUT
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or time.monotonic() > deadline:
        raise SystemExit(f"fetch failed with exit status {proc.returncode}")
    result: dict[str, Any] = json.loads(out)
    result["peak_rss_mib"] = usage.ru_maxrss / 1024
    return result


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fetch_rows(work: Path, size: int, runs: int, providers: int) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    source = work / f"blob-{size}.bin"
    make_file(source, size)
    stores = [work / f"provider{i}" for i in range(providers)]
    blob_id = ""
    for i, store in enumerate(stores):
        done = subprocess.run(
            blob(store, work / f"k{i}", "put", str(source), "--json"),
            capture_output=True,
            text=True,
            check=True,
        )
        blob_id = json.loads(done.stdout)[0]["id"]
    source.unlink()
    procs = []
    addrs = []
    try:
        for i, store in enumerate(stores):
            proc, addr = serve(store, work / f"k{i}", work / f"serve{i}.log")
            procs.append(proc)
            addrs.append(addr)
        rates, rss, seconds, fetcher_cpu, server_cpu = [], [], [], [], []
        for run in range(runs):
            target = work / f"fetcher-{providers}-{run}"
            before = sum(process_cpu_s(p.pid) for p in procs)
            result = fetch(target, work / "kf", blob_id, addrs)
            server_cpu.append(sum(process_cpu_s(p.pid) for p in procs) - before)
            rates.append(size / MIB / result["seconds"])
            seconds.append(result["seconds"])
            rss.append(result["peak_rss_mib"])
            fetcher_cpu.append(result["cpu_s"])
            shutil.rmtree(target)
        return {
            "size_mib": size // MIB,
            "providers": providers,
            "mb_s": statistics.median(rates),
            "runs_mb_s": rates,
            "seconds": statistics.median(seconds),
            "peak_rss_mib": max(rss),
            "fetcher_cpu_s": statistics.median(fetcher_cpu),
            "servers_cpu_s": statistics.median(server_cpu),
            "cpu_ms_per_mib": statistics.median(
                1000 * (f + c) / (size / MIB) for f, c in zip(fetcher_cpu, server_cpu, strict=True)
            ),
        }
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--multi-size-mib", type=int, default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--big-size-mib",
        type=int,
        default=0,
        help="Also one fetch of this size (e.g. 4096) to show the fetcher's RSS stays bounded.",
    )
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="Work directory (default /tmp).")
    args = parser.parse_args(argv)
    size = args.size_mib * MIB
    multi = (args.multi_size_mib or args.size_mib) * MIB

    limits: dict[str, float] = {}
    cpu: dict[str, float] = {}
    work = Path(tempfile.mkdtemp(prefix="blobnet-bench-", dir=args.dir))
    try:
        for mode in stack.ROWS:
            if mode.startswith("fast_stream") and not _fast_available():
                continue
            row = stack.run_row(mode, size, args.runs, work)
            limits[mode] = row.median_mb_s
            cpu[mode] = statistics.median(
                1000 * (r.sender_cpu_s + r.receiver_cpu_s) / row.size_mib for r in row.reps
            )
            print(
                f"{mode:<19}{row.median_mb_s:>8.1f} MB/s  CPU {cpu[mode]:.2f} ms per MiB "
                "(both processes)",
                flush=True,
            )

        one = fetch_rows(work, size, args.runs, providers=1)
        print_fetch("blob_fetch", one)
        three = fetch_rows(work / "multi", multi, args.runs, providers=3)
        print_fetch("blob_fetch_3", three)
        big = fetch_rows(work / "big", args.big_size_mib * MIB, 1, 1) if args.big_size_mib else None
        if big is not None:
            print_fetch("blob_fetch_big", big, f" ({args.big_size_mib} MiB blob)")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ratios = {f"blob_fetch/{k}": one["mb_s"] / v for k, v in limits.items() if v > 0}
    if limits.get("fast_stream_blake3") and limits.get("lean_pipe"):
        # The transport alone (Noise + yamux + BLAKE3, no store, no blob protocol).
        ratios["fast_stream_blake3/lean_pipe"] = limits["fast_stream_blake3"] / limits["lean_pipe"]
    if limits.get("fast_stream_store") and limits.get("fast_stream_blake3"):
        # What writing into the store (verified, O_DIRECT, from threads) costs the stream.
        ratios["fast_stream_store/fast_stream_blake3"] = (
            limits["fast_stream_store"] / limits["fast_stream_blake3"]
        )
    if limits.get("bare_fetch") and limits.get("lean_pipe"):
        # The best a pure-Python fetch could do, against the lean pipe.
        ratios["bare_fetch/lean_pipe"] = limits["bare_fetch"] / limits["lean_pipe"]
    print()
    for name, value in ratios.items():
        print(f"{name:<32}{value:>8.3f}")
    goal_lean = ratios.get("blob_fetch/lean_pipe", 0) >= 0.75
    goal_default = ratios.get("blob_fetch/libp2p_default", 0) >= 5
    goal_rss = one["peak_rss_mib"] < 256
    print(f"goal fetch >= 0.75x lean pipe: {'met' if goal_lean else 'NOT met'}")
    print(f"goal fetch >= 5x py-libp2p default stream: {'met' if goal_default else 'NOT met'}")
    print(f"goal fetcher peak RSS < 256 MiB: {'met' if goal_rss else 'NOT met'}")
    report = {"limits_mb_s": limits, "limits_cpu_ms_per_mib": cpu, "blob_fetch": one,
              "blob_fetch_3": three, "blob_fetch_big": big, "ratios": ratios,
              "runs": args.runs}  # fmt: skip
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_out}")
    return 0


def print_fetch(name: str, row: dict[str, Any], note: str = "") -> None:
    print(
        f"{name:<19}{row['mb_s']:>8.1f} MB/s  peak RSS {row['peak_rss_mib']:.0f} MiB  "
        f"transfer {row['seconds']:.2f} s, CPU {row['cpu_ms_per_mib']:.2f} ms per MiB "
        f"(servers {row['servers_cpu_s']:.2f} s + fetcher {row['fetcher_cpu_s']:.2f} s){note}",
        flush=True,
    )


def _fast_available() -> bool:
    try:
        from p2p.transport.host import fast_path_available
    except ImportError:
        return False
    return fast_path_available()


if __name__ == "__main__":
    raise SystemExit(main())
