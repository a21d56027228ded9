"""The light path of ``blob``: ``get``, ``put``, ``publish``, ``resolve``, ``catalog`` and
``status`` on a store that a ``blob serve`` runs on, sent to that daemon's local API
(p2p/daemon/API.md) with only the standard library and the thin client loaded: no click,
trio, store package or libp2p, so the command costs an interpreter's start and a socket's
round trip rather than the ~0.3 s (idle machine) to 1 s (loaded) of loading the full
program.

Rules
1. ``run(argv)`` returns an exit status when it handled the command, None when the full
   program must: no daemon answers (no socket file, or connecting is refused: nothing was
   sent), the daemon answers its first request ``busy`` (it did nothing: the command runs
   on a node of its own, or, for ``status``, asks again), or the command line holds
   anything this parser does not take (``--help``, an option only the full command has, a
   malformed value). The full program then does what it always did, its own daemon path
   included, with its own checks and messages.
2. Otherwise, once a request is sent, the daemon's answer is final: a result is printed as
   the full command prints it (the same JSON, with ``"via": "daemon"``), an error as one
   line ``blob: error: ...`` with the exit status the command would have had.
3. Global options (``--store``, ``--key``, ``--json``, ``-v``) may stand before or after
   the command, as in the full program; ``--api`` and ``--api-token`` before it.
4. Nothing here imports beyond the standard library, ``p2p.daemon.api``,
   ``p2p.daemon.client`` and ``p2p.fetch.options`` (the option table) at module level;
   tqdm is loaded only for a progress bar on a terminal. tests/p2p/test_cli_imports.py holds it so.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2p.daemon import api
from p2p.daemon.client import (
    BUSY,
    BadEndpoint,
    DaemonClient,
    DaemonGone,
    DaemonRefused,
    endpoint,
)
from p2p.fetch.options import COUNT, FLAG, GET_OPTIONS, MULTI, VALUE

GLOBAL_ANYWHERE = {"--store": VALUE, "--key": VALUE, "--json": FLAG, "-v": COUNT,
                   "--verbose": COUNT}  # fmt: skip
GLOBAL_BEFORE = {**GLOBAL_ANYWHERE, "--api": VALUE, "--api-token": VALUE}
# Each command's options this path takes (rule 1), and its positional arguments (min, max).
COMMANDS: dict[str, tuple[dict[str, str], int, int]] = {
    # get's from the one table the click command is built from too (p2p.fetch.options).
    "get": ({o.name: o.kind for o in GET_OPTIONS if o.light}, 1, 1),
    "put": (
        {"--tag": VALUE, "--chunk-size": VALUE, "--move": FLAG, "--follow-symlinks": FLAG},
        1, 1 << 16,
    ),
    "publish": (
        {"--seq": VALUE, "--expires-in": VALUE, "--peer": MULTI, "--bootstrap": MULTI,
         "--no-dht": FLAG},
        2, 2,
    ),
    "resolve": (
        {"--wait": VALUE, "--peer": MULTI, "--bootstrap": MULTI, "--no-dht": FLAG}, 1, 1
    ),
    "catalog": ({"--peer": MULTI, "--bootstrap": MULTI}, 1, 1),
    "status": ({}, 0, 0),
}  # fmt: skip
# blobstore.cli.PROGRESS_MIN_BYTES: a smaller put ends before a bar is worth drawing.
PROGRESS_MIN_BYTES = 32 * 1024 * 1024
# What every Ed25519 peer ID (a publisher's) starts with, in base58.
PEER_ID_PREFIX = "12D3KooW"
MAX_WAIT_S = 600.0  # blob resolve --wait's range
MIN_WAIT_S = 0.1


def default_store_root() -> Path:
    """``$XDG_DATA_HOME/blobnet/store`` (``~/.local/share/blobnet/store`` by default)."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "blobnet" / "store"


def default_key_path() -> Path:
    """``$XDG_CONFIG_HOME/blobnet/machine.key`` (``~/.config/blobnet/machine.key``)."""
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "blobnet" / "machine.key"


