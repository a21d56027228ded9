"""The catalog commands of ``blob``: ``publish NAME ID``, ``resolve PUBLISHER/NAME`` and
``catalog PUBLISHER``. On a store that a ``blob serve`` runs on, each is done by that
daemon (its key, its warm peers and DHT table; the JSON says ``"via": "daemon"``), unless
``--listen`` asks for a node of the command's own. Otherwise each runs a short-lived node
with the machine key (so the publisher is this machine's peer ID) over the store, dials
the peers it is given, does its one job and exits; records it publishes or resolves stay
in the store's record cache, which a ``blob serve`` on the same store answers from.

Errors keep the README's exit codes: 2 a malformed name or reference, 3 no such blob or
no valid record, 4 a malformed certificate, 6 the network.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from blobstore import BlobNotFound, Store
from blobstore.options import json_option
from identity.cli_common import load_trust, make_trust_options
from p2p.blob.ticket import validate_peer_addr
from p2p.cli.common import (
    bootstrap_option,
    daemon_of,
    listen_option,
    run_interruptible,
    verbose_option,
)
from p2p.cli.light import describe
from p2p.errors import BadAddress
from p2p.names.record import NameRecord, check_name, parse_ref

if TYPE_CHECKING:
    from identity import AdmissionCertificate, TrustStore
    from p2p.node.node import Node

T = TypeVar("T")
DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)

peer_option = click.option(
    "--peer",
    "peers",
    multiple=True,
    metavar="MADDR",
    help="Peer to dial first and ask (repeatable; /ip4/.../tcp/.../p2p/<id>).",
)
no_dht_option = click.option("--no-dht", is_flag=True, help="Do not use the Kademlia DHT.")


def _node_options(*, dht: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options of every catalog command that runs a node (``--no-dht`` with
    ``dht``), in the order ``--help`` lists them, and the click context."""

    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        command = json_option()(verbose_option(click.pass_context(command)))
        if dht:
            command = no_dht_option(command)
        return peer_option(bootstrap_option(listen_option(command)))

    return apply


_trust_options = make_trust_options(
    required=False,
    authority_help="Accept only publishers admitted by this authority (64 hex digits or a "
    ".pub file; repeatable).",
    revoked_help="Revocation list for --authority: one certificate serial or peer ID a line.",
)


def _load_trust(authorities: Sequence[str], revoked_path: Path | None) -> TrustStore | None:
    if not authorities:
        if revoked_path is not None:
            raise click.UsageError("--revoked needs --authority")
        return None
    return load_trust(authorities, revoked_path)


def _setup_logging(verbose: int) -> None:
    """As the other node commands do: libp2p's routine churn only with -vv."""
    import libp2p  # noqa: F401 - its import sets its logger's level; ours comes after

    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if verbose < 2:
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)


def _root(ctx: click.Context) -> dict[str, Any]:
    obj: dict[str, Any] = ctx.find_root().obj
    return obj


def _run_node(
    ctx: click.Context,
    *,
    peers: Sequence[str],
    bootstrap: Sequence[str],
    listen: Sequence[str],
    no_dht: bool,
    verbose: int,
    job: Callable[[Node], Awaitable[T]],
) -> T:
    """Open a node over the store with the machine key, dial ``peers``, run ``job``."""
    for addr in (*peers, *bootstrap):
        validate_peer_addr(addr, error=BadAddress)
    _setup_logging(verbose)
    store = Store.open(_root(ctx)["store_root"])
    key_path = _root(ctx)["key_path"]
    from p2p.names import service as names
    from p2p.node.node import NodeConfig, open_node

    config = NodeConfig(
        listen=tuple(listen or DEFAULT_LISTEN), bootstrap=tuple(bootstrap), dht=not no_dht
    )

    async def main() -> T:
        async with open_node(store, key_path=key_path, config=config) as node:
            names.install(node)
            for addr in peers:
                await node.connect(addr)
            return await job(node)

    # SIGINT or SIGTERM cancels the job (its cleanup runs) and exits 130, as every node
    # command does.
    return run_interruptible(main)


def _describe(record: NameRecord) -> str:
    return describe(record.to_json())


def _read_certificate(path: Path) -> AdmissionCertificate:
    from identity import MAX_CERTIFICATE_SIZE, AdmissionCertificate, NotFound

    try:
        with path.open("rb") as f:
            data = f.read(MAX_CERTIFICATE_SIZE + 1)
    except FileNotFoundError:
        raise NotFound(f"no certificate file at {path}") from None
    except OSError as exc:
        raise click.FileError(str(path), exc.strerror) from None
    return AdmissionCertificate.decode(data)


