"""Canonical msgpack: one encoding per value, strict decoding. Every signed or
content-addressed object of the project (manifests, protocol headers, tickets, key files,
certificates, attestations, names, closures, milestones) is a msgpack map with string keys
in a fixed order, written and checked through this module.

Canonical means: :func:`encode` is the only accepted spelling. :func:`decode_map` parses
with size limits; the caller checks every field's exact type, rebuilds the object and
hands both encodings to :func:`require_canonical`, which rejects extra or missing keys,
other key orders, wider integer or string headers, floats for ints and every other
alternative spelling in one comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack


class CodecError(ValueError):
    """Bytes are not a canonical encoding; callers translate it to their own error."""


def encode(fields: Any) -> bytes:
    """Canonical bytes of a value whose maps' keys are already in their fixed order."""
    data: bytes = msgpack.packb(fields, use_bin_type=True)
    return data


def decode_map(
    data: bytes | bytearray | memoryview,
    *,
    max_size: int,
    what: str,
    error: Callable[[str], Exception] = CodecError,
) -> dict[str, Any]:
    """Parse ``data`` as one msgpack map (at most ``max_size`` bytes); anything else raises
    ``error(message)``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise error(f"{what} must be bytes, not {type(data).__name__}")
    if len(data) > max_size:
        raise error(f"{what} is {len(data)} bytes, more than the limit of {max_size}")
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=max_size,
            max_bin_len=max_size,
            max_array_len=max_size,
            max_map_len=max_size,
            max_ext_len=0,
        )
    # msgpack raises a zoo of types for hostile input (ExtraData, FormatError, StackError,
    # ValueError, UnicodeDecodeError, TypeError for unhashable keys...): this is the one
    # boundary where they all become the caller's error. The message names the type only:
    # the library's text may quote the bytes, and these lines can reach a peer or a log.
    except Exception as exc:
        raise error(f"{what} is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise error(f"{what} must be a msgpack map, not {type(obj).__name__}")
    return obj


def require_canonical(
    data: bytes | bytearray | memoryview,
    rebuilt: bytes,
    *,
    what: str,
    error: Callable[[str], Exception] = CodecError,
) -> None:
    """Reject ``data`` unless it is byte-for-byte the canonical encoding ``rebuilt``."""
    if bytes(data) != rebuilt:
        raise error(f"{what} is not canonically encoded (extra fields, other order or wider types)")
