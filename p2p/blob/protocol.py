"""The sans-IO core of the ``/blobnet/blob/1.0.0`` to ``/blobnet/blob/1.5.0`` wire protocol.

Bytes in, events out; events in, bytes out. Nothing here touches a socket, a clock or the
store: the trio shell (server, client, downloader) moves bytes between these objects and
libp2p streams. ``p2p/blob/PROTOCOL.md`` is the wire specification; this module implements it.

Theory of operation
===================

1. Framing. Every message is a frame: a 4-byte big-endian header length ``H``, then ``H``
   bytes of a canonical msgpack map, then, for a ``chunk`` message only, exactly ``n`` raw
   body bytes. The length prefix is checked against a limit the moment its 4 bytes are
   here, before any of the header is buffered; the body length ``n`` is checked (against
   ``MAX_CHUNK_SIZE`` and the caller's expected length) before any of the body is buffered.

2. Canonical headers. A decoder builds the event from the map, re-encodes the event and
   compares the bytes: key order, integer widths, str-vs-bin and duplicate keys are all
   caught by that one comparison, so each message has exactly one valid encoding. Missing
   or extra keys, wrong types and out-of-range values are rejected before that, with a
   precise message.

3. Requests in order per stream. On 1.0.0 the client sends a request, reads the whole
   response, then may send the next. On 1.1.0 (``max_pipelined=MAX_PIPELINED_REQUESTS``) it
   may have up to that many requests outstanding; responses come in request order. The
   server reads a request, answers it completely, then takes the next. Both sides track the
   outstanding requests and check every message against the oldest: a ``get`` response
   carries only chunk indices that were asked for, each at most once, and ends with ``end``
   whose ``missing`` list is exactly the indices not sent.

4. Whose fault. Anything the peer sent that breaks these rules raises
   ``RemoteProtocolError`` (the shell resets the stream and scores the peer down; a server
   may first answer with the error code the exception hints at). Anything our own code asks
   for that the protocol forbids raises ``LocalProtocolError``: that is a bug. Once a
   connection has raised ``RemoteProtocolError`` it stays failed.

5. Copies. Received bytes are appended to one ``bytearray`` read from an offset (compacted
   once the consumed prefix dominates). A chunk body is copied exactly once, from the
   caller's buffer into a ``bytearray`` of exactly its length, and handed out as a read-only
   ``memoryview`` of it. Outgoing bodies are never copied: the shell writes
   ``encode_chunk_header(...)`` and then the body itself.

This module checks only what the protocol itself can check. Verifying that manifest bytes
hash to the blob ID, and that each chunk hashes to its manifest entry, is the receiver's
job (the downloader, with ``blobstore``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, TypeAlias

import msgpack

__all__ = [
    "BLOB_ID_BYTES",
    "CHUNK_HEADER_ROOM",
    "HASH_SIZE",
    "LENGTH_PREFIX_SIZE",
    "MAX_ADDRS_PER_PEER",
    "MAX_ADDR_LEN",
    "MAX_BITMAP_BYTES",
    "MAX_CHUNKS_PER_REQUEST",
    "MAX_CHUNK_SIZE",
    "MAX_ERROR_MESSAGE",
    "MAX_FELLOWS_COUNTED",
    "MAX_HEADER_SIZE",
    "MAX_MANIFEST_BYTES",
    "MAX_NUM_CHUNKS",
    "MAX_PEERS_LISTED",
    "MAX_PEER_ID_LEN",
    "MAX_PIPELINED_REQUESTS",
    "MAX_RANGES_PER_REQUEST",
    "SERVED_PROTOCOL_IDS",
    "Chunk",
    "ClientConnection",
    "End",
    "ErrorCode",
    "ErrorResponse",
    "GetRequest",
    "HaveRequest",
    "HaveResponse",
    "LocalProtocolError",
    "ManifestRequest",
    "ManifestResponse",
    "PeersRequest",
    "PeersResponse",
    "ProtocolError",
    "RemoteProtocolError",
    "Request",
    "Response",
    "ServerConnection",
    "StatusRequest",
    "StatusResponse",
    "TruncatedStreamError",
    "Version",
    "encode_chunk_header",
    "encode_request",
    "encode_response_header",
    "max_response_header_size",
]


class Version(enum.IntEnum):
    """A ``/blobnet/blob`` protocol version. Versions are ordered, and each carries every
    feature of the versions below it: a stream's version alone says what may cross it."""

    # Requests one at a time.
    V1_0 = 0
    # The same messages, and a client may pipeline requests (PROTOCOL.md section 5).
    V1_1 = 1
    # The `peers` request (peer exchange: who else fetches this blob).
    V1_2 = 2
    # The `status` request: the chunks a peer holds and those it is fetching now, so
    # fellow fetchers leave a chunk in flight to it instead of asking the seeder too.
    V1_3 = 3
    # `status` answers also count the peers that asked the server about the blob lately
    # (``fellows``): a fetcher that a seeder calls alone may ask it for much at once.
    V1_4 = 4
    # `try_get`, a `get` the server may decline while others fetch the blob from it: a
    # swarming fetcher's first chunk, asked with the manifest, costs a seeder one copy per
    # swarm instead of one per fetcher, and a lone fetcher still saves a round trip.
    V1_5 = 5

    @property
    def protocol_id(self) -> str:
        return f"/blobnet/blob/1.{self.value}.0"

    @property
    def max_pipelined(self) -> int:
        """Requests a client may have outstanding on one stream of this version."""
        return 1 if self is Version.V1_0 else MAX_PIPELINED_REQUESTS

    @property
    def peer_exchange(self) -> bool:
        return self >= Version.V1_2

    @property
    def status(self) -> bool:
        return self >= Version.V1_3

    @property
    def fellows(self) -> bool:
        return self >= Version.V1_4

    @property
    def tentative(self) -> bool:
        return self >= Version.V1_5

    @classmethod
    def of(cls, protocol_id: str) -> Version | None:
        """The version a protocol ID names, or None for anything else."""
        return _VERSION_OF.get(protocol_id)


_VERSION_OF = {v.protocol_id: v for v in Version}
# A server serves every version; a client asks for the lowest that carries what it needs.
SERVED_PROTOCOL_IDS = tuple(v.protocol_id for v in sorted(Version, reverse=True))

# --- Limits -------------------------------------------------------------------------------
# Every length, count and index a peer can claim is bounded here and checked before memory
# is allocated for it.

# Size of the big-endian unsigned length prefix in front of every header.
LENGTH_PREFIX_SIZE = 4

