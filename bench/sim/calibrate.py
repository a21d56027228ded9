"""Calibration: the same fan-out as real processes on bench/wan's testbed and in the
simulator, side by side.

A real run is bench.wan.scenarios.fan_out's, with the links as parameters: a seeder on
``seeder_mbit`` up (1 Gbit/s down, 20 ms one-way), N `blob get`s on ``worker_mbit`` links
with one-way delays of 20-40 ms, every get given only the seeder, started together at a
barrier after its imports, default options (no --listen). Each get's report gives the
wall-clock time its download began (the manifest in: ``done_at - seconds``) and ended
(``done_at``); the seeder's uplink bytes come from the forwarder.

The simulated run has the same hosts, and each fetcher starts where the real one's
manifest came in, less the dial and manifest round trips the simulation adds itself: the
real start-up after the barrier (node, key, listen: CPU work on a loaded machine, not the
network) is taken from the real run, and what follows is the model's. Compared: the time
until every fetcher holds the blob, and the bytes that left the seeder.

The machine's CPU is sampled (/proc/stat) over each real run: a run during which it had
no idle time was CPU-bound, and its times say as much about the machine's other tenants
as about the network.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 1 << 20
GATE_TIMEOUT = 60.0


@dataclass
class RealRun:
    workers: int
    size: int
    seeder_mbit: float
    worker_mbit: float
    starts: list[float]  # barrier -> each get's manifest in
    dones: list[float]  # barrier -> each get's blob complete
    seeder_uplink: int
    idle_share: float  # of the machine's CPU time over the run
    failures: int
    # Per get: bytes it took from the seeder, and its process's CPU seconds (its report).
    from_seeder: list[int] | None = None
    cpu_s: list[float] | None = None

    @property
    def all_hold_s(self) -> float:
        return max(self.dones)

    def to_json(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "size": self.size,
            "seeder_mbit": self.seeder_mbit,
            "worker_mbit": self.worker_mbit,
            "starts": self.starts,
            "dones": self.dones,
            "seeder_uplink": self.seeder_uplink,
            "idle_share": self.idle_share,
            "failures": self.failures,
            "from_seeder": self.from_seeder,
            "cpu_s": self.cpu_s,
        }


def _cpu_times() -> tuple[float, float]:
    """(idle, total) jiffies of the whole machine."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return idle, sum(fields[:8])


def real_fan_out(
    work: Path, workers: int, size: int, *, seeder_mbit: float, worker_mbit: float
) -> RealRun:
    """One fan-out as real processes (see the module docstring)."""
    from bench.wan.blobnodes import Barrier, BlobNode, write_random_file
    from bench.wan.testbed import Host, Testbed

    data = work / "blob.bin"
    write_random_file(data, size, seed=47)
    seeder = BlobNode(work / "seeder", "seed")
    blob_id = seeder.put(data)
    nodes = [BlobNode(work / f"w{k}", f"w{k}") for k in range(workers)]
    hosts = {"seed": Host(delay_ms=20.0, up_mbit=seeder_mbit, down_mbit=1000.0)}
    for k in range(workers):
        delay = 20.0 + 20.0 * k / max(1, workers - 1)
        hosts[f"w{k}"] = Host(delay_ms=delay, up_mbit=worker_mbit, down_mbit=worker_mbit)
    (work / "barrier").mkdir()
    barrier = Barrier(work / "barrier", work / "barrier" / "go", GATE_TIMEOUT)
    try:
        with Testbed(hosts) as tb:
            served = seeder.serve(tb)
            gettings = [
                n.start_get(tb, blob_id, [served.addr], barrier=barrier, default_listen=True)
                for n in nodes
            ]
            deadline = time.monotonic() + GATE_TIMEOUT
            while time.monotonic() < deadline and not all(
                g.proc.poll() is not None or barrier.ready(n)
                for n, g in zip(nodes, gettings, strict=True)
            ):
                time.sleep(0.02)
            idle0, total0 = _cpu_times()
            barrier.go.touch()
            go = time.time()
            results = [g.wait(60.0 + 40.0 * size / (seeder_mbit * 1e6 / 8)) for g in gettings]
            idle1, total1 = _cpu_times()
            uplink = int(tb.stats()["hosts"]["seed"]["uplink_bytes"])
            seeder.stop()
    finally:
        for node in [seeder, *nodes]:
            shutil.rmtree(node.root, ignore_errors=True)
    starts, dones, from_seeder, cpu_s = [], [], [], []
    seeder_id = served.peer_id
    for r in results:
        peers = r.report.get("peers", {})
        from_seeder.append(sum(int(v.get("bytes", 0)) for k, v in peers.items() if k == seeder_id))
        cpu_s.append(float(r.report.get("cpu_s", 0.0)))
        done_at, seconds = r.report.get("done_at"), r.report.get("seconds")
        if done_at is None or seconds is None:
            continue
        dones.append(float(done_at) - go)
        starts.append(float(done_at) - float(seconds) - go)
    return RealRun(
        workers,
        size,
        seeder_mbit,
        worker_mbit,
        starts,
        dones,
        uplink,
        (idle1 - idle0) / max(1.0, total1 - total0),
        sum(1 for r in results if r.returncode != 0),
        from_seeder,
        cpu_s,
    )


