"""Canonical msgpack for signed objects: one encoding per value, strict decoding.

Signed objects (key files, certificates, attestations) are msgpack maps with string keys
in a fixed order. Canonical means: :func:`encode` is the only accepted spelling.
:func:`decode_map` parses with size limits, then the caller checks every field's exact
type, rebuilds the object and compares its encoding with the input bytes, which rejects
extra or missing keys, other key orders, wider integer or string headers, floats for ints
and every other alternative spelling in one check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack


class CodecError(ValueError):
    """Bytes are not a canonical encoding; callers translate it to their own error."""


def encode(fields: dict[str, Any]) -> bytes:
    """Canonical bytes of a map whose keys are already in their fixed order."""
    data: bytes = msgpack.packb(fields, use_bin_type=True)
    return data


def decode_map(
    data: bytes,
    *,
    max_size: int,
    what: str,
    error: Callable[[str], Exception] = CodecError,
) -> dict[str, Any]:
    """Parse ``data`` as one msgpack map (at most ``max_size`` bytes); anything else raises
    ``error(message)`` (formats outside this package pass their own error type)."""
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
    # boundary where they all become our error.
    except Exception as exc:
        raise error(f"{what} is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise error(f"{what} must be a msgpack map, not {type(obj).__name__}")
    return obj


def take(fields: dict[str, Any], key: str, kind: type[Any], *, what: str) -> Any:
    """``fields[key]`` if present with exactly type ``kind`` (``bool`` is not an ``int``)."""
    if key not in fields:
        raise CodecError(f"{what} lacks the field {key!r}")
    value = fields[key]
    if type(value) is not kind:
        raise CodecError(
            f"{what} field {key!r} must be {kind.__name__}, not {type(value).__name__}"
        )
    return value


def take_bytes(fields: dict[str, Any], key: str, size: int, *, what: str) -> bytes:
    """``fields[key]`` as exactly ``size`` bytes."""
    value: bytes = take(fields, key, bytes, what=what)
    if len(value) != size:
        raise CodecError(f"{what} field {key!r} must be {size} bytes, not {len(value)}")
    return value


def check_text(value: str, max_len: int, what: str) -> None:
    """Raise :class:`CodecError` unless ``value`` is 1..max_len printable characters."""
    if not 0 < len(value) <= max_len:
        raise CodecError(f"{what} must be 1 to {max_len} characters, not {len(value)}")
    if not value.isprintable():
        raise CodecError(f"{what} must not contain control characters: {value!r}")


def require_canonical(data: bytes, rebuilt: bytes, *, what: str) -> None:
    """Reject ``data`` unless it is byte-for-byte the canonical encoding ``rebuilt``."""
    if bytes(data) != rebuilt:
        raise CodecError(
            f"{what} is not canonically encoded (extra fields, other order or wider types)"
        )


def check_keys(fields: dict[str, Any], expected: tuple[str, ...], *, what: str) -> None:
    """Reject a map whose keys are not exactly ``expected`` (order is checked later)."""
    extra = set(fields) - set(expected)
    if extra:
        raise CodecError(f"{what} has unknown fields: {', '.join(sorted(map(str, extra)))}")
    missing = [k for k in expected if k not in fields]
    if missing:
        raise CodecError(f"{what} lacks the fields: {', '.join(missing)}")


# Statement kinds and kernel classes are identifiers that appear in file names, logs and
# policy tables: a conservative alphabet keeps them unambiguous there.
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:+/-")


def check_name(value: str, max_len: int, what: str) -> None:
    """Raise :class:`CodecError` unless ``value`` is 1..max_len identifier characters."""
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise CodecError(f"{what} must be a string of 1 to {max_len} characters: {value!r:.80}")
    if not set(value) <= _NAME_CHARS or not value[0].isalnum():
        raise CodecError(
            f"{what} must start with a letter or digit and use only letters, digits and "
            f"._:+/- : {value!r}"
        )


def check_uint(value: int, what: str, *, bits: int = 63) -> None:
    """Raise :class:`CodecError` unless ``value`` is an int in [0, 2**bits)."""
    if type(value) is not int or not 0 <= value < (1 << bits):
        raise CodecError(f"{what} must be an integer from 0 to 2**{bits}-1: {value!r:.80}")
