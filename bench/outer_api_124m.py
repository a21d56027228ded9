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
    # in the embedding): what fits 4 workers in a 23 GiB machine (124M peaks at 6 GiB each).
    "30m": {"n_embd": 384, "n_layer": 6, "n_head": 6, "vocab_size": 50257, "n_positions": 1024},
    "tiny": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512, "n_positions": 128},
}
SEQ = 128
BATCH = 4
# Testbed hosts (bench.wan.three_continents) in the order workers are placed on them.
HOSTS = ("eu", "us", "asia")
# Bounds that only stop a hang.
WORKER_TIMEOUT = 3600


def build(size: str) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(**SIZES[size], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def worker(cfg_path: str) -> None:
    import torch

    from p2p import BlockingNode
    from training import determinism
    from training.outer.api import OuterLoop

    cfg = json.loads(Path(cfg_path).read_text())
    # The kernel class the launcher's certificates admit (prepare_run: one thread).
    determinism.enter("cpu", threads=1)
    model = build(cfg["size"])
    vocab = SIZES[cfg["size"]]["vocab_size"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(cfg["index"])
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
        for _ in range(cfg["rounds"] * cfg["inner_steps"] + 1):  # bounded
            if loop.finished:  # a joiner that caught up with the run's last state
                break
            batch = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.step(loss.item())
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
                    "peak_rss_bytes": result.get("peak_rss_bytes"),
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
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if not args.wan:
        _report(*_run(args, None), args)
        return
    from bench.wan import Testbed
    from bench.wan.testbed import three_continents, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"WAN testbed unavailable: {reason}")
    with Testbed(three_continents(mbit=args.wan_mbit)) as tb:
        outs, params = _run(args, tb)
        uplinks = {h: int(v["uplink_bytes"]) for h, v in tb.stats()["hosts"].items()}
    _report(outs, params, args, uplinks)


def _run(args: Any, tb: Any) -> tuple[list[dict[str, Any]], int]:
    """Init the run, start the workers (in the testbed's hosts with ``tb``), wait for all."""
    from safetensors.torch import save_file

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
        )
        state = root / "initial.safetensors"
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(state))
        del model
        w0 = plan.workers[0]
        spec, _ = init_run(
            Store.open(w0.store),
            SoftwareSigner(load_key_file(w0.key)),
            state,
            run_id="b124",
            authorities=(plan.authority,),
            options={"workers": args.workers, "inner_steps": args.inner_steps, "deadline": 30.0},
        )
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
                "index": i,
                "size": args.size,
                "store": str(w.store),
                "key": str(w.key),
                "cert": str(w.cert),
                "spec": spec,
                "rounds": args.rounds,
                "inner_steps": args.inner_steps,
                "bootstrap": bootstrap,
                "late": i == k,
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
            while not (w.dir / "addrs.json").exists():
                if procs[-1].poll() is not None:
                    raise SystemExit(f"worker {i} exited before listening")
                time.sleep(0.2)
            if not bootstrap:
                bootstrap = json.loads((w.dir / "addrs.json").read_text())[:1]
        for proc in procs:
            proc.wait(timeout=WORKER_TIMEOUT)
        outs = [
            json.loads((w.dir / "out.json").read_text()) if (w.dir / "out.json").exists() else {}
            for w in workers
        ]
    return outs, params


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
        f"{params / 1e6:.1f}M parameters, {args.inner_steps} inner steps, dense update "
        f"{dense / 1e6:.1f} MB, {where}"
    )
    print(
        f"{'worker':>6} {'round':>5} {'compute_s':>9} {'comm_s':>7} {'util':>6} "
        f"{'update_bytes':>12} {'vs_dense':>8} {'wire_sent':>10} {'wire_recv':>10}"
    )
    rows = []
    for i, out in enumerate(outs):
        if not out:
            print(f"{i:>6} failed (see its stderr)")
            continue
        # The joiner's timings start at its first own round; its records at its catch-up.
        own = [rec for rec in out["rounds"] if rec.get("how") != "caught up"]
        for r, (compute, comm) in enumerate(out["timings"]):
            rec = own[r] if r < len(own) else {}
            size = rec.get("update_bytes", 0)
            ratio = f"{dense / size:.0f}x" if size else "-"
            sent, recv = rec.get("wire_sent", 0), rec.get("wire_received", 0)
            rows.append(
                {
                    "worker": i,
                    "round": rec.get("round", r),
                    "compute_s": compute,
                    "comm_s": comm,
                    "update_bytes": size,
                    "wire_sent": sent,
                    "wire_received": recv,
                }
            )
            print(
                f"{i:>6} {rec.get('round', r):>5} {compute:>9.1f} {comm:>7.1f} "
                f"{compute / (compute + comm):>6.1%} {size:>12} {ratio:>8} "
                f"{sent / 1e3:>8.0f}kB {recv / 1e3:>8.0f}kB"
            )
        if out.get("peak_rss_bytes"):
            print(f"{i:>6} peak RSS {int(out['peak_rss_bytes']) / (1 << 30):.2f} GiB")
    if uplinks is not None:
        print(
            "testbed uplink bytes per host: "
            + ", ".join(f"{h} {b / 1e6:.1f} MB" for h, b in uplinks.items())
        )
    if args.json_out is not None:
        args.json_out.write_text(
            json.dumps({"parameters": params, "rows": rows, "uplinks": uplinks}, indent=1)
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
    else:
        print(f"joiner: first included update in round {first['round']}")


if __name__ == "__main__":
    main()
