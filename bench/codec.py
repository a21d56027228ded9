"""The SparseLoCo codec at model scale: encode (with error feedback) and decode of one
worker's update, time and peak memory, against the dense float32 update's size.

    .venv/bin/python bench/codec.py [--sizes 124m,1b] [--runs 3] [--json-out FILE]

Each size and mode runs in a fresh process (peak RSS is per process, above what the
imports took): random pseudo-gradients shaped like the model's layers (GPT-2 small for
124m, a Llama-style 1.1B for 1b). ``plain``: encode them, then decode the bytes (the
gradients and the decoded update are 1x the dense update each, so 2x is the floor with
no full-size temporaries). ``ef``: a worker's step with error feedback in its second
round (the residual is full, as in every round after the first), then the decode.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


# name -> list of (tensor name, shape): the layers of each model, float32.
def _gpt2_small() -> list[tuple[str, tuple[int, ...]]]:
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes = [("wte", (vocab, d)), ("wpe", (ctx, d)), ("ln_f.w", (d,)), ("ln_f.b", (d,))]
    for i in range(layers):
        p = f"h.{i}."
        shapes += [
            (p + "ln_1.w", (d,)), (p + "ln_1.b", (d,)),
            (p + "attn.c_attn.w", (d, 3 * d)), (p + "attn.c_attn.b", (3 * d,)),
            (p + "attn.c_proj.w", (d, d)), (p + "attn.c_proj.b", (d,)),
            (p + "ln_2.w", (d,)), (p + "ln_2.b", (d,)),
            (p + "mlp.c_fc.w", (d, 4 * d)), (p + "mlp.c_fc.b", (4 * d,)),
            (p + "mlp.c_proj.w", (4 * d, d)), (p + "mlp.c_proj.b", (d,)),
        ]  # fmt: skip
    return shapes


def _llama_1b() -> list[tuple[str, tuple[int, ...]]]:
    d, ff, vocab, layers = 2048, 5632, 32000, 22
    shapes = [("embed", (vocab, d)), ("norm", (d,)), ("lm_head", (vocab, d))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [
            (p + "q", (d, d)), (p + "k", (256, d)), (p + "v", (256, d)), (p + "o", (d, d)),
            (p + "gate", (ff, d)), (p + "up", (ff, d)), (p + "down", (d, ff)),
            (p + "norm1", (d,)), (p + "norm2", (d,)),
        ]  # fmt: skip
    return shapes


MODELS = {"124m": _gpt2_small, "1b": _llama_1b}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _one(size: str, mode: str) -> dict[str, Any]:
    import numpy as np

    from training.outer.codec import CodecParams, ErrorFeedback, decode, encode
    from training.outer.simconfig import SimConfig

    shapes = MODELS[size]()
    numel = sum(int(np.prod(s)) for _, s in shapes)
    rng = np.random.default_rng(0)
    base = _peak_rss_bytes()

    def grads() -> dict[str, Any]:
        return {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes}

    params = CodecParams(chunk=SimConfig.chunk, k=SimConfig.k, rice=True)
    if mode == "ef":
        # A worker's round: the residual (full after the first round) plus its gradients.
        feedback = ErrorFeedback(params)
        first = grads()
        feedback.step(first)
        del first
        second = grads()
        t0 = time.perf_counter()
        data = feedback.step(second)
    else:
        second = grads()
        t0 = time.perf_counter()
        data = encode(second, params)
    encode_s = time.perf_counter() - t0
    del second
    t0 = time.perf_counter()
    decoded = decode(data, max_elements=numel)
    decode_s = time.perf_counter() - t0
    assert len(decoded.tensors) == len(shapes)
    dense = 4 * numel
    peak = _peak_rss_bytes() - base
    return {
        "size": size,
        "mode": mode,
        "params": numel,
        "dense_bytes": dense,
        "update_bytes": len(data),
        "ratio_vs_dense": dense / len(data),
        "encode_s": encode_s,
        "decode_s": decode_s,
        "peak_rss_bytes": peak,
        "peak_rss_vs_dense": peak / dense,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="124m,1b")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--modes", default="plain,ef", help="plain: encode; ef: a worker's step")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(*args.one)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    summary = []
    for size in args.sizes.split(","):
        for mode in args.modes.split(","):
            runs = []
            for _ in range(args.runs):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", size, mode], env=env,
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            row = dict(runs[0])
            for key in ("encode_s", "decode_s", "peak_rss_bytes", "peak_rss_vs_dense"):
                row[key] = statistics.median(r[key] for r in runs)
            summary.append(row)
            print(
                f"{size:>5} {mode:>5}: {row['params'] / 1e6:6.1f}M params, update"
                f" {row['update_bytes'] / 1e6:6.2f} MB ({row['ratio_vs_dense']:.0f}x under"
                f" dense), encode {row['encode_s']:5.2f} s, decode {row['decode_s']:5.2f} s,"
                f" peak RSS {row['peak_rss_bytes'] / 2**30:5.2f} GiB ="
                f" {row['peak_rss_vs_dense']:.2f}x the dense update (median of {args.runs})",
                flush=True,
            )
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