def sim_fan_out(real: RealRun, *, seed: int = 0, **kwargs: Any) -> dict[str, Any]:
    """The simulated twin of ``real`` (manifests aligned, see the module docstring)."""
    from bench.sim.fanout import wan_fan_out

    base = wan_fan_out(
        real.workers,
        real.size,
        seeder_mbit=real.seeder_mbit,
        worker_mbit=real.worker_mbit,
        seed=seed,
        **kwargs,
    )
    # Where the simulation's own dial and manifest put each fetcher's download start.
    own = [f.manifest for f in base.fetchers]
    starts = sorted(real.starts)
    order = sorted(range(real.workers), key=lambda k: own[k] or 0.0)
    offsets = [0.0] * real.workers
    if len(starts) == real.workers:
        for rank, k in enumerate(order):
            offsets[k] = max(0.0, starts[rank] - (own[k] or 0.0))
    aligned = wan_fan_out(
        real.workers,
        real.size,
        seeder_mbit=real.seeder_mbit,
        worker_mbit=real.worker_mbit,
        seed=seed,
        arrivals=offsets,
        **kwargs,
    )
    hold = aligned.all_hold_s()
    return {
        "all_hold_s": hold,
        "seeder_ratio": aligned.seeder_sent / real.size,
        "hold_from_manifest_s": None if hold is None else hold - min(real.starts or [0.0]),
        "wall_s": aligned.wall_s,
    }


def compare(real: RealRun, sim: dict[str, Any]) -> dict[str, Any]:
    one = real.size / (real.seeder_mbit * 1e6 / 8)
    return {
        "workers": real.workers,
        "size_mib": real.size // MiB,
        "seeder_mbit": real.seeder_mbit,
        "worker_mbit": real.worker_mbit,
        "real_hold_s": round(real.all_hold_s, 2),
        "sim_hold_s": round(sim["all_hold_s"], 2),
        "hold_diff": round(sim["all_hold_s"] / real.all_hold_s - 1, 3),
        "real_hold_ratio": round(real.all_hold_s / one, 2),
        "sim_hold_ratio": round(sim["all_hold_s"] / one, 2),
        "real_seeder": round(real.seeder_uplink / real.size, 3),
        "sim_seeder": round(sim["seeder_ratio"], 3),
        "seeder_diff": round(sim["seeder_ratio"] / (real.seeder_uplink / real.size) - 1, 3),
        "real_start_s": round(statistics.median(real.starts), 2) if real.starts else None,
        "idle_share": round(real.idle_share, 3),
        "failures": real.failures,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--size-mib", type=int, default=32)
    parser.add_argument("--seeder-mbit", type=float, default=20.0)
    parser.add_argument("--worker-mbit", type=float, default=100.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument(
        "--goal",
        action="store_true",
        help="the testbed goal instead: fan_out at --workers, --size-mib (64), in turn with --base",
    )
    parser.add_argument("--base", type=Path, help="a tree to compare against (PYTHONPATH)")
    parser.add_argument(
        "--outer",
        type=int,
        metavar="K",
        help="the outer loop instead: K real workers on the testbed against the simulator",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument(
        "--cpu-mbyte",
        type=float,
        help="the simulated testbed's shared CPU: MB/s of payload all its processes move",
    )
    parser.add_argument(
        "--handling-ms", type=float, default=0.0, help="a message's wait for a CPU, ms"
    )
    parser.add_argument(
        "--from",
        dest="saved",
        type=Path,
        help="simulate again the real runs saved by an earlier --json-out (no testbed)",
    )
    args = parser.parse_args(argv)
    from bench.sim.world import Costs

    model: dict[str, Any] = {
        "cpu_bytes_per_s": None if args.cpu_mbyte is None else args.cpu_mbyte * 1e6,
        "costs": Costs(handling_s=args.handling_ms / 1000.0),
    }
    rows = []
    if args.goal:
        goal_runs(args.workers, args.runs, args.size_mib, args.base, args.json_out)
        return 0
    if args.outer:
        outer_compare(args)
        return 0
    if args.saved is not None:
        for old in json.loads(args.saved.read_text()):
            real = RealRun(**old["real"])
            sim = sim_fan_out(real, **model)
            row = compare(real, sim) | {"run": old["run"], "real": old["real"]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "real"}), flush=True)
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(rows, indent=1))
        return 0
    reals = []
    for workers in args.workers:
        for run in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="simcal-") as tmp:
                real = real_fan_out(
                    Path(tmp),
                    workers,
                    args.size_mib * MiB,
                    seeder_mbit=args.seeder_mbit,
                    worker_mbit=args.worker_mbit,
                )
            reals.append({"run": run, "real": real.to_json()})
            if args.json_out is not None:  # the real runs are the costly part: kept at once
                args.json_out.write_text(json.dumps(reals, indent=1))
            print(
                json.dumps({"workers": workers, "run": run, "real_hold_s": real.all_hold_s}),
                flush=True,
            )
    for saved in reals:
        real = RealRun(**saved["real"])
        row = compare(real, sim_fan_out(real, **model)) | saved
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "real"}), flush=True)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rows, indent=1))
    return 0


