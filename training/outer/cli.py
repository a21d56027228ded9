"""``blob outer``: the DiLoCo outer loop's commands.

``blob outer simulate`` runs K workers in one process (``training.outer.simulate``);
``blob outer worker`` runs one worker of a decentralised run (``training.outer.launch``), and
``blob outer run`` runs K of them as processes on 127.0.0.1. torch is imported only when a
command runs.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path as Path_
from typing import Any

import click

from blobstore.options import json_option
from identity import MAX_CERTIFICATE_SIZE, AdmissionCertificate
from identity.cli_common import make_trust_options, read_input, require_hardware_option
from p2p.cli.common import InputPath, check_listen_addrs, check_peer_addrs
from p2p.cli.nat import NAT_DEFAULT_LISTEN, check_relays, relay_options
from training.outer.simconfig import MODES, SimConfig, SimResult
from training.outer.verification import Level

_DEFAULTS = SimConfig()
# H for `outer run` and a worker without a spec when not given: the README's quick demo.
DEFAULT_INNER_STEPS = 20


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
@json_option()
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
    from training.outer.simulate import simulate

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
        click.echo(json.dumps(result.to_json(), indent=2, sort_keys=True))
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


# Options that `outer worker`/`outer run` (as run parameters) and `outer init` (into the spec)
# take alike: declared once so their ranges, defaults and help cannot drift apart.
_INNER_STEPS = click.option(
    "--inner-steps",
    type=click.IntRange(1, 100_000),
    default=DEFAULT_INNER_STEPS,
    show_default=True,
    help="Inner steps per round (H; a worker given --spec takes the spec's).",
)
_DEADLINE = click.option(
    "--deadline",
    type=click.FloatRange(0.1, 86_400),
    default=8.0,
    show_default=True,
    help="Seconds a round waits for updates after this worker's own.",
)
_PROPOSER_TIMEOUT = click.option(
    "--proposer-timeout",
    type=click.FloatRange(0.1, 86_400),
    default=3.0,
    show_default=True,
    help="Seconds before the next worker in rank proposes a round's closure.",
)
_BATCH = click.option("--batch", type=click.IntRange(1, 4096), default=8, show_default=True)
_INNER_LR = click.option("--inner-lr", type=float, default=2e-3, show_default=True)
_CHUNK = click.option("--chunk", type=int, default=4096, show_default=True, help="Codec chunk.")
_K = click.option(  # RunParams.k (not imported here: that module loads the node)
    "--k", "k", type=int, default=80, show_default=True, help="Values kept per chunk."
)
_REPLAY_RATE = click.option(
    "--replay-rate",
    type=click.FloatRange(0.0, 1.0),
    default=0.25,
    show_default=True,
    help="Share of each round's updates another worker replays to verify them.",
)
_QUORUM = click.option(
    "--quorum",
    type=click.IntRange(1, 64),  # p2p.node.gossip.MAX_RUN_WORKERS
    default=None,
    help="Distinct operators every round's closure must name [default: a majority of K, "
    "K/2+1, so two groups that cannot reach each other never both close a round]. Lower "
    "it only knowing that split workers may then fork the run.",
)


def _run_options(f: Any) -> Any:
    """Options every worker of a run must be given identically (``RunParams``)."""
    options = [
        click.option(
            "--workers",
            type=click.IntRange(1, 64),  # p2p.node.gossip.MAX_RUN_WORKERS
            default=None,
            help="K: a round closes early once updates from K workers (or, if more, from "
            "every worker heard in the round before) are in [required without --spec; "
            "`outer run`: 3].",
        ),
        click.option(
            "--rounds",
            type=click.IntRange(0, 100_000),
            default=None,
            help="Outer rounds [required without --spec; `outer run`: 3]; with --spec, leave "
            "after this many rounds.",
        ),
        _INNER_STEPS,
        _DEADLINE,
        _PROPOSER_TIMEOUT,
        click.option("--seed", type=int, default=0, show_default=True),
        _BATCH,
        click.option("--seq-len", type=click.IntRange(2, 512), default=64, show_default=True),
        _INNER_LR,
        _CHUNK,
        _K,
        click.option(
            "--model-size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True
        ),
        click.option(
            "--shard-sequences", type=click.IntRange(1, 1 << 20), default=512, show_default=True
        ),
        _REPLAY_RATE,
        _QUORUM,
        click.option(
            "--overlap",
            type=click.IntRange(0, 1),  # training.outer.spec.MAX_OVERLAP
            default=None,
            help="Rounds a worker trains ahead of the state its next update is taken "
            "against (1: the one-step-delayed outer step) [default: 0, blocking; with "
            "--spec, the spec's].",
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

    for name in ("workers", "rounds"):
        if kw[name] is None:
            raise click.UsageError(f"--{name} is required (or give the run's --spec)")
    kw["quorum"] = _quorum(kw["quorum"], kw["workers"])
    kw["overlap"] = kw["overlap"] or 0
    try:
        return RunParams(run_id=run_id, **kw)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _quorum(quorum: int | None, workers: int) -> int:
    """The --quorum a run of K ``workers`` is given (0: the default, a majority)."""
    if quorum is None:
        return 0
    if quorum > workers:
        raise click.BadParameter(
            f"{quorum} is more than the run's {workers} workers", param_hint="--quorum"
        )
    if quorum <= workers // 2:
        click.echo(
            f"blob: warning: --quorum {quorum} is at most half of the run's {workers} workers: "
            "two groups of them that cannot reach each other may both close rounds (a fork)",
            err=True,
        )
    return quorum


# A .pub file is one line; anything longer is not one (and is not read whole).
MAX_PUBLIC_KEY_FILE = 4096


def _authority(value: str) -> bytes:
    """An authority public key: 64 hex digits, the path of a ``.pub`` file, or the path
    of the authority's key file (its public half: ``outer run --workdir`` writes
    ``authority.key``). An error names the file, never its contents (a key file's bytes
    are secret)."""
    from pathlib import Path

    from identity import BadPublicKey, IdentityError, NotFound, load_key_file, parse_public_key

    try:
        return parse_public_key(value)
    except BadPublicKey:
        pass
    try:
        with open(value, "rb") as handle:
            data = handle.read(MAX_PUBLIC_KEY_FILE + 1)
    except FileNotFoundError:
        raise NotFound(
            f"--authority {value!r} is neither a public key (64 hex digits) nor a file"
        ) from None
    except OSError:
        raise click.BadParameter(
            f"{value!r} is neither a public key (64 hex digits) nor a readable file",
            param_hint="--authority",
        ) from None
    if data.startswith(b"blobnet-key"):
        try:
            return load_key_file(Path(value)).public_key_bytes
        except IdentityError as exc:
            raise click.BadParameter(
                f"{value} is a key file that cannot be read: {exc}", param_hint="--authority"
            ) from None
    try:
        if len(data) > MAX_PUBLIC_KEY_FILE:
            raise BadPublicKey("too long")
        return parse_public_key(data.decode("ascii"))
    except (BadPublicKey, UnicodeDecodeError):
        raise click.BadParameter(
            f"{value} holds no public key (a .pub file is one line of 64 hex digits)",
            param_hint="--authority",
        ) from None


@outer_group.command("worker")
@click.option("--spec", "spec_ref", default=None, help="The run's spec (ID, tag or run ID).")
@click.option("--data", "data_ref", default=None, help="Records blob to train on (with --spec).")
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the model trains (refused, never a fallback, where it is missing).",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 256),
    default=1,
    show_default=True,
    help="torch threads (part of the kernel class).",
)
@click.option("--run", "run_id", default=None, help="Run ID (names the pubsub topic).")
@click.option(
    "--shard",
    type=click.IntRange(0, 1 << 20),
    default=None,
    help="Data shard [default with --spec: drawn from the peer ID].",
)
@_run_options
@click.option(
    "--authority",
    "authorities",
    multiple=True,
    help="Trusted authority public key (hex or .pub file; repeatable; default: the spec's).",
)
@click.option(
    "--cert",
    "cert_path",
    type=click.Path(path_type=Path_, dir_okay=False),
    required=True,
    help="This machine's admission certificate.",
)
@require_hardware_option(
    "Accept only updates, closures and verdicts co-signed by a TPM attestation key "
    "their signer's certificate records (a spec that requires hardware implies it); this "
    "machine's key must then be TPM-bound."
)
@click.option("--initial", default=None, help="Blob ID of the run's initial global state.")
@click.option("--join", is_flag=True, help="Join a running run at its next round.")
@click.option(
    "--resume",
    is_flag=True,
    help="Restart where this worker stopped: its inner optimizer state, error-feedback "
    "residual and batch sampler from its store's resume point, then catch up from the "
    "run's tip (as --join).",
)
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
    default=None,
    help="Where to write this worker's result JSON [default: STORE/outer/RUN-result.json].",
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
@click.option("--test-pass-round", "pass_round", type=int, default=None, hidden=True)
@click.option(
    "--publish",
    "publish_as",
    metavar="NAME",
    default=None,
    help="At the end, name the final state <this peer ID>/NAME (signed; see blob resolve).",
)
@click.option(
    "--keep-states",
    type=click.IntRange(1, 1_000_000),
    default=3,
    show_default=True,
    help="Rounds whose state blobs this worker's store keeps (older ones are deleted; "
    "a run's evidence stays): the tip and two more serve replays and late catch-ups.",
)
@click.option(
    "--metrics",
    metavar="[HOST:]PORT",
    default=None,
    help="Serve Prometheus metrics (the outer loop's too) at http://HOST:PORT/metrics "
    "(host default 127.0.0.1). `blob status` on this worker's store shows its round.",
)
@click.pass_context
def worker_command(
    ctx: click.Context,
    /,
    spec_ref: str | None,
    data_ref: str | None,
    device: str,
    threads: int,
    run_id: str | None,
    shard: int | None,
    authorities: tuple[str, ...],
    cert_path: Path_,
    require_hardware: bool,
    initial: str | None,
    join: bool,
    resume: bool,
    bootstrap: tuple[str, ...],
    listen: str | None,
    relays: tuple[str, ...],
    assume_private: bool,
    via_relay: bool,
    result_path: Path_ | None,
    addr_file: Path_ | None,
    start_timeout: float,
    stall_round: int | None,
    cheat_from_round: int | None,
    pass_round: int | None,
    publish_as: str | None,
    keep_states: int,
    metrics: str | None,
    **run: Any,
) -> None:
    """Run one worker of a decentralised outer-loop run (one per machine).

    With --spec the run (model, codec, optimiser, K, authorities) comes from its spec and
    the model trains on --data (records tokenised with the base's own tokenizer by
    `blob train records --base`); --rounds then says when to leave. Without it, the
    built-in tiny model trains on synthetic data."""
    if metrics is not None:
        from p2p.cli.fleet import metrics_warning

        warning = metrics_warning(metrics)  # a malformed address is refused before any work
        if warning is not None:
            click.echo(warning, err=True)
    # So are the other mistakes of the command line: a malformed address (exit 2), a
    # missing (3) or malformed (4) certificate.
    check_peer_addrs(bootstrap, "--bootstrap")
    check_listen_addrs([] if listen is None else [listen])
    AdmissionCertificate.decode(read_input(cert_path, "certificate", MAX_CERTIFICATE_SIZE))
    import trio

    from blobstore import parse_blob_id
    from training.outer.launch import run_worker
    from training.outer.params import WorkerConfig
    from training.outer.runs import worker_files
    from training.outer.worker.faults import Faults

    check_relays(relays)
    if listen is None:
        listen = NAT_DEFAULT_LISTEN[0] if relays else "/ip4/127.0.0.1/tcp/0"
    obj = ctx.ensure_object(dict)
    make_trainer = None
    level = Level.REPLAYED  # the built-in trainer's updates replay
    min_level = Level.BOUNDED
    rendezvous = None
    if resume:
        if initial is not None:
            raise click.UsageError("--resume continues from the run's tip: no --initial")
        join = True
    if spec_ref is not None:
        from training.outer.runs import prepare_spec_worker

        if run["quorum"] is not None:
            raise click.UsageError("the run's quorum is its spec's (outer init --quorum)")
        if run["overlap"] is not None:
            raise click.UsageError("the run's overlap is its spec's (outer init --overlap)")
        prepared = prepare_spec_worker(
            Path_(obj["store_root"]),
            Path_(obj["key_path"]),
            spec_ref,
            data_ref,
            device=device,
            threads=threads,
            rounds=run["rounds"],
            bootstrap=bootstrap,
        )
        params, make_trainer, level = prepared.params, prepared.make_trainer, prepared.level
        min_level = prepared.spec.level
        require_hardware = require_hardware or prepared.spec.require_hardware
        run_id = params.run_id
        initial = initial if join else prepared.spec.initial
        rendezvous = _spec_blob(Path_(obj["store_root"]), spec_ref)
        authorities = authorities or prepared.spec.authorities
        shard = prepared.shard if shard is None else shard
    else:
        if run_id is None or shard is None:
            raise click.UsageError("give the run's --spec, or --run and --shard")
        if data_ref is not None or device != "cpu" or threads != 1:
            raise click.UsageError("--data, --device and --threads need the run's --spec")
        params = _params(run_id, **run)
    if not authorities:
        raise click.UsageError("give the run's --authority (or its --spec)")
    if initial is None and not join:
        raise click.UsageError("give the initial state (--initial BLOB_ID) or --join")
    if initial is not None:
        initial = parse_blob_id(initial)
    config = WorkerConfig(
        params=params,
        shard=shard,
        store_root=Path_(obj["store_root"]),
        key_path=Path_(obj["key_path"]),
        cert_path=cert_path,
        authorities=tuple(_authority(a) for a in authorities),
        result_path=result_path or worker_files(Path_(obj["store_root"])) / f"{run_id}-result.json",
        initial=initial,
        join=join,
        bootstrap=bootstrap,
        listen=listen,
        addr_file=addr_file,
        start_timeout=start_timeout,
        publish=publish_as,
        relays=relays,
        assume_private=assume_private,
        relayed_fetch=via_relay,
        make_trainer=make_trainer,
        level=level,
        min_level=min_level,
        require_hardware=require_hardware,
        keep_states=keep_states,
        metrics=metrics,
        rendezvous=rendezvous,
        keep_resume=True,
        resume=resume,
    )
    faults = Faults(
        stall_round=stall_round, cheat_from_round=cheat_from_round, pass_round=pass_round
    )
    result = trio.run(run_worker, config, faults)
    # The result is written (durably) and the node closed: what is left is the
    # interpreter's exit, whose final collection over torch's and py-libp2p's objects
    # took about 3 s a worker. Frozen objects are left to the process's end.
    gc.freeze()
    if not result["agreed"]:
        raise _disagreed()


def _spec_blob(store_root: Path_, ref: str) -> str:
    """The blob ID of the spec ``ref`` names (the run's rendezvous)."""
    from blobstore import Store
    from training.outer.runs import read_spec

    return read_spec(Store.open(store_root), ref)[0]


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
@json_option("Print the summary as JSON.")
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
        from p2p.names.record import check_name

        check_name(publish_as)  # refused before any worker starts
    run = {
        **run,
        "workers": run["workers"] or 3,
        "rounds": 3 if run["rounds"] is None else run["rounds"],
    }
    params = _params(run_id, **run)
    bound = timeout or 180 + params.rounds * (params.deadline + 60)
    with default_workdir() as tmp:
        root = workdir or Path_(tmp)
        plan = prepare_run(root, params)
        click.echo(
            f"run {run_id}: {params.workers} workers x {params.rounds} rounds x "
            f"{params.inner_steps} inner steps; initial state {plan.initial[:16]}; "
            f"workdir {root}; authority {plan.authority} (verify with "
            f"--authority {root / 'authority.pub'})",
            err=True,
        )
        click.echo(
            f"starting {params.workers} worker processes (each loads torch, then waits for "
            "the others to dial in)...",
            err=True,
        )
        extra = ("--publish", publish_as) if publish_as is not None else ()
        summary = summarise(run_local(plan, timeout=bound, extra=extra))
        failed = [
            f"worker {w.index} ({w.peer_id[-6:]})"
            for w, result in zip(plan.workers, summary["results"], strict=False)
            if result is None
        ]
    if as_json:
        click.echo(json.dumps(summary, indent=2, sort_keys=True))
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
    if failed:
        raise OuterRunFailed(f"{', '.join(failed)} failed; see their stderr above")
    if not summary["roots_agree"]:
        raise _disagreed()


# --- milestones and verification ------------------------------------------------------


def _store(ctx: click.Context) -> Any:
    from blobstore import Store

    return Store.open(Path_(ctx.ensure_object(dict)["store_root"]))


def _run_of(store: Any, ref: str) -> tuple[str, Any]:
    """Every command's RUN: (run ID, signed spec or None) of a spec's blob ID, a tag
    naming one, or a run ID (with or without a spec in this store: ``outer run`` makes
    none)."""
    from training.outer.runs import RunNotFound, read_spec

    try:
        _, signed = read_spec(store, ref)
    except RunNotFound:
        return ref, None
    return signed.spec.run, signed


@outer_group.command("milestones")
@click.argument("run_id", metavar="RUN")
@click.option(
    "--authority",
    "authorities",
    multiple=True,
    help="Check each milestone's signature against these authorities (hex or .pub).",
)
@json_option("Print the milestones as JSON.")
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
    store = _store(ctx)
    run_id, _ = _run_of(store, run_id)
    entries = list_milestones(store, run_id, trust)
    invalid = invalid_entries(entries)
    if as_json:
        click.echo(json.dumps(entries, indent=2, sort_keys=True))
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
        absent = ", ".join(f"{op} {p[-8:]}" for p, op in e.get("absent") or ())
        click.echo(
            f"round {e['round']:>4}  signed by {e['signer'][-8:]} ({e['signer_kind']})  root "
            f"{e['result'][:16]}  included {len(e['included'])} ({included}), excluded "
            f"{len(e['excluded'])}, replayed {len(e['verified'])}"
            + (f" ({verified})" if verified else "")
            + (f", absent {absent}" if absent else "")
        )


@outer_group.command("verify")
@click.argument("run_id", metavar="RUN")
@make_trust_options(
    revoked=False,
    authority_help="The run's authority public key (hex or .pub file; repeatable).",
)
@require_hardware_option(
    "Refuse any closure, update, milestone, verdict or catch-up not co-signed by a TPM "
    "attestation key (implied when the run's spec requires hardware)."
)
@json_option("Print the report as JSON.")
@click.pass_context
def verify_command(
    ctx: click.Context,
    /,
    run_id: str,
    authorities: tuple[str, ...],
    require_hardware: bool,
    as_json: bool,
) -> None:
    """Re-check RUN's closures, results, milestones, verdicts and catch-ups from the blobs
    in this store, every round from its start to the last round its milestones sign; exit
    1 if any is missing or fails."""
    from identity import TrustStore
    from training.outer.levels import check_levels
    from training.outer.milestones import verify_run
    from training.outer.params import OuterRunFailed

    trust = TrustStore(frozenset(_authority(a) for a in authorities))
    store = _store(ctx)
    run_id, signed = _run_of(store, run_id)
    if signed is not None and signed.spec.require_hardware:
        require_hardware = True
    quorum = None if signed is None else signed.spec.needed
    report = verify_run(store, run_id, trust, require_hardware=require_hardware, quorum=quorum)
    # A run made from a spec (outer init) that asks more than bounded updates: every
    # applied update offered at least the spec's level (training.outer.levels).
    if signed is not None and signed.spec.level != Level.BOUNDED:
        levels = check_levels(store, run_id, signed.spec.level)
        report.anchors.append(f"verification: each update at least {signed.spec.level}")
        report.failures.extend(f"level: {failure}" for failure in levels.failures)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, sort_keys=True))
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
@json_option("Print the tags as JSON.")
@click.pass_context
def forget_command(ctx: click.Context, /, run_id: str, dry_run: bool, as_json: bool) -> None:
    """Untag everything of RUN in this store (start, closures, milestones, verdicts, the
    updates they name, states), so the next `blob gc` deletes it: after this, RUN can no
    longer be verified from this store. `blob gc --dry-run` shows what would go."""
    from training.outer.milestones import run_tags

    store = _store(ctx)
    run_id, _ = _run_of(store, run_id)
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