# Largest msgpack header of any request, and of any response to a `get`. The biggest such
# header is a `get` with MAX_RANGES_PER_REQUEST ranges (~1.2 KiB) or an `end` listing
# MAX_CHUNKS_PER_REQUEST indices (~1.3 KiB); 64 KiB leaves room for a 1 KiB error message and
# future fields while keeping a hostile peer's cost per stream trivial. (h11's default
# incomplete-event limit is 16 KiB; bitswap's whole-message limit is 4 MiB.) Responses to
# `manifest` and `have` carry their payload inside the header and get a larger limit: see
# max_response_header_size().
MAX_HEADER_SIZE = 64 * 1024
# Room for a chunk's header (length prefix and msgpack) in front of its body: they take
# about 12 bytes. Servers reserve it in their send buffers, clients credit it per chunk.
CHUNK_HEADER_ROOM = 64

# The largest chunk: equals blobstore.MAX_CHUNK_SIZE (the chunk size is a power of two from
# 64 KiB to 16 MiB, DESIGN.md section 2). Defined here so the protocol core imports nothing
# from the store; keep the two equal (the protocol cannot carry a chunk the store refuses).
MAX_CHUNK_SIZE = 16 * 1024 * 1024

# The largest manifest accepted over the wire: 16 MiB of chunk hashes plus the few bytes of
# msgpack around them ({"v", "size", "chunk", "hashes"}). 16 MiB of hashes is 2**19 chunks,
# i.e. 512 TiB at the 1 MiB default chunk size: far beyond any checkpoint, yet a bounded
# allocation for a peer's claim.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024 + 64

# BLAKE3-256 digest size: one per chunk in a manifest, and the blob ID's raw size.
HASH_SIZE = 32
BLOB_ID_BYTES = 32

# Upper bound on chunks in any blob whose manifest fits MAX_MANIFEST_BYTES (each chunk
# costs HASH_SIZE bytes of manifest). Bounds `have` counts and every chunk index.
MAX_NUM_CHUNKS = MAX_MANIFEST_BYTES // HASH_SIZE

# A `have` bitmap for the largest possible blob: one bit per chunk.
MAX_BITMAP_BYTES = (MAX_NUM_CHUNKS + 7) // 8

# Ranges in one `get`. A downloader asks for a few runs of missing chunks at a time; 64 runs
# is plenty for rarest-first scheduling and bounds the server's validation work.
MAX_RANGES_PER_REQUEST = 64

# Chunks in one `get`: 256 MiB at the 1 MiB default chunk size. Big enough to keep a fast
# link busy for a second or more between requests, small enough that a per-request deadline
# derived from a minimum send rate stays meaningful and a slow peer holds few chunks hostage.
MAX_CHUNKS_PER_REQUEST = 256

# Requests one 1.1.0 stream may have outstanding (sent, response not complete), the one
# being answered included. Enough to hide a round trip behind the chunks of the previous
# request (a request is small; its response is up to 256 chunks); small enough that the
# server's view of one stream stays a short queue of parsed requests.
MAX_PIPELINED_REQUESTS = 8

# A `peers` response (1.2.0) lists at most this many peers, each with at most
# MAX_ADDRS_PER_PEER addresses of at most MAX_ADDR_LEN UTF-8 bytes and a peer ID of at most
# MAX_PEER_ID_LEN: 16 * (128 + 4 * 256) bytes plus msgpack framing stay well inside
# MAX_HEADER_SIZE, and a fetcher dials only a few of them anyway (p2p.blob.swarm).
MAX_PEERS_LISTED = 16
# The largest `fellows` count of a 1.4.0 `status` answer: a server remembers this many
# peers per blob (p2p.blob.swarm.MAX_SWARM_PEERS), and past a few the count changes nothing.
MAX_FELLOWS_COUNTED = 4 * MAX_PEERS_LISTED
MAX_ADDRS_PER_PEER = 4
MAX_ADDR_LEN = 256
MAX_PEER_ID_LEN = 128

# Error text, in UTF-8 bytes: one line for a log or a CLI message; a peer cannot make us
# store or print more.
MAX_ERROR_MESSAGE = 1024

# Overhead of the msgpack around the payload of a `manifest` or `have` response header
# (map marker, keys, type string, bin32 marker, `n` as uint32): 32 bytes is more than enough.
_PAYLOAD_HEADER_OVERHEAD = 32

# Compact the receive buffer once the consumed prefix is at least this large and at least
# half of the buffer, so a long stream of small frames costs amortised O(1) per byte.
_COMPACT_THRESHOLD = 64 * 1024


# --- Errors -------------------------------------------------------------------------------


class ErrorCode(enum.StrEnum):
    """The code of an ``error`` response (see PROTOCOL.md, "Errors")."""

    NOT_FOUND = "not_found"
    BUSY = "busy"
    BAD_REQUEST = "bad_request"
    TOO_LARGE = "too_large"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """Base of the protocol errors. Not raised itself: see the two subclasses."""

    # A network-level failure for the `blob` CLI (CONTRACTS.md exit codes).
    exit_code: ClassVar[int] = 6

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        if type(self) is ProtocolError:
            raise TypeError("raise LocalProtocolError or RemoteProtocolError, not ProtocolError")
        super().__init__(message)
        self.code = code


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol. ``code`` hints at the error a server should answer with
    (``bad_request`` for malformed input, ``too_large`` for input over a limit)."""


class TruncatedStreamError(RemoteProtocolError):
    """The peer closed the stream in the middle of a frame or before a response was
    complete. A protocol violation like any other, but the shell may prefer to treat it as
    a lost stream (a peer shutting down) rather than as misbehaviour worth a ban."""


class LocalProtocolError(ProtocolError):
    """Our own code asked for something the protocol forbids: a bug on this side."""


class _Invalid(Exception):
    """Internal: a message failed validation; callers re-raise it as Local or Remote."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code


class _Truncated(_Invalid):
    """Internal: the stream ended mid-frame or mid-response."""


def _remote(exc: _Invalid) -> RemoteProtocolError:
    cls = TruncatedStreamError if isinstance(exc, _Truncated) else RemoteProtocolError
    return cls(str(exc), exc.code)


# --- Events -------------------------------------------------------------------------------
# Frozen dataclasses; don't subclass them (the encoder and decoder dispatch on exact type).


