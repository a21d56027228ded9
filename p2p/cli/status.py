"""``blob status``, and ``blob get`` through a running daemon: the commands that talk to a
``blob serve`` on the same store over its local API (p2p/daemon/API.md)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from blobstore.exitcodes import ExitCode
from blobstore.options import json_option
from p2p.cli.common import store_of
from p2p.cli.light import Bar, render

if TYPE_CHECKING:
    from p2p.daemon.client import DaemonClient
    from p2p.node.request import FetchRequest


# A daemon answers `busy` while it serves its limit of clients (p2p.daemon.slots); a status
# asks again this often, for this long, before saying so.
BUSY_RETRY_S = 0.1
BUSY_WAIT_S = 2.0


class NoDaemon(Exception):
    """``blob status`` found no daemon on the store (exit 3: not found)."""

    exit_code = ExitCode.NOT_FOUND


class DaemonBusy(Exception):
    """The daemon stayed at its limit of clients (exit 5, as a busy store)."""

    exit_code = ExitCode.LOCAL_IO


@click.command()
@json_option()
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """What the node serving this store (`blob serve`) is doing: peer ID, addresses,
    reachability, connections, certificate, store use, transfers, names, DHT table."""
    store = store_of(ctx)
    obj = ctx.find_root().obj
    doc = status_of(Path(store.root), obj.get("api_addr"), obj.get("api_token"), time.monotonic)
    if doc is None:
        raise NoDaemon(f"no node is serving the store {store.root} (start one: blob serve)")
    doc.pop("event", None)
    click.echo(json.dumps(doc) if as_json else render(doc))


def status_of(
    store_root: Path,
    api_addr: str | None,
    token_file: Path | None,
    clock: Callable[[], float],
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any] | None:
    """The daemon's status document, or None when no daemon answers; a daemon that stays
    ``busy`` for BUSY_WAIT_S is DaemonBusy (a status has no node of its own to fall back
    on)."""
    from p2p.daemon.client import BUSY, DaemonClient, DaemonGone, DaemonRefused, endpoint

    where = endpoint(store_root, api_addr, token_file)
    if where.path is not None and not where.path.exists():
        return None
    client = DaemonClient(where)
    deadline = clock() + BUSY_WAIT_S
    while True:
        try:
            return client.status()
        except (OSError, DaemonGone):
            return None
        except DaemonRefused as exc:
            if exc.code != BUSY:
                raise
            if clock() >= deadline:
                raise DaemonBusy(
                    f"the node serving {store_root} is busy ({exc}); try again"
                ) from None
        sleep(BUSY_RETRY_S)


def fetch_via_daemon(
    client: DaemonClient | None, request: FetchRequest, show_progress: bool
) -> dict[str, Any] | None:
    """Fetch the request's blob (by its ID, from its named providers) in the daemon serving
    the store, on its warm connections and DHT table; its result (``"via": "daemon"``), or
    None when no daemon serves the store."""
    from p2p import errors
    from p2p.daemon.client import BUSY, DaemonRefused

    if client is None:
        return None
    bar = Bar(show_progress)
    try:
        result = client.fetch(request.blob_id, list(request.providers), bar)
    except DaemonRefused as exc:
        if exc.code == BUSY:
            return None  # it did nothing: the get runs on a node of its own
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
