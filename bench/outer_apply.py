"""What applying a round costs a worker at model scale: aggregating the closure's top-k
updates into the next state (``training.outer.aggregate.aggregate``: decode, rules 1-4,
the weighted sum, the outer step), its state root, hashing the state blob's ID (what a
proposer's closure names), and putting that blob in a store on disk from views of the
arrays: the communication time a round spends after its updates have arrived (the
proposer's closure waits on the first three; the blob is stored after it is out).

    .venv/bin/python bench/outer_apply.py [--size 124m] [--workers 3] [--runs 3]

Random pseudo-gradients shaped like the model's layers (``bench/codec.py``'s shapes),
encoded as workers encode them (SparseLoCo with error feedback, the run's default codec);
the process applies the glibc settings a worker runs with (``limit_heap_growth``). The
first run pays for the process's first touch of its memory (slow on a VM whose memory
grows as it is used); the medians are of the runs after it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("124m", "1b"), default="124m")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="after the first (warm-up) one")
    parser.add_argument("--store", type=Path, default=None, help="a folder on the disk to time")
    args = parser.parse_args()

    import numpy as np
    from codec import MODELS  # bench/codec.py: the layers of each model

    from blobstore import Store, blob_id_of
    from training.outer.aggregate import aggregate, wrap_update
    from training.outer.codec import ErrorFeedback
    from training.outer.loop import initial_state, make_update, state_root
    from training.outer.memory import limit_heap_growth
    from training.outer.params import RunParams
    from training.outer.state_blob import state_blocks, state_size

    limit_heap_growth()
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(s, dtype=np.float32) * 0.02 for n, s in MODELS[args.size]()}
    count = sum(v.size for v in params.values())
    run = RunParams("bench", args.workers, 1, 1)
    state = initial_state(params)
    root = state_root(state)
    blobs: dict[str, bytes] = {}
    for w in range(args.workers):
        feedback = ErrorFeedback(run.codec(), decay=run.ef_decay, schema_ref=True)
        end = {
            n: v + rng.standard_normal(v.shape, dtype=np.float32) * 1e-3 for n, v in params.items()
        }
        payload = make_update(state.params, end, feedback)
        blobs[f"peer{w}"] = wrap_update(payload, round_=0, start_root=root, author=f"peer{w}")
        del end, feedback
    entries = [(p, p) for p in blobs]
    print(
        f"{count / 1e6:.1f}M parameters, {args.workers} updates of "
        f"{statistics.mean(len(b) for b in blobs.values()) / 1e6:.2f} MB"
    )
    rows: list[tuple[float, float, float, float]] = []
    with tempfile.TemporaryDirectory(dir=args.store) as tmp:
        store = Store.open(Path(tmp) / "store")
        for r in range(args.runs + 1):
            t0 = time.perf_counter()
            agg = aggregate(state, entries, blobs.__getitem__, run.outer_config(), start_root=root)
            t1 = time.perf_counter()
            state_root(agg.state)
            t2 = time.perf_counter()
            blocks = state_blocks(agg.state)
            blob_id = blob_id_of(blocks)
            t3 = time.perf_counter()
            blob = store.put_blocks(blocks)
            t4 = time.perf_counter()
            assert blob == blob_id
            store.rm(blob)
            size = state_size(blocks)
            del blocks, agg
            row = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
            print(
                f"run {r}{' (warm-up)' if r == 0 else ''}: aggregate {row[0]:.2f} s, state root "
                f"{row[1]:.2f} s, blob ID {row[2]:.2f} s ({size / 1e6:.0f} MB), put "
                f"{row[3]:.2f} s, total {sum(row):.2f} s"
            )
            if r:
                rows.append(row)
    medians = [statistics.median(col) for col in zip(*rows, strict=True)]
    print(
        f"median of {len(rows)}: aggregate {medians[0]:.2f} s, state root {medians[1]:.2f} s, "
        f"blob ID {medians[2]:.2f} s, put {medians[3]:.2f} s"
    )


if __name__ == "__main__":
    main()