@dataclass
class Line:
    """A command line as this path reads it."""

    command: str
    args: list[str] = field(default_factory=list)
    opts: dict[str, Any] = field(default_factory=dict)
    before: dict[str, Any] = field(default_factory=dict)  # the global options before it

    def flag(self, name: str) -> bool:
        return bool(self.opts.get(name))

    def many(self, name: str) -> list[str]:
        return list(self.opts.get(name, []))


def parse(argv: Sequence[str]) -> Line | None:
    """``argv`` as a Line, or None when this path does not take it (rule 1)."""
    line: Line | None = None
    before: dict[str, Any] = {}
    allowed = GLOBAL_BEFORE
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        i += 1
        if item == "--":
            return None  # positionals that look like options: the full parser's job
        if not item.startswith("-") or item == "-":
            if line is None:
                if item not in COMMANDS:
                    return None
                line = Line(item, before=before)
                allowed = {**GLOBAL_ANYWHERE, **COMMANDS[item][0]}
            else:
                line.args.append(item)
            continue
        name, eq, value = item.partition("=")
        if name == "-vv" and not eq:
            name, extra = "-v", 1
        else:
            extra = 0
        kind = allowed.get(name)
        if kind is None:
            return None
        opts = line.opts if line is not None else before
        if kind in (FLAG, COUNT):
            if eq:
                return None
            opts[name] = opts.get(name, 0) + 1 + extra if kind == COUNT else True
            continue
        if not eq:
            if i == len(items):
                return None
            value = items[i]
            i += 1
        if kind == MULTI:
            opts.setdefault(name, []).append(value)
        elif name in opts:
            return None  # given twice: let click say which wins
        else:
            opts[name] = value
    if line is None:
        return None
    low, high = COMMANDS[line.command][1:]
    if not low <= len(line.args) <= high:
        return None
    return line


def run(argv: Sequence[str]) -> int | None:
    """Run ``argv`` through the daemon when this path takes it; its exit status, or None
    (rule 1)."""
    line = parse(argv)
    if line is None:
        return None
    merged = {**line.before, **line.opts}
    for name in ("--store", "--key"):
        if name in line.before and name in line.opts:
            return None
    store = Path(merged.get("--store") or os.environ.get("BLOBNET_STORE") or default_store_root())
    as_json = bool(merged.get("--json"))
    try:
        token = line.before.get("--api-token")
        where = endpoint(
            store.expanduser(), line.before.get("--api"), None if token is None else Path(token)
        )
    except BadEndpoint:
        return None  # the full program says what is wrong
    if where.path is not None and not where.path.exists():
        return None
    client = DaemonClient(where)
    try:
        sock = client.open()
    except OSError:
        return None
    handler = HANDLERS[line.command]
    try:
        return handler(Session(client, sock), line, as_json)
    except NotHere:
        sock.close()
        return None
    except DaemonRefused as exc:
        _error(str(exc))
        return exc.exit_code
    except DaemonGone as exc:
        _error(str(exc))
        return api.EXIT_NETWORK
    finally:
        sock.close()


class NotHere(Exception):
    """A value this path will not judge (a malformed number): the full program's to say."""


class Session:
    """The client, with the first request going over the connection already open."""

    def __init__(self, client: DaemonClient, sock: Any) -> None:
        self.client = client
        self._sock: Any = sock

    def request(
        self, op: str, on_event: Callable[[dict[str, Any]], None] | None = None, **args: Any
    ) -> dict[str, Any]:
        sock, self._sock = self._sock, None
        if sock is None:
            return self.client.request(op, on_event, **args)
        request = api.Request(op, args, self.client.where.token)
        for event in self.client._events(request, sock):
            kind = event.get("event")
            if kind == "progress":
                if on_event is not None:
                    on_event(event)
            elif kind == "error":
                if event.get("code") == BUSY:
                    raise NotHere  # rule 1: nothing done yet; the full program's turn
                raise DaemonRefused(
                    str(event.get("code")), str(event.get("message")),
                    int(event.get("exit_code", 1)),
                )  # fmt: skip
            elif kind == "result":
                event.pop("event", None)
                return event
        raise DaemonGone(f"the daemon at {self.client.path} closed the connection without a result")


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _error(message: str) -> None:
    sys.stderr.write(f"blob: error: {message}\n")
    sys.stderr.flush()