@dataclasses.dataclass(frozen=True, slots=True)
class ManifestRequest:
    """Ask for the manifest of ``blob_id`` (64 lowercase hex characters)."""

    blob_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class HaveRequest:
    """Ask which chunks of ``blob_id`` the peer holds."""

    blob_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class GetRequest:
    """Ask for chunks of ``blob_id``: half-open index ranges, sorted, non-overlapping.
    ``tentative`` (1.5.0, sent as ``try_get``): the server may decline it, answering
    `end` with every requested index in ``missing``, which then says nothing about what
    the server holds."""

    blob_id: str
    ranges: tuple[tuple[int, int], ...]
    tentative: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class PeersRequest:
    """(1.2.0) Ask which other peers recently fetched or hold ``blob_id``."""

    blob_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class StatusRequest:
    """(1.3.0) Ask which chunks of ``blob_id`` the peer holds and which it is fetching."""

    blob_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class ManifestResponse:
    """The manifest bytes (the receiver checks they hash to the blob ID)."""

    manifest: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class HaveResponse:
    """``bitmap`` has bit ``i % 8`` of byte ``i // 8`` set when chunk ``i`` is held."""

    num_chunks: int
    bitmap: bytes

    def has(self, index: int) -> bool:
        """Whether the peer holds chunk ``index``."""
        if not 0 <= index < self.num_chunks:
            return False
        return bool(self.bitmap[index >> 3] >> (index & 7) & 1)


