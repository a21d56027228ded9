"""Benchmark: SparseLoCo-compressed DiLoCo vs dense DiLoCo vs synchronous data parallel.

K simulated workers (one process, torch on one thread) train the tiny Llama on shards of a
synthetic corpus with learnable structure (training.outer.loop.synthetic_tokens). The three
modes see the same data and do the same number of inner steps:

  (a) sparseloco: DiLoCo whose pseudo-gradients go through the top-k 2-bit codec with
      error feedback (training.outer.codec);
  (b) diloco: dense float32 pseudo-gradients, Nesterov outer SGD (lr 0.7, momentum 0.9);
  (c) ddp: one AdamW step per step of every worker, gradients averaged (batch K x B).

Goal (issue 7): (a) ends within 5% of (b)'s held-out loss while each worker sends >= 100x
fewer bytes per round than a dense fp32 pseudo-gradient. Writes a PNG (loss and bytes per
round) and a JSON of the figures under bench/results/ and prints both paths.

    .venv/bin/python bench/outer.py            # the full comparison (a few minutes)
    .venv/bin/python bench/outer.py --quick    # a smoke run

Issue 18's honest comparison: ``--grid`` tunes dense DiLoCo and SparseLoCo on grids of the
same size, data and steps: the same outer learning rates, times each method's own second
axis (dense DiLoCo: Nesterov outer momentum 0 / 0.9, so plain averaging, lr 1 / momentum 0,
is in it; SparseLoCo: error-feedback decay 1 / 0.9, its paper's stand-in for momentum;
``--second-axis momentum`` gives both the momentum axis, the first grid), at the setting
given and at ``--settings`` others, and prints the grid and the best of each, with the
whole grid as a markdown table naming both axes (``--jobs N`` runs N grid points at once,
each a single-threaded process; a run whose held-out loss goes above its start is stopped
and shown as diverged, the same rule for both methods). Its goal: SparseLoCo within 3% of
the best dense DiLoCo at >= 146x fewer bytes than dense fp32, at two settings:

    .venv/bin/python bench/outer.py --grid --rounds 30 --inner-steps 50 --jobs 2
    .venv/bin/python bench/outer.py --grid --rounds 50 --inner-steps 20 --jobs 2
    .venv/bin/python bench/outer.py --grid --rounds 50 --inner-steps 20 --workers 8 --jobs 2

``--byzantine`` runs the setting given with one more worker that sends, in turn, a huge
update, garbage at the clip norm, the negated honest sum at the clip norm, a copy of an
honest payload in its own envelope, an empty update, and an honest update amplified to the
clip norm (which no rule can tell from honest), each against the same run without it under
the same aggregation (training.outer.aggregate); goal: never more than 1% worse:

    .venv/bin/python bench/outer.py --byzantine --rounds 40

Issue 17's network figures: ``--net`` runs ``blob outer run`` (K processes on 127.0.0.1,
gossipsub) and prints the bytes each worker's TCP sockets moved per round, next to the
update blob's size; ``--churn N`` runs N local runs of 3 workers with one paused past the
deadline and counts forks and non-zero exits:

    .venv/bin/python bench/outer.py --net --workers 3 --rounds 5 --inner-steps 2
    .venv/bin/python bench/outer.py --churn 20
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

from training.outer.simconfig import SimConfig, SimResult  # noqa: E402
from training.outer.simulate import simulate  # noqa: E402

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


# Issue 18's grid: plain averaging (1.0, 0.0) is in it; so are DiLoCo's (0.7, 0.9) and
# SparseLoCo's tuned default (3.0, 0.0).
GRID_LR = (0.7, 1.0, 2.0, 3.0)
GRID_MOMENTUM = (0.0, 0.9)

# The grid's second axis, one per method, each with the method's own momentum-like knob and
# the same number of values (so both get the same runs of the same data and steps): dense
# DiLoCo's Nesterov outer momentum, and SparseLoCo's error-feedback decay, the accumulator
# its paper uses in place of an outer momentum (Nesterov on top of it diverged or was far
# behind at lr >= 1 in every setting of --second-axis momentum). Decay 1 is the bench's
# default; 0.9 was chosen after it helped at 50 inner steps (bench/figures/outer-issue-18-
# grid.md says so). ``--second-axis momentum`` gives the old grid: momentum for both.
OWN_AXES: dict[str, tuple[str, tuple[float, ...]]] = {
    "diloco": ("outer_momentum", GRID_MOMENTUM),
    "sparseloco": ("ef_decay", (1.0, 0.9)),
}
SHARED_AXES: dict[str, tuple[str, tuple[float, ...]]] = {
    "diloco": ("outer_momentum", GRID_MOMENTUM),
    "sparseloco": ("outer_momentum", GRID_MOMENTUM),
}
AXIS_LABEL = {"outer_momentum": "mu", "ef_decay": "decay"}
AXIS_NAME = {"outer_momentum": "Nesterov momentum", "ef_decay": "error-feedback decay"}


def grid_axes(second_axis: str) -> dict[str, tuple[str, tuple[float, ...]]]:
    """Each method's second grid axis: its own knob ("own") or momentum for both."""
    axes = {"own": OWN_AXES, "momentum": SHARED_AXES}[second_axis]
    sizes = {len(values) for _, values in axes.values()}
    assert len(sizes) == 1, "both methods get the same number of grid points"
    return axes


