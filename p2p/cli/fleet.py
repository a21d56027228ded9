"""What a serving command (``serve``) adds for an operator: the local API (and, with
``--api-listen``, its TCP listener), ``--metrics``, ``--authority``, and a summary when it
stops.

``fleet_options`` gathers those options into one ``Fleet`` value handed to the command, and
``Fleet.running`` runs them beside the node for as long as it serves.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from p2p.blob.pacing import MIN_UPLOAD_LIMIT
from p2p.cli.common import InputPath, Rate

if TYPE_CHECKING:
    from identity import TrustStore
    from p2p.daemon.scrape import Exposition
    from p2p.node.node import Node

log = logging.getLogger("blobnet.serve")

# --metrics without a host part listens on loopback: metrics name peers' counts and
# sizes, and exposing them is the operator's choice (--metrics 0.0.0.0:9464).
METRICS_DEFAULT_HOST = "127.0.0.1"
# --api-listen's too: anyone who can reach it and holds the token drives the node (puts
# files from this machine, fetches, publishes), and the token crosses the wire in clear.
API_DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Fleet:
    """A serving command's operator options."""

    authorities: tuple[str, ...] = ()
    metrics: str | None = None
    download_limit: float | None = None  # MB/s, as given
    api_listen: tuple[str, int] | None = None
    # Where the TCP API's `put` may read (p2p.daemon.paths rule 2): absolute, links resolved.
    api_put_dirs: tuple[Path, ...] = ()

    def download_rate(self) -> float | None:
        """Bytes per second for NodeConfig.download_limit."""
        return None if self.download_limit is None else self.download_limit * 1e6

    def trust(self) -> TrustStore | None:
        """The authorities as a trust store (None: serve everyone)."""
        if not self.authorities:
            return None
        from identity.cli_common import load_trust

        return load_trust(self.authorities, None)

    @asynccontextmanager
    async def running(
        self, node: Node, reach: Any, role: str, relay: Any = None
    ) -> AsyncIterator[None]:
        """The local API and the metrics endpoint beside ``node`` (both listening before the
        block, so a port taken ends the command before its ready line); the summary at the
        end of a node that ran."""
        from p2p.daemon.server import serve_api
        from p2p.daemon.status import DaemonInfo

        trust = node.config.admission
        authorities = tuple(sorted(k.hex() for k in trust.authorities)) if trust else ()
        info = DaemonInfo(role, reach=reach, authorities=authorities, relay=relay)
        async with serve_api(node, info, self.api_listen, self.api_put_dirs) as daemon:
            if info.api_addr is not None:
                click.echo(
                    f"local API at tcp {info.api_addr} (token in "
                    f"{node.store.root / 'api.token'}; blob --api {info.api_addr})",
                    err=True,
                )
            async with serve_metrics(daemon.exposition, self.metrics):
                started = time.monotonic()
                try:
                    yield
                finally:
                    click.echo(summary(node, time.monotonic() - started), err=True)


def parse_metrics_addr(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``:PORT`` (loopback) or ``PORT``; click.BadParameter otherwise."""
    host, _, port = value.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT", param_hint="--metrics")
    return host.strip("[]") or METRICS_DEFAULT_HOST, number


def parse_api_listen(value: str, allow_remote: bool) -> tuple[str, int]:
    """``--api-listen HOST:PORT``: loopback only, unless ``--api-allow-remote`` (then a
    warning); click.BadParameter otherwise."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or API_DEFAULT_HOST
    try:
        number = int(port)
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not IP:PORT (a numeric address)", param_hint="--api-listen"
        ) from None
    if not 0 <= number <= 65535:
        raise click.BadParameter(f"{value!r}: no such port", param_hint="--api-listen")
    if not ip.is_loopback:
        if not allow_remote:
            raise click.BadParameter(
                f"{host} is not a loopback address: whoever reaches it and holds the token "
                "drives this node, and the token travels in clear (give --api-allow-remote "
                "if that is what you want)",
                param_hint="--api-listen",
            )
        click.echo(
            f"blob: warning: the local API listens on {host}, beyond this machine; its token "
            "travels unencrypted",
            err=True,
        )
    return host, number


