"""A blocking client of the local API (``API.md``): what ``blob get`` and ``blob status``
use when a daemon runs on their store.

``connect`` answers None when no daemon listens there (no socket file, or one a killed
daemon left), so callers go on without one; once connected, a daemon that stops
mid-request is a ``DaemonGone`` error, never a hang: progress events arrive every 0.2 s,
so a read that waits ``IDLE_TIMEOUT`` means the daemon is gone.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blobstore.errors import ExitCode
from p2p.daemon import api
from p2p.errors import P2PError

if TYPE_CHECKING:
    from p2p.names.record import NameRecord

# Connecting to a local socket takes microseconds; a daemon too loaded to accept within
# a second is treated as absent and the command runs on its own.
CONNECT_TIMEOUT = 1.0
# Longest silence between two events (the daemon sends one every 0.2 s while it works).
IDLE_TIMEOUT = 30.0
READ_SIZE = 64 * 1024


class DaemonGone(P2PError):
    """The daemon stopped answering in the middle of a request."""


class DaemonRefused(P2PError):
    """The daemon answered a request with an error; ``code`` names it (API.md)."""

    def __init__(self, code: str, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.code = code
        self.exit_code = ExitCode(exit_code)


class DaemonFailure(Exception):
    """An operation failed in the daemon; the subclass for each exit status carries it as
    the ``blob`` program's error boundary expects (a class attribute)."""

    exit_code = ExitCode.REJECTED


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
    def __init__(self, path: Path) -> None:
        self.path = path

    def request(
        self, op: str, on_event: Callable[[dict[str, Any]], None] | None = None, **args: Any
    ) -> dict[str, Any]:
        """Send one request; every ``progress`` event goes to ``on_event``; the ``result``
        event is returned and an ``error`` event raised as DaemonRefused."""
        for event in self._events(api.Request(op, args)):
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

    def _events(self, request: api.Request) -> Iterator[dict[str, Any]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            sock.connect(str(self.path))
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


def connect(store_root: Path) -> DaemonClient | None:
    """A client of the daemon serving ``store_root``, or None when none answers there."""
    path = api.socket_path(store_root)
    if not path.exists():
        return None
    client = DaemonClient(path)
    try:
        client.request("hello")
    except (OSError, DaemonGone, DaemonRefused):
        return None
    return client
