"""What the ``blob`` command families share: options, the store and key of a command,
logging, Ctrl-C handling, checks of peer addresses and a node's configuration.

Ctrl-C (or SIGTERM) during a networked command is caught by a trio signal receiver and
turned into an orderly cancellation, never a KeyboardInterrupt raised inside some task,
and the command exits 130 with one line.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import resource
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
import trio

from blobstore import Store
from blobstore.errors import PathNotFound
from blobstore.exitcodes import ExitCode
from p2p.blob.pacing import MIN_UPLOAD_LIMIT
from p2p.blob.ticket import plain_reason, validate_peer_addr
from p2p.cli.nat import (
    NAT_DEFAULT_LISTEN,
)
from p2p.errors import BadAddress
from p2p.transport.addresses import dialable_addrs

if TYPE_CHECKING:
    from identity import MachineKey
    from p2p.daemon.client import DaemonClient
    from p2p.node.node import Node

# libp2p takes seconds to import, so p2p.node.node is imported inside the commands that run a
# node: `blob put` and friends stay fast.
DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)

T = TypeVar("T")


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def store_of(ctx: click.Context) -> Store:
    return Store.open(ctx.find_root().obj["store_root"])


def daemon_of(ctx: click.Context) -> DaemonClient | None:
    """A client of the daemon serving the command's store (or at ``blob --api``), or None
    when none answers."""
    from p2p.daemon.client import connect

    obj = ctx.find_root().obj
    return connect(Path(obj["store_root"]), obj.get("api_addr"), obj.get("api_token"))


def key_path_of(ctx: click.Context) -> Path:
    path: Path = ctx.find_root().obj["key_path"]
    return path


def setup_logging(verbose: int) -> None:
    """Logging for commands that may run a node. py-libp2p is not imported here (it takes
    half a second, and a get served from the local store needs none of it): its records
    are dropped unless asked (p2p.logs), and with -vv it is imported first, since its
    import stops its logger propagating."""
    from p2p.logs import quiet_libraries

    # Warnings (an unreachable bootstrap peer, a banned provider) only with -v: by default
    # a command's outcome is its one result or error line.
    level = logging.ERROR if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # py-libp2p logs routine DHT and connection churn (a peer without the DHT, a stream
    # reset) at WARNING and ERROR; -vv shows it, through our handler.
    quiet_libraries(verbose < 2)
    if verbose >= 2:
        import libp2p  # noqa: F401

        logging.getLogger("libp2p").propagate = True


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


class Rate(click.FloatRange):
    """A rate in MB/s: a finite number at least ``min``. (click's FloatRange lets ``nan``
    through, since no comparison with it is true, and ``inf`` is no rate.)"""

    name = "rate"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a number of MB/s", param, ctx)
        return number


# MB/s on the command line (1e6 bytes), bytes/s in NodeConfig; p2p.blob.pacing's floor.
upload_limit_option = click.option(
    "--upload-limit",
    "upload_limit",
    type=Rate(min=MIN_UPLOAD_LIMIT / 1e6),
    metavar="MB/S",
    help="Send at most this many MB/s to other peers, all together (default: no limit).",
)


def upload_rate(mb_per_s: float | None) -> float | None:
    return None if mb_per_s is None else mb_per_s * 1e6


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while a networked command ran."""

    exit_code = ExitCode.INTERRUPTED

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
                            os._exit(ExitCode.INTERRUPTED)
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


def load_key(key_path: Path, *, server: bool = False) -> MachineKey:
    """The machine key at ``key_path``, made on first use. For a ``server`` a key is an
    identity others see: a new one is said, and it is made only at the default path or in
    a directory that exists (elsewhere a missing directory is more likely a typo in --key
    than a wish for a second identity). A one-shot get's identity is nobody's concern."""
    from identity import KeyNotFound, ensure_key
    from p2p.cli.light import default_key_path

    path = key_path.expanduser()
    missing_dir = not path.exists() and not path.parent.is_dir()
    if server and missing_dir and path != default_key_path():
        raise KeyNotFound(
            f"no key file at {key_path}, and its directory {path.parent} does not exist "
            "(a typo in --key?); a new key is made only in an existing directory"
        )
    key, created = ensure_key(path)
    if created and server:
        click.echo(f"blob: created a new machine key {key_path} (peer ID {key.peer_id})", err=True)
    return key


def check_peer_addrs(addrs: Sequence[str], option: str) -> None:
    """Malformed addresses are usage errors (exit 2), said plainly."""
    for addr in addrs:
        try:
            validate_peer_addr(addr, error=BadAddress)
        except BadAddress as exc:
            raise click.BadParameter(str(exc), param_hint=option) from None


def check_listen_addrs(addrs: Sequence[str], option: str = "--listen") -> None:
    """A listen address that is no multiaddr (``127.0.0.1:4001``) is a usage error (exit 2),
    found before a key is made or a node started."""
    from multiaddr import Multiaddr

    for addr in addrs:
        try:
            Multiaddr(addr)
        except Exception as exc:  # multiaddr raises many unrelated types for bad text
            raise click.BadParameter(
                f"{addr!r} is not a multiaddr ({plain_reason(exc)}); the form is "
                "/ip4/HOST/tcp/PORT",
                param_hint=option,
            ) from None


class InputPath(click.Path):
    """``click.Path(exists=True)`` for a file or directory the command reads: a missing one
    is not found (exit 3, as ``put`` says it), not a usage error (click's own, exit 2)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(exists=True, **kwargs)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not os.path.lexists(os.fsdecode(value)):
            raise PathNotFound(f"no such file or directory: {os.fsdecode(value)}")
        return super().convert(value, param, ctx)


def ready_addrs(node: Node) -> list[str]:
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
            ip = first_ip(addr)
        except ValueError:
            return NAT_DEFAULT_LISTEN
        if ip is None or not ipaddress.ip_address(ip).is_loopback:
            return NAT_DEFAULT_LISTEN
    return DEFAULT_LISTEN


def first_ip(addr: str) -> str | None:
    """The first /ip4/ or /ip6/ component of ``addr`` (None: a DNS name or none)."""
    parts = addr.split("/")
    for i, part in enumerate(parts[:-1]):
        if part in ("ip4", "ip6"):
            ipaddress.ip_address(parts[i + 1])  # ValueError if malformed
            return parts[i + 1]
    return None


def node_config(listen: Sequence[str], bootstrap: Sequence[str], dht: bool, **extra: Any) -> Any:
    from p2p.node.node import NodeConfig

    return NodeConfig(
        listen=tuple(listen or DEFAULT_LISTEN), bootstrap=tuple(bootstrap), dht=dht, **extra
    )


def write_output(
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
