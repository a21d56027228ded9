"""One schema per record: its wire keys in canonical order, each with its type and bounds,
written once and used to encode, decode and check it (over :mod:`blobstore.canonical`).

A record type (a certificate, a manifest, a TPM challenge) declares a :class:`Schema` of
:class:`Field` s beside its dataclass, one per version where versions differ::

    _SCHEMA = Schema(
        "TPM challenge",
        Field("v", int, const=FORMAT_VERSION),
        Field("nonce", bytes, size=NONCE_SIZE),
        Field("expires", int, lo=0),
        Field("evidence", bytes, attr="evidence_hash", size=HASH_SIZE),
    )

    def encode(self) -> bytes:
        return _SCHEMA.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Challenge:
        return cls(**_SCHEMA.decode(data, max_size=MAX_CHALLENGE_SIZE))  # then canonical

Rules:

1. Encoding writes the keys in the schema's order, each from the object's attribute (or
   the field's constant); :func:`blobstore.canonical.encode` gives the one spelling.
2. Decoding parses with :func:`blobstore.canonical.decode_map` (size-limited before msgpack
   runs), then refuses any other key set, a value of another exact type (``bool`` is not an
   ``int``), a length or integer out of bounds, or a constant that differs; it returns the
   attributes (constants left out), ready for the record's constructor.
3. The caller rebuilds the record and compares encodings (:func:`require_canonical`), which
   settles order and integer widths; rules the fields cannot say (a value's relation to
   another) stay in the record's constructor.
4. Every failure is :class:`~blobstore.canonical.CodecError` (a ``ValueError``), or the
   ``error`` the caller names: one exception policy for every record.

A message family whose type is a key (the protocol's ``t``, the outer messages' kinds) keeps
a table of schemas by that key, as ``p2p.blob.messages`` does with its key tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from blobstore.canonical import CodecError, decode_map, encode

_NO_CONST = object()


@dataclass(frozen=True)
class Field:
    """One key of a record on the wire.

    ``kind``: the exact Python type msgpack gives it (``int``, ``str``, ``bytes``, ``list``,
    ``bool``, ``dict``); ``nullable``: nil allowed too. ``attr``: the record's attribute
    (default: the key). ``size``: an exact length; ``max_len``: a largest one (``str``,
    ``bytes``, ``list``). ``lo``/``hi``: an ``int``'s inclusive bounds. ``const``: the value
    it must have (a version), written on encode and not returned on decode. ``out``/``into``:
    the record's value to the wire's and back (a tuple sent as a list, a nested record).
    """

    key: str
    kind: type[Any]
    attr: str | None = None
    size: int | None = None
    max_len: int | None = None
    lo: int | None = None
    hi: int | None = None
    nullable: bool = False
    const: Any = _NO_CONST
    out: Callable[[Any], Any] | None = None
    into: Callable[[Any], Any] | None = None
    optional: bool = False

    @property
    def name(self) -> str:
        return self.key if self.attr is None else self.attr

    def check(self, value: Any, what: str) -> None:
        """CodecError unless ``value`` has this field's type and bounds."""
        if value is None and self.nullable:
            return
        if type(value) is not self.kind:
            nil = " or nil" if self.nullable else ""
            raise CodecError(
                f"{what} field {self.key!r} must be {self.kind.__name__}{nil}, "
                f"not {type(value).__name__}"
            )
        if self.const is not _NO_CONST and value != self.const:
            raise CodecError(f"{what} field {self.key!r} must be {self.const!r}, not {value!r:.80}")
        if self.size is not None and len(value) != self.size:
            raise CodecError(
                f"{what} field {self.key!r} must be {self.size} long, not {len(value)}"
            )
        if self.max_len is not None and len(value) > self.max_len:
            raise CodecError(
                f"{what} field {self.key!r} is {len(value)} long, over the limit of {self.max_len}"
            )
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise CodecError(
                f"{what} field {self.key!r} must be in {self.lo}..{self.hi}, not {value}"
            )


class Schema:
    """A record's fields in canonical order; ``what`` names it in errors."""

    def __init__(self, what: str, *fields: Field) -> None:
        keys = [f.key for f in fields]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{what}: a key appears twice in {keys}")
        self.what = what
        self.fields = fields
        self.keys = tuple(keys)

    def then(self, *fields: Field, what: str | None = None) -> Schema:
        """This schema with ``fields`` after its own (a later version that adds keys)."""
        return Schema(what or self.what, *self.fields, *fields)

    def wire(self, record: object, **values: Any) -> dict[str, Any]:
        """The wire map of ``record``: every key in order, from ``values`` (by attribute
        name) where given, else the constant or the record's attribute."""
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.name in values:
                value = values[f.name]
            elif f.const is not _NO_CONST:
                value = f.const
            else:
                value = getattr(record, f.name)
            if f.optional and not value:
                continue
            out[f.key] = value if f.out is None or value is None else f.out(value)
        return out

    def encode(self, record: object, **values: Any) -> bytes:
        """Canonical bytes of :meth:`wire` (rule 1)."""
        return encode(self.wire(record, **values))

    def read(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Check a decoded map against the schema (rule 2); the record's attributes."""
        extra = set(fields) - set(self.keys)
        if extra:
            raise CodecError(
                f"{self.what} has unknown fields: {', '.join(sorted(map(str, extra)))}"
            )
        missing = [f.key for f in self.fields if f.key not in fields and not f.optional]
        if missing:
            raise CodecError(f"{self.what} lacks the fields: {', '.join(missing)}")
        values: dict[str, Any] = {}
        for f in self.fields:
            if f.key not in fields:
                continue  # optional: the record's default
            value = fields[f.key]
            f.check(value, self.what)
            if f.const is not _NO_CONST:
                continue
            values[f.name] = value if f.into is None or value is None else f.into(value)
        return values

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        *,
        max_size: int,
        error: Callable[[str], Exception] = CodecError,
    ) -> dict[str, Any]:
        """Parse ``data`` (at most ``max_size`` bytes) and :meth:`read` it; every failure is
        ``error(message)`` (rule 4)."""
        try:
            return self.read(decode_map(data, max_size=max_size, what=self.what))
        except CodecError as exc:
            raise error(str(exc)) from None


def select(
    fields: Mapping[str, Any], table: Mapping[Any, Schema], *, key: str, what: str
) -> Schema:
    """The schema ``fields[key]`` names in ``table`` (a version, a message type), checked
    exactly (``True`` is not ``1``); CodecError for one the table lacks."""
    tag = fields.get(key)
    for known, schema in table.items():
        if type(tag) is type(known) and tag == known:
            return schema
    known = ", ".join(map(repr, table))
    raise CodecError(f"{what} field {key!r} is {tag!r:.40}, not one this build reads ({known})")


__all__ = ["Field", "Schema", "select"]
