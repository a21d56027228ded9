"""A blocking client of the local API (``API.md``): what ``blob get``, ``put``,
``publish``, ``resolve``, ``catalog`` and ``status`` use when a daemon runs on their store.

``connect`` answers None when no daemon listens there (no socket file, or one a killed
daemon left), so callers go on without one; once connected, a daemon that stops
mid-request is a ``DaemonGone`` error, never a hang: progress events arrive every 0.2 s,
so a read that waits ``IDLE_TIMEOUT`` means the daemon is gone.

Where: the store's Unix socket, or, given an ``Endpoint`` with a TCP address (``blob
--api HOST:PORT``, env ``BLOBNET_API``), that listener, with the token read from
``--api-token FILE`` (env ``BLOBNET_API_TOKEN``; default the store's ``api.token``).

Like ``api``, this module imports only the standard library (api rule 5).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2p.daemon import api

if TYPE_CHECKING:
    from p2p.names.record import NameRecord

API_ENV = "BLOBNET_API"
TOKEN_ENV = "BLOBNET_API_TOKEN"
# A token file holds 64 hex digits and a newline; anything much longer is not one.
MAX_TOKEN_FILE = 1024

# Connecting to a local socket takes microseconds; a daemon too loaded to accept within
# a second is treated as absent and the command runs on its own.
CONNECT_TIMEOUT = 1.0
# A socket whose backlog is full refuses a connect at once (EAGAIN); it is asked again
# this often within CONNECT_TIMEOUT.
CONNECT_RETRY = 0.01
# Longest silence between two events (the daemon sends one every 0.2 s while it works).
IDLE_TIMEOUT = 30.0
READ_SIZE = 64 * 1024
# The error code of a daemon at its limit of clients: it did nothing, so the command may run
# on its own node instead (API.md).
BUSY = "busy"


class DaemonGone(Exception):
    """The daemon stopped answering in the middle of a request (a network failure, as the
    command's own node would have had: exit 6)."""

    exit_code = api.EXIT_NETWORK


class DaemonRefused(Exception):
    """The daemon answered a request with an error; ``code`` names it (API.md)."""

    def __init__(self, code: str, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.code = code
        self.exit_code = exit_code


class BadEndpoint(Exception):
    """``--api`` or ``--api-token`` names nothing usable (the user's to fix: exit 2)."""

    exit_code = api.EXIT_USAGE


class DaemonFailure(Exception):
    """An operation failed in the daemon; the subclass for each exit status carries it as
    the ``blob`` program's error boundary expects (a class attribute)."""

    exit_code = api.EXIT_REJECTED


@dataclass(frozen=True)
class Endpoint:
    """Where a daemon's API is: a Unix socket ``path``, or a TCP ``host``:``port`` with
    the ``token`` it wants."""

    path: Path | None = None
    host: str = ""
    port: int = 0
    token: str | None = None

    def describe(self) -> str:
        return str(self.path) if self.path is not None else f"{self.host}:{self.port}"


def parse_api_addr(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6), or BadEndpoint."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadEndpoint(f"--api {value!r} is not HOST:PORT")
    return host, int(port)


def read_token(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        raise BadEndpoint(f"cannot read the API token {path}: {exc.strerror or exc}") from None
    token = text.decode(errors="replace").strip()
    if len(text) > MAX_TOKEN_FILE or not token:
        raise BadEndpoint(f"{path} does not hold an API token")
    return token


def endpoint(
    store_root: Path, api_addr: str | None = None, token_file: Path | None = None
) -> Endpoint:
    """Where the daemon of ``store_root`` would listen: the TCP address given (or in
    ``$BLOBNET_API``) with its token, else the store's socket."""
    addr = api_addr or os.environ.get(API_ENV) or None
    if addr is None:
        return Endpoint(path=api.socket_path(store_root))
    host, port = parse_api_addr(addr)
    token_path = token_file or Path(os.environ.get(TOKEN_ENV) or api.token_path(store_root))
    return Endpoint(host=host, port=port, token=read_token(Path(token_path).expanduser()))


_FAILURES: dict[int, type[DaemonFailure]] = {}


def as_command_error(exc: DaemonRefused) -> Exception:
    """The daemon's error as the command would have raised it: its message, its exit
    status."""
    kind = _FAILURES.get(exc.exit_code)
    if kind is None:
        kind = type(f"DaemonFailure{exc.exit_code}", (DaemonFailure,), {"exit_code": exc.exit_code})
        _FAILURES[exc.exit_code] = kind
    return kind(str(exc))


class DaemonClient:
    def __init__(self, where: Endpoint | Path) -> None:
        self.where = where if isinstance(where, Endpoint) else Endpoint(path=where)
        self.path = self.where.describe()

    def request(
        self, op: str, on_event: Callable[[dict[str, Any]], None] | None = None, **args: Any
    ) -> dict[str, Any]:
        """Send one request; every ``progress`` event goes to ``on_event``; the ``result``
        event is returned and an ``error`` event raised as DaemonRefused."""
        for event in self._events(api.Request(op, args, self.where.token)):
            kind = event.get("event")
            if kind == "progress":
                if on_event is not None:
                    on_event(event)
            elif kind == "error":
                raise DaemonRefused(
                    str(event.get("code")),
                    str(event.get("message")),
                    int(event.get("exit_code", 1)),
                )
            elif kind == "result":
                return event
        raise DaemonGone(f"the daemon at {self.path} closed the connection without a result")

    def open(self) -> socket.socket:
        """A connection to the daemon; OSError when none listens there (or none accepts
        within CONNECT_TIMEOUT)."""
        where = self.where
        if where.path is None:
            return socket.create_connection((where.host, where.port), timeout=CONNECT_TIMEOUT)
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(CONNECT_TIMEOUT)
                sock.connect(str(where.path))
                return sock
            except BlockingIOError:
                # EAGAIN: the daemon is there, its backlog full (a burst of connections);
                # it accepts within milliseconds, so ask again.
                sock.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(CONNECT_RETRY)
            except BaseException:
                sock.close()
                raise

    def _events(
        self, request: api.Request, sock: socket.socket | None = None
    ) -> Iterator[dict[str, Any]]:
        sock = sock or self.open()
        try:
            sock.settimeout(IDLE_TIMEOUT)
            sock.sendall(request.encode())
            reader = api.LineReader(api.MAX_EVENT_BYTES)
            while True:
                try:
                    data = sock.recv(READ_SIZE)
                except TimeoutError:
                    raise DaemonGone(
                        f"the daemon at {self.path} said nothing for {IDLE_TIMEOUT:g} s"
                    ) from None
                except OSError as exc:
                    raise DaemonGone(f"the daemon at {self.path} went away: {exc}") from None
                if not data:
                    return
                for line in reader.feed(data):
                    yield json.loads(line)
        finally:
            sock.close()

    def status(self) -> dict[str, Any]:
        return self.request("status")

    def metrics(self) -> str:
        return str(self.request("metrics")["text"])

    def resolve(
        self,
        ref: str,
        *,
        wait_s: float = 5.0,
        authorities: Sequence[bytes] = (),
        peers: Sequence[str] = (),
        dht: bool = True,
    ) -> NameRecord:
        """The record the daemon resolved ``ref`` to (it verified it)."""
        from p2p.names.record import NameRecord

        result = self.request(
            "resolve", ref=ref, wait_s=wait_s, authorities=[k.hex() for k in authorities],
            peers=list(peers), dht=dht,
        )  # fmt: skip
        return NameRecord.decode(bytes.fromhex(str(result["record"])))

    def fetch(
        self,
        blob_id: str,
        providers: Sequence[str] = (),
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        return self.request("fetch", on_progress, id=blob_id, providers=list(providers))


def connect(
    store_root: Path, api_addr: str | None = None, token_file: Path | None = None
) -> DaemonClient | None:
    """A client of the daemon serving ``store_root`` (or at ``api_addr``, see
    ``endpoint``), or None when none answers there or it is ``busy`` (the command then runs
    on a node of its own). A TCP daemon that refuses the token is an error
    (DaemonRefused), not an absent daemon: the user asked for that one."""
    where = endpoint(Path(store_root), api_addr, token_file)
    if where.path is not None and not where.path.exists():
        return None
    client = DaemonClient(where)
    try:
        client.request("hello")
    except (OSError, DaemonGone):
        return None
    except DaemonRefused as exc:
        if where.path is None and exc.code != BUSY:
            raise
        return None
    return client
