"""Bytes on the wire of a local hub-less outer-loop run, per worker per round (issue 17).

    .venv/bin/python bench/outer_net.py --workers 3 --rounds 5 [--replay-rate 0.25]
                                        [--model-size small]
    .venv/bin/python bench/outer_net.py --wan-runs 1 --rounds 6 --deadline 8   (root)
    .venv/bin/python bench/outer_net.py --nat-runs 3 [--nat symmetric] [--via-relay]  (root)

Runs ``blob outer run``'s K worker processes on 127.0.0.1 and reads what each worker's TCP
sockets moved per round (``p2p.transport.meter``: announcements, closures, attestations,
verdicts, blob fetches and handshakes, framing and encryption included). Each figure is
given against the update blob and against the floor of an all-to-all exchange, where
every worker sends its update to and fetches one from each of the K - 1 others:
``(K - 1) x update`` each way. Replay traffic (the inner state a replayer fetches: three
times the model in float32) is counted when ``--replay-rate`` is above 0; the default 0
measures the loop itself. Byte counts do not depend on the machine's speed; which rounds
a slow worker misses (and so what it fetches) can.

``--wan-runs N`` runs issue 17's churn on the WAN testbed instead (``bench/wan``'s
three-continent preset, two workers per host; see :func:`wan_churn`). ``--nat-runs N``
runs ``bench.wan.outer_nat``'s three workers (two behind NATs of kind ``--nat``, with a
relay) N times and prints whether all agreed, whether home and cafe punched, and what
crossed the relay (issue 20 item 5).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from training.outer.launch import default_workdir, prepare_run, run_local, summarise
    from training.outer.params import RunParams

    params = RunParams(
        run_id="bench-net",
        workers=args.workers,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        deadline=args.deadline,
        proposer_timeout=1.0,
        replay_rate=args.replay_rate,
        model_size=args.model_size,
    )
    with default_workdir() as tmp:
        summary = summarise(run_local(prepare_run(Path(tmp), params), timeout=1200))
    rows = []
    k = params.workers
    for result in summary["results"]:
        if result is None:
            continue
        recs = result["rounds"]
        update = max(r["update_bytes"] for r in recs)
        n = len(recs)
        row = {
            "peer": result["peer_id"],
            "update": update,
            "sent": sum(r["wire_sent"] for r in recs) / n,
            "received": sum(r["wire_received"] for r in recs) / n,
            "announcements_published": sum(r["pubsub_sent"] for r in recs) / n,
            "announcements_delivered": sum(r["pubsub_received"] for r in recs) / n,
        }
        rows.append(row)
        floor = max(1, k - 1) * update
        print(
            f"worker {result['shard']}: update {update} B; per round {row['sent']:.0f} B sent "
            f"({row['sent'] / update:.2f}x the update, {row['sent'] / floor:.2f}x the "
            f"all-to-all floor), {row['received']:.0f} B received "
            f"({row['received'] / update:.2f}x, {row['received'] / floor:.2f}x); announcement "
            f"payloads {row['announcements_published']:.0f} B published, "
            f"{row['announcements_delivered']:.0f} B delivered"
        )
    done = f"{summary['finished']}/{summary['workers']}"
    print(f"finished {done}, roots agree: {summary['roots_agree']}")
    return {"params": params.__dict__, "workers": rows, "roots_agree": summary["roots_agree"]}


def wan_churn(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 17's WAN churn run: 6 workers over the three-continent preset (two per host)
    with a deadline that fits its RTTs; worker 0 (everyone's bootstrap peer) killed after
    round 1, worker 1 stopped after round 2 until worker 2 has closed round 4, and a late
    joiner. Counts forks and honest non-zero exits."""
    import tempfile

    from bench.wan import THREE_CONTINENTS, Testbed
    from bench.wan.testbed import unavailable_reason
    from training.outer.churn import ChurnPlan, churn_run
    from training.outer.launch import prepare_run
    from training.outer.params import RunParams

    reason = unavailable_reason()
    if reason is not None:
        print(f"WAN testbed unavailable: {reason}")
        return {"skipped": reason}
    params = RunParams(
        run_id="wan-churn",
        workers=6,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        deadline=args.deadline,
        proposer_timeout=3.0,
        replay_rate=args.replay_rate,
    )
    hosts = list(THREE_CONTINENTS)
    churn = ChurnPlan(
        pause=1,
        pause_after=2,
        pause_s=2 * params.deadline,
        resume_when=(2, 4),
        kill=0,
        kill_after=1,
        join=True,
    )
    runs = []
    for n in range(args.wan_runs):
        with (
            tempfile.TemporaryDirectory(prefix="blob-wan-churn-") as tmp,
            Testbed(THREE_CONTINENTS) as tb,
        ):
            plan = prepare_run(Path(tmp), params, slots=params.workers + 1)

            def place(i: int, argv: list[str], tb: Testbed = tb) -> list[str]:
                host = hosts[i % len(hosts)]
                return tb.argv(host, [*argv, "--listen", f"/ip4/{tb.addr(host)}/tcp/0"])

            res = churn_run(plan, churn, timeout=1200, place=place)
        hows = {
            i: [rec["how"] for rec in r["rounds"]] for i, r in res.results.items() if r is not None
        }
        run = {
            "exits": res.returncodes,
            "forked": res.forked(churn),
            "honest_exit_zero": res.all_exit_zero(churn),
            "events": res.events,
            "hows": hows,
        }
        runs.append(run)
        print(
            f"WAN churn run {n + 1}/{args.wan_runs}: exits {res.returncodes}, "
            f"{'FORK' if run['forked'] else 'one root'}; events {res.events}; paths {hows}",
            flush=True,
        )
    forks = sum(r["forked"] for r in runs)
    bad = sum(not r["honest_exit_zero"] for r in runs)
    print(f"{len(runs)} WAN churn runs: {forks} forks, {bad} with a non-zero honest exit")
    return {"params": params.__dict__, "runs": runs, "roots_agree": forks == 0 and bad == 0}


