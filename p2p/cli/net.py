"""The network commands of ``blob``: ``serve``, ``share``, ``get`` (local or over the
network), ``export``, ``ticket`` and ``demo``.

Everything that can be checked without the network is checked before a node starts:
addresses, output paths, tag names, a named peer with our own peer ID, and whether the
command names anywhere to fetch from at all. Named peers are dialled first, so a failure
says which peer and why. Ctrl-C (or SIGTERM) during a networked command is caught by a
trio signal receiver and turned into an orderly cancellation, never a KeyboardInterrupt
raised inside some task, and the command exits 130 with one line.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
import trio

from blobstore import BadBlobId, BlobNotFound, Store, parse_blob_id
from blobstore.export import check_output
from blobstore.store import check_tag_name
from p2p.blob.pacing import MIN_UPLOAD_LIMIT
from p2p.blob.ticket import MAX_TICKET_ADDRS, Ticket, validate_peer_addr
from p2p.cli.nat import (
    NAT_DEFAULT_LISTEN,
    behind_nat,
    check_relays,
    get_nat_options,
    load_certificate,
    nat_warning,
    ready_fields,
    serve_nat_options,
)
from p2p.errors import BadAddress
from p2p.transport.addresses import dialable_addrs

if TYPE_CHECKING:
    from identity import MachineKey
    from p2p.fetch.downloader import Progress
    from p2p.nat.punch import Reachable
    from p2p.node.node import Node

# libp2p takes seconds to import, so p2p.node.node is imported inside the commands that run a
# node: `blob put` and friends stay fast.
DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)
# --seed-for's ceiling: a day; a longer-lived seeder is `blob serve`.
MAX_SEED_SECONDS = 86400.0
# A punch longer than this is not going to work (py-libp2p's DCUtR gives up after 25 s).
MAX_PUNCH_TIMEOUT = 300.0

T = TypeVar("T")


def _own_cpu_s() -> float:
    """User + system CPU seconds of this process so far, all threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _store(ctx: click.Context) -> Store:
    return Store.open(ctx.find_root().obj["store_root"])


def _key_path(ctx: click.Context) -> Path:
    path: Path = ctx.find_root().obj["key_path"]
    return path


def _setup_logging(verbose: int) -> None:
    """Logging for commands that run a node. libp2p is imported first: its import sets
    its own logger's level, which would undo ours."""
    import libp2p  # noqa: F401

    # Warnings (an unreachable bootstrap peer, a banned provider) only with -v: by default
    # a command's outcome is its one result or error line.
    level = logging.ERROR if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if verbose < 2:
        # py-libp2p logs routine DHT and connection churn (a peer without the DHT, a
        # stream reset) at WARNING and ERROR; -vv shows it.
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)


