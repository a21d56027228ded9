"""``blob status``, and ``blob get`` through a running daemon: the commands that talk to a
``blob serve`` on the same store over its local API (p2p/daemon/API.md)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import click

from blobstore import Store
from blobstore.errors import ExitCode
from p2p.cli.common import json_option, store_of


class NoDaemon(Exception):
    """``blob status`` found no daemon on the store (exit 3: not found)."""

    exit_code = ExitCode.NOT_FOUND


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def render(status: dict[str, Any]) -> str:
    """The status document as an operator reads it."""
    lines = [
        f"peer       {status['peer_id']}  ({status['role']}, blobnet {status['version']}, "
        f"up {status['uptime_s']:.0f} s)",
        f"listen     {' '.join(status['listen_addrs'])}",
        f"addrs      {' '.join(status['addrs'])}",
        f"reach      {status['reachability']}"
        + (f" ({status['reachability_detail']})" if status.get("reachability_detail") else ""),
    ]
    cert = status.get("certificate")
    if cert:
        lines.append(
            f"admission  operator {cert['operator']}, authority {cert['authority'][:16]}, "
            f"expires in {cert['expires_in_s'] / 86400:.1f} days"
        )
    if status.get("authorities"):
        lines.append(f"serves     peers admitted by {', '.join(status['authorities'])}")
    store = status["store"]
    lines.append(f"store      {store['root']}: {store['blobs']} blob(s), {_size(store['bytes'])}")
    lines.append(f"dht        {status['dht_peers']} peer(s) in the routing table")
    conns = status["connections"]
    lines.append(
        f"peers      {len(conns)} connected ({status['connections_direct']} direct, "
        f"{status['connections_relayed']} relayed)"
    )
    for c in conns:
        lanes = f", {c['lanes']} lane(s)" if c["lanes"] else ""
        lines.append(f"  {c['peer']}  {c['kind']}, {c['connections']} connection(s){lanes}")
    for t in status["transfers"]:
        lines.append(
            f"fetching   {t['id'][:12]}  {_size(t['done_bytes'])} of {_size(t['total_bytes'])} "
            f"at {_size(t['rate_bytes_per_s'])}/s from {len(t['peers'])} peer(s)"
        )
    serving = status["serving"]
    lines.append(
        f"served     {_size(serving['bytes_sent'])}; {sum(serving['streams'].values())} "
        f"stream(s) open; {serving['refusals']} refused busy"
    )
    for name in status["names"]:
        lines.append(f"name       {name['name']} -> {name['id'][:12]} (seq {name['seq']})")
    for peer, count in status["bad_chunks_by_peer"].items():
        lines.append(f"bad data   {peer} sent {count} chunk(s) that failed verification")
    return "\n".join(lines)


@click.command()
@json_option
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """What the node serving this store (``blob serve``) is doing: peer ID, addresses,
    reachability, connections, certificate, store use, transfers, names, DHT table."""
    from p2p.daemon.client import connect

    store = store_of(ctx)
    client = connect(store.root)
    if client is None:
        raise NoDaemon(f"no node is serving the store {store.root} (start one: blob serve)")
    doc = client.status()
    doc.pop("event", None)
    click.echo(json.dumps(doc) if as_json else render(doc))


class DaemonBar:
    """A tqdm bar on stderr fed by the daemon's progress events."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None

    def __call__(self, event: dict[str, Any]) -> None:
        if not self.enabled or "total_bytes" not in event:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=event["total_bytes"], unit="B", unit_scale=True, unit_divisor=1024,
                desc=str(event["id"])[:12], file=sys.stderr,
            )  # fmt: skip
        self.bar.n = event["done_bytes"]
        self.bar.set_postfix_str(f"peers={event['peers']}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def fetch_via_daemon(
    store: Store, blob_id: str, providers: Sequence[str], show_progress: bool
) -> dict[str, Any] | None:
    """Fetch ``blob_id`` in the daemon serving ``store``, on its warm connections and DHT
    table; its result (``"via": "daemon"``), or None when no daemon serves the store."""
    from p2p import errors
    from p2p.daemon.client import DaemonRefused, connect

    client = connect(store.root)
    if client is None:
        return None
    bar = DaemonBar(show_progress)
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
    result.pop("event", None)
    result.pop("id", None)
    return result
