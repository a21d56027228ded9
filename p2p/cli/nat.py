"""What ``blob serve``, ``blob share`` and ``blob get`` do behind NAT: their
options, and the glue between a command's node and :mod:`p2p.nat.punch`.

- ``serve``/``share --relay MADDR... [--certificate FILE] [--assume-private]``: the node
  runs inside :func:`p2p.nat.punch.reachable`; when a relay's dial-back finds it private it
  holds reservations, and its ready line, tickets and DHT records name its circuit
  addresses (``Node.set_advertised``), which are all a peer outside can use.
- ``get [--via-relay] [--certificate FILE]``: circuit addresses (from a ticket, ``--peer``
  or the DHT) are reached through their relay and hole-punched by ``Node.connect``; a
  failed punch is one line on stderr and the fetch goes on with other providers, or
  fails with that line (exit 6). Only with ``--via-relay`` does the blob cross a relay,
  and only one run with raised ``--max-circuit-bytes`` lets it through.

Used by ``p2p.cli.serve``, ``p2p.cli.get`` and ``p2p.cli.relay`` (and the outer loop's
workers); libp2p is imported only when a node runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from identity import MAX_CERTIFICATE_SIZE
from identity.errors import NotFound

if TYPE_CHECKING:
    from p2p.nat.punch import Reachable
    from p2p.node.node import Node

# A node behind NAT must listen where its NAT maps it (hole punching dials from the
# listen port), so a command given relays listens on every interface unless told.
NAT_DEFAULT_LISTEN = ("/ip4/0.0.0.0/tcp/0",)


def load_certificate(path: Path | None) -> bytes | None:
    """The admission certificate file a node shows relays (None: none given)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CERTIFICATE_SIZE + 1)
    except FileNotFoundError:
        raise NotFound(f"no certificate file at {path}") from None
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror or str(exc)) from None
    if len(data) > MAX_CERTIFICATE_SIZE:
        raise click.BadParameter(
            f"{path} is larger than a certificate ({MAX_CERTIFICATE_SIZE} bytes)",
            param_hint="--certificate",
        )
    return data


def _certificate_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--certificate",
        "certificate_path",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help="This machine's admission certificate (blob admit), shown to relays.",
    )(command)


def relay_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--relay`` (repeatable) and ``--assume-private``, for a command that has its
    certificate already (``blob outer worker``)."""
    command = click.option(
        "--assume-private",
        is_flag=True,
        help="Reserve on the relays even if a relay can dial this node back.",
    )(command)
    return click.option(
        "--relay",
        "relays",
        multiple=True,
        metavar="MADDR",
        help="Relay to reserve on when this node is not publicly reachable (repeatable; "
        "the listen address then defaults to /ip4/0.0.0.0/tcp/0).",
    )(command)


def serve_nat_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--relay`` (repeatable), ``--certificate``, ``--assume-private``."""
    return relay_options(_certificate_option(command))


def get_nat_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--via-relay`` and ``--certificate``."""
    command = _certificate_option(command)
    return click.option(
        "--via-relay",
        is_flag=True,
        help="When hole punching to a NATed provider fails, fetch through its relay "
        "(only a relay run with raised --max-circuit-bytes lets a blob through).",
    )(command)


def check_relays(relays: Sequence[str]) -> None:
    """A relay is named by its own address, ``/ip4/HOST/tcp/PORT/p2p/<relay id>``."""
    from p2p.blob.ticket import validate_peer_addr
    from p2p.errors import BadAddress

    for addr in relays:
        try:
            validate_peer_addr(addr, error=BadAddress)
        except BadAddress as exc:
            raise click.BadParameter(str(exc), param_hint="--relay") from None
        if "/p2p-circuit" in addr:
            raise click.BadParameter(
                f"{addr} is a circuit address; give the relay's own address", param_hint="--relay"
            )


@asynccontextmanager
async def behind_nat(
    node: Node, relays: Sequence[str], certificate: bytes | None, assume_private: bool
) -> AsyncIterator[Reachable | None]:
    """Run ``node`` reachable through ``relays`` (None without relays): reservations,
    renewals, DCUtR, and its circuit addresses advertised while private."""
    if not relays:
        yield None
        return
    from p2p.nat.punch import reachable

    async with reachable(
        node.host, relays, certificate=certificate, assume_private=assume_private
    ) as reach:
        circuits = [a for r in reach.reservations for a in r.circuit_addrs]
        node.set_advertised(circuits or None)
        try:
            yield reach
        finally:
            node.set_advertised(None)


def ready_fields(reach: Reachable | None) -> dict[str, Any]:
    """What a ready line's JSON says about NAT (nothing without relays)."""
    if reach is None:
        return {}
    return {
        "public": reach.reachability.public,
        "reachability": reach.reachability.detail,
        "circuit_addrs": [a for r in reach.reservations for a in r.circuit_addrs],
        "problems": reach.problems,
    }


def nat_warning(reach: Reachable | None) -> str | None:
    """One line for stderr when relays were given and peers outside still cannot reach
    this node, else None."""
    if reach is None or reach.reservations:
        return None
    if reach.reachability.public is True and not reach.problems:
        return None  # public: its own addresses serve
    why = "; ".join(reach.problems) or reach.reachability.detail
    return (
        "blob: warning: no relay holds a reservation for this node, so peers outside its "
        f"network may not reach it: {why}"
    )