def grid_point(mode: str, lr: float, axis: str, value: float) -> dict[str, float]:
    """The outer hyper-parameters of one grid point: the axis not tuned stays at the
    method's untuned value (no outer momentum, error-feedback decay 1)."""
    point = {"outer_lr": lr, "outer_momentum": 0.0, "ef_decay": 1.0}
    point[axis] = value
    return point


def vars_of_base(args: argparse.Namespace) -> dict[str, int]:
    return {"workers": args.workers, "inner_steps": args.inner_steps, "rounds": args.rounds}


class _Diverged(Exception):
    """A grid run whose held-out loss went above where it started (or NaN)."""


def _grid_run(config: SimConfig) -> dict[str, Any]:
    """One grid point; a run that diverges is stopped (the same rule for both methods: it
    cannot be the best, and the grid's largest steps diverge within a few rounds)."""
    import math

    def watch(done: int, result: SimResult) -> None:
        loss = result.eval_loss[-1]
        if math.isnan(loss) or (done >= 3 and loss > result.eval_loss[0]):
            raise _Diverged(done)

    started = time.perf_counter()
    try:
        result = simulate(config, progress=watch)
    except _Diverged as stop:
        return {"loss": float("inf"), "diverged_at": stop.args[0], "x": None, "curve": []}
    return {
        "loss": result.eval_loss[-1],
        "x": result.dense_fp32_bytes / max(result.bytes_per_worker),
        "bytes": max(result.bytes_per_worker),
        "curve": result.eval_loss,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _grid_map(jobs: int, configs: list[SimConfig]) -> Any:
    """The grid's runs, in order: one at a time in this process, or ``jobs`` at once."""
    if jobs <= 1:
        yield from map(_grid_run, configs)
        return
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    # Spawned workers: each is one single-threaded torch process (no fork after torch).
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        yield from pool.map(_grid_run, configs)


def _grid(args: argparse.Namespace) -> dict[str, Any]:
    """Both methods on grids of the same size and budget, at each setting; the best of each."""
    axes = grid_axes(args.second_axis)
    settings: list[dict[str, Any]] = [{}]
    for spec in filter(None, (args.settings or "").split(";")):
        settings.append({k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))})
    out: dict[str, Any] = {
        "grid": {
            "outer_lr": GRID_LR,
            "second_axis": {
                mode: {"name": axis, "values": values} for mode, (axis, values) in axes.items()
            },
            "points_per_method": len(GRID_LR) * len(next(iter(axes.values()))[1]),
        }
    }
    points = []
    for extra in settings:
        base = {
            "workers": args.workers,
            "rounds": args.rounds,
            "inner_steps": args.inner_steps,
            "chunk": args.chunk,
            "k": args.k,
            "seed": args.seed,
            "threads": 1,
            **extra,
        }
        for mode, (axis, values) in axes.items():
            for lr in GRID_LR:
                for value in values:
                    points.append((extra, base, mode, grid_point(mode, lr, axis, value)))
    configs = [
        SimConfig(
            mode=mode,
            outer_lr=hyper["outer_lr"],
            outer_momentum=hyper["outer_momentum"],
            ef_decay=hyper["ef_decay"],
            **base,
        )
        for _, base, mode, hyper in points
    ]
    results = []
    for point, result in zip(points, _grid_map(args.jobs, configs), strict=True):
        extra, base, mode, hyper = point
        axis = axes[mode][0]
        results.append(result)
        shown = (
            f"diverged at round {result['diverged_at']}"
            if "diverged_at" in result
            else f"held-out {result['loss']:.4f}, {result['x']:.0f}x fewer bytes, "
            f"{result['seconds']}s"
        )
        print(
            f"  {extra or 'default'} {mode:>10} lr {hyper['outer_lr']:<4} "
            f"{AXIS_LABEL[axis]} {hyper[axis]:<4}: {shown}",
            file=sys.stderr,
            flush=True,
        )
    rows = [
        {
            **base,
            "mode": mode,
            "lr": hyper["outer_lr"],
            "mu": hyper["outer_momentum"],
            "ef_decay": hyper["ef_decay"],
            "axis": axes[mode][0],
            **result,
        }
        for (_, base, mode, hyper), result in zip(points, results, strict=True)
    ]
    width = len(next(iter(axes.values()))[1])
    table = [
        "| setting | method | second axis (a, b) | "
        + " | ".join(f"lr {lr} {ab}" for lr in GRID_LR for ab in "ab"[:width])
        + " | best | bytes vs fp32 |"
    ]
    table.append("|---" * (5 + len(GRID_LR) * width) + "|")
    for extra in settings:
        best: dict[str, dict[str, Any]] = {}
        at_setting = {**vars_of_base(args), **extra}
        label = (
            f"{at_setting['workers']} workers x {at_setting['inner_steps']} steps x "
            f"{at_setting['rounds']} rounds"
        )
        for mode, (axis, values) in axes.items():
            mine = [
                r
                for r, (e, *_rest) in zip(rows, points, strict=True)
                if e == extra and r["mode"] == mode
            ]
            cells = ["diverged" if r["loss"] == float("inf") else f"{r['loss']:.4f}" for r in mine]
            top = min(mine, key=lambda r: r["loss"])
            tag = AXIS_LABEL[axis]
            at = "mu" if axis == "outer_momentum" else "ef_decay"
            best[mode] = {"loss": top["loss"], "lr": top["lr"], axis: top[at], "axis": axis}
            ratios = [r["x"] for r in mine if r["x"] is not None]
            table.append(
                f"| {label} | {mode} | {AXIS_NAME[axis]} "
                f"({', '.join(str(v) for v in values)}) | "
                + " | ".join(cells)
                + f" | **{top['loss']:.4f}** (lr {top['lr']}, {tag} {top[at]}) | "
                + (f"{min(ratios):.0f}x |" if ratios else "- |")
            )
        gap = best["sparseloco"]["loss"] / best["diloco"]["loss"] - 1

        def named(b: dict[str, Any]) -> str:
            return f"lr {b['lr']}, {AXIS_LABEL[b['axis']]} {b[b['axis']]}"

        print(
            f"setting {label}: best dense DiLoCo {best['diloco']['loss']:.4f} "
            f"({named(best['diloco'])}), best SparseLoCo {best['sparseloco']['loss']:.4f} "
            f"({named(best['sparseloco'])}): gap {gap * 100:+.2f}% (goal <= +3%)"
        )
        out.setdefault("best", []).append({"setting": {**extra}, "best": best, "gap": gap})
    print("\n".join(table))
    out["table"] = table
    out["runs"] = rows
    return out


