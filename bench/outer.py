"""Benchmark: SparseLoCo-compressed DiLoCo vs dense DiLoCo vs synchronous data parallel.

K simulated workers (one process, torch on one thread) train the tiny Llama on shards of a
synthetic corpus with learnable structure (training.outer.synthetic_tokens). The three
modes see the same data and do the same number of inner steps:

  (a) sparseloco: DiLoCo whose pseudo-gradients go through the top-k 2-bit codec with
      error feedback (training.codec);
  (b) diloco: dense float32 pseudo-gradients, Nesterov outer SGD (lr 0.7, momentum 0.9);
  (c) ddp: one AdamW step per step of every worker, gradients averaged (batch K x B).

Goal (issue 7): (a) ends within 5% of (b)'s held-out loss while each worker sends >= 100x
fewer bytes per round than a dense fp32 pseudo-gradient. Writes a PNG (loss and bytes per
round) and a JSON of the figures under bench/results/ and prints both paths.

    .venv/bin/python bench/outer.py            # the full comparison (a few minutes)
    .venv/bin/python bench/outer.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.outer import SimConfig, SimResult, simulate  # noqa: E402

LOSS_GOAL = 0.05  # (a) within 5% of (b)
BYTES_GOAL = 100.0  # (a) >= 100x fewer bytes than a dense fp32 pseudo-gradient


def _run(config: SimConfig) -> SimResult:
    def progress(done: int, result: SimResult) -> None:
        print(
            f"  [{config.mode}] round {done}/{config.rounds}: held-out "
            f"{result.eval_loss[-1]:.4f}, {result.bytes_per_worker[-1]} B/worker, "
            f"{result.round_seconds[-1]:.1f}s",
            file=sys.stderr,
            flush=True,
        )

    return simulate(config, progress=progress)


def _plot(results: dict[str, SimResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "sparseloco": "(a) SparseLoCo DiLoCo",
        "diloco": "(b) dense DiLoCo",
        "ddp": "(c) synchronous DP",
    }
    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, result in results.items():
        rounds = list(range(len(result.eval_loss)))
        ax_loss.plot(rounds, result.eval_loss, marker=".", label=labels[mode])
        ax_bytes.plot(
            list(range(1, len(result.bytes_per_worker) + 1)),
            result.bytes_per_worker,
            marker=".",
            label=labels[mode],
        )
    dense = next(iter(results.values())).dense_fp32_bytes
    ax_bytes.axhline(dense, color="grey", linestyle="--", label="one dense fp32 pseudo-gradient")
    ax_bytes.axhline(dense / BYTES_GOAL, color="grey", linestyle=":", label="1/100 of that")
    ax_loss.set_xlabel("round")
    ax_loss.set_ylabel("held-out loss (nats/token)")
    ax_loss.set_title("held-out loss per round")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_bytes.set_yscale("log")
    ax_bytes.set_xlabel("round")
    ax_bytes.set_ylabel("bytes sent per worker per round")
    ax_bytes.set_title("communication per round")
    ax_bytes.legend(fontsize=8)
    ax_bytes.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=SimConfig.chunk)
    parser.add_argument("--k", type=int, default=SimConfig.k)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="sparseloco,diloco,ddp")
    parser.add_argument("--quick", action="store_true", help="3 rounds x 3 steps (smoke test)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.inner_steps = 3, 3
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    results: dict[str, SimResult] = {}
    started = time.perf_counter()
    for mode in modes:
        config = SimConfig(
            mode=mode,
            workers=args.workers,
            rounds=args.rounds,
            inner_steps=args.inner_steps,
            chunk=args.chunk,
            k=args.k,
            seed=args.seed,
            threads=1,
        )
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        results[mode] = _run(config)

    summary: dict[str, Any] = {}
    for mode, result in results.items():
        per_round = result.bytes_per_worker[-1] if result.bytes_per_worker else 0
        summary[mode] = {
            "final_eval_loss": result.eval_loss[-1],
            "bytes_per_worker_per_round": per_round,
            "total_bytes_per_worker": sum(result.bytes_per_worker),
            "x_fewer_than_dense_fp32": result.dense_fp32_bytes / per_round if per_round else None,
            "wall_seconds": round(result.wall_seconds, 2),
            "final_state_root": result.state_roots[-1],
        }
    goals: dict[str, Any] = {}
    if "sparseloco" in results and "diloco" in results:
        a, b = results["sparseloco"], results["diloco"]
        gap = a.eval_loss[-1] / b.eval_loss[-1] - 1
        ratio = a.dense_fp32_bytes / max(a.bytes_per_worker)
        goals = {
            "loss_gap_vs_dense_diloco": gap,
            "loss_within_5pct": gap <= LOSS_GOAL,
            "bytes_x_fewer_than_dense_fp32": ratio,
            "bytes_at_least_100x_fewer": ratio >= BYTES_GOAL,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = args.out / f"outer-{stamp}.json"
    png_path = args.out / f"outer-{stamp}.png"
    first = next(iter(results.values()))
    figures = {
        "params": first.params,
        "dense_fp32_bytes": first.dense_fp32_bytes,
        "workers": args.workers,
        "rounds": args.rounds,
        "inner_steps": args.inner_steps,
        "summary": summary,
        "goals": goals,
        "runs": {mode: result.to_json() for mode, result in results.items()},
        "total_wall_seconds": round(time.perf_counter() - started, 2),
    }
    json_path.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    _plot(results, png_path)

    print(
        f"tiny Llama: {first.params} parameters; dense fp32 pseudo-gradient "
        f"{first.dense_fp32_bytes} bytes"
    )
    for mode, row in summary.items():
        ratio = row["x_fewer_than_dense_fp32"]
        print(
            f"{mode:>10}: final held-out loss {row['final_eval_loss']:.4f}, "
            f"{row['bytes_per_worker_per_round']} B/worker/round"
            + (f" ({ratio:.1f}x fewer than dense fp32)" if ratio else "")
            + f", wall {row['wall_seconds']:.1f}s"
        )
    if goals:
        print(
            f"goal: loss gap {goals['loss_gap_vs_dense_diloco'] * 100:+.2f}% "
            f"({'met' if goals['loss_within_5pct'] else 'NOT met'}), "
            f"{goals['bytes_x_fewer_than_dense_fp32']:.1f}x fewer bytes "
            f"({'met' if goals['bytes_at_least_100x_fewer'] else 'NOT met'})"
        )
    print(f"json: {json_path}")
    print(f"png:  {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
