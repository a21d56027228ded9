"""The messages of the blob protocol: versions, limits, errors, the events each side sends,
and their canonical encoding and strict decoding (theory of operation: ``p2p.blob.protocol``,
rules 1 and 2). Pure functions of bytes and values; the connections that use them, one per
stream side, are in ``p2p.blob.protocol``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar, TypeAlias

from blobstore.canonical import decode_map
from blobstore.canonical import encode as encode_canonical

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


class Invalid(Exception):
    """Internal: a message failed validation; callers re-raise it as Local or Remote."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code


class Truncated(Invalid):
    """Internal: the stream ended mid-frame or mid-response."""


def to_remote_error(exc: Invalid) -> RemoteProtocolError:
    cls = TruncatedStreamError if isinstance(exc, Truncated) else RemoteProtocolError
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
T_CHUNK = "chunk"
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
    T_CHUNK: ("t", "i", "n"),
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
ALLOWED_RESPONSES: dict[type, frozenset[str]] = {
    ManifestRequest: frozenset({_T_MANIFEST, _T_ERROR}),
    HaveRequest: frozenset({_T_HAVE, _T_ERROR}),
    GetRequest: frozenset({T_CHUNK, _T_END, _T_ERROR}),
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


def is_int(value: object) -> bool:
    # bool is an int subclass; msgpack true/false must never pass as a number.
    return type(value) is int


def _blob_id_to_wire(blob_id: object) -> bytes:
    if type(blob_id) is not str or len(blob_id) != 2 * BLOB_ID_BYTES:
        raise Invalid(f"blob ID must be {2 * BLOB_ID_BYTES} lowercase hex characters")
    try:
        raw = bytes.fromhex(blob_id)
    except ValueError:
        raise Invalid("blob ID must be lowercase hex") from None
    if raw.hex() != blob_id:
        raise Invalid("blob ID must be lowercase hex")
    return raw


def _blob_id_from_wire(raw: object) -> str:
    if type(raw) is not bytes or len(raw) != BLOB_ID_BYTES:
        raise Invalid(f'"id" must be {BLOB_ID_BYTES} bytes')
    return raw.hex()


def check_ranges(ranges: object) -> tuple[tuple[int, int], ...]:
    """Validate chunk ranges and return them as a tuple of pairs."""
    if not isinstance(ranges, (list, tuple)):
        raise Invalid("ranges must be a list of [start, end] pairs")
    if not ranges:
        raise Invalid("a get request needs at least one range")
    if len(ranges) > MAX_RANGES_PER_REQUEST:
        raise Invalid(
            f"{len(ranges)} ranges in one request; the limit is {MAX_RANGES_PER_REQUEST}",
            ErrorCode.TOO_LARGE,
        )
    out: list[tuple[int, int]] = []
    total = 0
    previous_end = 0
    for pair in ranges:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise Invalid("each range must be a [start, end] pair")
        start, end = pair
        if not is_int(start) or not is_int(end):
            raise Invalid("range bounds must be integers")
        if not 0 <= start < end <= MAX_NUM_CHUNKS:
            raise Invalid(f"bad range [{start}, {end}): need 0 <= start < end <= MAX_NUM_CHUNKS")
        if start < previous_end:
            raise Invalid("ranges must be sorted and must not overlap")
        total += end - start
        if total > MAX_CHUNKS_PER_REQUEST:
            raise Invalid(
                f"more than {MAX_CHUNKS_PER_REQUEST} chunks in one request", ErrorCode.TOO_LARGE
            )
        previous_end = end
        out.append((start, end))
    return tuple(out)


def _check_chunk_length(length: object) -> int:
    if not is_int(length):
        raise Invalid("chunk length must be an integer")
    assert isinstance(length, int)
    if not 0 < length <= MAX_CHUNK_SIZE:
        raise Invalid(
            f"chunk length {length} outside 1..{MAX_CHUNK_SIZE}",
            ErrorCode.TOO_LARGE if length > 0 else ErrorCode.BAD_REQUEST,
        )
    return length


def _check_index(index: object) -> int:
    if not is_int(index):
        raise Invalid("chunk index must be an integer")
    assert isinstance(index, int)
    if not 0 <= index < MAX_NUM_CHUNKS:
        raise Invalid(f"chunk index {index} out of range")
    return index


def _check_have(num_chunks: object, bitmap: object) -> tuple[int, bytes]:
    if not is_int(num_chunks):
        raise Invalid("have count must be an integer")
    assert isinstance(num_chunks, int)
    if not 0 <= num_chunks <= MAX_NUM_CHUNKS:
        raise Invalid(f"have count {num_chunks} outside 0..{MAX_NUM_CHUNKS}")
    if type(bitmap) is not bytes:
        raise Invalid("have bitmap must be bytes")
    if len(bitmap) != (num_chunks + 7) // 8:
        raise Invalid(f"have bitmap of {len(bitmap)} bytes for {num_chunks} chunks")
    spare = -num_chunks % 8
    if spare and bitmap[-1] >> (8 - spare):
        raise Invalid("have bitmap sets bits past the last chunk")
    return num_chunks, bitmap


def _check_status(num_chunks: object, bitmap: object, soon: object) -> tuple[int, bytes, bytes]:
    num_chunks, bitmap = _check_have(num_chunks, bitmap)
    try:
        _, soon = _check_have(num_chunks, soon)
    except Invalid as exc:
        raise Invalid(f"status soon: {exc}") from None
    if int.from_bytes(bitmap, "little") & int.from_bytes(soon, "little"):
        raise Invalid("status names a chunk both held and soon")
    return num_chunks, bitmap, soon


def _check_fellows(fellows: object) -> int:
    if not is_int(fellows):
        raise Invalid("status fellows must be an integer")
    assert isinstance(fellows, int)
    if not 0 <= fellows <= MAX_FELLOWS_COUNTED:
        raise Invalid(f"status fellows {fellows} out of range 0..{MAX_FELLOWS_COUNTED}")
    return fellows


def _check_manifest(manifest: object) -> bytes:
    if type(manifest) is not bytes:
        raise Invalid("manifest must be bytes")
    if not 0 < len(manifest) <= MAX_MANIFEST_BYTES:
        raise Invalid(
            f"manifest of {len(manifest)} bytes; the limit is {MAX_MANIFEST_BYTES}",
            ErrorCode.TOO_LARGE,
        )
    return manifest


def _check_error(code: object, message: object) -> tuple[ErrorCode, str]:
    if type(code) is not str and not isinstance(code, ErrorCode):
        raise Invalid("error code must be a string")
    try:
        error_code = ErrorCode(code)
    except ValueError:
        raise Invalid(f"unknown error code {code!r}") from None
    if type(message) is not str:
        raise Invalid("error message must be a string")
    try:
        too_long = len(message) > MAX_ERROR_MESSAGE or len(message.encode()) > MAX_ERROR_MESSAGE
    except UnicodeEncodeError:
        raise Invalid("error message is not valid Unicode text") from None
    if too_long:
        raise Invalid(f"error message over {MAX_ERROR_MESSAGE} bytes")
    return error_code, message


def _check_text(value: object, limit: int, what: str) -> str:
    if type(value) is not str or not value or len(value.encode("utf-8")) > limit:
        raise Invalid(f"{what} must be a non-empty string of at most {limit} UTF-8 bytes")
    if not value.isprintable():
        raise Invalid(f"{what} holds unprintable characters")
    return value


def _check_peers(peers: object) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if not isinstance(peers, (list, tuple)) or len(peers) > MAX_PEERS_LISTED:
        raise Invalid(f"peers must be an array of at most {MAX_PEERS_LISTED} entries")
    out: list[tuple[str, tuple[str, ...]]] = []
    seen: set[str] = set()
    for entry in peers:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise Invalid("each peer must be a [peer_id, addrs] pair")
        peer_id = _check_text(entry[0], MAX_PEER_ID_LEN, "a peer ID")
        if peer_id in seen:
            raise Invalid("a peer is listed twice")
        seen.add(peer_id)
        addrs = entry[1]
        if not isinstance(addrs, (list, tuple)) or not 1 <= len(addrs) <= MAX_ADDRS_PER_PEER:
            raise Invalid(f"each peer has 1 to {MAX_ADDRS_PER_PEER} addresses")
        out.append((peer_id, tuple(_check_text(a, MAX_ADDR_LEN, "an address") for a in addrs)))
    return tuple(out)


def _check_missing(missing: object) -> tuple[int, ...]:
    if not isinstance(missing, (list, tuple)):
        raise Invalid('"missing" must be a list of chunk indices')
    if len(missing) > MAX_CHUNKS_PER_REQUEST:
        raise Invalid("more missing indices than a request can hold")
    previous = -1
    for index in missing:
        _check_index(index)
        if index <= previous:
            raise Invalid('"missing" must be strictly ascending')
        previous = index
    return tuple(missing)


# --- Encoding -----------------------------------------------------------------------------


def _frame(header: dict[str, Any]) -> bytes:
    body = encode_canonical(header)
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
        ranges = check_ranges(req.ranges)
        return {
            "t": _T_TRY_GET if req.tentative else _T_GET,
            "id": _blob_id_to_wire(req.blob_id),
            "r": [list(pair) for pair in ranges],
        }
    raise Invalid(f"not a request: {type(req).__name__}")


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
        raise Invalid("a chunk has a body: use encode_chunk_header / send_chunk_header")
    raise Invalid(f"not a response: {type(resp).__name__}")


def _chunk_map(index: int, length: int) -> dict[str, Any]:
    return {"t": T_CHUNK, "i": index, "n": length}


def encode_request(req: Request) -> bytes:
    """The frame of a request. Raises LocalProtocolError if the request is invalid."""
    try:
        return _frame(_request_map(req))
    except Invalid as exc:
        raise LocalProtocolError(str(exc), exc.code) from None


def encode_response_header(resp: Response) -> bytes:
    """The frame of a manifest, have, end or error response (not a chunk: it has a body)."""
    try:
        return _frame(_response_map(resp))
    except Invalid as exc:
        raise LocalProtocolError(str(exc), exc.code) from None


def encode_chunk_header(index: int, length: int) -> bytes:
    """The frame header of a chunk; the caller writes the ``length`` body bytes right after."""
    try:
        return _frame(_chunk_map(_check_index(index), _check_chunk_length(length)))
    except Invalid as exc:
        raise LocalProtocolError(str(exc), exc.code) from None


# --- Decoding -----------------------------------------------------------------------------


def _unpack_map(header: bytes, keys_by_type: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """Decode a header to a map with exactly the keys its ``t`` calls for. The framing
    bounded the header already (``max_response_header_size``), so its length is the limit
    here; the one msgpack boundary and its exception policy are blobstore.canonical's."""
    obj = decode_map(header, max_size=len(header), what="header", error=Invalid)
    kind = obj.get("t")
    if type(kind) is not str or kind not in keys_by_type:
        raise Invalid(f"unknown message type {kind!r}"[:200])
    expected = keys_by_type[kind]
    if len(obj) != len(expected) or set(obj) != set(expected):
        missing = sorted(set(expected) - set(obj))
        extra = sorted(repr(k) for k in set(obj) - set(expected))
        raise Invalid(f"{kind!r} message: missing keys {missing}, unexpected keys {extra}"[:300])
    return obj


def _require_canonical(header: bytes, canonical: dict[str, Any]) -> None:
    if encode_canonical(canonical) != header:
        raise Invalid("header is not canonical msgpack")


def decode_request(header: bytes, version: Version) -> Request:
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
        req = GetRequest(blob_id, check_ranges(obj["r"]), tentative=kind == _T_TRY_GET)
    _require_canonical(header, _request_map(req))
    return req


def decode_response(
    header: bytes, allowed: frozenset[str], fellows: bool = False
) -> tuple[str, Any]:
    """Decode a response header (``fellows``: on a 1.4.0 stream). Returns ("chunk",
    (index, length)) for a chunk header, else (type, event)."""
    obj = _unpack_map(header, _RESPONSE_KEYS_1_4 if fellows else _RESPONSE_KEYS)
    kind: str = obj["t"]
    if kind not in allowed:
        raise Invalid(f"a {kind!r} message does not answer the outstanding request")
    if kind == T_CHUNK:
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