SIZE_ORDER = {"tiny": 0, "small": 1}  # the study table's order of model sizes

# --study point keys: the grid's outer knobs, the codec's, and simconfig.SimConfig.ablation.
STUDY_KEYS = {
    "lr": "outer_lr",
    "mu": "outer_momentum",
    "decay": "ef_decay",
    "k": "k",
    "chunk": "chunk",
    "ablation": "ablation",
    "overlap": "overlap",  # overlapped rounds (training.outer.simulate point 3)
    "at": "overlap_at",
}


def parse_points(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``"diloco:lr=1,mu=0;sparseloco:lr=2,decay=0.9,k=64"`` -> [(mode, SimConfig fields)];
    knobs not named stay at no outer momentum and error-feedback decay 1."""
    points = []
    for item in filter(None, (p.strip() for p in spec.split(";"))):
        mode, _, knobs = item.partition(":")
        point: dict[str, Any] = {"outer_momentum": 0.0, "ef_decay": 1.0}
        for kv in filter(None, knobs.split(",")):
            key, _, value = kv.partition("=")
            field_ = STUDY_KEYS[key.strip()]
            point[field_] = (
                value if field_ == "ablation"
                else int(value) if field_ in ("k", "chunk", "overlap")
                else float(value)
            )  # fmt: skip
        if "outer_lr" not in point:
            raise SystemExit(f"study point {item!r} names no lr")
        points.append((mode.strip(), point))
    return points


def _study_key(row: dict[str, Any]) -> tuple[Any, ...]:
    fields = ("mode", "workers", "inner_steps", "rounds", "seed", "point")
    return (model_of(row), *(row[k] for k in fields))


def model_of(row: dict[str, Any]) -> str:
    """A study row's model size (rows without one are the tiny model's)."""
    return str(row.get("model_size", "tiny"))


def _point_label(mode: str, point: dict[str, Any]) -> str:
    short = {v: k for k, v in STUDY_KEYS.items()}
    knobs = [f"{short[k]} {v}" for k, v in sorted(point.items()) if k in short and v != ""]
    return f"{mode} " + ", ".join(knobs)


def _study(args: argparse.Namespace) -> dict[str, Any]:
    """Each point at each seed, one single-threaded run at a time; the JSON at
    ``--study-out`` is rewritten after every run (a stopped study keeps what it finished,
    and a rerun skips it), then the table of medians (``study_table``)."""
    import os

    path: Path = args.study_out
    rows: list[dict[str, Any]] = json.loads(path.read_text())["runs"] if path.exists() else []
    done = {_study_key(r) for r in rows}
    seeds = [int(s) for s in args.seeds.split(",")]
    for mode, point in parse_points(args.study):
        for seed in seeds:
            row = {
                "model_size": args.model_size,
                "mode": mode,
                "workers": args.workers,
                "inner_steps": args.inner_steps,
                "rounds": args.rounds,
                "seed": seed,
                "point": _point_label(mode, point),
            }
            if _study_key(row) in done:
                continue
            config = SimConfig(
                mode=mode,
                workers=args.workers,
                rounds=args.rounds,
                inner_steps=args.inner_steps,
                seed=seed,
                threads=1,
                model_size=args.model_size,
                **{"chunk": args.chunk, "k": args.k, **point},
            )
            result = _grid_run(config)
            rows.append({**row, **point, "k": config.k, "chunk": config.chunk, **result})
            done.add(_study_key(row))
            print(f"  {row['point']} seed {seed}: {result['loss']:.4f}", file=sys.stderr)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps({"runs": rows}, indent=1, default=str) + "\n")
            os.replace(tmp, path)
    table = study_table(rows)
    print("\n".join(table))
    return {"runs": rows, "table": table}


def study_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per setting: each point's held-out loss per seed and median, and its gap to the
    dense DiLoCo point with the lowest median (tuned on the same grid): the median over
    seeds of the per-seed gap, and the gap of the medians."""
    from statistics import median

    table = [
        "| setting | point | held-out loss per seed | median | gap vs tuned dense "
        "(median of per-seed, of medians) | bytes vs fp32 |",
        "|---|---|---|---|---|---|",
    ]

    def setting(r: dict[str, Any]) -> tuple[int, str, int, int, int]:
        model = model_of(r)
        return (SIZE_ORDER.get(model, len(SIZE_ORDER)), model, r["workers"], r["inner_steps"],
                r["rounds"])  # fmt: skip

    for order, model, workers, steps, rounds in sorted({setting(r) for r in rows}):
        mine = [r for r in rows if setting(r) == (order, model, workers, steps, rounds)]
        by_point: dict[str, dict[int, dict[str, Any]]] = {}
        for r in mine:
            by_point.setdefault(r["point"], {})[r["seed"]] = r
        medians = {p: median(x["loss"] for x in s.values()) for p, s in by_point.items()}
        dense = [p for p in by_point if p.startswith("diloco")]
        best = min(dense, key=medians.__getitem__) if dense else None
        label = f"{model}, {workers} workers x {steps} steps x {rounds} rounds"
        for point in sorted(by_point, key=medians.__getitem__):
            seeds = by_point[point]
            losses = ", ".join(
                f"s{seed} " + ("diverged" if r["loss"] == float("inf") else f"{r['loss']:.4f}")
                for seed, r in sorted(seeds.items())
            )
            gap = "-"
            if best is not None:
                ref = by_point[best]
                per_seed = [r["loss"] / ref[s]["loss"] - 1 for s, r in seeds.items() if s in ref]
                of_medians = medians[point] / medians[best] - 1
                gap = f"{median(per_seed) * 100:+.2f}%, {of_medians * 100:+.2f}%"
            ratios = [r["x"] for r in seeds.values() if r.get("x")]
            shown = (
                "ablation (dense bytes)"
                if "ablation" in point
                else f"{min(ratios):.0f}x"
                if ratios
                else "-"
            )
            mark = " (tuned dense)" if point == best else ""
            shown_point = point.replace("decay 1.0, ", "") if point.startswith("diloco") else point
            table.append(
                f"| {label} | {shown_point}{mark} | {losses} | **{medians[point]:.4f}** | {gap} | "
                f"{shown} |"
            )
        table.extend(_overlap_gaps(label, by_point))
    return table