@dataclasses.dataclass(frozen=True, slots=True)
class StatusResponse:
    """(1.3.0) ``bitmap`` as in HaveResponse; ``soon`` (same length, disjoint from
    ``bitmap``) has the chunks the peer is fetching now and will hold shortly (a hint);
    (1.4.0) ``fellows`` how many others fetch the blob from it now (a hint)."""

    num_chunks: int
    bitmap: bytes
    soon: bytes
    # (1.4.0 only, None before) other peers that asked the server about this blob within
    # the last few seconds (p2p.blob.swarm.FELLOW_WINDOW), at most MAX_FELLOWS_COUNTED.
    fellows: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PeersResponse:
    """(1.2.0) Peers of the same blob: ``(peer ID, (multiaddr, ...))`` pairs, at most
    MAX_PEERS_LISTED, each with 1 to MAX_ADDRS_PER_PEER addresses (a hint: the receiver
    dials them and verifies everything they send, as from any peer)."""

    peers: tuple[tuple[str, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a ``get`` response. ``data`` is a read-only view of the body; on the
    sending side only its length matters (use ``encode_chunk_header``)."""

    index: int
    data: memoryview


@dataclasses.dataclass(frozen=True, slots=True)
class End:
    """The last message of a ``get`` response: requested indices that were not sent
    because the server lacks them, ascending."""

    missing: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorResponse:
    """The request failed; ``message`` is at most MAX_ERROR_MESSAGE UTF-8 bytes."""

    code: ErrorCode
    message: str

    @classmethod
    def truncated(cls, code: ErrorCode, message: str) -> ErrorResponse:
        """An error whose message is cut to fit MAX_ERROR_MESSAGE (at a character boundary)."""
        raw = message.encode("utf-8", errors="replace")[:MAX_ERROR_MESSAGE]
        return cls(code, raw.decode("utf-8", errors="ignore"))


Request: TypeAlias = ManifestRequest | HaveRequest | GetRequest | PeersRequest | StatusRequest
Response: TypeAlias = (
    ManifestResponse | HaveResponse | Chunk | End | ErrorResponse | PeersResponse | StatusResponse
)

# Wire type strings.
_T_MANIFEST = "manifest"
_T_HAVE = "have"
_T_GET = "get"
_T_TRY_GET = "try_get"
_T_CHUNK = "chunk"
_T_END = "end"
_T_ERROR = "error"
_T_PEERS = "peers"
_T_STATUS = "status"

# Keys of each message on the wire, in their canonical order.
_REQUEST_KEYS: dict[str, tuple[str, ...]] = {
    _T_MANIFEST: ("t", "id"),
    _T_HAVE: ("t", "id"),
    _T_GET: ("t", "id", "r"),
}
# 1.2.0 adds `peers`; on 1.0.0 and 1.1.0 it stays an unknown message type.
_REQUEST_KEYS_1_2: dict[str, tuple[str, ...]] = {**_REQUEST_KEYS, _T_PEERS: ("t", "id")}
# 1.3.0 adds `status`; on older versions it is an unknown message type.
_REQUEST_KEYS_1_3: dict[str, tuple[str, ...]] = {**_REQUEST_KEYS_1_2, _T_STATUS: ("t", "id")}
# 1.5.0 adds `try_get`; on older versions it is an unknown message type.
_REQUEST_KEYS_1_5: dict[str, tuple[str, ...]] = {**_REQUEST_KEYS_1_3, _T_TRY_GET: ("t", "id", "r")}
_RESPONSE_KEYS: dict[str, tuple[str, ...]] = {
    _T_MANIFEST: ("t", "m"),
    _T_HAVE: ("t", "n", "bits"),
    _T_CHUNK: ("t", "i", "n"),
    _T_END: ("t", "missing"),
    _T_ERROR: ("t", "code", "msg"),
    _T_PEERS: ("t", "p"),
    _T_STATUS: ("t", "n", "bits", "soon"),
}

# 1.4.0's `status` also counts the peers fetching the blob.
_RESPONSE_KEYS_1_4: dict[str, tuple[str, ...]] = {
    **_RESPONSE_KEYS,
    _T_STATUS: ("t", "n", "bits", "soon", "f"),
}

# Which response types may answer each request type (a response carrying anything else is
# a remote protocol error).
_ALLOWED_RESPONSES: dict[type, frozenset[str]] = {
    ManifestRequest: frozenset({_T_MANIFEST, _T_ERROR}),
    HaveRequest: frozenset({_T_HAVE, _T_ERROR}),
    GetRequest: frozenset({_T_CHUNK, _T_END, _T_ERROR}),
    PeersRequest: frozenset({_T_PEERS, _T_ERROR}),
    StatusRequest: frozenset({_T_STATUS, _T_ERROR}),
}


def max_response_header_size(request: Request) -> int:
    """The largest response header length a client accepts while ``request`` is outstanding.

    ``manifest`` and ``have`` responses carry their payload (manifest bytes, bitmap) inside
    the header, so their limit is the payload limit plus msgpack overhead; every other frame
    is bounded by MAX_HEADER_SIZE.
    """
    if type(request) is ManifestRequest:
        return MAX_MANIFEST_BYTES + _PAYLOAD_HEADER_OVERHEAD
    if type(request) is HaveRequest:
        return max(MAX_HEADER_SIZE, MAX_BITMAP_BYTES + _PAYLOAD_HEADER_OVERHEAD)
    if type(request) is StatusRequest:
        return max(MAX_HEADER_SIZE, 2 * (MAX_BITMAP_BYTES + _PAYLOAD_HEADER_OVERHEAD))
    return MAX_HEADER_SIZE


# --- Validation (shared by encoders and decoders) -----------------------------------------


def _is_int(value: object) -> bool:
    # bool is an int subclass; msgpack true/false must never pass as a number.
    return type(value) is int


def _blob_id_to_wire(blob_id: object) -> bytes:
    if type(blob_id) is not str or len(blob_id) != 2 * BLOB_ID_BYTES:
        raise _Invalid(f"blob ID must be {2 * BLOB_ID_BYTES} lowercase hex characters")
    try:
        raw = bytes.fromhex(blob_id)
    except ValueError:
        raise _Invalid("blob ID must be lowercase hex") from None
    if raw.hex() != blob_id:
        raise _Invalid("blob ID must be lowercase hex")
    return raw


def _blob_id_from_wire(raw: object) -> str:
    if type(raw) is not bytes or len(raw) != BLOB_ID_BYTES:
        raise _Invalid(f'"id" must be {BLOB_ID_BYTES} bytes')
    return raw.hex()


def _check_ranges(ranges: object) -> tuple[tuple[int, int], ...]:
    """Validate chunk ranges and return them as a tuple of pairs."""
    if not isinstance(ranges, (list, tuple)):
        raise _Invalid("ranges must be a list of [start, end] pairs")
    if not ranges:
        raise _Invalid("a get request needs at least one range")
    if len(ranges) > MAX_RANGES_PER_REQUEST:
        raise _Invalid(
            f"{len(ranges)} ranges in one request; the limit is {MAX_RANGES_PER_REQUEST}",
            ErrorCode.TOO_LARGE,
        )
    out: list[tuple[int, int]] = []
    total = 0
    previous_end = 0
    for pair in ranges:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _Invalid("each range must be a [start, end] pair")
        start, end = pair
        if not _is_int(start) or not _is_int(end):
            raise _Invalid("range bounds must be integers")
        if not 0 <= start < end <= MAX_NUM_CHUNKS:
            raise _Invalid(f"bad range [{start}, {end}): need 0 <= start < end <= MAX_NUM_CHUNKS")
        if start < previous_end:
            raise _Invalid("ranges must be sorted and must not overlap")
        total += end - start
        if total > MAX_CHUNKS_PER_REQUEST:
            raise _Invalid(
                f"more than {MAX_CHUNKS_PER_REQUEST} chunks in one request", ErrorCode.TOO_LARGE
            )
        previous_end = end
        out.append((start, end))
    return tuple(out)


def _check_chunk_length(length: object) -> int:
    if not _is_int(length):
        raise _Invalid("chunk length must be an integer")
    assert isinstance(length, int)
    if not 0 < length <= MAX_CHUNK_SIZE:
        raise _Invalid(
            f"chunk length {length} outside 1..{MAX_CHUNK_SIZE}",
            ErrorCode.TOO_LARGE if length > 0 else ErrorCode.BAD_REQUEST,
        )
    return length


def _check_index(index: object) -> int:
    if not _is_int(index):
        raise _Invalid("chunk index must be an integer")
    assert isinstance(index, int)
    if not 0 <= index < MAX_NUM_CHUNKS:
        raise _Invalid(f"chunk index {index} out of range")
    return index


def _check_have(num_chunks: object, bitmap: object) -> tuple[int, bytes]:
    if not _is_int(num_chunks):
        raise _Invalid("have count must be an integer")
    assert isinstance(num_chunks, int)
    if not 0 <= num_chunks <= MAX_NUM_CHUNKS:
        raise _Invalid(f"have count {num_chunks} outside 0..{MAX_NUM_CHUNKS}")
    if type(bitmap) is not bytes:
        raise _Invalid("have bitmap must be bytes")
    if len(bitmap) != (num_chunks + 7) // 8:
        raise _Invalid(f"have bitmap of {len(bitmap)} bytes for {num_chunks} chunks")
    spare = -num_chunks % 8
    if spare and bitmap[-1] >> (8 - spare):
        raise _Invalid("have bitmap sets bits past the last chunk")
    return num_chunks, bitmap


def _check_status(num_chunks: object, bitmap: object, soon: object) -> tuple[int, bytes, bytes]:
    num_chunks, bitmap = _check_have(num_chunks, bitmap)
    try:
        _, soon = _check_have(num_chunks, soon)
    except _Invalid as exc:
        raise _Invalid(f"status soon: {exc}") from None
    if int.from_bytes(bitmap, "little") & int.from_bytes(soon, "little"):
        raise _Invalid("status names a chunk both held and soon")
    return num_chunks, bitmap, soon


def _check_fellows(fellows: object) -> int:
    if not _is_int(fellows):
        raise _Invalid("status fellows must be an integer")
    assert isinstance(fellows, int)
    if not 0 <= fellows <= MAX_FELLOWS_COUNTED:
        raise _Invalid(f"status fellows {fellows} out of range 0..{MAX_FELLOWS_COUNTED}")
    return fellows


def _check_manifest(manifest: object) -> bytes:
    if type(manifest) is not bytes:
        raise _Invalid("manifest must be bytes")
    if not 0 < len(manifest) <= MAX_MANIFEST_BYTES:
        raise _Invalid(
            f"manifest of {len(manifest)} bytes; the limit is {MAX_MANIFEST_BYTES}",
            ErrorCode.TOO_LARGE,
        )
    return manifest


def _check_error(code: object, message: object) -> tuple[ErrorCode, str]:
    if type(code) is not str and not isinstance(code, ErrorCode):
        raise _Invalid("error code must be a string")
    try:
        error_code = ErrorCode(code)
    except ValueError:
        raise _Invalid(f"unknown error code {code!r}") from None
    if type(message) is not str:
        raise _Invalid("error message must be a string")
    try:
        too_long = len(message) > MAX_ERROR_MESSAGE or len(message.encode()) > MAX_ERROR_MESSAGE
    except UnicodeEncodeError:
        raise _Invalid("error message is not valid Unicode text") from None
    if too_long:
        raise _Invalid(f"error message over {MAX_ERROR_MESSAGE} bytes")
    return error_code, message


def _check_text(value: object, limit: int, what: str) -> str:
    if type(value) is not str or not value or len(value.encode("utf-8")) > limit:
        raise _Invalid(f"{what} must be a non-empty string of at most {limit} UTF-8 bytes")
    if not value.isprintable():
        raise _Invalid(f"{what} holds unprintable characters")
    return value


def _check_peers(peers: object) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if not isinstance(peers, (list, tuple)) or len(peers) > MAX_PEERS_LISTED:
        raise _Invalid(f"peers must be an array of at most {MAX_PEERS_LISTED} entries")
    out: list[tuple[str, tuple[str, ...]]] = []
    seen: set[str] = set()
    for entry in peers:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise _Invalid("each peer must be a [peer_id, addrs] pair")
        peer_id = _check_text(entry[0], MAX_PEER_ID_LEN, "a peer ID")
        if peer_id in seen:
            raise _Invalid("a peer is listed twice")
        seen.add(peer_id)
        addrs = entry[1]
        if not isinstance(addrs, (list, tuple)) or not 1 <= len(addrs) <= MAX_ADDRS_PER_PEER:
            raise _Invalid(f"each peer has 1 to {MAX_ADDRS_PER_PEER} addresses")
        out.append((peer_id, tuple(_check_text(a, MAX_ADDR_LEN, "an address") for a in addrs)))
    return tuple(out)


def _check_missing(missing: object) -> tuple[int, ...]:
    if not isinstance(missing, (list, tuple)):
        raise _Invalid('"missing" must be a list of chunk indices')
    if len(missing) > MAX_CHUNKS_PER_REQUEST:
        raise _Invalid("more missing indices than a request can hold")
    previous = -1
    for index in missing:
        _check_index(index)
        if index <= previous:
            raise _Invalid('"missing" must be strictly ascending')
        previous = index
    return tuple(missing)


# --- Encoding -----------------------------------------------------------------------------


def _frame(header: dict[str, Any]) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    assert isinstance(body, bytes)
    return len(body).to_bytes(LENGTH_PREFIX_SIZE, "big") + body


def _request_map(req: object) -> dict[str, Any]:
    if type(req) is ManifestRequest:
        return {"t": _T_MANIFEST, "id": _blob_id_to_wire(req.blob_id)}
    if type(req) is HaveRequest:
        return {"t": _T_HAVE, "id": _blob_id_to_wire(req.blob_id)}
    if type(req) is PeersRequest:
        return {"t": _T_PEERS, "id": _blob_id_to_wire(req.blob_id)}
    if type(req) is StatusRequest:
        return {"t": _T_STATUS, "id": _blob_id_to_wire(req.blob_id)}
    if type(req) is GetRequest:
        ranges = _check_ranges(req.ranges)
        return {
            "t": _T_TRY_GET if req.tentative else _T_GET,
            "id": _blob_id_to_wire(req.blob_id),
            "r": [list(pair) for pair in ranges],
        }
    raise _Invalid(f"not a request: {type(req).__name__}")


def _response_map(resp: object) -> dict[str, Any]:
    if type(resp) is ManifestResponse:
        return {"t": _T_MANIFEST, "m": _check_manifest(resp.manifest)}
    if type(resp) is HaveResponse:
        num_chunks, bitmap = _check_have(resp.num_chunks, resp.bitmap)
        return {"t": _T_HAVE, "n": num_chunks, "bits": bitmap}
    if type(resp) is PeersResponse:
        return {"t": _T_PEERS, "p": [[p, list(a)] for p, a in _check_peers(resp.peers)]}
    if type(resp) is StatusResponse:
        num_chunks, bitmap, soon = _check_status(resp.num_chunks, resp.bitmap, resp.soon)
        if resp.fellows is None:
            return {"t": _T_STATUS, "n": num_chunks, "bits": bitmap, "soon": soon}
        fellows = _check_fellows(resp.fellows)
        return {"t": _T_STATUS, "n": num_chunks, "bits": bitmap, "soon": soon, "f": fellows}
    if type(resp) is End:
        return {"t": _T_END, "missing": list(_check_missing(resp.missing))}
    if type(resp) is ErrorResponse:
        code, message = _check_error(resp.code, resp.message)
        return {"t": _T_ERROR, "code": code.value, "msg": message}
    if type(resp) is Chunk:
        raise _Invalid("a chunk has a body: use encode_chunk_header / send_chunk_header")
    raise _Invalid(f"not a response: {type(resp).__name__}")


def _chunk_map(index: int, length: int) -> dict[str, Any]:
    return {"t": _T_CHUNK, "i": index, "n": length}


def encode_request(req: Request) -> bytes:
    """The frame of a request. Raises LocalProtocolError if the request is invalid."""
    try:
        return _frame(_request_map(req))
    except _Invalid as exc:
        raise LocalProtocolError(str(exc), exc.code) from None


def encode_response_header(resp: Response) -> bytes:
    """The frame of a manifest, have, end or error response (not a chunk: it has a body)."""
    try:
        return _frame(_response_map(resp))
    except _Invalid as exc:
        raise LocalProtocolError(str(exc), exc.code) from None


def encode_chunk_header(index: int, length: int) -> bytes:
    """The frame header of a chunk; the caller writes the ``length`` body bytes right after."""
    try:
        return _frame(_chunk_map(_check_index(index), _check_chunk_length(length)))
    except _Invalid as exc:
        raise LocalProtocolError(str(exc), exc.code) from None


# --- Decoding -----------------------------------------------------------------------------


def _unpack_map(header: bytes, keys_by_type: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """Decode a header to a map with exactly the keys its ``t`` calls for."""
    try:
        obj = msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises ValueError subclasses, StackError, etc.
        raise _Invalid(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise _Invalid("header must be a msgpack map")
    kind = obj.get("t")
    if type(kind) is not str or kind not in keys_by_type:
        raise _Invalid(f"unknown message type {kind!r}"[:200])
    expected = keys_by_type[kind]
    if len(obj) != len(expected) or set(obj) != set(expected):
        missing = sorted(set(expected) - set(obj))
        extra = sorted(repr(k) for k in set(obj) - set(expected))
        raise _Invalid(f"{kind!r} message: missing keys {missing}, unexpected keys {extra}"[:300])
    return obj


def _require_canonical(header: bytes, canonical: dict[str, Any]) -> None:
    if msgpack.packb(canonical, use_bin_type=True) != header:
        raise _Invalid("header is not canonical msgpack")


def _decode_request(header: bytes, version: Version) -> Request:
    keys = (
        _REQUEST_KEYS_1_5
        if version.tentative
        else _REQUEST_KEYS_1_3
        if version.status
        else _REQUEST_KEYS_1_2
        if version.peer_exchange
        else _REQUEST_KEYS
    )
    obj = _unpack_map(header, keys)
    kind = obj["t"]
    blob_id = _blob_id_from_wire(obj["id"])
    req: Request
    if kind == _T_MANIFEST:
        req = ManifestRequest(blob_id)
    elif kind == _T_HAVE:
        req = HaveRequest(blob_id)
    elif kind == _T_PEERS:
        req = PeersRequest(blob_id)
    elif kind == _T_STATUS:
        req = StatusRequest(blob_id)
    else:
        req = GetRequest(blob_id, _check_ranges(obj["r"]), tentative=kind == _T_TRY_GET)
    _require_canonical(header, _request_map(req))
    return req


def _decode_response(
    header: bytes, allowed: frozenset[str], fellows: bool = False
) -> tuple[str, Any]:
    """Decode a response header (``fellows``: on a 1.4.0 stream). Returns ("chunk",
    (index, length)) for a chunk header, else (type, event)."""
    obj = _unpack_map(header, _RESPONSE_KEYS_1_4 if fellows else _RESPONSE_KEYS)
    kind: str = obj["t"]
    if kind not in allowed:
        raise _Invalid(f"a {kind!r} message does not answer the outstanding request")
    if kind == _T_CHUNK:
        index = _check_index(obj["i"])
        length = _check_chunk_length(obj["n"])
        _require_canonical(header, _chunk_map(index, length))
        return kind, (index, length)
    event: Response
    if kind == _T_MANIFEST:
        event = ManifestResponse(_check_manifest(obj["m"]))
    elif kind == _T_HAVE:
        event = HaveResponse(*_check_have(obj["n"], obj["bits"]))
    elif kind == _T_END:
        event = End(_check_missing(obj["missing"]))
    elif kind == _T_PEERS:
        event = PeersResponse(_check_peers(obj["p"]))
    elif kind == _T_STATUS:
        event = StatusResponse(
            *_check_status(obj["n"], obj["bits"], obj["soon"]),
            fellows=_check_fellows(obj["f"]) if fellows else None,
        )
    else:
        event = ErrorResponse(*_check_error(obj["code"], obj["msg"]))
    _require_canonical(header, _response_map(event))
    return kind, event


# --- Receive buffer -----------------------------------------------------------------------


BodyAllocator: TypeAlias = Callable[[int], Any]


class _ReceiveBuffer:
    """Bytes received and not yet parsed, read from an offset; plus an optional chunk body
    being filled in place (bytes for it skip the buffer)."""

    __slots__ = ("_body", "_body_filled", "_buf", "_pos", "eof")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._body: memoryview | None = None
        self._body_filled = 0
        self.eof = False

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self.eof:
            if len(data) == 0:
                return
            raise LocalProtocolError("receive_data() after end of stream")
        if len(data) == 0:
            self.eof = True
            return
        view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
        with view:
            body = self._body
            if body is not None and self._body_filled < len(body):
                take = min(len(body) - self._body_filled, len(view))
                body[self._body_filled : self._body_filled + take] = view[:take]
                self._body_filled += take
                view = view[take:]
            if len(view):
                self._buf += view

    def __len__(self) -> int:
        return len(self._buf) - self._pos

    def _consume(self, n: int) -> None:
        self._pos += n
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos >= _COMPACT_THRESHOLD and self._pos * 2 >= len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0

    def header_length(self) -> int | None:
        """The next frame's header length, or None if its prefix is not all here."""
        if len(self) < LENGTH_PREFIX_SIZE:
            return None
        return int.from_bytes(self._buf[self._pos : self._pos + LENGTH_PREFIX_SIZE], "big")

    def take_header(self, max_size: int) -> bytes | None:
        """The next frame's header bytes, checking the length prefix against ``max_size``
        as soon as it is here; None if the frame is not complete yet."""
        length = self.header_length()
        if length is None:
            return None
        if length == 0:
            raise _Invalid("header length 0")
        if length > max_size:
            raise _Invalid(
                f"header length {length} over the limit of {max_size}", ErrorCode.TOO_LARGE
            )
        end = self._pos + LENGTH_PREFIX_SIZE + length
        if end > len(self._buf):
            return None
        header = bytes(self._buf[self._pos + LENGTH_PREFIX_SIZE : end])
        self._consume(LENGTH_PREFIX_SIZE + length)
        return header

    def start_body(self, length: int, allocate: BodyAllocator | None) -> None:
        """Take a body of ``length`` bytes (from ``allocate(length)``, a writable buffer of
        at least that size, else a new bytearray) and move already-buffered bytes into it."""
        body = memoryview(bytearray(length) if allocate is None else allocate(length))
        body = body.cast("B")[:length]
        if body.readonly or len(body) != length:
            raise LocalProtocolError(f"body allocator gave no writable {length}-byte buffer")
        take = min(length, len(self))
        if take:
            with memoryview(self._buf) as view:
                body[:take] = view[self._pos : self._pos + take]
            self._consume(take)
        self._body = body
        self._body_filled = take

    def body_space(self) -> memoryview | None:
        """The unfilled part of the body in progress, to receive into directly."""
        body = self._body
        if body is None or self._body_filled == len(body):
            return None
        return body[self._body_filled :]

    def body_received(self, n: int) -> None:
        body = self._body
        if body is None or not 0 < n <= len(body) - self._body_filled:
            raise LocalProtocolError(f"body_received({n}) does not fit the body in progress")
        self._body_filled += n

    def body_missing(self) -> int | None:
        """Bytes the body in progress still needs, or None when no body is in progress."""
        if self._body is None:
            return None
        return len(self._body) - self._body_filled

    def take_body(self) -> memoryview:
        body = self._body
        assert body is not None
        assert self._body_filled == len(body)
        self._body = None
        self._body_filled = 0
        return body.toreadonly()

    def bytes_needed(self, max_header: int) -> int:
        """Bytes still needed to complete the frame in progress (0 if nothing is pending
        or the frame is already complete)."""
        missing = self.body_missing()
        if missing is not None:
            return missing
        length = self.header_length()
        if length is None:
            return LENGTH_PREFIX_SIZE - len(self) if len(self) else 0
        if length == 0 or length > max_header:
            return 0
        return max(0, LENGTH_PREFIX_SIZE + length - len(self))


# --- Connections --------------------------------------------------------------------------


class _RequestState:
    """What a `get` response may still carry: the requested indices, those already sent."""

    __slots__ = ("requested", "sent")

    def __init__(self, request: Request) -> None:
        self.requested: frozenset[int] = frozenset()
        if type(request) is GetRequest:
            self.requested = frozenset(
                i for start, end in request.ranges for i in range(start, end)
            )
        self.sent: set[int] = set()

    def unsent(self) -> tuple[int, ...]:
        return tuple(sorted(self.requested - self.sent))


class ServerConnection:
    """The server's side of one stream: read a request, answer it, read the next.

    Loop: feed bytes with ``receive_data`` until ``next_request`` returns a request (None
    with ``eof_received`` set means the client closed the stream cleanly), then answer it with
    ``send_response`` / ``send_chunk_header`` and write the bytes they return. The request is
    answered after a ManifestResponse, HaveResponse, End or ErrorResponse.

    ``version`` is the stream's: on 1.0.0 one request at a time; from 1.1.0 requests that
    arrive while one is being answered are parsed and queued (a violation beyond
    ``max_pipelined`` outstanding), and ``next_request`` hands them out in order; each later
    version adds the requests and answer fields :class:`Version` lists.
    """

    def __init__(self, version: Version = Version.V1_0) -> None:
        self._version = version
        self._max_pipelined = version.max_pipelined
        self._recv = _ReceiveBuffer()
        self._request: Request | None = None
        self._state: _RequestState | None = None
        self._queued: deque[Request] = deque()
        # 1.0.0: bytes were already here behind the request being answered, so the client
        # sent them before reading its response; the next next_request() fails.
        self._sent_early = False
        self._deferred: _Invalid | None = None
        self._failed: str | None = None

    @property
    def eof_received(self) -> bool:
        """The client closed its side of the stream (``receive_data(b"")``)."""
        return self._recv.eof

    @property
    def counts_fellows(self) -> bool:
        """A 1.4.0 or later stream: `status` answers carry the ``fellows`` count."""
        return self._version.fellows

    @property
    def current_request(self) -> Request | None:
        """The request being answered, or None between requests."""
        return self._request

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes read from the stream; ``b""`` means the client closed its side."""
        self._recv.feed(data)

    def bytes_needed(self) -> int:
        """Bytes the request frame in progress still needs (0 if none is in progress)."""
        return self._recv.bytes_needed(MAX_HEADER_SIZE)

    def next_request(self) -> Request | None:
        """The next request, or None when more bytes are needed, while a response is owed
        (or, with ``eof_received``, when the stream ended cleanly). Raises
        RemoteProtocolError on anything malformed or oversized, on a stream cut mid-frame,
        on bytes sent while a response is owed (1.0.0), and on more than ``max_pipelined``
        requests outstanding (1.1.0)."""
        if self._failed is not None:
            raise RemoteProtocolError(f"connection already failed: {self._failed}")
        try:
            if self._max_pipelined == 1:
                request = self._next_sequential()
            else:
                request = self._next_pipelined()
        except _Invalid as exc:
            self._failed = str(exc)
            raise _remote(exc) from None
        if request is not None:
            self._request = request
            self._state = _RequestState(request)
        return request

    def _next_sequential(self) -> Request | None:
        if self._sent_early or (self._request is not None and len(self._recv)):
            raise _Invalid("client sent a new request before reading the response")
        if self._request is not None:
            return None
        request = self._take_request()
        self._sent_early = request is not None and len(self._recv) > 0
        return request

    def _next_pipelined(self) -> Request | None:
        # A violation behind queued requests waits until they are handed out, so what the
        # peer sees does not depend on how its bytes were split into reads.
        if self._deferred is None:
            try:
                while (request := self._take_request()) is not None:
                    if len(self._queued) + (self._request is not None) >= self._max_pipelined:
                        raise _Invalid(
                            f"more than {self._max_pipelined} requests outstanding on one stream",
                            ErrorCode.TOO_LARGE,
                        )
                    self._queued.append(request)
            except _Invalid as exc:
                self._deferred = exc
        if self._request is not None:
            return None
        if self._queued:
            return self._queued.popleft()
        if self._deferred is not None:
            raise self._deferred
        return None

    def _take_request(self) -> Request | None:
        header = self._recv.take_header(MAX_HEADER_SIZE)
        if header is None:
            if self._recv.eof and len(self._recv):
                raise _Truncated("stream closed in the middle of a request")
            return None
        return _decode_request(header, self._version)

    def unsent_indices(self) -> tuple[int, ...]:
        """Indices of the current `get` not sent yet, ascending: the ``missing`` list of an
        End sent now."""
        if self._state is None or type(self._request) is not GetRequest:
            raise LocalProtocolError("no get request is being answered")
        return self._state.unsent()

    def send_response(self, resp: Response) -> bytes:
        """The frame of a manifest, have, end or error response to the current request.
        Each of these completes the request."""
        request = self._request
        if request is None or self._state is None:
            raise LocalProtocolError(f"no request to answer with {type(resp).__name__}")
        if type(resp) is ManifestResponse and type(request) is not ManifestRequest:
            raise LocalProtocolError("a manifest response answers only a manifest request")
        if type(resp) is HaveResponse and type(request) is not HaveRequest:
            raise LocalProtocolError("a have response answers only a have request")
        if type(resp) is PeersResponse and type(request) is not PeersRequest:
            raise LocalProtocolError("a peers response answers only a peers request")
        if type(resp) is StatusResponse and type(request) is not StatusRequest:
            raise LocalProtocolError("a status response answers only a status request")
        if type(resp) is StatusResponse and (resp.fellows is not None) != self._version.fellows:
            raise LocalProtocolError(
                "a status answer counts fellows on a 1.4.0 or 1.5.0 stream, and only there"
            )
        if type(resp) is End:
            if type(request) is not GetRequest:
                raise LocalProtocolError("end answers only a get request")
            if tuple(resp.missing) != self._state.unsent():
                raise LocalProtocolError(
                    "end.missing must list exactly the requested chunks not sent, ascending"
                )
        data = encode_response_header(resp)
        self._request = None
        self._state = None
        return data

    def send_chunk_header(self, index: int, length: int) -> bytes:
        """The header frame of one chunk of the current `get`; write the ``length`` body
        bytes right after it."""
        if type(self._request) is not GetRequest or self._state is None:
            raise LocalProtocolError("chunks answer only a get request")
        if not _is_int(index) or index not in self._state.requested:
            raise LocalProtocolError(f"chunk {index} was not requested")
        if index in self._state.sent:
            raise LocalProtocolError(f"chunk {index} already sent")
        data = encode_chunk_header(index, length)
        self._state.sent.add(index)
        return data


ExpectedLength: TypeAlias = Callable[[int], int]


class ClientConnection:
    """The client's side of one stream: send a request, read its whole response, repeat.

    ``next_event`` returns the response's events; the request is complete after a
    ManifestResponse, HaveResponse, End or ErrorResponse, and then ``send_request`` may be
    called again. Chunk bodies arrive whole, as read-only memoryviews.

    Zero-copy bodies: with ``set_body_allocator`` each chunk body lands in a buffer of the
    caller's choosing, and while a body is in progress ``body_space`` is a writable view of
    its unfilled part: receive into it and report the count with ``body_received`` instead
    of passing bytes through ``receive_data``.

    Pipelining (1.1.0 and later streams): with ``max_pipelined`` > 1 up to that
    many requests may be sent before their responses complete; the server answers in order,
    so every event belongs to ``outstanding_request`` (the oldest), and ``send_request`` may
    be called again whenever ``outstanding_count < max_pipelined``.
    """

    def __init__(self, version: Version = Version.V1_0, *, max_pipelined: int = 1) -> None:
        if not 1 <= max_pipelined <= version.max_pipelined:
            raise LocalProtocolError(
                f"max_pipelined must be 1..{version.max_pipelined} on a {version.protocol_id} "
                "stream"
            )
        self._version = version
        self._max_pipelined = max_pipelined
        self._recv = _ReceiveBuffer()
        self._request: Request | None = None
        self._state: _RequestState | None = None
        self._queued: deque[tuple[Request, _RequestState]] = deque()
        self._pending_index: int | None = None
        self._expected_length: ExpectedLength | None = None
        self._allocate: BodyAllocator | None = None
        self._failed: str | None = None

    @property
    def eof_received(self) -> bool:
        """The server closed its side of the stream (``receive_data(b"")``)."""
        return self._recv.eof

    @property
    def outstanding_request(self) -> Request | None:
        """The request whose response is being read (the oldest outstanding), or None."""
        return self._request

    @property
    def outstanding_count(self) -> int:
        """Requests sent whose responses are not complete (at most ``max_pipelined``)."""
        return (self._request is not None) + len(self._queued)

    def set_expected_chunk_length(self, fn: ExpectedLength | None) -> None:
        """Check each chunk header's length against ``fn(index)`` before buffering its body
        (a mismatch is a RemoteProtocolError). None turns the check off."""
        self._expected_length = fn

    def set_body_allocator(self, allocate: BodyAllocator | None) -> None:
        """Take each chunk body's buffer from ``allocate(length)`` (a writable buffer of at
        least ``length`` bytes; the body is its first ``length``). None: new bytearrays."""
        self._allocate = allocate

    def body_space(self) -> memoryview | None:
        """While a chunk body is arriving, the writable view its next bytes belong in;
        None otherwise (then read ``bytes_needed`` bytes and use ``receive_data``)."""
        return self._recv.body_space()

    def body_received(self, n: int) -> None:
        """``n`` (> 0) bytes were written at the start of ``body_space()``. The end of the
        stream is still reported with ``receive_data(b"")``."""
        self._recv.body_received(n)

    def send_request(self, req: Request) -> bytes:
        """The frame of ``req``. LocalProtocolError if a request is outstanding or ``req``
        is invalid (bad blob ID, ranges unsorted/overlapping/empty/over the limits)."""
        if self._failed is not None:
            raise LocalProtocolError(f"connection already failed: {self._failed}")
        if self.outstanding_count >= self._max_pipelined:
            raise LocalProtocolError(
                "a request is already outstanding on this stream"
                if self._max_pipelined == 1
                else f"{self._max_pipelined} requests already outstanding on this stream"
            )
        if self._recv.eof:
            raise LocalProtocolError("the server closed the stream")
        if type(req) is PeersRequest and not self._version.peer_exchange:
            raise LocalProtocolError("peers is a /blobnet/blob/1.2.0 request")
        if type(req) is StatusRequest and not self._version.status:
            raise LocalProtocolError("status is a /blobnet/blob/1.3.0 request")
        if type(req) is GetRequest and req.tentative and not self._version.tentative:
            raise LocalProtocolError("try_get is a /blobnet/blob/1.5.0 request")
        data = encode_request(req)
        if type(req) is GetRequest:
            # Normalise lists to tuples so the stored request matches what is on the wire.
            req = GetRequest(req.blob_id, _check_ranges(req.ranges), req.tentative)
        if self._request is None:
            self._request = req
            self._state = _RequestState(req)
        else:
            self._queued.append((req, _RequestState(req)))
        return data

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes read from the stream; ``b""`` means the server closed its side."""
        self._recv.feed(data)

    def bytes_needed(self) -> int:
        """Bytes the frame in progress still needs: a good size for the next read when a
        large chunk body or manifest is arriving. 0 if unknown."""
        limit = (
            MAX_HEADER_SIZE if self._request is None else max_response_header_size(self._request)
        )
        return self._recv.bytes_needed(limit)

    def next_event(self) -> Response | None:
        """The next response event, or None when more bytes are needed (or, with
        ``eof_received`` and no request outstanding, when the stream ended cleanly).
        Raises RemoteProtocolError if the server broke the protocol."""
        if self._failed is not None:
            raise RemoteProtocolError(f"connection already failed: {self._failed}")
        try:
            return self._next_event()
        except _Invalid as exc:
            self._failed = str(exc)
            raise _remote(exc) from None
        except LocalProtocolError as exc:  # a refused body buffer: the framing is lost
            self._failed = str(exc)
            raise

    def _next_event(self) -> Response | None:
        if self._pending_index is not None:
            return self._finish_chunk()
        request = self._request
        if request is None or self._state is None:
            if len(self._recv):
                raise _Invalid("server sent data while no request was outstanding")
            return None
        header = self._recv.take_header(max_response_header_size(request))
        if header is None:
            if self._recv.eof:
                raise _Truncated("stream closed before the response was complete")
            return None
        kind, decoded = _decode_response(
            header, _ALLOWED_RESPONSES[type(request)], self._version.fellows
        )
        state = self._state
        if kind == _T_CHUNK:
            index, length = decoded
            if index not in state.requested:
                raise _Invalid(f"server sent chunk {index}, which was not requested")
            if index in state.sent:
                raise _Invalid(f"server sent chunk {index} twice")
            if self._expected_length is not None:
                expected = self._expected_length(index)
                if length != expected:
                    raise _Invalid(f"chunk {index} is {length} bytes; expected {expected}")
            self._recv.start_body(length, self._allocate)  # may refuse the buffer
            state.sent.add(index)
            self._pending_index = index
            return self._finish_chunk()
        event: Response = decoded
        if type(event) is End and event.missing != state.unsent():
            raise _Invalid("end.missing is not exactly the requested chunks that were not sent")
        self._request, self._state = self._queued.popleft() if self._queued else (None, None)
        return event

    def _finish_chunk(self) -> Chunk | None:
        if self._recv.body_missing():
            if self._recv.eof:
                raise _Truncated("stream closed in the middle of a chunk body")
            return None
        index = self._pending_index
        assert index is not None
        self._pending_index = None
        return Chunk(index, self._recv.take_body())
