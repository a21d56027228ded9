"""``blob serve`` and ``blob share``: a node that serves the store until stopped."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import trio

from blobstore import Store
from blobstore.catalog import check_tag_name
from blobstore.options import json_option
from p2p.blob.ticket import MAX_TICKET_ADDRS, Ticket
from p2p.cli.common import (
    DEFAULT_LISTEN,
    InputPath,
    Interrupted,
    bootstrap_option,
    check_peer_addrs,
    key_path_of,
    listen_option,
    load_key,
    node_config,
    ready_addrs,
    run_interruptible,
    setup_logging,
    store_of,
    upload_limit_option,
    upload_rate,
    verbose_option,
)
from p2p.cli.config import config_options, to_toml
from p2p.cli.fleet import Fleet, fleet_options
from p2p.cli.nat import (
    NAT_DEFAULT_LISTEN,
    behind_nat,
    check_relays,
    load_certificate,
    nat_warning,
    ready_fields,
    serve_nat_options,
)

if TYPE_CHECKING:
    from identity import MachineKey
    from p2p.nat.punch import Reachable
    from p2p.node.node import Node


class NatSetup:
    """A serving command's NAT options, checked (``--relay``, ``--certificate``,
    ``--assume-private``)."""

    def __init__(
        self, relays: Sequence[str], certificate_path: Path | None, assume_private: bool
    ) -> None:
        check_relays(relays)
        self.relays = tuple(relays)
        self.certificate = load_certificate(certificate_path)
        self.assume_private = assume_private

    def listen(self, listen: Sequence[str]) -> tuple[str, ...]:
        """Behind NAT a node listens where its NAT maps it, unless told otherwise."""
        return tuple(listen) or (NAT_DEFAULT_LISTEN if self.relays else DEFAULT_LISTEN)


async def _serve_until_signal(
    store: Store,
    key: MachineKey,
    config: Any,
    on_ready: Callable[[Node, Reachable | None], None],
    nat: NatSetup,
    fleet: Fleet,
) -> None:
    """Run a node until cancelled (``run_interruptible`` cancels it on SIGINT/SIGTERM),
    reachable through ``nat``'s relays when it is behind NAT, with its local API."""
    from p2p.node.node import open_node

    async with (
        open_node(store, key=key, config=config) as node,
        behind_nat(node, nat.relays, nat.certificate, nat.assume_private) as reach,
        fleet.running(node, reach, "serve"),
    ):
        warning = nat_warning(reach)
        if warning is not None:
            click.echo(warning, err=True)
        on_ready(node, reach)
        sys.stdout.flush()
        await trio.sleep_forever()


def _serve_checks(ctx: click.Context, bootstrap: Sequence[str]) -> tuple[Store, MachineKey]:
    from p2p.daemon.server import check_store_free
    from p2p.node.dial import check_not_self

    check_peer_addrs(bootstrap, "--bootstrap")
    store = store_of(ctx)
    check_store_free(store.root)  # one daemon per store: refused before a node starts
    key_path = key_path_of(ctx)
    key = load_key(key_path, server=True)
    check_not_self(bootstrap, key.peer_id, key_path)
    _claim_key(ctx, key_path, key.peer_id)
    return store, key


