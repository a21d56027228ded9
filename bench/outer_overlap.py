"""Blocking against overlapped outer rounds (the spec's ``overlap``) on the three-continent
testbed, at compute-to-communication ratios set by H: the utilisation curve.

Every point runs ``bench/outer_api_124m.py``'s workers (three ``OuterLoop`` processes, eu,
us and asia, one each, the same model and data) twice at the same H and rounds: blocking
(overlap 0) and overlapped (overlap 1). The ratio is set by H, the model and the links
fixed: a round's communication, C, is what a blocking loop waits at a round's end (the
update made, the round agreed, the state in the model), and t one inner step's seconds,
both measured in a blocking calibration run of each setting; ratio x runs H = round(x * C /
t) steps. Each point also prints the ratio it got (its compute over the blocking run's
wait at that H). Two settings of the inner step, each printed with its name:

- ``sleep``: each step adds a fixed drift to the parameters and sleeps for the rest of the
  real step's time (timed alone): the CPU is left to the worker's own work (encode,
  aggregate, apply), as a GPU worker's would be. The goals are read here. No loss.
- ``cpu``: the real model's inner step (AdamW on Zipf tokens) on the CPU, the workers and
  their nodes sharing the machine's cores. The loss is this setting's.

Per point and mode it prints the medians over the workers' rounds 1..R-2 (round 0 holds
the start, the last round the run's end) of: the utilisation the user's loop saw (seconds
in its inner steps over seconds in its inner steps and in ``loop.step()``), the
utilisation by ``loop.timings`` (compute / (compute + waited); the loop's own clock of
the same seconds, so the two agree unless the loop's accounting is wrong), the seconds
``step()`` waited, the round's communication (seconds from the update handed to the worker to the
next state offered: ``RoundRecord.phases["applied"]``) and the round's compute; and the
mean training loss of the last round (the median over workers).

    sudo .venv/bin/python bench/outer_overlap.py --size 30m --rounds 6           # the curve
    sudo .venv/bin/python bench/outer_overlap.py --size tiny --rounds 4 --ratios 1 \\
        --settings sleep                                                     # a smoke run

``--json-out`` (default ``bench/results/outer-overlap.json``) is rewritten after every run;
a rerun with the same settings skips the points it holds, so a stopped sweep goes on where
it stopped. ``--comm-seconds`` and ``--step-seconds`` skip the calibration.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench.outer_api_124m, bench.wan

from bench import outer_api_124m as api_bench  # noqa: E402

RATIOS = (0.5, 1.0, 2.0, 5.0, 10.0)
SETTINGS = ("sleep", "cpu")
# The calibration run: blocking, sleeping steps, this many seconds of compute a round
# (long enough that the three workers' rounds start apart by less than a step).
CALIBRATION_COMPUTE = 10.0
CALIBRATION_ROUNDS = 4
# Issue 46's goal where a round's communication is no longer than its compute.
GOAL = 0.99


def run_point(
    args: argparse.Namespace,
    tb: Any,
    *,
    setting: str,
    overlap: int,
    inner_steps: int,
    step_s: float,
) -> dict[str, Any]:
    """One run of the three workers; its summary (medians) and its per-round rows."""
    ns = argparse.Namespace(
        size=args.size,
        rounds=args.rounds,
        workers=3,
        inner_steps=inner_steps,
        joiner_round=0,
        no_joiner=True,
        device="cpu",
        dtype="float32",
        batch=args.batch,
        seq=args.seq,
        threads=1,
        lr=args.lr,
        pin=False,
        check=True,
        overlap=overlap,
        sleep_step=step_s if setting == "sleep" else None,
    )
    began = time.monotonic()
    outs, _params, failures = api_bench._run(ns, tb)
    rows = round_rows(outs, inner_steps)
    summary = summarise(rows, outs, args.rounds, inner_steps)
    return {
        "setting": setting,
        "overlap": overlap,
        "inner_steps": inner_steps,
        "step_s": step_s,
        "wall_s": time.monotonic() - began,
        "failures": failures,
        "rows": rows,
        # Per worker, per step: (seconds in the step, seconds in step(), whether it ended
        # a round): where inside a round the loop's seconds went.
        "steps": [out.get("steps", []) for out in outs],
        **summary,
    }


def round_rows(outs: list[dict[str, Any]], h: int) -> list[dict[str, Any]]:
    """Per worker and round: the user's loop's own clock (seconds in its steps, in
    ``step()``), the loop's ``timings``, the worker's phases and the round's mean loss."""
    rows = []
    for i, out in enumerate(outs):
        if not out:
            continue
        records = {rec["round"]: rec for rec in out["rounds"] if rec.get("how") != "caught up"}
        rounds = split_rounds(out.get("steps", []))
        losses = out.get("losses", [])
        for r, (compute, waited, overlapped) in enumerate(out["timings"]):
            in_steps, in_loop = rounds[r] if r < len(rounds) else (math.nan, math.nan)
            window = losses[r * h : (r + 1) * h]  # the r-th round's steps (H each)
            phases = records.get(r, {}).get("phases", {})
            rows.append(
                {
                    "worker": i,
                    "round": r,
                    "in_steps": in_steps,
                    "in_loop": in_loop,
                    "compute": compute,
                    "waited": waited,
                    "overlapped": overlapped,
                    "comm": phases.get("applied", math.nan),
                    "phases": phases,
                    "loss": sum(window) / len(window) if window else math.nan,
                }
            )
    return rows