def goal_runs(
    workers: list[int], runs: int, size_mib: int, base: Path | None, out: Path | None
) -> list[dict[str, Any]]:
    """The issue's testbed goal: bench.wan.scenarios.fan_out (a 100 Mbit/s seeder, 1 Gbit/s
    fetchers given only the seeder, default options), this tree against ``base`` (a tree
    put first on PYTHONPATH, e.g. ``git archive`` of the commit before), run after run in
    turn so both see the same machine."""
    import os
    import tempfile

    from bench.wan.scenarios import fan_out

    rows: list[dict[str, Any]] = []
    trees = [("this", None)] + ([("base", base)] if base is not None else [])
    for run in range(runs):
        for n in workers:
            for name, tree in trees:
                saved = os.environ.get("PYTHONPATH")
                if tree is not None:
                    os.environ["PYTHONPATH"] = str(tree)
                idle0, total0 = _cpu_times()
                try:
                    with tempfile.TemporaryDirectory(prefix="simgoal-") as tmp:
                        got = fan_out(Path(tmp), n, size_mib * MiB, default_listen=True)
                finally:
                    if saved is None:
                        os.environ.pop("PYTHONPATH", None)
                    else:
                        os.environ["PYTHONPATH"] = saved
                idle1, total1 = _cpu_times()
                row = {
                    "tree": name,
                    "workers": n,
                    "run": run,
                    "hold_ratio": None
                    if got.all_hold_s is None
                    else got.all_hold_s / got.one_transfer_s,
                    "total_ratio": got.total_s / got.one_transfer_s,
                    "seeder": got.seeder_uplink_bytes / got.size,
                    "failures": got.failures,
                    "idle_share": (idle1 - idle0) / max(1.0, total1 - total0),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                if out is not None:
                    out.write_text(json.dumps(rows, indent=1))
    return rows


# The testbed's THREE_CONTINENTS one-way delays (bench.wan.testbed.three_continents: eu-us
# 80 ms, us-asia 150 ms, eu-asia 200 ms RTT), worker i on host i mod 3, 1 Gbit/s.
OUTER_HOSTS = (("eu", 0.0325), ("us", 0.0075), ("asia", 0.0675))


def real_outer(
    work: Path, workers: int, rounds: int, model_size: str, inner_steps: int
) -> dict[str, Any]:
    """A real outer-loop run on the testbed: ``workers`` worker processes (``blob outer
    worker``, as bench/outer_net.py --wan-runs places them), no churn, no replay; each
    worker's round records (phases, bytes)."""
    from bench.wan import THREE_CONTINENTS, Testbed
    from training.outer.churn import ChurnPlan, churn_run
    from training.outer.launch import prepare_run
    from training.outer.params import RunParams

    params = RunParams(
        run_id="sim-calibration",
        workers=workers,
        rounds=rounds,
        inner_steps=inner_steps,
        deadline=8.0,
        proposer_timeout=3.0,
        replay_rate=0.0,
        model_size=model_size,
    )
    hosts = [name for name, _ in OUTER_HOSTS]
    with Testbed(THREE_CONTINENTS) as tb:
        plan = prepare_run(work, params)

        def place(i: int, argv: list[str], tb: Testbed = tb) -> list[str]:
            host = hosts[i % len(hosts)]
            return tb.argv(host, [*argv, "--listen", f"/ip4/{tb.addr(host)}/tcp/0"])

        res = churn_run(plan, ChurnPlan(), timeout=1800, place=place)
    return {
        "params": params.__dict__,
        "exits": res.returncodes,
        "results": {i: r for i, r in res.results.items() if r is not None},
    }


def outer_rows(results: dict[Any, Any]) -> list[dict[str, Any]]:
    """Per worker and round: the seconds from the update to the next state applied
    (``phases["applied"]``), and bytes received."""
    rows = []
    for i, result in results.items():
        for rec in result["rounds"]:
            applied = rec.get("phases", {}).get("applied")
            if applied is None:
                continue
            rows.append(
                {
                    "worker": int(i),
                    "round": rec["round"],
                    "comm_s": applied,
                    "ready_s": rec["phases"].get("ready"),
                    "phases": rec["phases"],
                    "how": rec["how"],
                    "update_bytes": rec["update_bytes"],
                    "state_bytes": rec["state_bytes"],
                    "received": rec["wire_received"],
                }
            )
    return rows


def outer_compare(args: Any) -> None:
    """``--outer K``: real runs, each with its simulated twin; per run the median worker's
    seconds from its update to the next state, and bytes received per round."""
    import tempfile

    out = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="simcal-outer-") as tmp:
            real = real_outer(Path(tmp), args.outer, args.rounds, args.model_size, args.inner_steps)
        rows = outer_rows(real["results"])
        if args.json_out is not None:  # the real run is the costly part: kept at once
            saved = args.json_out.with_suffix(".real.json")
            saved.write_text(json.dumps([*out, {"run": run, "real": real}], default=str))
        if not rows:
            print(json.dumps({"run": run, "failed": real["exits"]}), flush=True)
            continue
        sim = sim_outer(real, rows)
        row = {
            "run": run,
            "exits": real["exits"],
            "update_bytes": statistics.median(r["update_bytes"] for r in rows),
            "real_comm_s": statistics.median(r["comm_s"] for r in rows),
            "sim_comm_s": statistics.median(sim["comm_s"]) if sim["comm_s"] else None,
            # Comparable to the simulation's, where every update comes at once: per round,
            # the worker whose updates were in first (the last to announce) waited least.
            "real_comm_last_s": statistics.median(
                min((r for r in rows if r["round"] == k), key=lambda r: r["ready_s"] or 0.0)[
                    "comm_s"
                ]
                for k in {r["round"] for r in rows}
            ),
            "sim_apply_s": sim["apply_s"],
            "real_received": statistics.median(r["received"] for r in rows),
            "sim_received": statistics.median(
                x["received_median"] for x in sim["report"]["rounds"]
            ),
            "sim_forks": sim["report"]["forks"],
            "real_rows": rows,
        }
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "real_rows"}), flush=True)
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(out, indent=1))