def _claim_key(ctx: click.Context, key_path: Path, peer_id: str) -> None:
    """Hold an exclusive flock on the key file while serving, and warn when another
    server holds it: two servers with one key are one peer ID at two addresses, and peers
    that reach one of them cannot tell which blobs the other holds."""
    import fcntl
    import os

    try:
        fd = os.open(key_path.expanduser(), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        click.echo(
            f"blob: warning: another server on this machine already runs with key {key_path} "
            f"(peer ID {peer_id}); give each server its own --key",
            err=True,
        )
        return
    # Released when the process ends; the fd lives as long as the command's context.
    ctx.call_on_close(lambda: os.close(fd))


def _run_server(
    store: Store,
    key: MachineKey,
    config: Any,
    on_ready: Callable[[Node, Reachable | None], None],
    nat: NatSetup,
    fleet: Fleet | None = None,
) -> None:
    fleet = fleet or Fleet()
    try:
        run_interruptible(lambda: _serve_until_signal(store, key, config, on_ready, nat, fleet))
    except Interrupted as exc:
        click.echo(f"stopping on {exc.signal_name}", err=True)  # a server's normal end: exit 0


@click.command()
@fleet_options
@config_options
@listen_option
@bootstrap_option
@click.option("--no-dht", is_flag=True, help="Do not run the Kademlia DHT.")
@click.option(
    "--verify-reads",
    is_flag=True,
    help="Hash every chunk again before sending it (guards against this disk's bit rot).",
)
@upload_limit_option
@serve_nat_options
@json_option("Print the ready line as JSON.")
@verbose_option
@click.pass_context
def serve(
    ctx: click.Context,
    listen: Sequence[str],
    bootstrap: Sequence[str],
    no_dht: bool,
    verify_reads: bool,
    upload_limit: float | None,
    relays: Sequence[str],
    certificate_path: Path | None,
    assume_private: bool,
    as_json: bool,
    verbose: int,
    print_config: bool,
    fleet: Fleet,
) -> None:
    """Serve this store's blobs until SIGINT or SIGTERM.

    Prints one ready line (peer ID and dialable addresses) once the node accepts peers; a
    wildcard listen address (/ip4/0.0.0.0/...) is shown as each interface's address.
    With --relay, a node that the relay cannot dial back (behind NAT) reserves a slot
    there and its ready line names its circuit address instead.
    """
    if print_config:
        click.echo(to_toml(ctx.params), nl=False)
        return
    setup_logging(verbose)
    nat = NatSetup(relays, certificate_path, assume_private)
    store, key = _serve_checks(ctx, bootstrap)
    config = node_config(
        nat.listen(listen),
        bootstrap,
        not no_dht,
        verify_reads=verify_reads,
        upload_limit=upload_rate(upload_limit),
        admission=fleet.trust(),
        certificate=nat.certificate,
        download_limit=fleet.download_rate(),
    )

    def ready(node: Node, reach: Reachable | None) -> None:
        addrs = ready_addrs(node)
        if as_json:
            click.echo(json.dumps({"peer_id": node.peer_id, "addrs": addrs, **ready_fields(reach)}))
        else:
            click.echo(f"ready {node.peer_id} " + " ".join(addrs))

    _run_server(store, key, config, ready, nat, fleet)


@click.command()
@click.argument("path", type=InputPath(path_type=Path))
@click.option("--tag", "tag_name", metavar="NAME", help="Tag the shared blob.")
@listen_option
@bootstrap_option
@click.option("--no-dht", is_flag=True, help="Do not run the Kademlia DHT.")
@upload_limit_option
@serve_nat_options
@json_option("Print the ticket line as JSON (id, ticket, addrs).")
@verbose_option
@click.pass_context
def share(
    ctx: click.Context,
    path: Path,
    tag_name: str | None,
    listen: Sequence[str],
    bootstrap: Sequence[str],
    no_dht: bool,
    upload_limit: float | None,
    relays: Sequence[str],
    certificate_path: Path | None,
    assume_private: bool,
    as_json: bool,
    verbose: int,
) -> None:
    """Put PATH (a file or directory) into the store and serve it until SIGINT: prints a
    ticket that `blob get TICKET` fetches from anywhere that can reach this machine.

    The ticket is the first line on stdout; how to fetch it goes to stderr."""
    from blobstore.cli import progress_bar

    setup_logging(verbose)
    if tag_name is not None:
        check_tag_name(tag_name)
    nat = NatSetup(relays, certificate_path, assume_private)
    store, key = _serve_checks(ctx, bootstrap)
    is_dir = path.is_dir()
    size = path.stat().st_size if not is_dir else 0
    with progress_bar(size, path.name, not as_json) as progress:
        blob_id = store.put_dir(path) if is_dir else store.put_path(path, progress=progress)
    if tag_name is not None:
        store.tag(tag_name, blob_id)
    config = node_config(
        nat.listen(listen), bootstrap, not no_dht, upload_limit=upload_rate(upload_limit)
    )

    def ready(node: Node, reach: Reachable | None) -> None:
        addrs = ready_addrs(node)
        ticket = Ticket(blob_id, tuple(addrs[:MAX_TICKET_ADDRS])).encode()
        if as_json:
            info = {"id": blob_id, "ticket": ticket, "peer_id": node.peer_id, "addrs": addrs}
            click.echo(json.dumps({**info, **ready_fields(reach)}))
        else:
            click.echo(ticket)
        click.echo(
            f"sharing {path} ({blob_id[:12]}) as {node.peer_id}; fetch it with\n"
            f"  blob get {ticket} -o {path.name}\n"
            "Ctrl-C stops sharing.",
            err=True,
        )

    _run_server(store, key, config, ready, nat)
