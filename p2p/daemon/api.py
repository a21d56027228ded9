"""The local API's wire format, without I/O (``API.md`` beside this file is the contract).

Rules
1. A client connects to the daemon's Unix socket (``socket_path``), sends one request: a
   JSON object on one line, ``{"api": 1, "op": ...}``, and reads events, one JSON object a
   line, until a ``result`` or an ``error`` event; then both sides close. One request per
   connection keeps both ends simple; connecting to a local socket costs microseconds.
2. Every line is bounded: a request by ``MAX_REQUEST_BYTES`` (checked before it is
   parsed), an event by ``MAX_EVENT_BYTES``. A request that is not valid JSON, names
   another API version or an unknown op gets an ``error`` event with a code saying so.
3. An ``error`` event says whose fault it was: ``code`` ``bad_request`` (the client's),
   ``unsupported_version``, ``busy`` (the daemon's limits), ``internal`` (the daemon's
   bug), or the name of the blobnet error the operation raised (``NoProviders``,
   ``FetchFailed``, ...) with that error's exit status, so a thin client exits as the
   command would have without a daemon.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blobstore.errors import ExitCode

API_VERSION = 1
SOCKET_NAME = "api.sock"
# The socket file's mode: only the store's owner may drive its daemon.
SOCKET_MODE = 0o600
# A request names a blob and at most MAX_PROVIDERS addresses of a few hundred bytes each.
MAX_REQUEST_BYTES = 64 * 1024
MAX_PROVIDERS = 64
# The largest event: a status of a busy node (hundreds of connections, tens of transfers) or
# the metrics text, a few hundred KiB; 16 MiB is far above and still bounds a client.
MAX_EVENT_BYTES = 16 * 1024 * 1024
# sun_path holds 108 bytes with its NUL: a longer socket path cannot be bound or dialled.
MAX_SOCKET_PATH = 107
OPS = ("hello", "status", "metrics", "fetch", "announce", "resolve")
# A resolve waits for peers and the DHT at most this long (blob resolve --wait's ceiling).
MAX_RESOLVE_WAIT = 600.0
MAX_AUTHORITIES = 64
ERROR_CODES = ("bad_request", "unsupported_version", "busy", "internal")


def socket_path(store_root: Path) -> Path:
    """Where the daemon of the store at ``store_root`` listens."""
    return Path(store_root) / SOCKET_NAME


class ApiError(Exception):
    """A request the daemon refused: ``code`` (rule 3) and a one-line ``message``."""

    def __init__(self, code: str, message: str, exit_code: int = ExitCode.REJECTED) -> None:
        super().__init__(message)
        self.code = code
        self.exit_code = exit_code


@dataclass(frozen=True)
class Request:
    op: str
    args: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return encode_line({"api": API_VERSION, "op": self.op, **self.args})


def encode_line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def decode_request(line: bytes) -> Request:
    """One request line (without its newline) as a Request; ApiError if it is not one."""
    if len(line) > MAX_REQUEST_BYTES:
        raise ApiError("bad_request", f"request longer than {MAX_REQUEST_BYTES} bytes")
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise ApiError("bad_request", "request is not a JSON object on one line") from None
    if not isinstance(obj, dict):
        raise ApiError("bad_request", "request is not a JSON object")
    version = obj.pop("api", None)
    if version != API_VERSION:
        raise ApiError(
            "unsupported_version", f"this daemon speaks API {API_VERSION}, not {version!r}"
        )
    op = obj.pop("op", None)
    if op not in OPS:
        raise ApiError("bad_request", f"unknown op {op!r} (known: {', '.join(OPS)})")
    return Request(op, obj)


def fetch_args(request: Request) -> tuple[str, list[str], bool]:
    """``fetch``'s (blob ID, provider addresses, recursive), checked."""
    from blobstore import BadBlobId, parse_blob_id

    try:
        blob_id = parse_blob_id(str(request.args.get("id", "")))
    except BadBlobId as exc:
        raise ApiError("bad_request", str(exc)) from None
    providers = request.args.get("providers", [])
    if not isinstance(providers, list) or not all(isinstance(p, str) for p in providers):
        raise ApiError("bad_request", "providers must be a list of multiaddr strings")
    if len(providers) > MAX_PROVIDERS:
        raise ApiError("bad_request", f"at most {MAX_PROVIDERS} providers")
    return blob_id, providers, bool(request.args.get("recursive", True))


def resolve_args(request: Request) -> tuple[str, float, list[bytes], list[str], bool]:
    """``resolve``'s (reference, wait, authority keys, peers to dial first, use the DHT)."""
    ref = request.args.get("ref")
    if not isinstance(ref, str) or len(ref) > MAX_REQUEST_BYTES // 4:
        raise ApiError("bad_request", "ref must be a PUBLISHER/NAME string")
    wait = request.args.get("wait_s", 5.0)
    if not isinstance(wait, int | float) or not 0 < wait <= MAX_RESOLVE_WAIT:
        raise ApiError(
            "bad_request", f"wait_s must be a number of seconds up to {MAX_RESOLVE_WAIT:g}"
        )
    authorities = request.args.get("authorities", [])
    try:
        keys = [bytes.fromhex(a) for a in authorities]
    except (TypeError, ValueError):
        keys = []
    if (
        not isinstance(authorities, list)
        or len(keys) != len(authorities)
        or any(len(k) != 32 for k in keys)
        or len(keys) > MAX_AUTHORITIES
    ):
        raise ApiError("bad_request", "authorities must be a list of 64-hex-digit keys")
    peers = request.args.get("peers", [])
    if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
        raise ApiError("bad_request", "peers must be a list of multiaddr strings")
    if len(peers) > MAX_PROVIDERS:
        raise ApiError("bad_request", f"at most {MAX_PROVIDERS} peers")
    return ref, float(wait), keys, peers, bool(request.args.get("dht", True))


def error_event(exc: BaseException) -> dict[str, Any]:
    """The ``error`` event for what an operation raised (rule 3)."""
    if isinstance(exc, ApiError):
        return {"event": "error", "code": exc.code, "message": str(exc), "exit_code": 1}
    code = getattr(type(exc), "exit_code", None)
    if isinstance(code, int):
        return {
            "event": "error",
            "code": type(exc).__name__,
            "message": str(exc),
            "exit_code": code,
        }
    return {"event": "error", "code": "internal", "message": repr(exc), "exit_code": 1}


class LineReader:
    """Bytes in, lines out, each bounded (rule 2)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        lines = []
        while (end := self._buffer.find(b"\n")) >= 0:
            lines.append(bytes(self._buffer[:end]))
            del self._buffer[: end + 1]
        if len(self._buffer) > self.limit:
            raise ApiError("bad_request", f"line longer than {self.limit} bytes")
        return lines