def _overlap_gaps(label: str, by_point: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """Each overlapped point's held-out loss against the same point blocking (the median
    over seeds of the per-seed gap): what overlapping rounds costs in loss."""
    from statistics import median

    out = []
    for point, seeds in sorted(by_point.items()):
        if "overlap 1" not in point:
            continue
        blocking = ", ".join(
            part for part in point.split(", ") if not part.startswith(("overlap", "at "))
        )
        ref = by_point.get(blocking)
        if ref is None:
            continue
        gaps = [r["loss"] / ref[s]["loss"] - 1 for s, r in seeds.items() if s in ref]
        out.append(f"| {label} | {point} against blocking | | | {median(gaps) * 100:+.2f}% | |")
    return out


def _evidence(args: argparse.Namespace) -> dict[str, Any]:
    """Bytes per round of a finished run's evidence in one worker's store (what ``blob outer
    verify`` needs and ``blob gc`` keeps: training.outer.milestones rule 2), next to the
    size of one state blob (which may go)."""
    import re
    from statistics import mean

    from blobstore import Store

    store = Store.open(args.evidence)
    run = re.escape(args.run_id)
    kinds = {"updates": "update blobs", "closure": "closures", "milestone": "milestones"}
    rows: dict[str, list[int]] = {
        k: [] for k in ("update blobs", "update collections", "closures", "milestones", "verdicts")
    }
    rounds, states = set(), []
    for name, blob in store.tags().items():
        size = store.manifest(blob).size
        if re.fullmatch(rf"outer-{run}-(state-\d+|start)", name):
            states.append(size)
        m = re.fullmatch(rf"outer-{run}-(updates|closure|milestone|verdict)-(\d+)(-.*)?", name)
        if m is None:
            continue
        rounds.add(int(m.group(2)))
        if m.group(1) == "updates":
            rows["update collections"].append(size)
            children = store.read_collection(blob)
            rows["update blobs"].extend(store.manifest(e.blob_id).size for e in children)
        else:
            rows[kinds.get(m.group(1), "verdicts")].append(size)
    n = max(len(rounds), 1)
    per_round = {
        k: {"count": len(v), "bytes_per_round": sum(v) / n, "each": round(mean(v)) if v else 0}
        for k, v in rows.items()
    }
    total = sum(sum(v) for v in rows.values()) / n
    for k, v in per_round.items():
        print(f"{k:>18}: {v['bytes_per_round']:>8.0f} B per round ({v['count']} of {v['each']} B)")
    print(f"{'evidence':>18}: {total:>8.0f} B per round over {n} rounds; one state blob "
          f"{max(states, default=0)} B")  # fmt: skip
    return {"rounds": n, "per_round": per_round, "evidence_bytes_per_round": total,
            "state_blob_bytes": max(states, default=0)}  # fmt: skip


def _attacks(config: SimConfig) -> dict[str, Any]:
    """Issue 18's byzantine worker, one kind per run: each makes its payload from the
    round's honest updates (the strongest thing a worker that sees them can send)."""
    import numpy as np

    from training.outer.aggregate import CLIP_FACTOR
    from training.outer.codec import CodecParams, decode, encode, encode_dense

    codec = CodecParams(chunk=config.chunk, k=config.k)
    rng = np.random.default_rng([config.seed, 18])

    def pack(tensors: dict[str, Any]) -> bytes:
        if config.mode == "diloco":
            return encode_dense(tensors)
        return encode(tensors, codec)

    def norm(tensors: Any) -> float:
        return float(
            np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in tensors.values()))
        )

    def at_clip(tensors: dict[str, Any], updates: Any) -> bytes:
        """``tensors`` scaled so its decoded norm is CLIP_FACTOR x the honest median: the
        most an update can bring before rule 3 down-weights it."""
        norms = sorted(norm(u) for u in updates.values())
        target = CLIP_FACTOR * norms[(len(norms) - 1) // 2]
        got = norm(
            decode(pack(tensors), max_elements=sum(v.size for v in tensors.values())).tensors
        )
        factor = np.float32(target / got) if got > 0 else np.float32(0)
        return pack({n: v * factor for n, v in tensors.items()})

    def first(payloads: Any) -> str:
        return sorted(payloads)[0]

    def huge(state: Any, payloads: Any, updates: Any) -> bytes:
        u = updates[first(payloads)]
        return pack({n: v * np.float32(1e30) for n, v in u.items()})

    def garbage(state: Any, payloads: Any, updates: Any) -> bytes:
        noise = {
            n: rng.standard_normal(v.shape).astype(np.float32) for n, v in state.params.items()
        }
        return at_clip(noise, updates)

    def negated(state: Any, payloads: Any, updates: Any) -> bytes:
        mean = {n: -sum(u[n] for u in updates.values()) for n in state.params}
        return at_clip(mean, updates)

    def copy(state: Any, payloads: Any, updates: Any) -> bytes:
        return bytes(payloads[first(payloads)])

    def empty(state: Any, payloads: Any, updates: Any) -> bytes:
        return pack({n: np.zeros_like(v) for n, v in state.params.items()})

    def amplified(state: Any, payloads: Any, updates: Any) -> bytes:
        """An honest update re-sent at the clip norm: agrees, so no rule excludes it; it
        only weighs one worker's view of the round about three times."""
        return at_clip(dict(updates[first(payloads)]), updates)

    return {
        "huge": huge,
        "garbage": garbage,
        "negated": negated,
        "copy": copy,
        "empty": empty,
        "amplified": amplified,
    }


def _byzantine(args: argparse.Namespace) -> dict[str, Any]:
    """Held-out loss with one byzantine worker of each kind, against the same run without
    it (same aggregation rule), and against the plain mean for reference (issue 18 goal)."""
    base = SimConfig(
        mode=args.modes.split(",")[0],
        workers=args.workers,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        chunk=args.chunk,
        k=args.k,
        seed=args.seed,
        threads=1,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )
    clean = simulate(base, robust=True)
    plain = simulate(base)
    cosines = [c for rnd in clean.agreement for c in rnd] or [float("nan")]
    honest_out = sum(len(rnd) for rnd in clean.excluded)
    out: dict[str, Any] = {
        "config": clean.config.__dict__,
        "without": clean.eval_loss[-1],
        "plain_mean": plain.eval_loss[-1],
        "agreement": clean.agreement,
        "honest_excluded": clean.excluded,
        "kinds": {},
    }
    print(
        f"{base.mode}, {base.workers} honest workers x {base.rounds} rounds x "
        f"{base.inner_steps} steps: held-out {clean.eval_loss[-1]:.4f} without a byzantine "
        f"worker ({plain.eval_loss[-1]:.4f} with the plain mean); honest cosines "
        f"{min(cosines):.2f}..{max(cosines):.2f}; honest updates excluded: {honest_out}",
        flush=True,
    )
    kinds = [k for k in args.kinds.split(",") if k]
    attacks = _attacks(clean.config)
    for kind in kinds:
        attacked = simulate(base, adversary=attacks[kind])
        loss = attacked.eval_loss[-1]
        # Any exclusion counts: a re-wrapped copy excludes whichever of the two sorts later.
        reasons = sorted({r.split(": ", 1)[1] for rnd in attacked.excluded for r in rnd})
        caught = sum(bool(rnd) for rnd in attacked.excluded)
        worse = loss / clean.eval_loss[-1] - 1
        same = attacked.state_roots == clean.state_roots
        out["kinds"][kind] = {
            "loss": loss,
            "worse": worse,
            "rounds_excluded": caught,
            "reasons": reasons,
            "same_bits": same,
        }
        print(
            f"  {kind:>8}: held-out {loss:.4f} ({worse * 100:+.2f}% vs without; goal <= +1%), "
            f"excluded in {caught}/{base.rounds} rounds {reasons}; "
            f"{'bit-identical run' if same else 'different run'}",
            flush=True,
        )
    return out


def _net(args: argparse.Namespace) -> dict[str, Any]:
    """``blob outer run``: wire bytes per worker per round, from the workers' sockets."""
    from training.outer.launch import default_workdir, prepare_run, run_local, summarise
    from training.outer.params import RunParams

    params = RunParams(
        run_id="bench",
        workers=args.workers,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        deadline=args.deadline,
        proposer_timeout=1.0,
        # Replays fetch a worker's inner state (1.5 MB on the tiny model): counted here
        # they would hide what the round itself costs on the wire.
        replay_rate=0.0,
    )
    with default_workdir() as tmp:
        summary = summarise(run_local(prepare_run(Path(tmp), params), timeout=1200))
    rows = []
    for result in summary["results"]:
        if result is None:
            continue
        recs = result["rounds"]
        update = max(r["update_bytes"] for r in recs)
        sent = sum(r["wire_sent"] for r in recs) / len(recs)
        received = sum(r["wire_received"] for r in recs) / len(recs)
        ann_sent = sum(r["pubsub_sent"] for r in recs) / len(recs)
        ann_received = sum(r["pubsub_received"] for r in recs) / len(recs)
        rows.append(
            {
                "peer": result["peer_id"],
                "update": update,
                "sent": sent,
                "received": received,
                "announcements_published": ann_sent,
                "announcements_delivered": ann_received,
            }
        )
        print(
            f"worker {result['shard']}: update blob {update} B; per round on the wire "
            f"{sent:.0f} B sent, {received:.0f} B received ({sent / update:.2f}x / "
            f"{received / update:.2f}x the update); announcement payloads {ann_sent:.0f} B "
            f"published, {ann_received:.0f} B delivered"
        )
    print(
        f"finished {summary['finished']}/{summary['workers']}, "
        f"roots agree: {summary['roots_agree']}"
    )
    return {"params": params.__dict__, "workers": rows, "roots_agree": summary["roots_agree"]}


def _churn(args: argparse.Namespace) -> dict[str, Any]:
    """N local runs of 3 workers with one paused past the deadline: forks and bad exits."""
    import tempfile

    from training.outer.churn import ChurnPlan, churn_run
    from training.outer.launch import prepare_run
    from training.outer.params import RunParams

    params = RunParams(
        run_id="churn", workers=3, rounds=4, inner_steps=2, deadline=4.0, proposer_timeout=2.0
    )
    churn = ChurnPlan(pause=1, pause_after=0, pause_s=3 * params.deadline)
    forks = bad_exits = caught = 0
    for i in range(args.churn):
        with tempfile.TemporaryDirectory(prefix="blob-churn-") as tmp:
            res = churn_run(prepare_run(Path(tmp), params), churn, timeout=600)
        forks += res.forked(churn)
        bad_exits += not res.all_exit_zero(churn)
        # The pause must have mattered: rounds the others closed without the paused worker.
        paused = res.results.get(1)
        others = res.results.get(0)
        without = (
            sum(
                all(x["peer"] != paused["peer_id"] for x in rec["included"])
                for rec in others["rounds"]
            )
            if paused is not None and others is not None
            else 0
        )
        hows = [rec["how"] for rec in paused["rounds"]] if paused is not None else []
        caught += "caught up" in hows
        print(
            f"run {i + 1}/{args.churn}: exits {res.returncodes}, "
            f"{'FORK' if res.forked(churn) else 'one root'}; paused worker: {hows}; "
            f"rounds closed without it: {without}",
            flush=True,
        )
    print(
        f"{args.churn} runs: {forks} forks, {bad_exits} runs with a non-zero honest exit, "
        f"{caught} in which the paused worker caught up from a state blob"
    )
    return {"runs": args.churn, "forks": forks, "bad_exits": bad_exits, "caught_up": caught}


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
    parser.add_argument("--grid", action="store_true", help="tune both methods (issue 18)")
    parser.add_argument(
        "--settings", default="", help='more settings, e.g. "workers=8;inner_steps=20"'
    )
    parser.add_argument("--net", action="store_true", help="wire bytes of blob outer run")
    parser.add_argument("--deadline", type=float, default=6.0)
    parser.add_argument("--churn", type=int, default=0, help="N paused-worker runs")
    parser.add_argument(
        "--byzantine", action="store_true", help="loss with and without a byzantine worker"
    )
    parser.add_argument("--kinds", default="huge,garbage,negated,copy,empty,amplified")
    parser.add_argument("--jobs", type=int, default=1, help="grid runs in parallel")
    parser.add_argument(
        "--second-axis",
        choices=("own", "momentum"),
        default="own",
        help="the grid's second axis: each method's own knob (DiLoCo Nesterov momentum, "
        "SparseLoCo error-feedback decay) or momentum for both (the first grid)",
    )
    parser.add_argument("--outer-lr", type=float, default=None)
    parser.add_argument("--outer-momentum", type=float, default=None)
    parser.add_argument(
        "--study",
        default="",
        metavar="POINTS",
        help='points at every --seeds seed, e.g. "diloco:lr=1,mu=0;sparseloco:lr=2,decay=0.9"',
    )
    parser.add_argument("--seeds", default="0,1,2", help="the study's seeds")
    parser.add_argument(
        "--model-size",
        choices=("tiny", "small"),
        default="tiny",
        help="the study's model (training.model.SIZES: tiny ~0.12M, small ~3.7M parameters)",
    )
    parser.add_argument(
        "--evidence", type=Path, default=None, metavar="STORE", help="a run's evidence bytes"
    )
    parser.add_argument("--run-id", default="local", help="the run --evidence measures")
    parser.add_argument(
        "--study-out",
        type=Path,
        default=REPO / "bench" / "results" / "outer-study.json",
        help="the study's runs (resumed: points already in it are not rerun)",
    )
    parser.add_argument(
        "--study-table", nargs="*", default=None, metavar="JSON", help="print a study's table"
    )
    args = parser.parse_args(argv)
    if args.study_table:
        rows = [r for f in args.study_table for r in json.loads(Path(f).read_text())["runs"]]
        print("\n".join(study_table(rows)))
        return 0
    special = {
        "grid": _grid,
        "net": _net,
        "churn": _churn,
        "byzantine": _byzantine,
        "study": _study,
        "evidence": _evidence,
    }
    for name, run in special.items():
        if getattr(args, name):
            figures = run(args)
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"outer-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
            path.write_text(json.dumps(figures, indent=2, sort_keys=True, default=str) + "\n")
            print(f"json: {path}")
            return 0
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
