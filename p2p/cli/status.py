"""``blob status``, and ``blob get`` through a running daemon: the commands that talk to a
``blob serve`` on the same store over its local API (p2p/daemon/API.md)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from blobstore.exitcodes import ExitCode
from blobstore.options import json_option
from p2p.cli.common import daemon_of, store_of
from p2p.cli.light import Bar, render

if TYPE_CHECKING:
    from p2p.daemon.client import DaemonClient


class NoDaemon(Exception):
    """``blob status`` found no daemon on the store (exit 3: not found)."""

    exit_code = ExitCode.NOT_FOUND


@click.command()
@json_option()
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """What the node serving this store (`blob serve`) is doing: peer ID, addresses,
    reachability, connections, certificate, store use, transfers, names, DHT table."""
    store = store_of(ctx)
    client = daemon_of(ctx)
    if client is None:
        raise NoDaemon(f"no node is serving the store {store.root} (start one: blob serve)")
    doc = client.status()
    doc.pop("event", None)
    click.echo(json.dumps(doc) if as_json else render(doc))


def fetch_via_daemon(
    client: DaemonClient | None, blob_id: str, providers: Sequence[str], show_progress: bool
) -> dict[str, Any] | None:
    """Fetch ``blob_id`` in the daemon serving the store, on its warm connections and DHT
    table; its result (``"via": "daemon"``), or None when no daemon serves the store."""
    from p2p import errors
    from p2p.daemon.client import DaemonRefused

    if client is None:
        return None
    bar = Bar(show_progress)
    try:
        result = client.fetch(blob_id, providers, bar)
    except DaemonRefused as exc:
        # The daemon's error, as the command would have raised it without a daemon.
        kind = getattr(errors, exc.code, None)
        if isinstance(kind, type) and issubclass(kind, errors.P2PError):
            raise kind(str(exc)) from None
        raise errors.P2PError(f"the daemon's fetch failed: {exc} ({exc.code})") from None
    finally:
        bar.close()
    for key in ("event", "id", "store_path"):
        result.pop(key, None)
    return result