class Bar:
    """A tqdm byte bar on stderr fed by the daemon's progress events (a terminal only)."""

    def __init__(self, enabled: bool, desc: str = "", minimum: int = 0) -> None:
        self.enabled = enabled
        self.desc = desc
        self.minimum = minimum
        self.bar: Any = None

    def __call__(self, event: dict[str, Any]) -> None:
        total = event.get("total_bytes")
        if not self.enabled or total is None or total < self.minimum:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, unit="B", unit_scale=True, unit_divisor=1024,
                desc=self.desc or str(event.get("id", ""))[:12], file=sys.stderr,
            )  # fmt: skip
        self.bar.n = event["done_bytes"]
        if "peers" in event:
            self.bar.set_postfix_str(f"peers={event['peers']}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _get(session: Session, line: Line, as_json: bool) -> int:
    ref = line.args[0]
    peers = line.many("--peer")
    if "/" in ref:
        if not ref.startswith(PEER_ID_PREFIX):
            raise NotHere  # not a name, nor an ID, tag or ticket: the full get says so
        # PUBLISHER/NAME: resolved by the daemon, as `blob get` resolves it.
        found = session.request(
            "resolve", ref=ref, wait_s=5.0, peers=peers, dht=bool(line.many("--bootstrap"))
        )
        sys.stderr.write(f"{ref} is {found['id']} (seq {found.get('seq', '?')})\n")
        ref = str(found["id"])
    bar = Bar(not line.flag("--no-progress") and not as_json and sys.stderr.isatty())
    try:
        result = session.request("fetch", bar, ref=ref, providers=peers)
    finally:
        bar.close()
    blob_id = result.pop("id")
    store_path = result.pop("store_path", None)
    if as_json:
        _out(json.dumps({"id": blob_id, "path": None, "tag": None, **result}))
    else:
        _out(f"{blob_id}  {store_path}")
    return 0


def _put(session: Session, line: Line, as_json: bool) -> int:
    if "--tag" in line.opts and len(line.args) > 1:
        raise NotHere
    results = []
    for given in line.args:
        bar = Bar(not as_json and sys.stderr.isatty(), Path(given).name, PROGRESS_MIN_BYTES)
        args: dict[str, Any] = {
            "path": os.path.abspath(os.path.expanduser(given)),
            "move": line.flag("--move"),
            "follow_symlinks": line.flag("--follow-symlinks"),
        }
        for option, key in (("--tag", "tag"), ("--chunk-size", "chunk_size")):
            if option in line.opts:
                args[key] = line.opts[option]
        try:
            result = session.request("put", bar, **args)
        finally:
            bar.close()
        result["path"] = given
        results.append(result)
        if not as_json:
            _out(f"{result['id']}  {given if given.isprintable() else ascii(given)}")
    if as_json:
        _out(json.dumps(results, indent=2))
    return 0


def _number(line: Line, option: str, kind: Callable[[str], Any], low: float) -> Any:
    if option not in line.opts:
        return None
    try:
        value = kind(line.opts[option])
    except ValueError:
        raise NotHere from None
    if value < low:
        raise NotHere
    return value


def describe(record: dict[str, Any]) -> str:
    """A name record as ``blob resolve`` prints it."""
    expiry = "" if record.get("expires") is None else f", expires {record['expires']}"
    return f"{record['id']}  {record['ref']}  seq {record['seq']}{expiry}"


def _publish(session: Session, line: Line, as_json: bool) -> int:
    name, ref = line.args
    args: dict[str, Any] = {
        "name": name, "ref": ref, "peers": line.many("--peer"),
        "dht": not line.flag("--no-dht"), "seq": _number(line, "--seq", int, 0),
        "expires_in_s": _number(line, "--expires-in", int, 1),
    }  # fmt: skip
    result = session.request("publish", **{k: v for k, v in args.items() if v is not None})
    if as_json:
        _out(json.dumps(result))
        return 0
    _out(describe(result))
    pushed, dht = len(result.get("pushed_to", [])), bool(result.get("dht"))
    sys.stderr.write(f"published: pushed to {pushed} peer(s), DHT {'yes' if dht else 'no'}\n")
    if not pushed and not dht:
        sys.stderr.write(
            "note: no peer took the record; it is kept in this store, and the `blob serve` "
            "on it spreads and answers for it\n"
        )
    return 0


def _resolve(session: Session, line: Line, as_json: bool) -> int:
    wait = _number(line, "--wait", float, MIN_WAIT_S)
    if wait is not None and wait > MAX_WAIT_S:
        raise NotHere
    result = session.request(
        "resolve", ref=line.args[0], wait_s=5.0 if wait is None else wait,
        peers=line.many("--peer"), dht=not line.flag("--no-dht"),
    )  # fmt: skip
    if "ref" not in result:
        raise NotHere  # an older daemon: only the full program can read its record
    _out(json.dumps({**result, "via": "daemon"}) if as_json else describe(result))
    return 0


def _catalog(session: Session, line: Line, as_json: bool) -> int:
    result = session.request("catalog", publisher=line.args[0], peers=line.many("--peer"))
    records = list(result["records"])
    if as_json:
        _out(json.dumps([{**r, "via": "daemon"} for r in records]))
        return 0
    now = time.time()
    for r in records:
        left = "" if r.get("expires") is None else f"  ({int(r['expires'] - now)} s left)"
        _out(f"{r['name']}  {r['id']}  seq {r['seq']}{left}")
    return 0


def _status(session: Session, line: Line, as_json: bool) -> int:
    doc = session.request("status")
    _out(json.dumps(doc) if as_json else render(doc))
    return 0


HANDLERS: dict[str, Callable[[Session, Line, bool], int]] = {
    "get": _get, "put": _put, "publish": _publish, "resolve": _resolve,
    "catalog": _catalog, "status": _status,
}  # fmt: skip


def size_text(n: float) -> str:
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
    observed = status.get("observed_addrs")
    if observed:
        lines.append(f"observed   {' '.join(observed)}")
    if status.get("api_tcp"):
        lines.append(f"api        tcp {status['api_tcp']} (and the store's api.sock)")
    cert = status.get("certificate")
    if cert:
        lines.append(
            f"admission  operator {cert['operator']}, authority {cert['authority'][:16]}, "
            f"expires in {cert['expires_in_s'] / 86400:.1f} days"
        )
    if status.get("authorities"):
        lines.append(f"serves     peers admitted by {', '.join(status['authorities'])}")
    store = status["store"]
    lines.append(
        f"store      {store['root']}: {store['blobs']} blob(s), {size_text(store['bytes'])}"
    )
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
            f"fetching   {t['id'][:12]}  {size_text(t['done_bytes'])} of "
            f"{size_text(t['total_bytes'])} at {size_text(t['rate_bytes_per_s'])}/s from "
            f"{len(t['peers'])} peer(s)"
        )
    serving = status["serving"]
    lines.append(
        f"served     {size_text(serving['bytes_sent'])}; {sum(serving['streams'].values())} "
        f"stream(s) open; {serving['refusals']} refused busy"
    )
    for name in status["names"]:
        lines.append(f"name       {name['name']} -> {name['id'][:12]} (seq {name['seq']})")
    for peer, count in status["bad_chunks_by_peer"].items():
        lines.append(f"bad data   {peer} sent {count} chunk(s) that failed verification")
    return "\n".join(lines)
