"""``python -m bench.sim``: run a simulated scenario and write its figures (bench.sim)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _fanout(args: argparse.Namespace) -> dict[str, Any]:
    from bench.sim.fanout import internet_fan_out, wan_fan_out

    if args.testbed:
        result = wan_fan_out(
            args.fetchers,
            args.size_mib * MiB,
            seeder_mbit=args.seeder_mbit,
            worker_mbit=args.down_mbit[1],
            seed=args.seed,
            exact_every=args.exact_every,
        )
    else:
        result = internet_fan_out(
            args.fetchers,
            args.size_mib * MiB,
            seeder_up_mbit=args.seeder_mbit,
            down_mbit=(args.down_mbit[0], args.down_mbit[1]),
            up_ratio=args.up_ratio,
            stagger_s=args.stagger,
            churn=args.churn,
            liars=args.liars,
            seeder_leaves=args.seeder_leaves,
            seed=args.seed,
            exact_every=args.exact_every,
            chunk=args.chunk_mib * MiB,
        )
    summary = result.summary()
    out = {
        "summary": summary,
        "fetchers": [f.__dict__ for f in result.fetchers],
        "one_transfer_s": result.one_transfer_s,
        "seeder_sent": result.seeder_sent,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "params"}, indent=1))
    return out


def _outer(args: argparse.Namespace) -> dict[str, Any]:
    from bench.sim.outer import OuterParams, OuterSim

    params = OuterParams(
        workers=args.workers,
        rounds=args.rounds,
        compute_s=args.compute,
        update_bytes=args.update_bytes,
        state_bytes=args.state_bytes,
        link_mbit=args.link_mbit,
        deadline=args.deadline,
        proposer_timeout=args.proposer_timeout,
        churn=args.churn,
        quorum=args.quorum,
        fetch=args.fetch,
        sample=args.sample,
        seed=args.seed,
        exact_every=args.exact_every,
    )
    report = OuterSim(params).run()
    print(json.dumps({k: v for k, v in report.items() if k != "params"}, indent=1, default=str))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    fan = sub.add_parser("fanout", help="one seeder to many fetchers")
    fan.add_argument("--fetchers", type=int, default=1000)
    fan.add_argument("--size-mib", type=int, default=1024)
    fan.add_argument("--chunk-mib", type=int, default=1, help="the blob's chunk size")
    fan.add_argument("--seeder-mbit", type=float, default=1000.0)
    fan.add_argument("--down-mbit", type=float, nargs=2, default=[10.0, 1000.0])
    fan.add_argument("--up-ratio", type=float, default=1.0)
    fan.add_argument("--stagger", type=float, default=0.0, help="arrivals over this many s")
    fan.add_argument("--churn", type=float, default=0.0, help="share leaving mid-fetch")
    fan.add_argument("--liars", type=float, default=0.0, help="share serving bad chunks")
    fan.add_argument("--seeder-leaves", action="store_true")
    fan.add_argument("--testbed", action="store_true", help="bench.wan's fan-out instead")
    fan.add_argument("--seed", type=int, default=0)
    fan.add_argument("--exact-every", type=float, default=0.5)
    fan.add_argument("--json-out", type=Path)
    fan.add_argument("--plot", type=Path, help="completion-time CDF (PNG)")
    outer = sub.add_parser("outer", help="the outer loop's rounds at K workers")
    outer.add_argument("--workers", type=int, default=64)
    outer.add_argument("--rounds", type=int, default=3)
    outer.add_argument("--compute", type=float, default=60.0)
    outer.add_argument("--update-bytes", type=int, default=3_000_000)
    outer.add_argument("--state-bytes", type=int, default=1_000_000_000)
    outer.add_argument("--link-mbit", type=float, default=100.0)
    outer.add_argument("--deadline", type=float, default=8.0)
    outer.add_argument("--proposer-timeout", type=float, default=3.0)
    outer.add_argument("--churn", type=float, default=0.0)
    outer.add_argument(
        "--quorum", type=int, default=0, help="the run's quorum (0: a majority of the workers)"
    )
    outer.add_argument("--fetch", choices=("swarm", "direct"), default="swarm")
    outer.add_argument("--sample", type=int, help="fetch and name a rotating sample (proposal)")
    outer.add_argument("--seed", type=int, default=0)
    outer.add_argument("--exact-every", type=float, default=1.0)
    outer.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if args.what == "fanout":
        out = _fanout(args)
        if args.plot is not None:
            from bench.sim.figures import plot_fanout

            plot_fanout([out], args.plot)
    else:
        out = _outer(args)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    raise SystemExit(main())
