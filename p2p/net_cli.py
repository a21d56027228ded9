"""The network commands of ``blob``: ``serve``, ``get`` (local or over the network),
``ticket`` and ``demo``."""

from __future__ import annotations

import json
import logging
import resource
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import trio

from blobstore import BadBlobId, BlobNotFound, Store
from p2p.errors import BadAddress
from p2p.ticket import Ticket, validate_peer_addr

if TYPE_CHECKING:
    from p2p.downloader import Progress

# libp2p takes seconds to import, so p2p.node is imported inside the commands that run a
# node: `blob put` and friends stay fast.
DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)


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

    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
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
verbose_option = click.option("-v", "--verbose", count=True, help="More logging on stderr.")


@click.command()
@listen_option
@bootstrap_option
@click.option("--no-dht", is_flag=True, help="Do not run the Kademlia DHT.")
@click.option(
    "--verify-reads",
    is_flag=True,
    help="Hash every chunk again before sending it (guards against this disk's bit rot).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the ready line as JSON.")
@verbose_option
@click.pass_context
def serve(
    ctx: click.Context,
    listen: Sequence[str],
    bootstrap: Sequence[str],
    no_dht: bool,
    verify_reads: bool,
    as_json: bool,
    verbose: int,
) -> None:
    """Serve this store's blobs until SIGINT or SIGTERM.

    Prints one ready line (peer ID and listen addresses) once the node accepts peers.
    """
    _setup_logging(verbose)
    store = _store(ctx)
    key_path = _key_path(ctx)
    from p2p.node import NodeConfig, open_node

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            config = NodeConfig(
                listen=tuple(listen or DEFAULT_LISTEN),
                bootstrap=tuple(bootstrap),
                dht=not no_dht,
                verify_reads=verify_reads,
            )
            async with open_node(store, key_path=key_path, config=config) as node:
                if as_json:
                    click.echo(json.dumps({"peer_id": node.peer_id, "addrs": node.addrs}))
                else:
                    click.echo(f"ready {node.peer_id} " + " ".join(node.addrs))
                sys.stdout.flush()
                async for signum in signals:
                    click.echo(f"stopping on {signal.Signals(signum).name}", err=True)
                    break

    trio.run(main)


class ProgressBar:
    """A tqdm bar on stderr fed by the downloader's progress callback."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None

    def __call__(self, progress: Progress) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=progress.total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=progress.blob_id[:12],
                file=sys.stderr,
                leave=True,
            )
        self.bar.n = progress.done_bytes
        active = sum(1 for s in progress.peers.values() if not s.banned and not s.dropped)
        self.bar.set_postfix_str(f"peers={active}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@click.command()
@click.argument("ref")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write the blob here.")
@click.option("--peer", "peers", multiple=True, metavar="MADDR", help="Provider (repeatable).")
@bootstrap_option
@listen_option
@click.option("--no-dht", is_flag=True, help="Ask only the named and connected peers.")
@click.option(
    "--discovery-timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds to keep looking for providers when none can serve.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
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
    discovery_timeout: float,
    as_json: bool,
    no_progress: bool,
    verbose: int,
) -> None:
    """Get a blob by ID, 8+ character prefix, tag or ticket: from the local store if it is
    there, else from the network (named peers, a ticket's peers, the DHT).

    With -o the blob (or a collection's directory) is written to PATH.
    """
    _setup_logging(verbose)
    store = _store(ctx)
    blob_id: str | None = None
    if not ref.startswith("blob1"):
        try:
            blob_id = store.resolve(ref)
        except BlobNotFound:
            blob_id = None
        if blob_id is not None and not store.has(blob_id):
            blob_id = None  # a partial blob: resume it over the network
    stats: dict[str, Any] = {"source": "local"}
    if blob_id is None:
        for addr in peers:
            validate_peer_addr(addr, error=BadAddress)
        if not ref.startswith("blob1"):
            from blobstore import parse_blob_id

            try:
                parse_blob_id(ref)
            except BadBlobId:
                raise BlobNotFound(
                    f"{ref!r} is not in the local store; to fetch it, give its full 64-hex ID "
                    "or a ticket"
                ) from None
        bar = ProgressBar(enabled=not no_progress and not as_json and sys.stderr.isatty())
        key_path = _key_path(ctx)
        final: list[Progress] = []
        # This process's CPU seconds (all threads) from the fetch's start to its end, for
        # benchmarks: start-up and imports excluded.
        cpu_marks: list[float] = []

        def on_progress(progress: Progress) -> None:
            bar(progress)
            if progress.finished:
                cpu_marks.append(_own_cpu_s())
                final.append(progress)

        from p2p.node import NodeConfig, open_node

        config = NodeConfig(
            listen=tuple(listen or DEFAULT_LISTEN),
            bootstrap=tuple(bootstrap),
            dht=not no_dht,
            discovery_timeout=discovery_timeout,
        )

        async def main() -> str:
            async with open_node(store, key_path=key_path, config=config) as node:
                # A one-shot fetcher does not announce: it is gone once the blob is here.
                cpu_marks.append(_own_cpu_s())
                return await node.fetch(ref, providers=peers, progress=on_progress, announce=False)

        try:
            blob_id = trio.run(main)
        finally:
            bar.close()
        stats = {"source": "network"}
        if final:
            stats["rate_bytes_per_s"] = final[-1].rate_bytes_per_s
            stats["seconds"] = final[-1].elapsed
            stats["duplicate_bytes"] = final[-1].duplicate_bytes
            stats["cpu_s"] = round(cpu_marks[-1] - cpu_marks[0], 3)
            stats["peers"] = {
                peer: {"bytes": final[-1].new_bytes.get(peer, 0), "banned": s.banned}
                for peer, s in final[-1].peers.items()
            }
    if output is not None:
        store.export(blob_id, output)
    if as_json:
        click.echo(json.dumps({"id": blob_id, "path": str(output) if output else None, **stats}))
    else:
        click.echo(f"{blob_id}  {output if output else store.path(blob_id)}")


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
@click.pass_context
def ticket(ctx: click.Context, ref: str, addrs: Sequence[str]) -> None:
    """Print a ticket: the blob ID and provider addresses in one copyable string."""
    store = _store(ctx)
    try:
        blob_id = store.resolve(ref)
    except BlobNotFound:
        from blobstore import parse_blob_id

        blob_id = parse_blob_id(ref)
    for addr in addrs:
        validate_peer_addr(addr, error=BadAddress)
    click.echo(Ticket(blob_id, tuple(addrs)).encode())


@click.command()
@click.option("--size-mib", default=256, show_default=True, help="Checkpoint size.")
@click.option("--keep", is_flag=True, help="Keep the temp stores and print where.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def demo(size_mib: int, keep: bool, as_json: bool) -> None:
    """Three nodes as separate processes on 127.0.0.1: a generated safetensors checkpoint
    is put on node 1, fetched by node 2, then by node 3 from nodes 1 and 2 at once,
    verified and memory-mapped from the store."""
    from p2p.demo import run_demo

    run_demo(size_mib=size_mib, keep=keep, as_json=as_json)


def register(group: click.Group) -> None:
    for command in (serve, get, ticket, demo):
        group.add_command(command)