listen_option = click.option(
    "--listen",
    "listen",
    multiple=True,
    metavar="MADDR",
    help="Address to listen on (repeatable; default /ip4/127.0.0.1/tcp/0).",
)
bootstrap_option = click.option(
    "--bootstrap", multiple=True, metavar="MADDR", help="DHT bootstrap peer (repeatable)."
)
verbose_option = click.option(
    "-v", "--verbose", count=True, help="Warnings and progress notes on stderr (-vv: debug)."
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
# MB/s on the command line (1e6 bytes), bytes/s in NodeConfig; p2p.blob.pacing's floor.
upload_limit_option = click.option(
    "--upload-limit",
    "upload_limit",
    type=click.FloatRange(min=MIN_UPLOAD_LIMIT / 1e6),
    metavar="MB/S",
    help="Send at most this many MB/s to other peers, all together (default: no limit).",
)


def _upload_limit(mb_per_s: float | None) -> float | None:
    return None if mb_per_s is None else mb_per_s * 1e6


EXIT_INTERRUPTED = 130


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while a networked command ran."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"interrupted by {signal_name}")
        self.signal_name = signal_name


def run_interruptible(work: Callable[[], Awaitable[T]]) -> T:
    """``trio.run(work)``, with SIGINT and SIGTERM cancelling ``work`` in order (its
    cleanup runs: a fetch flushes what verified) and then raising ``Interrupted``. A
    second signal during that cleanup ends the process at once (exit 130): the store is
    crash-safe, so only what verified since the last flush is lost.

    trio's default Ctrl-C handling raises KeyboardInterrupt inside whichever task is
    running, which can leave a task that a worker thread will later wake; a signal
    receiver turns the signal into a plain cancellation instead."""
    caught: list[int] = []

    async def main() -> T:
        result: list[T] = []
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                work_scope = trio.CancelScope()

                async def watch() -> None:
                    async for signum in signals:
                        if caught:
                            click.echo("Interrupted again: stopping now.", err=True)
                            os._exit(EXIT_INTERRUPTED)
                        caught.append(signum)
                        work_scope.cancel()

                nursery.start_soon(watch)
                with work_scope:
                    result.append(await work())
                nursery.cancel_scope.cancel()
        if caught or not result:
            raise Interrupted(signal.Signals(caught[0]).name if caught else "cancelled")
        return result[0]

    try:
        return trio.run(main)
    except BaseException as exc:
        if caught and not isinstance(exc, Interrupted):
            # Whatever the cancellation surfaced as (a dial or stream error wrapping it),
            # the user asked to stop.
            raise Interrupted(signal.Signals(caught[0]).name) from None
        raise


def _load_key(key_path: Path) -> MachineKey:
    from identity import load_or_create_key

    return load_or_create_key(key_path)


def _check_peer_addrs(addrs: Sequence[str], option: str) -> None:
    """Malformed addresses are usage errors (exit 2), said plainly."""
    for addr in addrs:
        try:
            validate_peer_addr(addr, error=BadAddress)
        except BadAddress as exc:
            raise click.BadParameter(str(exc), param_hint=option) from None


def _ready_addrs(node: Node) -> list[str]:
    """What a ready line and a ticket name: the circuit addresses of a node behind NAT
    (nothing else can be dialled from outside), else its own dialable addresses."""
    return dialable_addrs(node.reachable_addrs)


def fetch_listen(listen: Sequence[str], addrs: Sequence[str]) -> tuple[str, ...]:
    """``blob get``'s listen address: as given; else loopback when every peer the
    command names is on this machine, else every interface on a random port (fellow
    fetchers on other machines fetch from it, and hole punching dials from it)."""
    if listen:
        return tuple(listen)
    for addr in addrs:
        try:
            ip = _first_ip(addr)
        except ValueError:
            return NAT_DEFAULT_LISTEN
        if ip is None or not ipaddress.ip_address(ip).is_loopback:
            return NAT_DEFAULT_LISTEN
    return DEFAULT_LISTEN


def _first_ip(addr: str) -> str | None:
    """The first /ip4/ or /ip6/ component of ``addr`` (None: a DNS name or none)."""
    parts = addr.split("/")
    for i, part in enumerate(parts[:-1]):
        if part in ("ip4", "ip6"):
            ipaddress.ip_address(parts[i + 1])  # ValueError if malformed
            return parts[i + 1]
    return None


def _node_config(listen: Sequence[str], bootstrap: Sequence[str], dht: bool, **extra: Any) -> Any:
    from p2p.node.node import NodeConfig

    return NodeConfig(
        listen=tuple(listen or DEFAULT_LISTEN), bootstrap=tuple(bootstrap), dht=dht, **extra
    )


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
) -> None:
    """Run a node until cancelled (``run_interruptible`` cancels it on SIGINT/SIGTERM),
    reachable through ``nat``'s relays when it is behind NAT."""
    from p2p.node.node import open_node

    async with (
        open_node(store, key=key, config=config) as node,
        behind_nat(node, nat.relays, nat.certificate, nat.assume_private) as reach,
    ):
        warning = nat_warning(reach)
        if warning is not None:
            click.echo(warning, err=True)
        on_ready(node, reach)
        sys.stdout.flush()
        await trio.sleep_forever()


def _serve_checks(ctx: click.Context, bootstrap: Sequence[str]) -> tuple[Store, MachineKey]:
    from p2p.node.dial import check_not_self

    _check_peer_addrs(bootstrap, "--bootstrap")
    store = _store(ctx)
    key_path = _key_path(ctx)
    key = _load_key(key_path)
    check_not_self(bootstrap, key.peer_id, key_path)
    return store, key


