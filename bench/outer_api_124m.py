"""A GPT-2-small-shaped model (~124M parameters, built locally from a config and a seed)
trained through the outer-loop API (``training.outer.api.OuterLoop``) by worker processes,
each its own store, key and node, with a fourth worker joining at round 2.

Per round it prints compute seconds (the user's H inner steps), communication seconds
(``step()`` waiting for the round's closure: announce, fetch, aggregate, agree), compute
utilisation, bytes each worker's update took against a dense float32 update, and the
joiner's time to its first included update. Anchors: Covenant-72B (146x fewer bytes,
94.5% utilisation), INTELLECT-1 (83-96% utilisation).

    .venv/bin/python bench/outer_api_124m.py --rounds 3 --inner-steps 20      # 124M, local
    .venv/bin/python bench/outer_api_124m.py --size tiny --rounds 3           # a smoke run
    sudo .venv/bin/python bench/outer_api_124m.py --wan [--wan-mbit 100]      # three continents
    python3 bench/outer_api_124m.py --device cuda --dtype bfloat16 --batch 16 --seq 1024 \
        --compute-seconds 60 --wan                                            # on one GPU
    python3 bench/outer_api_124m.py --size tiny --workers 2 --no-joiner --rounds 2 \
        --device cuda --dtype bfloat16 --lr 1e-3 --check                      # the CUDA check

``--device cuda`` puts every worker's model on the one GPU (the workers share it, time
sliced); ``--dtype bfloat16`` trains the model in bfloat16 while the outer state stays
float32 in host memory. ``--compute-seconds S`` times a few inner steps first and picks H
so each worker's round computes about S seconds with the others sharing the device.
``--check`` makes the run a test: every worker ends on one final root, each worker's
loss falls from its first round to its last, and ``blob outer verify`` passes on worker
0's store; it exits 1 naming what failed. The tokens are Zipf-distributed (a skewed
unigram the model learns within a round), so the loss has something to fall to.

With ``--wan`` the workers run on the three-continent testbed (``bench/wan``: eu, us, asia at
80/150/200 ms RTT, ``--wan-mbit`` each way, default 1000): worker i on host i mod 3, the
joiner beside worker 0 in eu, each listening on its host's address; the testbed's per-host
uplink bytes are printed with the table, and its namespaces are removed on the way out
(also on an error or Ctrl-C). It needs root, ``ip`` and /dev/net/tun, and says which is
missing. Without ``--wan`` the workers run on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.wan

SIZES = {
    # GPT-2 small: 124M parameters with tied embeddings.
    "124m": {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},
    # GPT-2's vocabulary and context at half its width and layers (~30M parameters, most
    # in the embedding): a quicker run, 1.8 GiB a worker (124M: 5.1 GiB).
    "30m": {"n_embd": 384, "n_layer": 6, "n_head": 6, "vocab_size": 50257, "n_positions": 1024},
    "tiny": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512, "n_positions": 128},
}
# The steps timed (after WARMUP_STEPS) to pick H for --compute-seconds.
WARMUP_STEPS = 3
TIMED_STEPS = 8
# --check: the loss must fall by LOSS_DROP from the mean of a worker's first FIRST_STEPS
# steps to the mean of its last round's.
LOSS_DROP = 0.2
FIRST_STEPS = 5
# Testbed hosts (bench.wan.three_continents) in the order workers are placed on them.
HOSTS = ("eu", "us", "asia")
# Bounds that only stop a hang.
WORKER_TIMEOUT = 3600
# --overlap: rounds of steps a worker trains on after its last update while the final
# state is agreed (a round's communication up to this many times its compute).
OVERLAP_TAIL = 4
# --sleep-step: each inner step moves every parameter by SLEEP_DRIFT times a unit-variance
# direction (norm: an H-step update stays far under the model's, MAX_PARAM_RATIO), drawn
# from SLEEP_SEED.
SLEEP_DRIFT = 1e-5
SLEEP_SEED = 1234


def build(size: str) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(**SIZES[size], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def setup(device: str, threads: int) -> None:
    """The process settings a worker runs with, and so the kernel class its certificate
    must admit (the launcher asks a child process set up the same way: kernel_class)."""
    import torch

    if device == "cpu":
        from training import determinism

        determinism.enter("cpu", threads=threads)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device here")
        torch.set_num_threads(threads)


def kernel_class(cfg: dict[str, Any]) -> str:
    """The kernel class ID a worker process reads: a child process does what a worker
    does before its ``OuterLoop`` detects the class (set up, build the model on its
    device: that loads the libraries the class records), so the launcher's own settings
    cannot leak into it."""
    from training.outer.launch import worker_env

    argv = [sys.executable, __file__, "--kernel-class-of", json.dumps(cfg)]
    out = subprocess.run(argv, env=worker_env(), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"could not read the {cfg['device']} kernel class: {out.stderr.strip()}")
    return out.stdout.strip().splitlines()[-1]


def worker_kernel_class(cfg: dict[str, Any]) -> str:
    """What :func:`worker` does up to its ``OuterLoop``, then the class detected."""
    import torch

    from training.kernel_class import detect

    setup(cfg["device"], cfg["threads"])
    model = make_model(cfg)
    torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    return detect(cfg["device"]).id


def batches(size: str, batch: int, seq: int, seed: int) -> Any:
    """Endless batches of Zipf-distributed tokens (a skewed unigram: learnable in a round)."""
    import torch

    vocab = SIZES[size]["vocab_size"]
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.multinomial(weights, batch * seq, replacement=True, generator=gen).view(
            batch, seq
        )


def make_model(cfg: dict[str, Any]) -> Any:
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["dtype"]]
    return build(cfg["size"]).to(device=cfg["device"], dtype=dtype)


def train_step(model: Any, opt: Any, batch: Any) -> Any:
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def step_seconds(cfg: dict[str, Any]) -> float:
    """Seconds of one inner step of this model alone on the device (the median of
    TIMED_STEPS after WARMUP_STEPS)."""
    import torch

    setup(cfg["device"], cfg["threads"])
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    data = batches(cfg["size"], cfg["batch"], cfg["seq"], seed=99)
    times = []
    for i in range(WARMUP_STEPS + TIMED_STEPS):
        began = time.perf_counter()
        train_step(model, opt, next(data).to(cfg["device"])).item()  # item(): synchronised
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - began)
    del model, opt
    if cfg["device"] == "cuda":
        torch.cuda.empty_cache()  # the workers need the memory, not this process
    return sorted(times)[len(times) // 2]


def directions(model: Any, index: int) -> list[Any]:
    """--sleep-step: per parameter, SLEEP_DRIFT times a direction shared by the workers
    plus one of worker ``index``'s own (equal parts: the signs of two workers' updates
    agree at a cosine of about 1/3, as honest workers' do, and no two are near copies)."""
    import torch

    shared = torch.Generator().manual_seed(SLEEP_SEED)
    own = torch.Generator().manual_seed(SLEEP_SEED + 1 + index)
    out = []
    for p in model.parameters():
        d = torch.randn(p.shape, generator=shared) + torch.randn(p.shape, generator=own)
        out.append(d.mul_(SLEEP_DRIFT).to(device=p.device, dtype=p.dtype))
    return out


