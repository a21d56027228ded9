"""The verification levels (training.outer.verification): ordered by strength, not by
spelling, and spelled on the wire, in specs and commitments exactly as their strings."""

from __future__ import annotations

import json

import msgpack
import pytest

from identity import MachineKey, SoftwareSigner
from training.outer.replay import UpdateCommitment, decode_commitment
from training.outer.spec import RunSpec, decode_spec, encode_spec
from training.outer.verification import Level


def test_a_level_is_at_least_itself_and_every_weaker_one_only() -> None:
    order = [Level.BOUNDED, Level.SCORED, Level.REPLAYED]
    for i, level in enumerate(order):
        for j, minimum in enumerate(order):
            assert level.at_least(minimum) == (i >= j), (level, minimum)
    # Alphabetical order ("replayed" < "scored") is not strength.
    assert Level.REPLAYED.at_least(Level.SCORED)


def test_a_member_is_spelled_as_its_string() -> None:
    for level in Level:
        assert msgpack.packb(level) == msgpack.packb(level.value)
        assert json.dumps(level) == json.dumps(level.value)
        assert f"{level}" == level.value
    assert Level.names() == "bounded, scored, replayed"


@pytest.mark.parametrize("level", ["bounded", "scored", "replayed"])
def test_a_decoded_spec_and_commitment_carry_members(level: str) -> None:
    """A spec and a commitment decoded from bytes hold members (so a decoded level
    compares by strength), and encode to the bytes they came from."""
    spec = RunSpec(
        run="r",
        initial="a" * 64,
        root="b" * 64,
        tensors=(("w", (2,)),),
        inner_steps=1,
        workers=1,
        authorities=("c" * 64,),
        level=level,  # type: ignore[arg-type]  # a string, as a caller may give it
    )
    assert spec.level is Level(level)
    blob = encode_spec(spec, SoftwareSigner(MachineKey.generate()))
    decoded_spec = decode_spec(blob).spec
    assert decoded_spec.level is Level(level)
    assert msgpack.unpackb(msgpack.unpackb(blob)["body"])["level"] == level
    c = UpdateCommitment(
        "r", 0, "a" * 64, "peer", 0, 1, 1, bytes(4), bytes(4), 4096, 80, "b" * 64, "c" * 64,
        "d" * 64, level,  # type: ignore[arg-type]
    )  # fmt: skip
    data = c.encode()
    decoded = decode_commitment(data)
    assert decoded.level is Level(level)
    assert decoded.encode() == data
