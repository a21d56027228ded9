"""One schema per record (blobstore.schema): the keys, types and bounds, written once."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import pytest

from blobstore.canonical import CodecError
from blobstore.schema import Field, Schema, select


@dataclass(frozen=True)
class Point:
    name: str
    tags: tuple[str, ...]
    digest: bytes
    count: int
    note: bytes | None


V1 = Schema(
    "point",
    Field("v", int, const=1),
    Field("n", str, attr="name", max_len=8),
    Field("tags", list, out=list, into=tuple),
    Field("d", bytes, attr="digest", size=4),
    Field("count", int, lo=0, hi=10),
    Field("note", bytes, nullable=True),
)
V2 = Schema("point", Field("v", int, const=2), *V1.fields[1:])
POINT = Point("p", ("a",), b"1234", 3, None)


def test_a_record_goes_out_in_schema_order_and_comes_back_as_its_attributes() -> None:
    data = V1.encode(POINT)
    assert data == msgpack.packb(
        {"v": 1, "n": "p", "tags": ["a"], "d": b"1234", "count": 3, "note": None},
        use_bin_type=True,
    )
    assert Point(**V1.decode(data, max_size=100)) == POINT
    assert V2.wire(POINT)["v"] == 2
    assert V2.wire(POINT)["tags"] == ["a"]  # the wire's list, the record's tuple


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"count": True}, "'count' must be int, not bool"),
        ({"count": 11}, r"must be in 0\.\.10"),
        ({"d": b"123"}, "must be 4 long"),
        ({"n": "x" * 9}, "over the limit of 8"),
        ({"note": 5}, "must be bytes or nil"),
        ({"v": 2}, "'v' must be 1"),
        ({"extra": 1}, "unknown fields: extra"),
    ],
)
def test_a_field_of_another_type_bound_or_key_is_refused(
    change: dict[str, object], message: str
) -> None:
    fields = {**V1.wire(POINT), **change}
    with pytest.raises(CodecError, match=message):
        V1.read(fields)


def test_a_missing_key_and_bad_bytes_are_the_callers_error() -> None:
    fields = V1.wire(POINT)
    del fields["tags"]
    with pytest.raises(CodecError, match="lacks the fields: tags"):
        V1.read(fields)
    with pytest.raises(KeyError, match="not valid msgpack"):
        V1.decode(b"\xc1", max_size=100, error=KeyError)
    with pytest.raises(KeyError, match="more than the limit"):
        V1.decode(V1.encode(POINT), max_size=10, error=KeyError)


def test_select_picks_the_schema_its_tag_names_exactly() -> None:
    table = {1: V1, 2: V2}
    assert select({"v": 2}, table, key="v", what="point") is V2
    with pytest.raises(CodecError, match="'v' is True, not one this build reads"):
        select({"v": True}, table, key="v", what="point")
    with pytest.raises(CodecError, match="'v' is 3"):
        select({"v": 3}, table, key="v", what="point")


def test_an_optional_key_is_written_only_when_set_and_read_as_the_default() -> None:
    """A field a record does not use is left out, so records from before it keep their
    bytes; a decoder leaves a missing one to the record's default."""

    @dataclass(frozen=True)
    class Run:
        name: str
        step: str = ""

    schema = Schema("run", Field("name", str), Field("step", str, optional=True))
    plain = schema.encode(Run("r"))
    assert plain == msgpack.packb({"name": "r"}, use_bin_type=True)
    assert Run(**schema.decode(plain, max_size=100)) == Run("r")
    named = schema.encode(Run("r", "s"))
    assert named == msgpack.packb({"name": "r", "step": "s"}, use_bin_type=True)
    assert Run(**schema.decode(named, max_size=100)) == Run("r", "s")
    with pytest.raises(CodecError, match="lacks the fields: name"):
        schema.decode(msgpack.packb({"step": "s"}), max_size=100)
