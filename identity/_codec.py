"""The field checks of the identity formats (key files, certificates, attestations), over
the project's canonical msgpack (:mod:`blobstore.canonical`): a decoder parses with
:func:`~blobstore.canonical.decode_map`, checks every field's exact type with :func:`take`
and its kin, rebuilds the object and hands both encodings to
:func:`~blobstore.canonical.require_canonical`.
"""

from __future__ import annotations

from typing import Any

from blobstore.canonical import CodecError


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
