"""``blob outer``: the DiLoCo outer loop's commands.

For now ``blob outer simulate`` runs K workers in one process (``training.outer.simulate``);
the multi-process ``outer run`` / ``outer worker`` commands reuse the same round functions.
torch is imported only when a command runs.
"""

from __future__ import annotations

import json
import sys

import click

from training.outer import MODES, SimConfig, SimResult

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
    from training.codec import CodecParams
    from training.outer import simulate

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