def sleep_step(model: Any, drift: list[Any], seconds: float) -> None:
    """--sleep-step: one inner step that moves the parameters by ``drift`` (one add each)
    and sleeps out the rest of ``seconds``, leaving the CPU free as a GPU worker's is."""
    import torch

    began = time.perf_counter()
    with torch.no_grad():
        for p, d in zip(model.parameters(), drift, strict=True):
            p.add_(d)
    left = seconds - (time.perf_counter() - began)
    if left > 0:
        time.sleep(left)


def worker(cfg_path: str) -> None:
    import torch

    from p2p import BlockingNode
    from training.outer.api import OuterLoop

    cfg = json.loads(Path(cfg_path).read_text())
    if cfg.get("cpu") is not None:  # --pin: before any thread starts (they inherit it)
        os.sched_setaffinity(0, {cfg["cpu"]})
    setup(cfg["device"], cfg["threads"])  # the kernel class the certificate admits
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    data = batches(cfg["size"], cfg["batch"], cfg["seq"], seed=cfg["index"])
    sleeping = cfg.get("sleep_step")
    drift = directions(model, cfg["index"]) if sleeping else []
    losses: list[float] = []
    applied: list[float] = []  # when each of its rounds' closures was applied (monotonic)
    # Per inner step, seen from the user's loop: seconds in the step itself, seconds in
    # loop.step(), and whether that step() ended a round (the loop's own utilisation).
    steps: list[tuple[float, float, bool]] = []
    started = time.monotonic()
    with (
        BlockingNode(
            cfg["store"],
            key_path=cfg["key"],
            listen=[cfg["listen"]],
            dht=False,
            pubsub=True,
        ) as node,
        OuterLoop(
            node,
            spec=cfg["spec"],
            model=model,
            certificate=cfg["cert"],
            rounds=cfg["rounds"],
            bootstrap=cfg["bootstrap"],
            late=cfg["late"],
        ) as loop,
    ):
        Path(cfg["addrs"]).write_text(json.dumps(node.addrs))
        loop.join()
        joined = time.monotonic()
        # Overlapped, the loop trains on after its last update until the final state
        # comes: OVERLAP_TAIL more rounds' steps at most.
        tail = OVERLAP_TAIL if cfg.get("overlap") else 0
        for _ in range((cfg["rounds"] + tail) * cfg["inner_steps"] + 1):  # bounded
            if loop.finished:  # a joiner that caught up with the run's last state
                break
            began = time.perf_counter()
            loss: float | None = None
            if sleeping:
                sleep_step(model, drift, sleeping)
            else:
                loss = train_step(model, opt, next(data).to(cfg["device"])).item()
                losses.append(loss)
            stepped = time.perf_counter()
            ended = loop.step(loss)
            steps.append((stepped - began, time.perf_counter() - stepped, ended))
            if ended:
                applied.append(time.monotonic())
            if loop.finished:
                break
        result = loop.result or {}
        Path(cfg["out"]).write_text(
            json.dumps(
                {
                    "timings": loop.timings,
                    "rounds": result.get("rounds", []),
                    "peer": result.get("peer_id"),
                    "started": started,
                    "joined": joined,
                    "applied": applied,
                    "peak_rss_bytes": result.get("peak_rss_bytes"),
                    "final_root": result.get("final_root"),
                    "losses": losses,
                    "steps": steps,
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="124m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=3, help="K, before the joiner")
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--joiner-round", type=int, default=2)
    parser.add_argument("--no-joiner", action="store_true", help="three workers only")
    parser.add_argument("--wan", action="store_true", help="on the three-continent testbed")
    parser.add_argument("--wan-mbit", type=float, default=1000.0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch", type=int, default=4, help="sequences per inner step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--lr", type=float, default=3e-4, help="the inner AdamW's")
    parser.add_argument(
        "--compute-seconds",
        type=float,
        default=None,
        help="pick H for about this many seconds of compute per round (overrides --inner-steps)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="worker i on CPU i mod the CPU count, all its threads: with as many workers "
        "as CPUs, each a one-core machine of its own",
    )
    parser.add_argument(
        "--overlap",
        type=int,
        choices=(0, 1),
        default=0,
        help="the spec's overlap: 1 trains the next round while a round is agreed",
    )
    parser.add_argument(
        "--sleep-step",
        type=float,
        default=None,
        metavar="S",
        help="inner steps that sleep S seconds (after one add of a drift to the "
        "parameters) instead of training: the CPU left free, as a GPU worker's is",
    )
    parser.add_argument("--check", action="store_true", help="fail unless the run is sound")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--kernel-class-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.kernel_class_of:
        print(worker_kernel_class(json.loads(args.kernel_class_of)))
        return
    if args.compute_seconds is not None:
        _calibrate(args)
    if not args.wan:
        _finish(*_run(args, None), args)
        return
    from bench.wan import Testbed
    from bench.wan.testbed import three_continents, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"WAN testbed unavailable: {reason}")
    with Testbed(three_continents(mbit=args.wan_mbit)) as tb:
        outs, params, failures = _run(args, tb)
        uplinks = {h: int(v["uplink_bytes"]) for h, v in tb.stats()["hosts"].items()}
    _finish(outs, params, failures, args, uplinks)


def _phases(row: dict[str, Any]) -> str:
    """Where a round's communication went (``RoundRecord.phases``); the rest of comm_s
    made the update before them and loaded the state into the model after (the last
    round's also holds its settle wait)."""
    phases = row["phases"]
    rest = row["comm_s"] - phases.get("applied", row["comm_s"])
    return (
        ", ".join(f"{p} {t:.1f}" for p, t in sorted(phases.items(), key=lambda pt: pt[1]))
        + f"; the rest {rest:.1f} s"
    )


def _calibrate(args: Any) -> None:
    """Set ``args.inner_steps`` for about ``args.compute_seconds`` of compute per round:
    one step timed alone, times the workers sharing the device (a GPU is time sliced
    between them; on the CPU each worker has its own threads)."""
    import math

    alone = step_seconds(_settings(args))
    sharing = args.workers if args.device == "cuda" else 1
    args.inner_steps = max(1, math.ceil(args.compute_seconds / (alone * sharing)))
    print(
        f"calibrated: one inner step alone {alone * 1e3:.1f} ms; H = {args.inner_steps} "
        f"for about {args.compute_seconds:g} s per round with {sharing} worker(s) sharing "
        f"the {args.device}",
        flush=True,
    )


def _settings(args: Any) -> dict[str, Any]:
    """What every worker process is given of the model and its device."""
    keys = ("size", "device", "dtype", "batch", "seq", "threads", "lr")
    return {k: getattr(args, k) for k in keys}


def _finish(
    outs: list[dict[str, Any]],
    params: int,
    failures: list[str],
    args: Any,
    uplinks: dict[str, int] | None = None,
) -> None:
    _report(outs, params, args, uplinks)
    if not args.check:
        return
    if failures:
        for failure in failures:
            print(f"CHECK FAILED: {failure}")
        raise SystemExit(1)
    print("CHECK PASSED: one final root, every loss fell, verify passed")


def _run(args: Any, tb: Any) -> tuple[list[dict[str, Any]], int, list[str]]:
    """Init the run, start the workers (in the testbed's hosts with ``tb``), wait for all;
    (their outputs, the parameter count, what --check found wrong)."""
    from blobstore import Store
    from identity import SoftwareSigner, load_key_file
    from training.outer.launch import prepare_run, worker_env
    from training.outer.params import RunParams
    from training.outer.runs import init_run

    model = build(args.size)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="bench-124m-") as tmp:
        root = Path(tmp)
        plan = prepare_run(
            root / "run",
            RunParams("b124", args.workers, args.rounds, args.inner_steps),
            slots=args.workers + 1,
            kernel_class=kernel_class(_settings(args)),
        )
        w0 = plan.workers[0]
        spec, _ = init_run(  # from the module: its tied names are the spec's aliases
            Store.open(w0.store),
            SoftwareSigner(load_key_file(w0.key)),
            model,
            run_id="b124",
            authorities=(plan.authority,),
            options={
                "workers": args.workers,
                "inner_steps": args.inner_steps,
                "deadline": 30.0,
                **({"overlap": args.overlap} if args.overlap else {}),
            },
        )
        del model
        spec_bytes = Store.open(w0.store).path(spec).read_bytes()
        procs: list[Any] = []
        bootstrap: list[str] = []
        k = args.workers
        workers = plan.workers[:k] if args.no_joiner else plan.workers
        for i, w in enumerate(workers):
            host = HOSTS[i % len(HOSTS)] if i < k else HOSTS[0]
            if i == k:  # the joiner: once the others are in round joiner_round
                while not _in_round(args.joiner_round, root, procs):
                    time.sleep(1)
            Store.open(w.store).put_bytes(spec_bytes)
            cfg = {
                **_settings(args),
                "index": i,
                "cpu": i % (os.cpu_count() or 1) if args.pin else None,
                "store": str(w.store),
                "key": str(w.key),
                "cert": str(w.cert),
                "spec": spec,
                "rounds": args.rounds,
                "inner_steps": args.inner_steps,
                "bootstrap": bootstrap,
                "late": i == k,
                "overlap": args.overlap,
                "sleep_step": args.sleep_step,
                "addrs": str(w.dir / "addrs.json"),
                "out": str(w.dir / "out.json"),
                "listen": "/ip4/127.0.0.1/tcp/0" if tb is None else f"/ip4/{tb.addr(host)}/tcp/0",
            }
            (w.dir / "cfg.json").write_text(json.dumps(cfg))
            argv = [sys.executable, __file__, "--worker", str(w.dir / "cfg.json")]
            if tb is None:
                procs.append(subprocess.Popen(argv, env=worker_env()))
            else:
                procs.append(tb.popen(host, argv, env=worker_env()))
            if bootstrap:
                continue  # the others start at once: only worker 0's address is needed
            while not (w.dir / "addrs.json").exists():
                if procs[-1].poll() is not None:
                    raise SystemExit(f"worker {i} exited before listening")
                time.sleep(0.2)
            bootstrap = json.loads((w.dir / "addrs.json").read_text())[:1]
        for proc in procs:
            proc.wait(timeout=WORKER_TIMEOUT)
        outs = [
            json.loads((w.dir / "out.json").read_text()) if (w.dir / "out.json").exists() else {}
            for w in workers
        ]
        failures = _check(outs, args, plan) if args.check else []
    return outs, params, failures


def _check(outs: list[dict[str, Any]], args: Any, plan: Any) -> list[str]:
    """What is wrong with the finished run: roots, losses, ``blob outer verify``."""
    from click.testing import CliRunner

    from training.outer.cli import outer_group

    failures = [f"worker {i} wrote no result" for i, out in enumerate(outs) if not out]
    roots = {out.get("final_root") for out in outs if out}
    if len(roots) != 1 or None in roots:
        failures.append(f"the workers ended on {len(roots)} final roots: {sorted(map(str, roots))}")
    h = args.inner_steps
    for i, out in enumerate(outs[: args.workers]):  # a joiner may train one round only
        if args.sleep_step:
            break  # sleeping steps have no loss
        losses = out.get("losses", [])
        if len(losses) < 2 * h:
            failures.append(f"worker {i} took {len(losses)} steps, fewer than two rounds")
            continue
        head = losses[:FIRST_STEPS]
        first, last = sum(head) / len(head), sum(losses[-h:]) / h
        if not last < first - LOSS_DROP:
            failures.append(
                f"worker {i}'s loss fell from {first:.3f} (its first {len(head)} steps) to "
                f"{last:.3f} (its last round) only"
            )
    w0 = plan.workers[0]
    verified = CliRunner().invoke(
        outer_group,
        ["verify", "b124", "--authority", plan.authority],
        obj={"store_root": w0.store, "key_path": w0.key},
    )
    print(verified.output.rstrip())
    if verified.exit_code != 0:
        failures.append(f"blob outer verify exited {verified.exit_code}")
    return failures


def _in_round(round_: int, root: Path, procs: list[Any]) -> bool:
    """Whether worker 0 holds the state of round ``round_`` (its store's state tags)."""
    from blobstore import Store

    for proc in procs:
        if proc.poll() is not None:
            raise SystemExit("a worker exited before the joiner's round")
    store = Store.open(root / "run" / "worker-0" / "store")
    return any(name.startswith(f"outer-b124-state-{round_}") for name in store.tags())


def _report(
    outs: list[dict[str, Any]], params: int, args: Any, uplinks: dict[str, int] | None = None
) -> None:
    dense = 4 * params
    where = "127.0.0.1" if uplinks is None else f"three continents at {args.wan_mbit:g} Mbit/s"
    print(
        f"{params / 1e6:.1f}M parameters, {args.inner_steps} inner steps of {args.batch}x"
        f"{args.seq} tokens, {args.dtype} on {args.device}, dense update "
        f"{dense / 1e6:.1f} MB, {where}"
    )
    print(
        f"{'worker':>6} {'round':>5} {'compute_s':>9} {'comm_s':>7} {'util':>6} "
        f"{'update_bytes':>12} {'vs_dense':>8} {'wire_sent':>10} {'wire_recv':>10} {'loss':>6}"
    )
    h = args.inner_steps
    rows = []
    for i, out in enumerate(outs):
        if not out:
            print(f"{i:>6} failed (see its stderr)")
            continue
        # The joiner's timings start at its first own round; its records at its catch-up.
        own = [rec for rec in out["rounds"] if rec.get("how") != "caught up"]
        for r, (compute, comm, _overlapped) in enumerate(out["timings"]):
            rec = own[r] if r < len(own) else {}
            size = rec.get("update_bytes", 0)
            ratio = f"{dense / size:.0f}x" if size else "-"
            sent, recv = rec.get("wire_sent", 0), rec.get("wire_received", 0)
            steps = out.get("losses", [])[r * h : (r + 1) * h]
            loss = sum(steps) / len(steps) if steps else float("nan")
            rows.append(
                {
                    "worker": i,
                    "round": rec.get("round", r),
                    "compute_s": compute,
                    "comm_s": comm,
                    "update_bytes": size,
                    "wire_sent": sent,
                    "wire_received": recv,
                    "loss": loss,
                    "phases": rec.get("phases", {}),
                }
            )
            print(
                f"{i:>6} {rec.get('round', r):>5} {compute:>9.1f} {comm:>7.1f} "
                f"{compute / (compute + comm):>6.1%} {size:>12} {ratio:>8} "
                f"{sent / 1e3:>8.0f}kB {recv / 1e3:>8.0f}kB {loss:>6.3f}"
            )
        for row in rows:
            if row["worker"] == i and row["phases"]:
                print(f"{'':>6} {row['round']:>5} s after the update: {_phases(row)}")
        if out.get("peak_rss_bytes"):
            print(f"{i:>6} peak RSS {int(out['peak_rss_bytes']) / (1 << 30):.2f} GiB")
    if uplinks is not None:
        print(
            "testbed uplink bytes per host: "
            + ", ".join(f"{h} {b / 1e6:.1f} MB" for h, b in uplinks.items())
        )
    if args.json_out is not None:
        args.json_out.write_text(
            json.dumps(
                {
                    "parameters": params,
                    "settings": {
                        k: getattr(args, k)
                        for k in ("size", "device", "dtype", "batch", "seq", "inner_steps")
                    },
                    "rows": rows,
                    "uplinks": uplinks,
                },
                indent=1,
            )
        )
    if len(outs) <= args.workers:
        return
    joiner = outs[args.workers]
    if not joiner:
        print("joiner: failed (see its stderr)")
        return
    first = next(
        (
            rec
            for rec in joiner["rounds"]
            if any(x["peer"] == joiner["peer"] for x in rec.get("included", []))
        ),
        None,
    )
    if first is None:
        print("joiner: no included update")
        return
    own = [rec["round"] for rec in joiner["rounds"] if rec.get("how") != "caught up"]
    at = own.index(first["round"])
    if at < len(joiner.get("applied", [])):
        print(
            f"joiner: first included update in round {first['round']}, applied "
            f"{joiner['applied'][at] - joiner['started']:.1f} s after it started (it held "
            f"the run's state {joiner['joined'] - joiner['started']:.1f} s after it started)"
        )
    else:
        print(f"joiner: first included update in round {first['round']}")


if __name__ == "__main__":
    main()