@click.command()
@click.argument("name")
@click.argument("ref")
@click.option(
    "--seq",
    type=click.IntRange(min=0, max=(1 << 63) - 1),
    default=None,
    help="Sequence number (default: one more than the last, at least Unix time).",
)
@click.option(
    "--expires-in",
    "expires_in",
    type=click.IntRange(min=1),
    default=None,
    metavar="SECONDS",
    help="The record expires this many seconds from now.",
)
@click.option(
    "--cert",
    "cert_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="This machine's admission certificate, to embed.",
)
@_node_options(dht=True)
def publish(
    ctx: click.Context,
    name: str,
    ref: str,
    seq: int | None,
    expires_in: int | None,
    cert_path: Path | None,
    peers: Sequence[str],
    bootstrap: Sequence[str],
    listen: Sequence[str],
    no_dht: bool,
    as_json: bool,
    verbose: int,
) -> None:
    """Name a blob of this store: sign PEER_ID/NAME -> ID with the machine key and spread
    it to the peers given (and theirs) and the DHT.

    REF is a blob ID, 8+ character prefix or tag. The record is also kept in the store,
    so a `blob serve` on it answers for the name.
    """
    check_name(name)
    store = Store.open(_root(ctx)["store_root"])
    blob_id = store.resolve(ref)
    if not store.has(blob_id):
        raise BlobNotFound(f"blob {blob_id} is not complete in this store; get it first")
    certificate = None if cert_path is None else _read_certificate(cert_path)
    from p2p.names import service as names

    async def job(node: Node) -> names.Spread:
        return await names.publish(
            node, name, blob_id, seq=seq, expiry_s=expires_in, certificate=certificate
        )

    for addr in peers:
        validate_peer_addr(addr, error=BadAddress)
    request = {
        "name": name, "ref": blob_id, "peers": list(peers), "dht": not no_dht, "seq": seq,
        "expires_in_s": expires_in,
        "certificate": None if certificate is None else certificate.encode().hex(),
    }  # fmt: skip
    by_daemon = None if listen else _via_daemon(ctx, "publish", request)
    if by_daemon is not None:
        shown = by_daemon
    else:
        spread = _run_node(
            ctx,
            peers=peers,
            bootstrap=bootstrap,
            listen=listen,
            no_dht=no_dht,
            verbose=verbose,
            job=job,
        )
        shown = spread.to_json()
    if as_json:
        click.echo(json.dumps(shown))
        return
    click.echo(describe(shown))
    pushed, stored = len(shown["pushed_to"]), bool(shown["dht"])
    click.echo(f"published: pushed to {pushed} peer(s), DHT {'yes' if stored else 'no'}", err=True)
    if not pushed and not stored:
        click.echo(
            "note: no peer took the record; it is kept in this store, and `blob serve` "
            "on this store spreads and answers for it",
            err=True,
        )


@click.command()
@click.argument("ref", metavar="PUBLISHER/NAME")
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0.1, max=600),
    default=5.0,
    show_default=True,
    help="Seconds to wait for peers and the DHT.",
)
@_trust_options
@_node_options(dht=True)
def resolve(
    ctx: click.Context,
    ref: str,
    wait_s: float,
    authorities: Sequence[str],
    revoked_path: Path | None,
    peers: Sequence[str],
    bootstrap: Sequence[str],
    listen: Sequence[str],
    no_dht: bool,
    as_json: bool,
    verbose: int,
) -> None:
    """Print the blob ID that PUBLISHER/NAME names now: the newest valid record from
    this store's cache, the connected peers and the DHT."""
    target = parse_ref(ref)
    trust = _load_trust(authorities, revoked_path)
    from p2p.names import service as names

    async def job(node: Node) -> NameRecord:
        return await names.resolve(node, target, trust=trust, wait_s=wait_s)

    keys = () if trust is None or revoked_path is not None else tuple(trust.authorities)
    daemon_ok = not listen and (trust is None or revoked_path is None)
    by_daemon = (
        resolve_via_daemon(ctx, ref, wait_s, keys, peers, dht=not no_dht) if daemon_ok else None
    )
    record = by_daemon or _run_node(
        ctx,
        peers=peers,
        bootstrap=bootstrap,
        listen=listen,
        no_dht=no_dht,
        verbose=verbose,
        job=job,
    )
    via = {"via": "daemon"} if by_daemon is not None else {}
    click.echo(json.dumps({**record.to_json(), **via}) if as_json else _describe(record))


