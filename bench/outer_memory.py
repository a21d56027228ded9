"""Memory and disk per outer-loop worker as the run goes on.

Runs K local worker processes (``training.outer.launch``: real nodes, stores and TCP on
127.0.0.1) on the built-in model and prints, per worker, its peak resident memory (from
its result: ``getrusage`` in the worker), that minus the interpreter-and-libraries floor
per parameter, and its store's size on disk::

    .venv/bin/python bench/outer_memory.py --model-size small --rounds 3 --rounds 30

The goal it is held to: peak RSS <= 36 bytes per float32 parameter + 1 GiB, the same at
round 3 as at round 30, and disk bounded by the kept state blobs (``store_by_kind_mib``:
state blobs, inner-state blobs, other blobs, the rest of the store directory).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
# The goal's slope: parameters, outer momentum, error-feedback residual, the inner
# optimizer's two moments, a gradient, and a decoded update and aggregate, float32 each.
GOAL_BYTES_PER_PARAM = 36


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _breakdown(root: Path) -> dict[str, float]:
    """MiB of a store by kind: state blobs, inner-state blobs, other blobs, the rest of the
    directory (manifests, tags, partials)."""
    import msgpack

    from blobstore import Store
    from training.outer.state_blob import BadStateBlob, decode_state

    store = Store.open(root)
    sizes = {"state": 0, "inner": 0, "other": 0}
    for blob in store.blob_ids():
        path = store.path(blob)
        size = path.stat().st_size
        data = path.read_bytes()
        try:
            decode_state(data)
            sizes["state"] += size
            continue
        except BadStateBlob:
            pass
        try:
            obj = msgpack.unpackb(data, raw=False)
        except Exception:  # not msgpack: another kind of blob
            obj = None
        kind = "inner" if isinstance(obj, dict) and set(obj) == {"v", "opt", "ef"} else "other"
        sizes[kind] += size
    out = {k: round(v / (1 << 20), 1) for k, v in sizes.items()}
    out["rest"] = round((_du(root) - sum(sizes.values())) / (1 << 20), 1)
    return out


def run(size: str, workers: int, rounds: int, inner_steps: int) -> dict[str, object]:
    from training.model import make_tiny_llama
    from training.outer.launch import prepare_run, run_local
    from training.outer.params import RunParams

    params_count = sum(p.numel() for p in make_tiny_llama(size).parameters())
    params = RunParams(
        f"mem-{size}-{rounds}",
        workers=workers,
        rounds=rounds,
        inner_steps=inner_steps,
        model_size=size,
        deadline=6.0,
        proposer_timeout=1.0,
    )
    with tempfile.TemporaryDirectory(prefix="bench-outer-mem-") as tmp:
        plan = prepare_run(Path(tmp), params)
        started = time.monotonic()
        results = run_local(plan, timeout=600 + rounds * 60)
        seconds = time.monotonic() - started
        disk = [_du(w.store) for w in plan.workers]
        kinds = [_breakdown(w.store) for w in plan.workers]
    rows = []
    for i, result in enumerate(results):
        if result is None:
            rows.append({"worker": i, "failed": True})
            continue
        rss = int(result["peak_rss_bytes"])
        rows.append(
            {
                "worker": i,
                "peak_rss_mib": round(rss / (1 << 20), 1),
                "bytes_per_param_over_1gib": round(max(0, rss - GIB) / params_count, 1),
                "bytes_per_param": round(rss / params_count, 1),
                "store_mib": round(disk[i] / (1 << 20), 1),
                "store_by_kind_mib": kinds[i],
                "final_round": result["final_round"],
            }
        )
    goal = GIB + GOAL_BYTES_PER_PARAM * params_count
    return {
        "model_size": size,
        "parameters": params_count,
        "rounds": rounds,
        "inner_steps": inner_steps,
        "workers": rows,
        "goal_peak_rss_mib": round(goal / (1 << 20), 1),
        "seconds": round(seconds, 1),
        "meets_goal": all(
            not r.get("failed") and r["peak_rss_mib"] * (1 << 20) <= goal for r in rows
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rounds", type=int, action="append", help="repeatable (3 and 30)")
    parser.add_argument("--inner-steps", type=int, default=5)
    args = parser.parse_args()
    for rounds in args.rounds or [3]:
        print(json.dumps(run(args.model_size, args.workers, rounds, args.inner_steps), indent=2))


if __name__ == "__main__":
    main()
