"""``blob relay``: run a circuit relay v2 for admitted peers. The options that
``blob serve`` and ``blob get`` take to work behind NAT live in :mod:`p2p.cli.nat`.

A relay is a blobnet node with a public address. It reserves slots only for peers that
show an admission certificate from a trusted authority (``--authority``), answers their
dial-back checks, and cuts every circuit at limits meant for signalling (defaults:
``p2p.nat.relay.CIRCUIT_MAX_BYTES`` and ``CIRCUIT_MAX_SECONDS``); raise them only for a relay
that users may fetch whole blobs through (``blob get --via-relay``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import trio

from blobstore.options import json_option
from identity.cli_common import load_trust, trust_options
from p2p.cli.common import (
    DEFAULT_LISTEN,
    Interrupted,
    key_path_of,
    listen_option,
    load_key,
    run_interruptible,
    setup_logging,
    store_of,
    verbose_option,
)

__all__ = ["relay"]

# p2p.nat.relay imports libp2p (seconds): it is imported inside the command, so `blob put`
# stays fast. The option defaults are its constants, resolved there; their help states
# them (a test checks the two agree).


def _positive(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value <= 0:
        raise click.BadParameter("must be positive (relay v2 reads 0 as unlimited)")
    return value


@click.command("relay")
@listen_option
@trust_options
@click.option(
    "--max-circuit-bytes",
    type=int,
    default=None,
    callback=_positive,
    help="Bytes one circuit may carry, both ways together, before the relay cuts it "
    "[default: 524288, signalling only].",
)
@click.option(
    "--max-circuit-seconds",
    type=int,
    default=None,
    callback=_positive,
    help="Seconds one circuit may stay open [default: 120].",
)
@click.option(
    "--max-reservations",
    type=int,
    default=None,
    callback=_positive,
    help="Peers that may hold a reservation at once [default: 256].",
)
@click.option(
    "--max-circuits-per-peer",
    type=int,
    default=None,
    callback=_positive,
    help="Circuits open at once to one reserved peer [default: 8].",
)
@click.option(
    "--open-circuits",
    is_flag=True,
    help="Let peers without a certificate open circuits to admitted ones (reservations "
    "stay admitted-only).",
)
@click.option("--no-dht", is_flag=True, help="Do not run the Kademlia DHT.")
@json_option()
@verbose_option
@click.pass_context
def relay(
    ctx: click.Context,
    listen: Sequence[str],
    authorities: Sequence[str],
    revoked_path: Path | None,
    max_circuit_bytes: int | None,
    max_circuit_seconds: int | None,
    max_reservations: int | None,
    max_circuits_per_peer: int | None,
    open_circuits: bool,
    no_dht: bool,
    as_json: bool,
    verbose: int,
) -> None:
    """Relay circuits for admitted peers behind NAT until SIGINT or SIGTERM.

    Listen on a public address (e.g. --listen /ip4/0.0.0.0/tcp/4001). Prints one ready
    line: the relay's peer ID and the addresses to give nodes as their --relay.
    """
    from p2p.cli.fleet import Fleet
    from p2p.nat import relay as r

    setup_logging(verbose)
    trust = load_trust(authorities, revoked_path)
    store = store_of(ctx)
    key = load_key(key_path_of(ctx), server=True)
    limits = r.control_limits(
        max_bytes=max_circuit_bytes or r.CIRCUIT_MAX_BYTES,
        max_seconds=max_circuit_seconds or r.CIRCUIT_MAX_SECONDS,
        max_reservations=max_reservations or r.MAX_RESERVATIONS,
        max_circuits_per_peer=max_circuits_per_peer or r.MAX_CIRCUITS_PER_PEER,
    )

    async def run() -> None:
        from p2p.node.node import open_node
        from p2p.transport.addresses import dialable_addrs

        async with (
            open_node(
                store, key=key, listen=tuple(listen or DEFAULT_LISTEN), dht=not no_dht
            ) as node,
            r.relay_service(
                node.host, trust=trust, limits=limits, open_connect=open_circuits
            ) as service,
            Fleet().running(node, None, "relay", relay=service),  # local API: status, metrics
        ):
            addrs = dialable_addrs(node.addrs)
            if as_json:
                limits_json = {
                    "max_circuit_bytes": limits.data,
                    "max_circuit_seconds": limits.duration,
                }
                click.echo(json.dumps({"peer_id": node.peer_id, "addrs": addrs, **limits_json}))
            else:
                click.echo(f"relay {node.peer_id} " + " ".join(addrs))
            sys.stdout.flush()
            try:
                await trio.sleep_forever()
            finally:
                counters.update(relayed_bytes=service.relayed_bytes, refused=service.refused)

    counters: dict[str, Any] = {}
    try:
        run_interruptible(run)
    except Interrupted as exc:
        # A server's normal end (exit 0), with what it carried: an operator (and the NAT
        # tests) can tell signalling from bulk.
        refused = counters.get("refused", [])
        click.echo(
            f"stopping on {exc.signal_name}: relayed {counters.get('relayed_bytes', 0)} bytes, "
            f"refused {len(refused)} peer(s)",
            err=True,
        )
        if as_json and counters:
            click.echo(json.dumps({"stopped": exc.signal_name, **counters}))
