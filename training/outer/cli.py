"""``blob outer``: the DiLoCo outer loop's commands.

``blob outer simulate`` runs K workers in one process (``training.outer.loop.simulate``);
``blob outer worker`` runs one worker of a decentralised run (``training.outer.launch``), and
``blob outer run`` runs K of them as processes on 127.0.0.1. torch is imported only when a
command runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path as Path_
from typing import Any

import click

from p2p.nat_cli import NAT_DEFAULT_LISTEN, check_relays, relay_options
from training.outer.loop import MODES, SimConfig, SimResult

_DEFAULTS = SimConfig()


@click.group("outer")
def outer_group() -> None:
    """DiLoCo outer loop with SparseLoCo-compressed pseudo-gradients."""


@outer_group.command("simulate")
@click.option("--mode", type=click.Choice(MODES), default=_DEFAULTS.mode, show_default=True)
@click.option("--workers", type=click.IntRange(1, 64), default=_DEFAULTS.workers, show_default=True)
@click.option(
    "--rounds", type=click.IntRange(0, 10_000), default=_DEFAULTS.rounds, show_default=True
)
@click.option(
    "--inner-steps",
    type=click.IntRange(1, 100_000),
    default=_DEFAULTS.inner_steps,
    show_default=True,
)
@click.option(
    "--chunk",
    type=int,
    default=_DEFAULTS.chunk,
    show_default=True,
    help="Top-k chunk size (power of two, 16..65536).",
)
@click.option(
    "--k", "k", type=int, default=_DEFAULTS.k, show_default=True, help="Values kept per chunk."
)
@click.option("--outer-lr", type=float, default=None, help="Outer learning rate.")
@click.option("--outer-momentum", type=float, default=None, help="Outer Nesterov momentum.")
@click.option("--ef-decay", type=float, default=None, help="Error-feedback decay (sparseloco).")
@click.option("--inner-lr", type=float, default=_DEFAULTS.inner_lr, show_default=True)
@click.option("--seed", type=int, default=_DEFAULTS.seed, show_default=True)
@click.option(
    "--threads",
    type=click.IntRange(1, 256),
    default=1,
    show_default=True,
    help="torch threads (results are bit-reproducible for a fixed count).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def simulate_command(
    mode: str,
    workers: int,
    rounds: int,
    inner_steps: int,
    chunk: int,
    k: int,
    outer_lr: float | None,
    outer_momentum: float | None,
    ef_decay: float | None,
    inner_lr: float,
    seed: int,
    threads: int,
    as_json: bool,
) -> None:
    """Run K simulated workers in this process and report held-out loss and bytes sent."""
    from training.outer.codec import CodecParams
    from training.outer.loop import simulate

    try:
        CodecParams(chunk=chunk, k=k)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--chunk/--k") from None
    config = SimConfig(
        **{
            **_DEFAULTS.__dict__,
            "outer_lr": outer_lr,
            "outer_momentum": outer_momentum,
            "ef_decay": ef_decay,
            "mode": mode,
            "workers": workers,
            "rounds": rounds,
            "inner_steps": inner_steps,
            "chunk": chunk,
            "k": k,
            "inner_lr": inner_lr,
            "seed": seed,
            "threads": threads,
        }
    )

    def progress(done: int, result: SimResult) -> None:
        click.echo(
            f"round {done}/{rounds}: held-out loss {result.eval_loss[-1]:.4f}, "
            f"{result.bytes_per_worker[-1]} bytes/worker, {result.round_seconds[-1]:.1f}s",
            err=True,
        )

    result = simulate(config, progress=progress)
    if as_json:
        json.dump(result.to_json(), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return
    click.echo(f"mode {mode}: {workers} workers x {rounds} rounds x {inner_steps} inner steps")
    click.echo(f"held-out loss: {result.eval_loss[0]:.4f} -> {result.eval_loss[-1]:.4f}")
    if result.bytes_per_worker:
        sent = result.bytes_per_worker[-1]
        click.echo(
            f"bytes per worker per round: {sent} "
            f"({result.dense_fp32_bytes / sent:.1f}x less than a dense fp32 pseudo-gradient)"
        )
    click.echo(f"final state root: {result.state_roots[-1]}")
    click.echo(f"wall time: {result.wall_seconds:.1f}s")


# --- the decentralised run -----------------------------------------------------------


def _run_options(f: Any) -> Any:
    """Options every worker of a run must be given identically (``RunParams``)."""
    options = [
        click.option(
            "--workers",
            type=click.IntRange(1, 64),  # p2p.gossip.MAX_RUN_WORKERS
            required=True,
            help="K: a round closes early once updates from K workers are in.",
        ),
        click.option(
            "--rounds", type=click.IntRange(0, 100_000), required=True, help="Outer rounds."
        ),
        click.option(
            "--inner-steps",
            type=click.IntRange(1, 100_000),
            required=True,
            help="Inner AdamW steps per round (H).",
        ),
        click.option(
            "--deadline",
            type=click.FloatRange(0.1, 86_400),
            default=8.0,
            show_default=True,
            help="Seconds a round waits for updates after this worker's own.",
        ),
        click.option(
            "--proposer-timeout",
            type=click.FloatRange(0.1, 86_400),
            default=3.0,
            show_default=True,
            help="Seconds before the next worker in rank proposes a round's closure.",
        ),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--batch", type=click.IntRange(1, 4096), default=8, show_default=True),
        click.option("--seq-len", type=click.IntRange(2, 512), default=64, show_default=True),
        click.option("--inner-lr", type=float, default=2e-3, show_default=True),
        click.option("--chunk", type=int, default=4096, show_default=True),
        click.option(  # RunParams.k (not imported here: that module loads the node)
            "--k", "k", type=int, default=80, show_default=True, help="Values kept per chunk."
        ),
        click.option(
            "--model-size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True
        ),
        click.option(
            "--shard-sequences", type=click.IntRange(1, 1 << 20), default=512, show_default=True
        ),
        click.option(
            "--replay-rate",
            type=click.FloatRange(0.0, 1.0),
            default=0.25,
            show_default=True,
            help="Share of each round's updates another worker replays to verify them.",
        ),
        click.option(
            "--fetch-floor",
            type=click.FloatRange(0.1, 86_400),
            default=10.0,
            show_default=True,
            help="Seconds a fetch gets on top of three deadlines (also how long a finished "
            "worker waits for a missing one).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _params(run_id: str, **kw: Any) -> Any:
    from training.outer.params import RunParams

    try:
        return RunParams(run_id=run_id, **kw)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _authority(value: str) -> bytes:
    """An authority public key: 64 hex digits or the path of a ``.pub`` file."""
    from pathlib import Path

    from identity import BadPublicKey, parse_public_key

    try:
        return parse_public_key(value)
    except BadPublicKey:
        pass
    try:
        text = Path(value).read_text(errors="replace")
    except OSError:
        raise click.BadParameter(
            f"{value!r} is neither a public key (64 hex) nor a readable .pub file",
            param_hint="--authority",
        ) from None
    try:
        return parse_public_key(text.strip())
    except BadPublicKey as exc:
        raise click.BadParameter(f"{value}: {exc}", param_hint="--authority") from None


@outer_group.command("worker")
@click.option("--run", "run_id", required=True, help="Run ID (names the pubsub topic).")
@click.option("--shard", type=click.IntRange(0, 1 << 20), required=True, help="Data shard.")
@_run_options
@click.option(
    "--authority",
    "authorities",
    multiple=True,
    required=True,
    help="Trusted authority public key (hex or .pub file; repeatable).",
)
@click.option(
    "--cert",
    "cert_path",
    type=click.Path(path_type=Path_, dir_okay=False),
    required=True,
    help="This machine's admission certificate.",
)
@click.option("--initial", default=None, help="Blob ID of the run's initial global state.")
@click.option("--join", is_flag=True, help="Join a running run at its next round.")
@click.option("--bootstrap", multiple=True, help="Peer multiaddr to dial (repeatable).")
@click.option(
    "--listen",
    default=None,
    help="Listen address [default: /ip4/127.0.0.1/tcp/0; with --relay /ip4/0.0.0.0/tcp/0].",
)
@relay_options
@click.option(
    "--via-relay",
    is_flag=True,
    help="When hole punching to a worker behind NAT fails, fetch through the relay.",
)
@click.option(
    "--result",
    "result_path",
    type=click.Path(path_type=Path_, dir_okay=False),
    required=True,
    help="Where to write this worker's result JSON.",
)
@click.option(
    "--addr-file",
    type=click.Path(path_type=Path_, dir_okay=False),
    default=None,
    help="Write this node's addresses here once it listens (for launchers).",
)
@click.option(
    "--start-timeout",
    type=click.FloatRange(1, 86_400),
    default=300.0,
    show_default=True,
    help="Seconds to wait for the other workers (or, with --join, for a state).",
)
@click.option("--stall-round", type=int, default=None, hidden=True)
@click.option("--test-cheat-from-round", "cheat_from_round", type=int, default=None, hidden=True)
@click.option(
    "--publish",
    "publish_as",
    metavar="NAME",
    default=None,
    help="At the end, name the final state <this peer ID>/NAME (signed; see blob resolve).",
)
@click.pass_context
def worker_command(
    ctx: click.Context,
    /,
    run_id: str,
    shard: int,
    authorities: tuple[str, ...],
    cert_path: Path_,
    initial: str | None,
    join: bool,
    bootstrap: tuple[str, ...],
    listen: str | None,
    relays: tuple[str, ...],
    assume_private: bool,
    via_relay: bool,
    result_path: Path_,
    addr_file: Path_ | None,
    start_timeout: float,
    stall_round: int | None,
    cheat_from_round: int | None,
    publish_as: str | None,
    **run: Any,
) -> None:
    """Run one worker of a decentralised outer-loop run (one per machine)."""
    import trio

    from blobstore import parse_blob_id
    from training.outer.launch import run_worker
    from training.outer.params import WorkerConfig

    if initial is None and not join:
        raise click.UsageError("give the initial state (--initial BLOB_ID) or --join")
    if initial is not None:
        initial = parse_blob_id(initial)
    check_relays(relays)
    if listen is None:
        listen = NAT_DEFAULT_LISTEN[0] if relays else "/ip4/127.0.0.1/tcp/0"
    obj = ctx.ensure_object(dict)
    config = WorkerConfig(
        params=_params(run_id, **run),
        shard=shard,
        store_root=Path_(obj["store_root"]),
        key_path=Path_(obj["key_path"]),
        cert_path=cert_path,
        authorities=tuple(_authority(a) for a in authorities),
        result_path=result_path,
        initial=initial,
        join=join,
        bootstrap=bootstrap,
        listen=listen,
        addr_file=addr_file,
        start_timeout=start_timeout,
        stall_round=stall_round,
        cheat_from_round=cheat_from_round,
        publish=publish_as,
        relays=relays,
        assume_private=assume_private,
        relayed_fetch=via_relay,
    )
    result = trio.run(run_worker, config)
    if not result["agreed"]:
        raise _disagreed()


def _disagreed() -> Exception:
    from training.outer.params import OuterRunFailed

    return OuterRunFailed("workers reached different global states (see the DISAGREE lines)")


@outer_group.command("run")
@_run_options
@click.option("--run", "run_id", default="local", show_default=True, help="Run ID.")
@click.option(
    "--publish",
    "publish_as",
    metavar="NAME",
    default=None,
    help="Each worker names its final state <its peer ID>/NAME at the end.",
)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path_, file_okay=False),
    default=None,
    help="Keep keys, stores and results here (default: a temp dir, removed after).",
)
@click.option("--timeout", type=click.FloatRange(1, 86_400), default=None, help="Bound (s).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def run_command(
    run_id: str,
    publish_as: str | None,
    workdir: Path_ | None,
    timeout: float | None,
    as_json: bool,
    **run: Any,
) -> None:
    """Run K worker processes on 127.0.0.1 (a mesh, no hub) and compare their roots."""
    from training.outer.launch import default_workdir, prepare_run, run_local, summarise
    from training.outer.params import OuterRunFailed

    if publish_as is not None:
        from p2p.names import check_name

        check_name(publish_as)  # refused before any worker starts
    params = _params(run_id, **run)
    bound = timeout or 180 + params.rounds * (params.deadline + 60)
    with default_workdir() as tmp:
        root = workdir or Path_(tmp)
        plan = prepare_run(root, params)
        click.echo(
            f"run {run_id}: {params.workers} workers x {params.rounds} rounds x "
            f"{params.inner_steps} inner steps; initial state {plan.initial[:16]}; "
            f"workdir {root}",
            err=True,
        )
        extra = ("--publish", publish_as) if publish_as is not None else ()
        summary = summarise(run_local(plan, timeout=bound, extra=extra))
    if as_json:
        json.dump(summary, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        click.echo(f"{'round':>5}  {'loss':>8}  {'bytes per worker':<24}  {'included':<10}  roots")
        for row in summary["rounds"]:
            sizes = ",".join(str(b) for b in row["update_bytes"])
            included = ",".join(str(n) for n in row["included"])
            agree = "agree" if row["roots_agree"] else "DISAGREE"
            click.echo(
                f"{row['round']:>5}  {row['mean_loss']:>8.4f}  {sizes:<24}  {included:<10}  "
                f"{agree} {row['root'][:16]}"
            )
        click.echo(f"workers finished: {summary['finished']}/{summary['workers']}")
        click.echo(f"final root: {summary['final_root'] or 'workers disagree'}")
    if summary["finished"] != summary["workers"]:
        raise OuterRunFailed(
            f"{summary['workers'] - summary['finished']} worker(s) failed; see their stderr"
        )
    if not summary["roots_agree"]:
        raise _disagreed()


# --- milestones and verification ------------------------------------------------------


def _store(ctx: click.Context) -> Any:
    from blobstore import Store, StoreError

    try:
        return Store.open(Path_(ctx.ensure_object(dict)["store_root"]))
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


@outer_group.command("milestones")
@click.argument("run_id", metavar="RUN")
@click.option(
    "--authority",
    "authorities",
    multiple=True,
    help="Check each milestone's signature against these authorities (hex or .pub).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the milestones as JSON.")
@click.pass_context
def milestones_command(
    ctx: click.Context, /, run_id: str, authorities: tuple[str, ...], as_json: bool
) -> None:
    """List the signed per-round milestones of RUN kept in this store, with the replay
    verdicts on each round's sampled updates (included vs verified); exit 1 if any is
    invalid."""
    from identity import TrustStore
    from training.outer.milestones import invalid_entries, list_milestones
    from training.outer.params import OuterRunFailed

    trust = TrustStore(frozenset(_authority(a) for a in authorities)) if authorities else None
    entries = list_milestones(_store(ctx), run_id, trust)
    invalid = invalid_entries(entries)
    if as_json:
        json.dump(entries, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        _show_milestones(run_id, entries)
    if invalid:
        raise OuterRunFailed(f"run {run_id}: {invalid} invalid milestone(s) or verdict(s)")


def _show_milestones(run_id: str, entries: list[dict[str, Any]]) -> None:
    if not entries:
        click.echo(f"no milestones of run {run_id} in this store")
    for e in entries:
        if "error" in e:
            click.echo(f"round {e['round']:>4}  INVALID: {e['error']}")
            continue
        included = ", ".join(p[-8:] for p, _ in e["included"])
        verified = ", ".join(
            f"{v['author'][-8:]} {v.get('outcome', 'INVALID')}" for v in e["verified"]
        )
        click.echo(
            f"round {e['round']:>4}  signed by {e['signer'][-8:]}  root {e['result'][:16]}  "
            f"included {len(e['included'])} ({included}), excluded {len(e['excluded'])}, "
            f"replayed {len(e['verified'])}" + (f" ({verified})" if verified else "")
        )


@outer_group.command("verify")
@click.argument("run_id", metavar="RUN")
@click.option(
    "--authority",
    "authorities",
    multiple=True,
    required=True,
    help="The run's authority public key (hex or .pub file; repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def verify_command(
    ctx: click.Context, /, run_id: str, authorities: tuple[str, ...], as_json: bool
) -> None:
    """Re-check RUN's closures, results, milestones and verdicts from the blobs in this
    store, every round from its start to the last round its milestones sign; exit 1 if
    any is missing or fails."""
    from identity import TrustStore
    from training.outer.milestones import verify_run
    from training.outer.params import OuterRunFailed

    trust = TrustStore(frozenset(_authority(a) for a in authorities))
    report = verify_run(_store(ctx), run_id, trust)
    if as_json:
        json.dump(report.to_json(), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        for line in report.anchors:
            click.echo(line)
        click.echo(f"rounds checked: {len(report.checked_rounds)}")
        for failure in report.failures:
            click.echo(f"FAILED {failure}")
    if not report.ok:
        raise OuterRunFailed(
            f"run {run_id}: {len(report.failures)} check(s) failed"
            if report.failures
            else f"run {run_id}: nothing to verify in this store"
        )


@outer_group.command("forget")
@click.argument("run_id", metavar="RUN")
@click.option("--dry-run", is_flag=True, help="Say what would be untagged; untag nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the tags as JSON.")
@click.pass_context
def forget_command(ctx: click.Context, /, run_id: str, dry_run: bool, as_json: bool) -> None:
    """Untag everything of RUN in this store (start, closures, milestones, verdicts, the
    updates they name, states), so the next ``blob gc`` deletes it: after this, RUN can no
    longer be verified from this store. ``blob gc --dry-run`` shows what would go."""
    from training.outer.milestones import run_tags

    store = _store(ctx)
    tags = run_tags(store, run_id)
    if not dry_run:
        for name in tags:
            store.untag(name)
    if as_json:
        click.echo(json.dumps({"untagged": tags, "dry_run": dry_run}, indent=2, sort_keys=True))
        return
    for name, blob in tags.items():
        click.echo(f"{'would untag' if dry_run else 'untagged'} {name} {blob[:16]}")
    click.echo(
        f"run {run_id}: {len(tags)} tag(s) {'would be ' if dry_run else ''}removed; "
        "`blob gc --dry-run` lists what gc would now delete",
        err=True,
    )