def split_rounds(steps: list[list[Any]]) -> list[tuple[float, float]]:
    """(seconds in the inner steps, seconds in ``step()``) of each round: the steps up to
    and including the ``step()`` that ended it."""
    out = []
    in_steps = in_loop = 0.0
    for stepped, looped, ended in steps:
        in_steps += stepped
        in_loop += looped
        if ended:
            out.append((in_steps, in_loop))
            in_steps = in_loop = 0.0
    return out


def summarise(
    rows: list[dict[str, Any]], outs: list[dict[str, Any]], rounds: int, h: int
) -> dict[str, Any]:
    """Medians over the workers' rounds 1..R-2, and the last round's loss."""
    inner = [row for row in rows if 1 <= row["round"] <= rounds - 2]

    def median(key: str) -> float:
        values = [v for v in (key_of(row, key) for row in inner) if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    last = [
        statistics.fmean(out["losses"][(rounds - 1) * h : rounds * h])
        for out in outs
        if out and len(out.get("losses", [])) >= rounds * h
    ]
    return {
        "util_loop": median("util_loop"),
        "util_timings": median("util_timings"),
        "min_util_loop": min((key_of(row, "util_loop") for row in inner), default=math.nan),
        "at_goal": sum(key_of(row, "util_loop") >= GOAL for row in inner),
        "waited": median("waited"),
        "in_loop": median("in_loop"),
        "comm": median("comm"),
        "compute": median("compute"),
        "in_steps": median("in_steps"),
        "loss": statistics.median(last) if last else math.nan,
        "samples": len(inner),
    }


def key_of(row: dict[str, Any], key: str) -> float:
    if key == "util_loop":
        return row["in_steps"] / (row["in_steps"] + row["in_loop"])
    if key == "util_timings":
        return row["compute"] / (row["compute"] + row["waited"])
    return float(row[key])


def step_alone(args: argparse.Namespace) -> float:
    """One real inner step's seconds, alone on the machine (what a sleeping step sleeps)."""
    if args.step_seconds:
        return float(args.step_seconds)
    cfg = {k: getattr(args, k) for k in ("size", "batch", "seq", "lr")}
    step_s = api_bench.step_seconds({**cfg, "device": "cpu", "dtype": "float32", "threads": 1})
    print(f"calibrated: one inner step alone {step_s:.3f} s", flush=True)
    return step_s


def calibrate(args: argparse.Namespace, tb: Any, setting: str, alone: float) -> dict[str, float]:
    """``setting``'s t (an inner step's median seconds in a run) and C (the median seconds
    a blocking ``step()`` waited at a round's end), from a blocking run of
    CALIBRATION_ROUNDS rounds of about CALIBRATION_COMPUTE seconds (steps timed alone)."""
    if args.comm_seconds:
        return {"step_s": alone, "comm_s": args.comm_seconds}
    h = max(1, math.ceil(CALIBRATION_COMPUTE / alone))
    saved = args.rounds
    args.rounds = CALIBRATION_ROUNDS
    try:
        point = run_point(args, tb, setting=setting, overlap=0, inner_steps=h, step_s=alone)
    finally:
        args.rounds = saved
    step_s = alone if setting == "sleep" else point["in_steps"] / h
    print(
        f"calibrated {setting}: an inner step {step_s:.2f} s, a blocking round waits "
        f"{point['waited']:.2f} s (H = {h}, median of {point['samples']} rounds)",
        flush=True,
    )
    return {"step_s": step_s, "comm_s": point["waited"]}


def table(points: list[dict[str, Any]]) -> list[str]:
    """The curve as a markdown table, one row per setting, ratio and mode; "got" is the
    point's compute over the wait of the blocking run at the same H."""
    blocking = {(p["setting"], p["ratio"]): p for p in points if not p["overlap"]}
    lines = [
        "| setting | ratio | got | H | mode | compute_s | comm_s | waited_s | util (loop) | "
        "util (timings) | min util (loop) | rounds >= 99% | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(points, key=lambda p: (p["setting"] != "sleep", p["ratio"], p["overlap"])):
        mode = "overlap 1" if p["overlap"] else "blocking"
        loss = "-" if math.isnan(p["loss"]) else f"{p['loss']:.3f}"
        base = blocking.get((p["setting"], p["ratio"]))
        got = f"{p['in_steps'] / base['waited']:.2f}" if base else "-"
        lines.append(
            f"| {p['setting']} | {p['ratio']:g} | {got} | {p['inner_steps']} | {mode} | "
            f"{p['in_steps']:.1f} | {p['comm']:.1f} | {p['waited']:.2f} | "
            f"{p['util_loop']:.1%} | {p['util_timings']:.1%} | {p['min_util_loop']:.1%} | "
            f"{p['at_goal']}/{p['samples']} | {loss} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(api_bench.SIZES), default="30m")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--modes", default="0,1", help="overlap values to run")
    parser.add_argument("--wan-mbit", type=float, default=1000.0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--step-seconds", type=float, default=None, help="skip timing t")
    parser.add_argument("--comm-seconds", type=float, default=None, help="skip measuring C")
    parser.add_argument(
        "--json-out", type=Path, default=REPO / "bench" / "results" / "outer-overlap.json"
    )
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    settings = args.settings.split(",")
    if not set(settings) <= set(SETTINGS):
        raise SystemExit(f"--settings: of {', '.join(SETTINGS)}")
    modes = [int(m) for m in args.modes.split(",")]

    from bench.wan import Testbed
    from bench.wan.testbed import three_continents, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"WAN testbed unavailable: {reason}")
    key = {k: getattr(args, k) for k in ("size", "rounds", "wan_mbit", "batch", "seq", "lr")}
    done: dict[str, Any] = {}
    if args.json_out.exists():
        held = json.loads(args.json_out.read_text())
        if held.get("settings") == key:
            done = held
    points: list[dict[str, Any]] = list(done.get("points", []))
    calibrations: dict[str, dict[str, float]] = dict(done.get("calibrations", {}))
    alone = done.get("step_alone_s") or step_alone(args)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.json_out.write_text(
            json.dumps(
                {
                    "settings": key,
                    "step_alone_s": alone,
                    "calibrations": calibrations,
                    "points": points,
                },
                indent=1,
            )
        )

    with Testbed(three_continents(mbit=args.wan_mbit)) as tb:
        for setting in settings:
            if setting not in calibrations:
                calibrations[setting] = calibrate(args, tb, setting, alone)
                save()
            step_s, comm_s = calibrations[setting]["step_s"], calibrations[setting]["comm_s"]
            for ratio in ratios:
                h = max(1, round(ratio * comm_s / step_s))
                for overlap in modes:
                    if any(
                        (p["setting"], p["ratio"], p["overlap"]) == (setting, ratio, overlap)
                        for p in points
                    ):
                        continue
                    point = run_point(
                        args, tb, setting=setting, overlap=overlap, inner_steps=h, step_s=alone
                    )
                    point["ratio"] = ratio
                    points.append(point)
                    save()
                    print("\n".join(table([point])[2:3]), flush=True)
                    for failure in point["failures"]:
                        print(f"  CHECK FAILED: {failure}", flush=True)
    print("\n".join(table(points)))
    for setting, cal in calibrations.items():
        print(
            f"{setting}: C = {cal['comm_s']:.2f} s, t = {cal['step_s']:.2f} s (calibrated); "
            "medians over 3 workers x rounds 1..R-2"
        )
    print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
