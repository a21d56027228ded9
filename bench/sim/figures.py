"""Plots of the simulator's results (matplotlib, the bench extra).

    python -m bench.sim.figures fanout OUT.png RUN.json [RUN.json ...]
    python -m bench.sim.figures outer OUT.png RUN.json [RUN.json ...]

``fanout``: for each run (``python -m bench.sim fanout --json-out``), the CDF over honest
fetchers of the share of its own downlink each one got (one transfer at its link's rate
over its time from arrival to holding the blob), with Kraken's 50% and the goal's 2x
marked. ``outer``: per run (``python -m bench.sim outer --json-out``), a worker's median
communication per round in seconds and in bytes against K, each over the all-to-all floor.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _label(run: dict[str, Any]) -> str:
    p = run["summary"]["params"]
    parts = [f"{p['size'] / (1 << 20):g} MiB to {p['fetchers']} fetchers"]
    if p.get("stagger_s"):
        parts.append(f"over {p['stagger_s']:g} s")
    if p.get("churn"):
        parts.append(f"{p['churn']:.0%} leave")
    if p.get("liars"):
        parts.append(f"{p['liars']:.0%} liars")
    if p.get("seeder_leaves"):
        parts.append("seeder leaves")
    return ", ".join(parts)


def plot_fanout(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        size = run["summary"]["size"]
        shares = sorted(
            (size / f["down_bps"]) / (f["done"] - f["arrived"])
            for f in run["fetchers"]
            if not f["liar"] and not f["churned"] and f["done"] is not None
        )
        if not shares:
            continue
        ys = [(k + 1) / len(shares) for k in range(len(shares))]
        ax.step(shares, ys, where="post", label=_label(run))
    ax.axvline(0.5, color="grey", linestyle="--", linewidth=1)
    ax.text(0.51, 0.03, "50% of its downlink\n(Kraken; 2x one transfer)", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("share of its own downlink a fetcher got (one transfer / its time)")
    ax.set_ylabel("fraction of honest fetchers")
    mbit = runs[0]["summary"]["params"].get("seeder_up_mbit", 1000.0)
    ax.set_title(f"One {mbit:g} Mbit/s seeder, links of 10 Mbit/s-1 Gbit/s, simulated (bench/sim)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_outer(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    for run in runs:
        p = run["params"]
        ks = p["workers"]
        label = f"compute {p['compute_s']:g} s" + (
            f", sample {p['sample']}" if p.get("sample") else ""
        )
        rounds = run["rounds"]
        if not rounds:
            continue
        comm = sorted(r["comm_s_median"] for r in rounds)[len(rounds) // 2]
        byts = sorted(r["bytes_in_median"] for r in rounds)[len(rounds) // 2]
        left.scatter([ks], [comm], label=label)
        right.scatter([ks], [byts / 1e6], label=label)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers K")
        ax.grid(True, alpha=0.3)
    ks = [64, 128, 256]
    link = runs[0]["params"]["link_mbit"] * 1e6 / 8 if runs else 12.5e6
    update = runs[0]["params"]["update_bytes"] if runs else 3e6
    left.plot(ks, [(k - 1) * update / link for k in ks], "k--", linewidth=1, label="floor")
    right.plot(ks, [(k - 1) * update / 1e6 for k in ks], "k--", linewidth=1, label="floor")
    left.set_ylabel("communication per round (s, median worker)")
    right.set_ylabel("bytes received per round (MB, median worker)")
    left.legend(fontsize=8)
    fig.suptitle("Outer loop, 3 MB updates on 100 Mbit/s links, simulated (bench/sim)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[0] not in ("fanout", "outer"):
        print(__doc__, file=sys.stderr)
        return 2
    runs = [json.loads(Path(f).read_text()) for f in args[2:]]
    (plot_fanout if args[0] == "fanout" else plot_outer)(runs, Path(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