# --- the user's own model: a run spec and its export -------------------------------------


@outer_group.command("init")
@click.option(
    "--model",
    "model_ref",
    default=None,
    help="Hugging Face model directory or a model collection ID (or a state file, as --state).",
)
@click.option(
    "--state",
    "state_file",
    type=InputPath(path_type=Path_, dir_okay=False),
    default=None,
    help="Your model's whole state: a file training.outer.save_state(model, FILE) wrote, "
    "or any safetensors state dict (floating tensors trainable, the rest fixed, unless "
    "--buffer / --frozen say otherwise).",
)
@click.option(
    "--buffer",
    "buffer_globs",
    multiple=True,
    metavar="GLOB",
    help="State dict names that are floating buffers (agreed each round, e.g. "
    "'*.running_*'); repeatable.",
)
@click.option(
    "--frozen",
    "frozen_globs",
    multiple=True,
    metavar="GLOB",
    help="State dict names that are frozen tensors (fixed by the initial state); repeatable.",
)
@click.option(
    "--overlap",
    type=click.IntRange(0, 1),
    default=0,
    show_default=True,
    help="Rounds a worker trains ahead of the state its next update is taken against (1: "
    "the one-step-delayed outer step; 0 blocks).",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Point an existing run ID of this store at the new spec (else it is refused).",
)
@click.option("--run", "run_id", required=True, help="Run ID (names the pubsub topic).")
@click.option(
    "--authority",
    "authorities",
    multiple=True,
    required=True,
    help="Authority whose admission certificates count (hex or .pub file; repeatable).",
)
@click.option(
    "--min-verification",
    "level",
    type=click.Choice([level.value for level in Level]),
    default=Level.BOUNDED.value,
    callback=lambda _ctx, _param, value: Level(value),
    show_default=True,
    help="The least verification an update may offer.",
)
@click.option("--workers", type=click.IntRange(1, 64), required=True, help="K per round.")
@click.option(
    "--rounds",
    type=click.IntRange(0, 100_000),
    default=0,
    show_default=True,
    help="Planned rounds (0: open-ended; each worker says when it leaves).",
)
@_INNER_STEPS
@click.option("--outer-lr", type=float, default=3.0, show_default=True)
@click.option("--momentum", "outer_momentum", type=float, default=0.0, show_default=True)
@_CHUNK
@_K
@_BATCH
@_INNER_LR
@_DEADLINE
@_PROPOSER_TIMEOUT
@_REPLAY_RATE
@_QUORUM
@click.option("--data", "data_ref", default=None, help="The run's records blob (replay needs it).")
@require_hardware_option(
    "Workers accept, and verify passes, only attestations co-signed by a TPM "
    "attestation key their signer's certificate records (every worker TPM-bound)."
)
@json_option("Print the spec as JSON.")
@click.pass_context
def init_command(
    ctx: click.Context,
    /,
    model_ref: str | None,
    state_file: Path_ | None,
    buffer_globs: tuple[str, ...],
    frozen_globs: tuple[str, ...],
    replace: bool,
    run_id: str,
    authorities: tuple[str, ...],
    data_ref: str | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Make a run from your model: its initial state (trainable parameters, buffers, fixed
    tensors, tied names), and a signed run spec naming it (the spec's blob ID is what
    workers join by). Prints the spec ID."""
    import tempfile

    from blobstore.errors import BlobNotFound, PathNotFound
    from identity import SoftwareSigner, format_public_key, load_or_create_key
    from training.outer.codec import CodecParams
    from training.outer.messages import check_run_id
    from training.outer.runs import init_run

    try:
        check_run_id(run_id)
        CodecParams(chunk=options["chunk"], k=options["k"])
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    options["quorum"] = _quorum(options["quorum"], options["workers"])
    store = _store(ctx)
    obj = ctx.ensure_object(dict)
    signer = SoftwareSigner(load_or_create_key(Path_(obj["key_path"])))
    keys = tuple(format_public_key(_authority(a)) for a in authorities)
    data = store.tags().get(data_ref, data_ref) if data_ref else ""
    if data and not store.has(data):
        raise BlobNotFound(f"records {data_ref} are not in this store")
    if (model_ref is None) == (state_file is None):
        raise click.UsageError("give one of --model DIR and --state FILE")
    with tempfile.TemporaryDirectory(prefix="blob-outer-init-") as tmp:
        source = state_file or Path_(str(model_ref))
        if model_ref is not None and not source.exists():
            blob = store.tags().get(model_ref, model_ref)
            known = len(blob) == 64 and all(c in "0123456789abcdef" for c in blob)
            if not known or not store.has(blob) or not store.is_collection(blob):
                raise PathNotFound(f"{model_ref}: no such directory, file or collection")
            source = Path_(tmp) / "model"
            store.export(blob, source)
        spec_id, spec = init_run(
            store,
            signer,
            source,
            run_id=run_id,
            authorities=keys,
            options={**options, "data": data},
            buffers=buffer_globs,
            frozen=frozen_globs,
            replace=replace,
        )
    if as_json:
        body = spec.body()
        body["tensors"] = len(spec.tensors)
        click.echo(json.dumps({"spec": spec_id, **body, "parameters": spec.parameters}, indent=2))
        return
    rest = [
        f"{len(spec.buffers)} buffers" if spec.buffers else "",
        f"{len(spec.fixed)} fixed tensors" if spec.fixed else "",
        f"{len(spec.aliases)} tied names" if spec.aliases else "",
    ]
    click.echo(
        f"run {run_id}: {len(spec.tensors)} trainable tensors, {spec.parameters} parameters"
        + "".join(f", {x}" for x in rest if x)
        + f", initial state {spec.initial[:16]}, minimum verification {spec.level}"
        + (", hardware-signed attestations only" if spec.require_hardware else ""),
        err=True,
    )
    click.echo(spec_id)


@outer_group.command("export")
@click.argument("run_ref", metavar="RUN")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path_, file_okay=False),
    required=True,
    help="Directory to write (from_pretrained loads it).",
)
@click.option(
    "--round",
    "round_",
    type=click.IntRange(0, None),
    default=None,
    help="The state after this many rounds [default: the newest held].",
)
@click.pass_context
def export_command(ctx: click.Context, /, run_ref: str, output: Path_, round_: int | None) -> None:
    """Write a run's state (by its spec ID, tag or run ID) as a model directory with the
    base's config and tokenizer."""
    from training.outer.runs import export_run

    r, blob = export_run(_store(ctx), run_ref, output, round_=round_)
    click.echo(f"{_state_after(r)}: state {blob[:16]} -> {output}", err=True)


def _state_after(r: int) -> str:
    """Which rounds' updates the state of round ``r`` holds (round r starts from it)."""
    if r == 0:
        return "the initial state (--round 0): no round's updates"
    held = "round 0" if r == 1 else f"rounds 0 to {r - 1}"
    return f"the state after {r} round(s) (--round {r}): the updates of {held} applied"


@outer_group.command("levels")
@click.argument("run_ref", metavar="RUN")
@json_option("Print the report as JSON.")
@click.pass_context
def levels_command(ctx: click.Context, /, run_ref: str, as_json: bool) -> None:
    """Check the verification level of every update RUN applied (by its spec ID, tag or run
    ID) against the spec's minimum, from this store; exit 1 on any below it or unknown."""
    from training.outer.levels import check_levels
    from training.outer.params import OuterRunFailed
    from training.outer.runs import RunNotFound, read_spec

    store = _store(ctx)
    try:
        spec = read_spec(store, run_ref)[1].spec
    except RunNotFound:
        from training.outer.milestones import run_tags

        if not run_tags(store, run_ref):
            raise
        raise RunNotFound(
            f"run {run_ref} has no run spec in this store: it ran without one (`blob outer "
            "run`, or workers without --spec), and a spec's minimum verification level is "
            "what each update is checked against. A run made with `blob outer init` (its "
            f"workers started with --spec) has one; `blob outer verify {run_ref} --authority "
            "KEY` checks a run without"
        ) from None
    report = check_levels(store, spec.run, spec.level)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        for r, entries in sorted(report.rounds.items()):
            levels = ", ".join(f"{e['peer'][-8:]} {e['level']}" for e in entries)
            click.echo(f"round {r:>4}  {levels}")
        for failure in report.failures:
            click.echo(f"FAILED {failure}")
    if not report.ok:
        raise OuterRunFailed(
            f"run {spec.run}: {len(report.failures)} update(s) below {spec.level.value!r} or "
            "unknown"
            if report.failures
            else f"run {spec.run}: no closures in this store"
        )