@click.command()
@click.argument("publisher")
@_trust_options
@_node_options(dht=False)
def catalog(
    ctx: click.Context,
    publisher: str,
    authorities: Sequence[str],
    revoked_path: Path | None,
    peers: Sequence[str],
    bootstrap: Sequence[str],
    listen: Sequence[str],
    as_json: bool,
    verbose: int,
) -> None:
    """List what PUBLISHER has named, as this store and the peers given know it (the
    DHT finds a name, but cannot list them)."""
    parse_ref(f"{publisher}/x")
    trust = _load_trust(authorities, revoked_path)
    from p2p.names import service as names

    async def job(node: Node) -> list[NameRecord]:
        return await names.catalog(node, publisher, trust=trust)

    for addr in peers:
        validate_peer_addr(addr, error=BadAddress)
    keys = () if trust is None or revoked_path is not None else tuple(trust.authorities)
    daemon_ok = not listen and (trust is None or revoked_path is None)
    request = {"publisher": publisher, "authorities": [k.hex() for k in keys], "peers": peers}
    by_daemon = _via_daemon(ctx, "catalog", request) if daemon_ok else None
    if by_daemon is not None:
        shown = [{**r, "via": "daemon"} for r in by_daemon["records"]]
    else:
        records = _run_node(
            ctx,
            peers=peers,
            bootstrap=bootstrap,
            listen=listen,
            no_dht=True,
            verbose=verbose,
            job=job,
        )
        shown = [r.to_json() for r in records]
    if as_json:
        click.echo(json.dumps(shown))
        return
    now = time.time()
    for record in shown:
        left = "" if record["expires"] is None else f"  ({int(record['expires'] - now)} s left)"
        click.echo(f"{record['name']}  {record['id']}  seq {record['seq']}{left}")


def resolve_name(
    ctx: click.Context,
    ref: str,
    *,
    peers: Sequence[str] = (),
    bootstrap: Sequence[str] = (),
    listen: Sequence[str] = (),
    no_dht: bool = False,
    verbose: int = 0,
) -> str:
    """The blob ID that ``PUBLISHER/NAME`` names now, for commands that take an ID
    (``blob get PUBLISHER/NAME``): a short-lived node asks as ``blob resolve`` does, and,
    like ``blob get``, uses the DHT only with ``--bootstrap``."""
    target = parse_ref(ref)
    from p2p.names import service as names

    async def job(node: Node) -> NameRecord:
        return await names.resolve(node, target)

    record = (
        None if listen else resolve_via_daemon(ctx, ref, 5.0, (), peers, dht=bool(bootstrap))
    ) or _run_node(
        ctx,
        peers=peers,
        bootstrap=bootstrap,
        listen=listen,
        no_dht=no_dht or not bootstrap,
        verbose=verbose,
        job=job,
    )
    click.echo(f"{ref} is {record.blob_id} (seq {record.seq})", err=True)
    return record.blob_id


def resolve_via_daemon(
    ctx: click.Context,
    ref: str,
    wait_s: float,
    authorities: Sequence[bytes],
    peers: Sequence[str],
    *,
    dht: bool,
) -> NameRecord | None:
    """The record a `blob serve` on this store resolves ``ref`` to (on its warm peers and
    DHT table, p2p/daemon/API.md), or None when no daemon serves the store."""
    from p2p.daemon.client import DaemonRefused, as_command_error

    for addr in peers:
        validate_peer_addr(addr, error=BadAddress)
    client = daemon_of(ctx)
    if client is None:
        return None
    try:
        return client.resolve(ref, wait_s=wait_s, authorities=authorities, peers=peers, dht=dht)
    except DaemonRefused as exc:
        raise as_command_error(exc) from None


def _via_daemon(ctx: click.Context, op: str, request: dict[str, Any]) -> dict[str, Any] | None:
    """``op`` done by the daemon serving this store (p2p/daemon/API.md), its result; None
    when no daemon serves it."""
    from p2p.daemon.client import DaemonRefused, as_command_error

    client = daemon_of(ctx)
    if client is None:
        return None
    args = {k: v for k, v in request.items() if v is not None}
    try:
        result = client.request(op, **args)
    except DaemonRefused as exc:
        raise as_command_error(exc) from None
    result.pop("event", None)
    return result


COMMANDS: list[click.Command] = [publish, resolve, catalog]


def register(group: click.Group) -> None:
    """Add the catalog commands to the ``blob`` group."""
    for command in COMMANDS:
        group.add_command(command)
