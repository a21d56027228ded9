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
   ``unsupported_version``, ``busy`` (the daemon's limits: the client runs on its own),
   ``internal`` (the daemon's bug), ``unauthorized`` (a TCP request without the right
   token), ``forbidden`` (a ``put`` of a path this caller may not have the daemon read), or
   the name of the blobnet error the operation raised (``NoProviders``, ``FetchFailed``,
   ...) with that error's exit status, so a thin client exits as the command would have
   without a daemon.
4. The Unix socket needs no token: its mode lets only the store's owner connect. The TCP
   listener (``serve --api-listen``, loopback unless forced) takes a request only with the
   ``token`` held in ``<store>/api.token`` (mode 0600, so again only the owner can read
   it), compared in constant time, and checked before anything else is read from the
   request: on TCP, a line that is not a JSON object carrying that token is
   ``unauthorized``, whatever else is wrong with it.
5. This module and ``client`` import nothing beyond the standard library: ``blob get`` and
   friends on a store a daemon serves load only them (p2p.cli.light), so the exit statuses
   below are the values of blobstore.exitcodes.ExitCode (a test holds them equal) rather than
   an import of it, which would load the whole store package (~60 ms).
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

API_VERSION = 1
SOCKET_NAME = "api.sock"
# The TCP listener's token (rule 4): 32 random bytes as hex, a new one each time it starts.
TOKEN_NAME = "api.token"
TOKEN_MODE = 0o600
TOKEN_BYTES = 32
# The socket file's mode: only the store's owner may drive its daemon.
SOCKET_MODE = 0o600
# A request names a blob and at most MAX_PROVIDERS addresses of a few hundred bytes each.
MAX_REQUEST_BYTES = 64 * 1024
# A request is an object holding strings and lists of strings: two levels. Nesting is
# bounded by the line's length and by the interpreter's recursion limit (json's decoder
# counts its depth against it and raises RecursionError): such a line is a bad request.
MAX_PROVIDERS = 64
# The largest event: a status of a busy node (hundreds of connections, tens of transfers) or
# the metrics text, a few hundred KiB; 16 MiB is far above and still bounds a client.
MAX_EVENT_BYTES = 16 * 1024 * 1024
# sun_path holds 108 bytes with its NUL: a longer socket path cannot be bound or dialled.
MAX_SOCKET_PATH = 107
OPS = ("hello", "status", "metrics", "fetch", "announce", "resolve", "put", "publish", "catalog")
# A resolve waits for peers and the DHT at most this long (blob resolve --wait's ceiling).
MAX_RESOLVE_WAIT = 600.0
MAX_AUTHORITIES = 64
ERROR_CODES = (
    "bad_request", "unsupported_version", "busy", "internal", "unauthorized", "forbidden",
)  # fmt: skip
# blobstore.exitcodes.ExitCode's values (rule 5).
EXIT_REJECTED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_LOCAL_IO = 5
EXIT_NETWORK = 6
EXIT_INTERRUPTED = 130


def socket_path(store_root: Path) -> Path:
    """Where the daemon of the store at ``store_root`` listens."""
    return Path(store_root) / SOCKET_NAME


def token_path(store_root: Path) -> Path:
    """Where the daemon of the store at ``store_root`` keeps its TCP listener's token."""
    return Path(store_root) / TOKEN_NAME


class ApiError(Exception):
    """A request the daemon refused: ``code`` (rule 3) and a one-line ``message``."""

    def __init__(self, code: str, message: str, exit_code: int = EXIT_REJECTED) -> None:
        super().__init__(message)
        self.code = code
        self.exit_code = exit_code


@dataclass(frozen=True)
class Request:
    op: str
    args: dict[str, Any] = field(default_factory=dict)
    token: str | None = None

    def encode(self) -> bytes:
        token = {} if self.token is None else {"token": self.token}
        return encode_line({"api": API_VERSION, "op": self.op, **token, **self.args})


def encode_line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


UNAUTHORIZED = (
    "the local API's TCP listener wants the token in the store's api.token (blob --api-token FILE)"
)


def _parse_object(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_REQUEST_BYTES:
        raise ApiError("bad_request", f"request longer than {MAX_REQUEST_BYTES} bytes")
    try:
        obj = json.loads(line)
    except RecursionError:
        raise ApiError("bad_request", "request nests too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError("bad_request", "request is not a JSON object on one line") from None
    if not isinstance(obj, dict):
        raise ApiError("bad_request", "request is not a JSON object")
    return obj


def decode_request(line: bytes, token: str | None = None) -> Request:
    """One request line (without its newline) as a Request; ApiError if it is not one.
    With ``token`` (the TCP listener's), a line that is not an object carrying it is
    ``unauthorized`` before anything else is judged (rule 4)."""
    if token is None:
        obj = _parse_object(line)
    else:
        try:
            obj = _parse_object(line)
        except ApiError:
            obj = {}
        given = obj.get("token")
        given_bytes = given.encode(errors="replace") if isinstance(given, str) else b""
        if not hmac.compare_digest(given_bytes, token.encode()):
            raise ApiError("unauthorized", UNAUTHORIZED)
    version = obj.pop("api", None)
    if version != API_VERSION:
        raise ApiError(
            "unsupported_version", f"this daemon speaks API {API_VERSION}, not {version!r}"
        )
    op = obj.pop("op", None)
    if op not in OPS:
        raise ApiError("bad_request", f"unknown op {op!r} (known: {', '.join(OPS)})")
    carried = obj.pop("token", None)
    return Request(op, obj, carried if isinstance(carried, str) else None)


def fetch_args(request: Request) -> tuple[str, list[str], bool]:
    """``fetch``'s (blob reference, provider addresses, recursive), checked. The reference
    is the ``id`` (64 hex digits), or else the ``ref`` the daemon resolves in its store: an
    ID, a prefix of 8+ hex digits, a tag or a ticket."""
    if "id" in request.args or "ref" not in request.args:
        from blobstore import BadBlobId, parse_blob_id

        try:
            ref = parse_blob_id(str(request.args.get("id", "")))
        except BadBlobId as exc:
            raise ApiError("bad_request", str(exc)) from None
    else:
        ref = _string(request, "ref")
    providers = _addrs(request, "providers")
    return ref, providers, bool(request.args.get("recursive", True))


def _string(request: Request, name: str, *, required: bool = True) -> str:
    """A string argument, bounded (a reference, a name, a path)."""
    value = request.args.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or not value or len(value) > MAX_REQUEST_BYTES // 4:
        raise ApiError("bad_request", f"{name} must be a non-empty string")
    return value


def _addrs(request: Request, name: str) -> list[str]:
    addrs = request.args.get(name, [])
    if not isinstance(addrs, list) or not all(isinstance(p, str) for p in addrs):
        raise ApiError("bad_request", f"{name} must be a list of multiaddr strings")
    if len(addrs) > MAX_PROVIDERS:
        raise ApiError("bad_request", f"at most {MAX_PROVIDERS} {name}")
    return addrs


def _optional_int(request: Request, name: str) -> int | None:
    value = request.args.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
        raise ApiError("bad_request", f"{name} must be a whole number", EXIT_USAGE)
    return value


@dataclass(frozen=True)
class PutArgs:
    """``put``: a file or directory the daemon reads (an absolute path on its machine)."""

    path: str
    tag: str | None
    chunk_size: str | None
    move: bool
    follow_symlinks: bool


def put_args(request: Request) -> PutArgs:
    path = _string(request, "path")
    if not path.startswith("/"):
        raise ApiError("bad_request", "path must be absolute (the daemon has its own cwd)")
    tag = _string(request, "tag", required=False) or None
    chunk = request.args.get("chunk_size")
    if chunk is not None and not isinstance(chunk, str | int):
        raise ApiError("bad_request", "chunk_size must be a size (4MiB, 65536)", EXIT_USAGE)
    return PutArgs(
        path, tag, None if chunk is None else str(chunk), bool(request.args.get("move")),
        bool(request.args.get("follow_symlinks")),
    )  # fmt: skip


@dataclass(frozen=True)
class PublishArgs:
    """``publish``: NAME -> the blob ``ref`` names in the daemon's store."""

    name: str
    ref: str
    seq: int | None
    expires_in_s: int | None
    certificate: bytes | None
    peers: list[str]
    dht: bool


def publish_args(request: Request) -> PublishArgs:
    certificate = request.args.get("certificate")
    try:
        cert = None if certificate is None else bytes.fromhex(certificate)
    except (TypeError, ValueError):
        raise ApiError("bad_request", "certificate must be hex") from None
    expires = _optional_int(request, "expires_in_s")
    if expires == 0:
        raise ApiError("bad_request", "expires_in_s must be at least 1", EXIT_USAGE)
    return PublishArgs(
        _string(request, "name"), _string(request, "ref"), _optional_int(request, "seq"),
        expires, cert, _addrs(request, "peers"), bool(request.args.get("dht", True)),
    )  # fmt: skip


def catalog_args(request: Request) -> tuple[str, list[bytes], list[str]]:
    """``catalog``'s (publisher, authority keys, peers to dial first)."""
    return _string(request, "publisher"), _authorities(request), _addrs(request, "peers")


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
    keys = _authorities(request)
    peers = _addrs(request, "peers")
    return ref, float(wait), keys, peers, bool(request.args.get("dht", True))


def _authorities(request: Request) -> list[bytes]:
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
    return keys


def error_event(exc: BaseException) -> dict[str, Any]:
    """The ``error`` event for what an operation raised (rule 3)."""
    if isinstance(exc, ApiError):
        return {"event": "error", "code": exc.code, "message": str(exc), "exit_code": exc.exit_code}
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
