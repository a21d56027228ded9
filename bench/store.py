"""Store benchmark: ``Store.put_path`` against a lean read + BLAKE3 + write loop.

Both run in the same process on the same file, alternating, so they see the same disk,
page cache and CPU. The lean loop is the floor of what a put must do: read 8 MiB blocks,
BLAKE3 each 1 MiB chunk, write the block to another file, fsync it. ``put`` adds the
manifest, the durable publish and the bookkeeping. Goal: put >= 0.8x the lean loop.

It also times ``Store.export`` of the same blob three ways (issue 14: ``-o`` after a
fetch re-hashed and copied what had just been verified): the default (each chunk hashed
again, cloned or copied), ``verify=False`` (copy only), and ``link="hardlink"`` (nothing
copied), each against the lean loop's rate.

    .venv/bin/python bench/store.py [--size-mib 1024] [--runs 3] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from blake3 import blake3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blobstore import DEFAULT_CHUNK_SIZE, ExportLink, Store

BLOCK = 8 * 1024 * 1024
MIB = 1024 * 1024


def make_input(path: Path, size: int) -> None:
    """Random-ish bytes (a repeated random 64 MiB block is enough for hashing speed)."""
    pattern = os.urandom(min(size, 64 * MIB)) if size else b""
    with open(path, "wb") as f:
        left = size
        while left > 0:
            piece = pattern[: min(left, len(pattern))]
            f.write(piece)
            left -= len(piece)
        f.flush()
        os.fsync(f.fileno())


def lean_loop(src: Path, dst: Path, chunk: int = DEFAULT_CHUNK_SIZE) -> float:
    """Seconds to read, hash per chunk and write ``src`` to ``dst``, fsync included."""
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    hashes = bytearray()
    start = time.perf_counter()
    fd_in = os.open(src, os.O_RDONLY)
    fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while n := os.readv(fd_in, [view]):
            for off in range(0, n, chunk):
                hashes += blake3(view[off : min(off + chunk, n)]).digest()
            out = view[:n]
            while out:
                out = out[os.write(fd_out, out) :]
        os.fsync(fd_out)
    finally:
        os.close(fd_in)
        os.close(fd_out)
    elapsed = time.perf_counter() - start
    os.unlink(dst)
    return elapsed


def store_put(store: Store, src: Path) -> float:
    start = time.perf_counter()
    blob_id = store.put_path(src)
    elapsed = time.perf_counter() - start
    store.rm(blob_id)
    return elapsed


def store_export(store: Store, blob_id: str, dst: Path, verify: bool, link: ExportLink) -> float:
    start = time.perf_counter()
    store.export(blob_id, dst, verify=verify, link=link)
    elapsed = time.perf_counter() - start
    os.unlink(dst)
    return elapsed


EXPORTS: dict[str, tuple[bool, ExportLink]] = {
    "export_verified": (True, "reflink"),  # the default
    "export_unhashed": (False, "reflink"),
    "export_hardlink": (False, "hardlink"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="input size (default 1024)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each (median reported)")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: temp)")
    parser.add_argument("--json-out", type=Path, default=None, help="write results as JSON")
    args = parser.parse_args()
    size = args.size_mib * MIB
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="blobnet-bench-") as tmp:
        work = Path(tmp)
        src = work / "input.bin"
        make_input(src, size)
        store = Store.open(work / "store")
        lean_loop(src, work / "warm.bin")  # warm the page cache equally for both
        lean_times, put_times = [], []
        export_times: dict[str, list[float]] = {name: [] for name in EXPORTS}
        for _ in range(args.runs):
            lean_times.append(lean_loop(src, work / "lean.bin"))
            put_times.append(store_put(store, src))
        blob_id = store.put_path(src)
        for _ in range(args.runs):
            for name, (verify, link) in EXPORTS.items():
                out = work / "out.bin"
                export_times[name].append(store_export(store, blob_id, out, verify, link))
    lean = statistics.median(lean_times)
    put = statistics.median(put_times)
    mb = size / 1e6
    result = {
        "size_bytes": size,
        "runs": args.runs,
        "lean_seconds": lean_times,
        "put_seconds": put_times,
        "lean_mb_s": mb / lean,
        "put_mb_s": mb / put,
        "ratio": lean / put,
        "goal": 0.8,
        **{f"{name}_seconds": times for name, times in export_times.items()},
        **{f"{name}_mb_s": mb / statistics.median(t) for name, t in export_times.items()},
    }
    print(f"input            {size / MIB:.0f} MiB, median of {args.runs}")
    print(f"lean loop        {result['lean_mb_s']:8.1f} MB/s")
    print(f"Store.put_path   {result['put_mb_s']:8.1f} MB/s")
    print(f"ratio put/lean   {result['ratio']:8.3f}  (goal >= 0.8)")
    for name in EXPORTS:
        rate = result[f"{name}_mb_s"]
        print(f"{name:<16} {rate:8.1f} MB/s  ({rate / result['lean_mb_s']:.2f}x the lean loop)")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