def _run_server(
    store: Store,
    key: MachineKey,
    config: Any,
    on_ready: Callable[[Node, Reachable | None], None],
    nat: NatSetup,
) -> None:
    try:
        run_interruptible(lambda: _serve_until_signal(store, key, config, on_ready, nat))
    except Interrupted as exc:
        click.echo(f"stopping on {exc.signal_name}", err=True)  # a server's normal end: exit 0


@click.command()
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
@click.option("--json", "as_json", is_flag=True, help="Print the ready line as JSON.")
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
) -> None:
    """Serve this store's blobs until SIGINT or SIGTERM.

    Prints one ready line (peer ID and dialable addresses) once the node accepts peers; a
    wildcard listen address (/ip4/0.0.0.0/...) is shown as each interface's address.
    With --relay, a node that the relay cannot dial back (behind NAT) reserves a slot
    there and its ready line names its circuit address instead.
    """
    _setup_logging(verbose)
    nat = NatSetup(relays, certificate_path, assume_private)
    store, key = _serve_checks(ctx, bootstrap)
    config = _node_config(
        nat.listen(listen),
        bootstrap,
        not no_dht,
        verify_reads=verify_reads,
        upload_limit=_upload_limit(upload_limit),
    )

    def ready(node: Node, reach: Reachable | None) -> None:
        addrs = _ready_addrs(node)
        if as_json:
            click.echo(json.dumps({"peer_id": node.peer_id, "addrs": addrs, **ready_fields(reach)}))
        else:
            click.echo(f"ready {node.peer_id} " + " ".join(addrs))

    _run_server(store, key, config, ready, nat)


@click.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--tag", "tag_name", metavar="NAME", help="Tag the shared blob.")
@listen_option
@bootstrap_option
@click.option("--no-dht", is_flag=True, help="Do not run the Kademlia DHT.")
@upload_limit_option
@serve_nat_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print the ticket line as JSON (id, ticket, addrs)."
)
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

    _setup_logging(verbose)
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
    config = _node_config(
        nat.listen(listen), bootstrap, not no_dht, upload_limit=_upload_limit(upload_limit)
    )

    def ready(node: Node, reach: Reachable | None) -> None:
        addrs = _ready_addrs(node)
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