def metrics_warning(value: str) -> str | None:
    """The warning for ``--metrics`` beyond loopback (the operator's choice, said once, as
    ``--api-allow-remote``'s is), or None."""
    host, _port = parse_metrics_addr(value)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (
        f"blob: warning: metrics are served on {host}, beyond this machine: whoever reaches "
        "it reads this node's counts and sizes"
    )


@asynccontextmanager
async def serve_metrics(exposition: Exposition, addr: str | None) -> AsyncIterator[None]:
    """Serve the metrics at ``http://ADDR/metrics`` for the block (p2p.daemon.scrape: on
    the node's event loop, every wait bounded); nothing when ``addr`` is None."""
    from p2p.daemon import scrape

    if addr is None:
        yield
        return
    host, port = parse_metrics_addr(addr)
    async with scrape.serve_metrics(exposition, host, port) as bound:
        click.echo(f"metrics at http://{bound[0]}:{bound[1]}/metrics", err=True)
        yield


def summary(node: Node, seconds: float) -> str:
    """The line ``serve`` prints when it stops."""
    stats = node.server.stats
    fetched = node.metrics.ended["ok"]
    return (
        f"served {stats.chunks_sent} chunk(s), {stats.bytes_sent / 1e6:.1f} MB, "
        f"{stats.busy_rejections} refused busy, "
        f"{node.server.gate.refused if node.server.gate is not None else 0} refused unadmitted; "
        f"fetched {fetched} blob(s); up {seconds:.0f} s"
    )


def fleet_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--authority``, ``--metrics``, ``--download-limit``, ``--api-listen`` and
    ``--api-put-dir``, handed to ``command`` as ``fleet``."""

    @functools.wraps(command)
    def wrapper(
        *args: Any,
        authorities: tuple[str, ...],
        metrics: str | None,
        download_limit: float | None,
        api_listen: str | None,
        api_allow_remote: bool,
        api_put_dirs: tuple[Path, ...],
        **kw: Any,
    ) -> Any:
        if metrics is not None:
            warning = metrics_warning(metrics)  # a usage error before anything starts
            if warning is not None:
                click.echo(warning, err=True)
        if api_allow_remote and api_listen is None:
            raise click.UsageError("--api-allow-remote widens --api-listen: give that too")
        if api_put_dirs and api_listen is None:
            raise click.UsageError("--api-put-dir is for the TCP API: give --api-listen too")
        tcp = None if api_listen is None else parse_api_listen(api_listen, api_allow_remote)
        dirs = tuple(Path(d) for d in api_put_dirs)
        fleet = Fleet(tuple(authorities), metrics, download_limit, tcp, dirs)
        return command(*args, fleet=fleet, **kw)

    wrapper = click.option(
        "--api-put-dir",
        "api_put_dirs",
        multiple=True,
        metavar="DIR",
        type=InputPath(file_okay=False, resolve_path=True, path_type=Path),
        help="Let the TCP API's put read files under DIR (repeatable; default: nowhere, so "
        "TCP clients cannot have the daemon read this machine's files).",
    )(wrapper)
    wrapper = click.option(
        "--api-allow-remote",
        "api_allow_remote",
        is_flag=True,
        help="Let --api-listen take a non-loopback address (the token travels in clear).",
    )(wrapper)
    wrapper = click.option(
        "--api-listen",
        "api_listen",
        metavar="IP:PORT",
        help="Also serve the local API on TCP here (loopback; port 0: any), for clients "
        "with the token in STORE/api.token (blob --api IP:PORT).",
    )(wrapper)

    wrapper = click.option(
        "--download-limit",
        "download_limit",
        type=Rate(min=MIN_UPLOAD_LIMIT / 1e6),
        metavar="MB/S",
        help="Receive at most this many MB/s in this node's fetches, all together (default: "
        "no limit).",
    )(wrapper)

    wrapper = click.option(
        "--metrics",
        "metrics",
        metavar="HOST:PORT",
        help="Serve Prometheus metrics at http://HOST:PORT/metrics (HOST defaults to 127.0.0.1).",
    )(wrapper)
    return click.option(
        "--authority",
        "authorities",
        multiple=True,
        metavar="KEY",
        help="Serve blobs, names and status only to peers admitted by this authority (64 hex "
        "digits or a .pub file; repeatable).",
    )(wrapper)
