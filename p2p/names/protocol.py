"""``/blobnet/names/1.0.0``: ask a peer for name records, or hand it one (sans-IO core).

One request and one response per stream. Each message is a 4-byte big-endian length
followed by that many bytes of one canonical msgpack map (keys in the order shown)::

    get:     {"op": "get", "key": bin32}             -> {"op": "record", "record": bin | nil}
    put:     {"op": "put", "record": bin}            -> {"op": "put", "ok": bool, "reason": str}
    list:    {"op": "list", "publisher": "12D3..."}  -> {"op": "records", "records": [bin, ...]}
    any:                                             -> {"op": "error", "message": str}

``key`` is :func:`p2p.names.record.record_key`; ``record`` is a canonical name record.
Lengths are checked before a body is read (``MAX_REQUEST_SIZE``, ``MAX_RESPONSE_SIZE``);
a frame over its limit, a map with other keys, order or types, or an unknown ``op`` is a
remote protocol error. The records inside are only *shaped* here: the caller verifies
each one (signature, publisher, name, expiry) before believing it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from blobstore.canonical import encode as encode_canonical
from identity import decode_msgpack_map
from p2p.names.cache import MAX_RECORDS_PER_PUBLISHER
from p2p.names.record import MAX_NAME_RECORD_SIZE

PROTOCOL_ID = "/blobnet/names/1.0.0"
LENGTH_PREFIX_SIZE = 4
KEY_SIZE = 32
# A request carries at most one record (put) plus its small envelope.
MAX_REQUEST_SIZE = MAX_NAME_RECORD_SIZE + 64
# A listing: one publisher's names, each a record, plus its small envelope (1.3 MiB at
# worst, with a certificate in every record; about 80 KiB without).
MAX_LISTED_RECORDS = MAX_RECORDS_PER_PUBLISHER
MAX_RESPONSE_SIZE = MAX_LISTED_RECORDS * (MAX_NAME_RECORD_SIZE + 8) + 64
# Reasons and error messages are for logs: one line.
MAX_MESSAGE_LENGTH = 512
_MAX_PEER_ID_LENGTH = 64


class NamesProtocolError(Exception):
    """The peer broke ``/blobnet/names/1.0.0`` (a remote fault: drop its answer)."""


@dataclass(frozen=True)
class GetRequest:
    key: bytes


@dataclass(frozen=True)
class PutRequest:
    record: bytes


@dataclass(frozen=True)
class ListRequest:
    publisher: str


@dataclass(frozen=True)
class RecordResponse:
    record: bytes | None


@dataclass(frozen=True)
class PutResponse:
    ok: bool
    reason: str


@dataclass(frozen=True)
class RecordsResponse:
    records: tuple[bytes, ...]


@dataclass(frozen=True)
class ErrorResponse:
    message: str


Request = GetRequest | PutRequest | ListRequest
Response = RecordResponse | PutResponse | RecordsResponse | ErrorResponse


def _frame(fields: dict[str, Any]) -> bytes:
    body: bytes = encode_canonical(fields)
    return struct.pack(">I", len(body)) + body


def _fields(message: Request | Response) -> dict[str, Any]:
    if isinstance(message, GetRequest):
        return {"op": "get", "key": message.key}
    if isinstance(message, PutRequest):
        return {"op": "put", "record": message.record}
    if isinstance(message, ListRequest):
        return {"op": "list", "publisher": message.publisher}
    if isinstance(message, RecordResponse):
        return {"op": "record", "record": message.record}
    if isinstance(message, PutResponse):
        return {"op": "put", "ok": message.ok, "reason": message.reason[:MAX_MESSAGE_LENGTH]}
    if isinstance(message, RecordsResponse):
        return {"op": "records", "records": list(message.records)}
    return {"op": "error", "message": message.message[:MAX_MESSAGE_LENGTH]}


def encode(message: Request | Response) -> bytes:
    """The framed bytes of a message (length prefix included)."""
    return _frame(_fields(message))


def body_length(prefix: bytes, *, limit: int) -> int:
    """The body length announced by a 4-byte prefix, refused over ``limit``."""
    if len(prefix) != LENGTH_PREFIX_SIZE:
        raise NamesProtocolError("truncated length prefix")
    (length,) = struct.unpack(">I", prefix)
    if length > limit:
        raise NamesProtocolError(f"message of {length} bytes, over the limit of {limit}")
    return int(length)


def _parse(body: bytes, limit: int, what: str) -> dict[str, Any]:
    fields = decode_msgpack_map(body, max_size=limit, what=what, error=NamesProtocolError)
    return fields


def _exact(body: bytes, message: Request | Response, what: str) -> None:
    if _frame(_fields(message))[LENGTH_PREFIX_SIZE:] != bytes(body):
        raise NamesProtocolError(f"{what} is not canonically encoded")


def _bytes(value: object, what: str, *, size: int | None = None, limit: int) -> bytes:
    if type(value) is not bytes or (size is not None and len(value) != size):
        raise NamesProtocolError(f"{what} must be {size or 'some'} bytes")
    if len(value) > limit:
        raise NamesProtocolError(f"{what} is over {limit} bytes")
    return value


def decode_request(body: bytes) -> Request:
    """Parse a request body (after its length prefix)."""
    fields = _parse(body, MAX_REQUEST_SIZE, "names request")
    op = fields.get("op")
    message: Request
    if op == "get" and set(fields) == {"op", "key"}:
        message = GetRequest(_bytes(fields["key"], "key", size=KEY_SIZE, limit=KEY_SIZE))
    elif op == "put" and set(fields) == {"op", "record"}:
        message = PutRequest(_bytes(fields["record"], "record", limit=MAX_NAME_RECORD_SIZE))
    elif op == "list" and set(fields) == {"op", "publisher"}:
        publisher = fields["publisher"]
        if type(publisher) is not str or not 0 < len(publisher) <= _MAX_PEER_ID_LENGTH:
            raise NamesProtocolError("publisher must be a peer ID")
        message = ListRequest(publisher)
    else:
        raise NamesProtocolError(f"unknown names request {sorted(map(str, fields))!r:.120}")
    _exact(body, message, "names request")
    return message


def decode_response(body: bytes, request: Request) -> Response:
    """Parse the response body to ``request`` (an error response is always allowed)."""
    fields = _parse(body, MAX_RESPONSE_SIZE, "names response")
    op = fields.get("op")
    message: Response
    keys = set(fields)
    if op == "error" and keys == {"op", "message"}:
        text = fields["message"]
        if type(text) is not str or len(text) > MAX_MESSAGE_LENGTH:
            raise NamesProtocolError("error message must be a short string")
        message = ErrorResponse(text)
    elif isinstance(request, GetRequest) and op == "record" and keys == {"op", "record"}:
        raw = fields["record"]
        record = None if raw is None else _bytes(raw, "record", limit=MAX_NAME_RECORD_SIZE)
        message = RecordResponse(record)
    elif isinstance(request, PutRequest) and op == "put" and keys == {"op", "ok", "reason"}:
        ok, reason = fields["ok"], fields["reason"]
        if type(ok) is not bool or type(reason) is not str or len(reason) > MAX_MESSAGE_LENGTH:
            raise NamesProtocolError("put response must be a bool and a short reason")
        message = PutResponse(ok, reason)
    elif isinstance(request, ListRequest) and op == "records" and keys == {"op", "records"}:
        raw_list = fields["records"]
        if type(raw_list) is not list or len(raw_list) > MAX_LISTED_RECORDS:
            raise NamesProtocolError(f"records must be a list of at most {MAX_LISTED_RECORDS}")
        message = RecordsResponse(
            tuple(_bytes(r, "record", limit=MAX_NAME_RECORD_SIZE) for r in raw_list)
        )
    else:
        raise NamesProtocolError(f"unexpected names response {sorted(map(str, keys))!r:.120}")
    _exact(body, message, "names response")
    return message