class ProgressBar:
    """A tqdm bar on stderr fed by the downloader's progress callback. On a resumed fetch
    it starts at the bytes already held, and its rate counts only bytes fetched now."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None

    def __call__(self, progress: Progress) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            # The bytes held when this fetch began: the downloader's rate counts only the
            # bytes since, so done - rate * elapsed recovers them exactly.
            start = max(
                0, round(progress.done_bytes - progress.rate_bytes_per_s * progress.elapsed)
            )
            self.bar = tqdm(
                total=progress.total_bytes,
                initial=start,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=progress.blob_id[:12],
                file=sys.stderr,
                leave=True,
            )
            self.bar.start_t -= progress.elapsed  # the fetch's clock, not the bar's
        self.bar.n = progress.done_bytes
        active = sum(1 for s in progress.peers.values() if not s.banned and not s.dropped)
        self.bar.set_postfix_str(f"peers={active}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _locally_complete(store: Store, blob_id: str, include: Sequence[str]) -> bool:
    """Whether ``blob_id`` (and the collection files wanted) are all in the store."""
    if not store.has(blob_id):
        return False
    if not store.is_collection(blob_id):
        return True
    from blobstore.export import select_entries

    try:
        wanted = select_entries(store, blob_id, include)
    except BlobNotFound:
        return True  # nothing matches: reported when exporting
    return all(store.has(child) for _path, child in wanted)


def _resolve_ref(store: Store, ref: str) -> tuple[str | None, tuple[str, ...]]:
    """``(blob ID or None if unknown here, ticket addresses)``."""
    if ref.startswith("blob1"):
        ticket = Ticket.decode(ref)
        return ticket.blob_id, ticket.addrs
    try:
        return store.resolve(ref), ()
    except BlobNotFound:
        pass
    try:
        return parse_blob_id(ref), ()
    except BadBlobId:
        raise BlobNotFound(
            f"{ref!r} is not in the local store; to fetch it, give its full 64-hex ID or a ticket"
        ) from None


@click.command()
@click.argument("ref")
@click.option(
    "-o", "--output", type=click.Path(path_type=Path), help="Write the blob (or directory) here."
)
@click.option("--peer", "peers", multiple=True, metavar="MADDR", help="Provider (repeatable).")
@bootstrap_option
@click.option(
    "--listen",
    "listen",
    multiple=True,
    metavar="MADDR",
    help="Address to serve fellow fetchers and hole-punch from (repeatable; default "
    "/ip4/127.0.0.1/tcp/0 when every peer named is on this machine, else "
    "/ip4/0.0.0.0/tcp/0).",
)
@click.option("--no-dht", is_flag=True, help="Do not use the DHT even with --bootstrap.")
@click.option("--tag", "tag_name", metavar="NAME", help="Tag what was fetched (pins it).")
@click.option(
    "--include",
    "include",
    multiple=True,
    metavar="GLOB",
    help="Only a collection's files whose path matches (fnmatch, repeatable).",
)
@click.option(
    "--tensor",
    "tensors",
    multiple=True,
    metavar="NAME",
    help="Only this tensor of a safetensors blob (or of a sharded model's collection), "
    "fetching just its chunks (repeatable); -o FILE.npy (one) or FILE.npz.",
)
@click.option(
    "--link",
    is_flag=True,
    help="With -o: symlinks to the store's read-only files instead of copies.",
)
@click.option(
    "--discovery-timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds to keep looking for providers on the DHT when none can serve.",
)
@click.option(
    "--no-upload",
    is_flag=True,
    help="Serve nothing while fetching (by default fellow fetchers of the blob may fetch "
    "what has arrived, so a checkpoint crosses its seeder's uplink about once).",
)
@upload_limit_option
@click.option(
    "--seed-for",
    type=click.FloatRange(min=0, max=MAX_SEED_SECONDS),
    default=None,
    metavar="SECONDS",
    help="Once fetched (and written to -o), keep serving it to fellow fetchers this long; "
    "Ctrl-C ends that early (exit 0).",
)
@get_nat_options
@click.option(
    "--punch-timeout",
    type=click.FloatRange(min=1, max=MAX_PUNCH_TIMEOUT),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="How long hole punching to one NATed provider may take (a failing punch waits "
    "it out; one that works takes a few round trips).",
)
@json_option
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@verbose_option
@click.pass_context
def get(
    ctx: click.Context,
    ref: str,
    output: Path | None,
    peers: Sequence[str],
    bootstrap: Sequence[str],
    listen: Sequence[str],
    no_dht: bool,
    tag_name: str | None,
    include: Sequence[str],
    tensors: Sequence[str],
    link: bool,
    discovery_timeout: float,
    no_upload: bool,
    upload_limit: float | None,
    seed_for: float | None,
    via_relay: bool,
    certificate_path: Path | None,
    punch_timeout: float,
    as_json: bool,
    no_progress: bool,
    verbose: int,
) -> None:
    """Get a blob by ID, 8+ character prefix, tag or ticket: from the local store if it is
    there, else from the network (named peers, a ticket's peers, the DHT through
    --bootstrap peers).

    With -o the blob (or a collection's directory) is written to PATH. Providers behind
    NAT (circuit addresses) are reached through their relay and hole-punched; the blob
    crosses the direct connection, or, with --via-relay, the relay when the punch fails.
    """
    _setup_logging(verbose)
    started_at = time.time()
    # Everything checkable without the network, first.
    if tag_name is not None:
        check_tag_name(tag_name)
    if upload_limit is not None and no_upload:
        raise click.UsageError("--upload-limit limits what --no-upload switches off: give one")
    if seed_for is not None and (no_upload or tensors):
        raise click.UsageError(
            "--seed-for serves what was fetched: not with --no-upload or --tensor"
        )
    certificate = load_certificate(certificate_path)
    if tensors and (include or link):
        raise click.UsageError("--tensor takes a single safetensors blob: no --include or --link")
    if link and output is None:
        raise click.UsageError("--link makes links at -o PATH: give -o")
    if output is not None:
        check_output(output)
    _check_peer_addrs(peers, "--peer")
    _check_peer_addrs(bootstrap, "--bootstrap")
    store = _store(ctx)
    from p2p.names.record import is_name_ref

    ticket_addrs: tuple[str, ...] = ()
    if is_name_ref(ref):
        from p2p.cli.names import resolve_name

        blob_id: str | None = resolve_name(
            ctx,
            ref,
            peers=peers,
            bootstrap=bootstrap,
            listen=listen,
            no_dht=no_dht,
            verbose=verbose,
        )
    else:
        blob_id, ticket_addrs = _resolve_ref(store, ref)
    assert blob_id is not None
    stats: dict[str, Any] = {"source": "local"}
    if tensors:
        _get_tensors(ctx, store, blob_id, [*peers, *ticket_addrs], tensors, output, listen, as_json)
        return
    # A lease keeps gc off what this get still needs (a collection's children included),
    # however long the fetch and the export take.
    with store.lease([blob_id]):
        fetched = False

        def finish(stats: dict[str, Any], fetched: bool) -> None:
            """Tag, write -o and print the result line."""
            if tag_name is not None:
                store.tag(tag_name, blob_id)
            if output is not None:
                # What was just fetched was verified chunk by chunk on arrival: no second
                # hash.
                _write_output(
                    store,
                    blob_id,
                    output,
                    include,
                    link,
                    show_progress=not as_json,
                    verify=not fetched,
                )
            if as_json:
                where = str(output) if output else None
                click.echo(json.dumps({"id": blob_id, "path": where, "tag": tag_name, **stats}))
            else:
                click.echo(f"{blob_id}  {output if output else store.path(blob_id)}")
            sys.stdout.flush()

        if (peers or ticket_addrs) and store.has(blob_id) and store.verify(blob_id):
            # Sources were named, so a rotten local copy is repaired from them instead of
            # being exported (verify has quarantined it; only its bad chunks travel).
            click.echo(
                f"blob: note: the local copy of {blob_id[:12]} is corrupt (quarantined); "
                "repairing it from the named peers",
                err=True,
            )
        if not _locally_complete(store, blob_id, include):
            named = [*peers, *ticket_addrs]
            use_dht = bool(bootstrap) and not no_dht
            if not named and not use_dht:
                raise click.UsageError(
                    f"{blob_id[:12]} is not complete in this store, and nothing says where to "
                    "fetch it from: give --peer MADDR, --bootstrap MADDR or a ticket"
                )
            key_path = _key_path(ctx)
            key = _load_key(key_path)
            from p2p.fetch.scheduler import SchedulerConfig
            from p2p.node.dial import check_not_self

            check_not_self([*named, *bootstrap], key.peer_id, key_path)
            config = _node_config(
                fetch_listen(listen, [*named, *bootstrap]),
                bootstrap,
                use_dht,
                discovery_timeout=discovery_timeout,
                upload=not no_upload,
                upload_limit=_upload_limit(upload_limit),
                relayed_fetch=via_relay,
                certificate=certificate,
                punch_timeout=punch_timeout,
                # A one-shot get's node ends with its fetch: while fellows still ask it
                # for chunks it stays a little (p2p.blob.swarm rule 5), so the tail of the
                # swarm is not left to the seeder alone.
                scheduler=SchedulerConfig(linger_while_asked=not no_upload),
            )
            bar = ProgressBar(enabled=not no_progress and not as_json and sys.stderr.isatty())
            seed = None if seed_for is None else Seeding(seed_for, bar, finish)
            try:
                stats = _fetch(
                    store, key, config, blob_id, named, include, bar, verbose, started_at, seed
                )
                fetched = True
            except Interrupted as exc:
                if seed is None or not seed.started:
                    raise
                # The get itself succeeded (its result line is out): ending the seeding is
                # a server's normal end.
                click.echo(f"stopping on {exc.signal_name}", err=True)
                return
            finally:
                bar.close()
            if seed is not None:
                return  # finished inside, before seeding
        elif seed_for is not None:
            click.echo(
                f"blob: note: {blob_id[:12]} was already here; nothing fetched, so nothing "
                "to seed (blob serve serves it)",
                err=True,
            )
        finish(stats, fetched)


def _get_tensors(
    ctx: click.Context,
    store: Store,
    blob_id: str,
    named: Sequence[str],
    names: Sequence[str],
    output: Path | None,
    listen: Sequence[str],
    as_json: bool,
) -> None:
    """``blob get REF --tensor NAME...``: only those tensors, saved with numpy."""
    from p2p.fetch.tensors import TensorFetch, fetch_tensors, read_local_tensors

    if output is not None and output.suffix not in (".npy", ".npz"):
        raise click.UsageError("--tensor writes numpy files: give -o NAME.npy or -o NAME.npz")
    if output is not None and output.suffix == ".npy" and len(set(names)) > 1:
        raise click.UsageError("several --tensor go to one -o NAME.npz")
    result: TensorFetch
    if not named:
        source = "local"
        if not store.has(blob_id):
            raise click.UsageError(
                f"{blob_id[:12]} is not complete in this store: --tensor fetches from "
                "--peer MADDR or a ticket's peers"
            )
        result = run_interruptible(lambda: read_local_tensors(store, blob_id, names))
    else:
        source = "network"
        key_path = _key_path(ctx)
        key = _load_key(key_path)
        from p2p.node.dial import check_not_self, dial_named, peer_id_of, unreachable_error
        from p2p.node.node import open_node

        check_not_self(named, key.peer_id, key_path)
        config = _node_config(listen, (), False)

        async def main() -> TensorFetch:
            async with open_node(store, key=key, config=config) as node:
                dialled = await dial_named(node, named)
                if not dialled.reached:
                    raise unreachable_error(dialled.failures)
                peers = [peer_id_of(a) for a in dialled.usable]
                return await fetch_tensors(node, blob_id, names, peers=peers)

        result = run_interruptible(main)
    if output is not None:
        _save_arrays(output, result.tensors)
    info: dict[str, dict[str, Any]] = {
        name: {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "bytes": t.end - t.begin,
            "file": result.files[name],
        }
        for name, t in result.infos.items()
    }
    if as_json:
        click.echo(
            json.dumps(
                {
                    "id": blob_id,
                    "path": str(output) if output else None,
                    "source": source,
                    "tensors": info,
                    "fetched_chunks": result.fetched_chunks,
                    "chunks": result.num_chunks,
                }
            )
        )
        return
    for name, t in info.items():
        shape = "x".join(map(str, t["shape"])) or "scalar"
        click.echo(f"{name}  {t['dtype']} {shape}  {t['file']}")
    where = f" into {output}" if output is not None else ""
    click.echo(
        f"fetched {result.fetched_chunks} of {result.num_chunks} chunks of {blob_id[:12]}" + where,
        err=True,
    )


def _save_arrays(output: Path, arrays: dict[str, Any]) -> None:
    """One array to NAME.npy, or all of them to NAME.npz, renamed into place."""
    import secrets

    import numpy as np

    staging = output.absolute().parent / f".{output.name}.blobnet-{secrets.token_hex(6)}"
    try:
        with staging.open("wb") as handle:
            if output.suffix == ".npy":
                np.save(handle, next(iter(arrays.values())))
            else:
                np.savez(handle, **arrays)
        staging.replace(output)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        from blobstore.errors import StoreError

        raise StoreError(f"cannot write {output}: {exc.strerror or exc}") from None


class Seeding:
    """``get --seed-for``: once fetched, ``finish`` (tag, -o, result line) runs inside
    the node, which then serves fellow fetchers for ``seconds``."""

    def __init__(
        self,
        seconds: float,
        bar: ProgressBar,
        finish: Callable[[dict[str, Any], bool], None],
    ) -> None:
        self.seconds = seconds
        self.bar = bar
        self.finish = finish
        self.started = False

    async def run(self, node: Node, blob_id: str, stats: dict[str, Any]) -> None:
        self.bar.close()
        await trio.to_thread.run_sync(self.finish, stats, True)
        self.started = True
        click.echo(
            f"seeding {blob_id[:12]} for {self.seconds:g} s as {node.peer_id} (Ctrl-C stops)",
            err=True,
        )
        await trio.sleep(self.seconds)


def _fetch(
    store: Store,
    key: MachineKey,
    config: Any,
    blob_id: str,
    named: Sequence[str],
    include: Sequence[str],
    bar: ProgressBar,
    verbose: int,
    started_at: float | None = None,
    seed: Seeding | None = None,
) -> dict[str, Any]:
    """Dial the named peers, then fetch ``blob_id`` (and the wanted files of a
    collection); the fetch's figures for ``--json``. A failed hole punch is one note on
    stderr (the fetch goes on with other providers) and part of the error when no
    provider is left. With ``seed``, it finishes and seeds inside the node."""
    from p2p.errors import P2PError
    from p2p.node.dial import dial_named, unreachable_error
    from p2p.node.node import open_node

    final: list[Progress] = []
    # This process's CPU seconds (all threads) from the fetch's start to its end, for
    # benchmarks: start-up and imports excluded.
    cpu_marks: list[float] = []
    first_byte_at: list[float] = []
    done_at: list[float] = []  # wall clock when the blob was complete (before any linger)
    said: set[str] = set()

    def on_progress(progress: Progress) -> None:
        bar(progress)
        if not first_byte_at and sum(progress.new_bytes.values()) > 0:
            first_byte_at.append(time.time())
        if progress.finished:
            cpu_marks.append(_own_cpu_s())
            final.append(progress)
            done_at.append(time.time())

    def note_punches(node: Node) -> None:
        for reasons, then in (
            (node.punches.failures, "fetching from other providers"),
            (node.punches.relayed, "fetching through its relay (--via-relay)"),
        ):
            for reason in reasons:
                if reason not in said:
                    said.add(reason)
                    click.echo(f"blob: note: {reason}; {then}", err=True)

    async def main() -> None:
        async with open_node(store, key=key, config=config) as node:
            try:
                # The first named peer to answer starts the fetch; if none can, say why.
                dialled = await dial_named(node, named)
                if dialled.failures and not dialled.reached and not config.dht:
                    raise unreachable_error(dialled.failures)
                if dialled.failures and verbose:
                    for line in dialled.failures:
                        click.echo(f"blob: note: cannot reach {line}", err=True)
                note_punches(node)
                cpu_marks.append(_own_cpu_s())
                # A one-shot fetcher does not announce: it is gone once the blob is here.
                await _fetch_wanted(node, blob_id, dialled.usable, include, on_progress)
            except P2PError as exc:
                punches = [r for r in node.punches.failures if r not in str(exc)]
                if not punches:
                    raise
                # Why the NATed providers were no use is the part the user needs.
                raise type(exc)(f"{exc}; " + "; ".join(punches)) from None
            note_punches(node)
            if seed is not None:
                stats = _fetch_stats(final, cpu_marks, first_byte_at, started_at, done_at)
                await seed.run(node, blob_id, stats)

    run_interruptible(main)
    return _fetch_stats(final, cpu_marks, first_byte_at, started_at, done_at)


def _fetch_stats(
    final: list[Progress],
    cpu_marks: list[float],
    first_byte_at: list[float],
    started_at: float | None,
    done_at: Sequence[float] = (),
) -> dict[str, Any]:
    stats: dict[str, Any] = {"source": "network"}
    if final:
        stats["rate_bytes_per_s"] = final[-1].rate_bytes_per_s
        stats["transfer_rate_bytes_per_s"] = final[-1].transfer_rate_bytes_per_s
        stats["seconds"] = final[-1].elapsed
        stats["duplicate_bytes"] = final[-1].duplicate_bytes
        stats["cpu_s"] = round(cpu_marks[-1] - cpu_marks[0], 3)
        stats["peers"] = {
            peer: {"bytes": final[-1].new_bytes.get(peer, 0), "banned": s.banned}
            for peer, s in final[-1].peers.items()
        }
    if first_byte_at:
        # Wall clock, so a caller can count from its own start of this process too.
        stats["first_byte_at"] = first_byte_at[0]
        if started_at is not None:
            stats["first_byte_s"] = round(first_byte_at[0] - started_at, 3)
    if done_at:
        # Wall clock too: a swarm bench takes the last worker's (p2p.blob.swarm rule 5: a
        # fetcher may linger after this, serving fellows).
        stats["done_at"] = done_at[0]
    return stats


# Files of a collection fetched at once with --include (as the node does for whole ones).
INCLUDE_PARALLELISM = 4


async def _fetch_wanted(
    node: Node,
    blob_id: str,
    providers: Sequence[str],
    include: Sequence[str],
    on_progress: Callable[[Progress], None],
) -> None:
    if not include:
        await node.fetch(blob_id, providers=providers, progress=on_progress, announce=False)
        return
    await node.fetch(blob_id, providers=providers, recursive=False, announce=False)
    if not await trio.to_thread.run_sync(node.store.is_collection, blob_id):
        raise click.UsageError(f"--include picks files of a collection; {blob_id[:12]} is a file")
    from blobstore.export import select_entries

    wanted = await trio.to_thread.run_sync(select_entries, node.store, blob_id, include)
    limiter = trio.CapacityLimiter(INCLUDE_PARALLELISM)

    async def child(child_id: str) -> None:
        async with limiter:
            await node.fetch(
                child_id, providers=providers, progress=on_progress, recursive=False,
                announce=False,
            )  # fmt: skip

    async with trio.open_nursery() as nursery:
        for child_id in dict.fromkeys(c for _path, c in wanted):
            nursery.start_soon(child, child_id)


def _write_output(
    store: Store,
    blob_id: str,
    output: Path,
    include: Sequence[str],
    link: bool,
    show_progress: bool = False,
    verify: bool = True,
) -> None:
    """``-o``: links, a subset of a collection, or the store's own verified export (with
    a progress bar on a terminal, since it reads every byte again)."""
    from blobstore.cli import progress_bar
    from blobstore.export import export_files, link_file, select_entries

    collection = store.is_collection(blob_id)
    if include and not collection:
        raise click.UsageError(f"--include picks files of a collection; {blob_id[:12]} is a file")
    if collection and (include or link):
        export_files(store, select_entries(store, blob_id, include), output, link=link)
    elif link:
        link_file(store, blob_id, output)
    else:
        size = (
            sum(e.size for e in store.read_collection(blob_id))
            if collection
            else store.manifest(blob_id).size
        )
        with progress_bar(size, output.name, show_progress) as progress:
            store.export(blob_id, output, progress=progress, verify=verify)


@click.command("export")
@click.argument("ref")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--copy", is_flag=True, help="Verified copies instead of symlinks into the store.")
@click.option(
    "--include", "include", multiple=True, metavar="GLOB", help="Only matching files (fnmatch)."
)
@json_option
@click.pass_context
def export_cmd(
    ctx: click.Context, ref: str, dest: Path, copy: bool, include: Sequence[str], as_json: bool
) -> None:
    """Write a blob from the store to DEST without copying it: symlinks to the store's
    read-only files (a collection becomes a directory of them), which
    transformers' from_pretrained(DEST) and safetensors load as they are."""
    check_output(dest)
    store = _store(ctx)
    blob_id = store.resolve(ref)
    _write_output(store, blob_id, dest, include, link=not copy)
    if as_json:
        click.echo(json.dumps({"id": blob_id, "path": str(dest), "linked": not copy}))
    else:
        click.echo(f"{blob_id}  {dest}")