def sim_outer(real: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The simulated twin of a real outer run: the same K, rounds, update and state sizes,
    hosts, deadline and proposer time-out; compute jitter as the real workers showed."""
    from bench.sim.outer import OuterParams, OuterSim

    p = real["params"]
    # The CPU work after a closure is in: its "closure" mark to "applied" where a worker
    # applied another's closure (aggregating, storing the state blob).
    applying = [
        r["phases"]["applied"] - r["phases"]["closure"]
        for r in rows
        if "closure" in r["phases"] and r["how"] == "applied"
    ]
    update = int(statistics.median(r["update_bytes"] for r in rows))
    state = int(statistics.median(r["state_bytes"] for r in rows))
    params = OuterParams(
        workers=p["workers"],
        rounds=p["rounds"],
        compute_s=30.0,
        update_bytes=update,
        state_bytes=state,
        link_mbit=1000.0,
        deadline=p["deadline"],
        proposer_timeout=p["proposer_timeout"],
        fetch="swarm",
        hosts=tuple((delay, 1000.0) for _, delay in OUTER_HOSTS),
        jitter=0.0,
        apply_s=statistics.median(applying) if applying else 0.0,
    )
    sim = OuterSim(params)
    report = sim.run()
    comm = [
        x.adopted - x.announced
        for x in sim.logs
        if x.announced is not None and x.adopted is not None and x.how == "applied"
    ]
    return {"report": report, "comm_s": comm, "apply_s": params.apply_s}


if __name__ == "__main__":
    raise SystemExit(main())