def nat_runs(args: argparse.Namespace) -> dict[str, Any]:
    """``--nat-runs``: see the module docstring; a run counts as good when all three
    workers exit 0 on one final root with every update included."""
    import tempfile

    from bench.wan.outer_nat import run_outer_nat
    from bench.wan.testbed import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"WAN testbed unavailable: {reason}")
        return {"skipped": reason}
    runs = []
    extra = ("--via-relay",) if args.via_relay else ()
    for n in range(args.nat_runs):
        with tempfile.TemporaryDirectory(prefix="blob-outer-nat-") as tmp:
            run = run_outer_nat(Path(tmp), nat=args.nat, worker_extra=extra)
        results = list(run.results.values())
        included = {x["peer"] for r in results for rec in r["rounds"] for x in rec["included"]}
        good = (
            len(results) == 3
            and len({r["final_root"] for r in results}) == 1
            and set(run.peers.values()) <= included
        )
        row: dict[str, Any] = {
            "good": good,
            "exits": run.exits,
            "seconds": round(run.seconds, 1),
            "relayed_bytes": run.relayed_bytes,
            "relay_host_sent": run.sent.get("relay"),
            "direct_flows": run.direct_flows,
            "update_bytes": min(
                (rec["update_bytes"] for r in results for rec in r["rounds"]), default=0
            ),
        }
        runs.append(row)
        print(f"NAT run {n + 1}/{args.nat_runs} ({args.nat}): {row}", flush=True)
    goods = sum(bool(r["good"]) for r in runs)
    punched = sum(int(r["direct_flows"]) > 0 for r in runs)
    print(
        f"{len(runs)} runs behind {args.nat} NATs: {goods} good, {punched} punched, relay "
        f"carried {[r['relayed_bytes'] for r in runs]} B"
    )
    return {"nat": args.nat, "runs": runs, "roots_agree": goods == len(runs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=6.0)
    parser.add_argument("--replay-rate", type=float, default=0.0)
    parser.add_argument(
        "--model-size",
        choices=("tiny", "small"),
        default="tiny",
        help="small (3.7M parameters) shows what a round's fixed bytes weigh against a "
        "larger update",
    )
    parser.add_argument("--json", type=Path, default=None, help="Write the figures here.")
    parser.add_argument(
        "--wan-runs",
        type=int,
        default=0,
        help="Instead: this many churn runs of 6 workers on the three-continent testbed.",
    )
    parser.add_argument(
        "--nat-runs",
        type=int,
        default=0,
        help="Instead: this many 3-worker runs, two workers behind NATs with a relay.",
    )
    parser.add_argument("--nat", choices=("eim", "symmetric"), default="eim")
    parser.add_argument(
        "--via-relay", action="store_true", help="--nat-runs: NATed workers get --via-relay."
    )
    args = parser.parse_args(argv)
    run = nat_runs if args.nat_runs else wan_churn if args.wan_runs else measure
    out = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return 0 if out["roots_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