@click.command()
@click.argument("ref")
@click.option(
    "--addr",
    "addrs",
    multiple=True,
    required=True,
    metavar="MADDR",
    help="Provider address ending in /p2p/<peer id> (repeatable).",
)
@json_option
@click.pass_context
def ticket(ctx: click.Context, ref: str, addrs: Sequence[str], as_json: bool) -> None:
    """Print a ticket: the blob ID and provider addresses in one copyable string."""
    _check_peer_addrs(addrs, "--addr")
    store = _store(ctx)
    try:
        blob_id = store.resolve(ref)
    except BlobNotFound:
        blob_id = parse_blob_id(ref)
    text = Ticket(blob_id, tuple(addrs)).encode()
    if as_json:
        click.echo(json.dumps({"id": blob_id, "addrs": list(addrs), "ticket": text}))
    else:
        click.echo(text)


@click.command()
@click.option("--size-mib", default=256, show_default=True, help="Checkpoint size.")
@click.option("--keep", is_flag=True, help="Keep the temp stores and print where.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def demo(size_mib: int, keep: bool, as_json: bool) -> None:
    """Three nodes as separate processes on 127.0.0.1: a generated safetensors checkpoint
    is put on node 1, fetched by node 2, then by node 3 from nodes 1 and 2 at once,
    verified and memory-mapped from the store."""
    from p2p.cli.demo import run_demo

    run_demo(size_mib=size_mib, keep=keep, as_json=as_json)


def register(group: click.Group) -> None:
    for command in (serve, share, get, export_cmd, ticket, demo):
        group.add_command(command)
