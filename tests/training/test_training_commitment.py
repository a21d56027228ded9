"""Commitment and round-record encodings: canonical, strict, every field in the digest."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import msgpack
import pytest

from training.errors import BadRoundRecord
from training.kernel_class import KERNEL_CLASS_SCHEMA, KernelClass
from training.rounds.commitment import Commitment, RoundRecord, pack
from training.rounds.recipe import Recipe, recipe_hash

KC = KernelClass.from_fields(
    {"schema": KERNEL_CLASS_SCHEMA, "device": "cpu", "cpu_capability": "AVX2", "threads": 1}
)
BASE = Commitment(
    base_id="b" * 64,
    records_id="c" * 64,
    recipe_hash=recipe_hash(Recipe(steps=3)),
    seed=5,
    kernel_class=KC,
    steps=3,
    start_root=bytes(32),
    end_root=bytes(range(32)),
    step_log=(1, 2, 3),
    adapter_id="d" * 64,
)


def test_round_trip() -> None:
    assert Commitment.decode(BASE.encode()) == BASE
    record = RoundRecord(BASE, Recipe(steps=3), b"attestation")
    assert RoundRecord.decode(record.encode()) == record


@pytest.mark.parametrize(
    "change",
    [
        {"base_id": "e" * 64},
        {"records_id": "e" * 64},
        {"recipe_hash": "e" * 64},
        {"seed": 6},
        {"kernel_class": KernelClass.from_fields({**KC.fields, "threads": 2})},
        {"start_root": b"\1" * 32},
        {"end_root": b"\1" * 32},
        {"step_log": (1, 2, 4)},
        {"adapter_id": "e" * 64},
    ],
)
def test_every_field_is_in_the_digest(change: dict[str, Any]) -> None:
    assert dataclasses.replace(BASE, **change).digest != BASE.digest


def test_decode_rejects_non_canonical_and_malformed() -> None:
    m = BASE.to_map()
    unsorted = msgpack.packb(dict(reversed(list(m.items()))), use_bin_type=True)
    with pytest.raises(BadRoundRecord, match="canonical"):
        Commitment.decode(unsorted)
    with pytest.raises(BadRoundRecord, match="step log"):
        Commitment.decode(pack({**m, "step_log": b"\0" * 8}))
    with pytest.raises(BadRoundRecord, match="keys"):
        Commitment.decode(pack({**m, "extra": 1}))
    with pytest.raises(BadRoundRecord, match="blob ID"):
        Commitment.decode(pack({**m, "adapter": "X" * 64}))
    with pytest.raises(BadRoundRecord, match="canonical"):
        Commitment.decode(pack({**m, "kernel_class_id": "cpu-0"}))
    with pytest.raises(BadRoundRecord, match="msgpack"):
        Commitment.decode(b"\xc1")
    # A replay runs with the record's thread count: a string there was a ValueError
    # traceback from `blob train replay`, not a bad record.
    hostile = KernelClass(fields={**KC.fields, "threads": "two"})  # its own ID matches
    hostile_map = {**m, "kernel_class": hostile.fields, "kernel_class_id": hostile.id}
    with pytest.raises(BadRoundRecord, match="threads"):
        Commitment.decode(pack(hostile_map))
    wrong_recipe = RoundRecord(BASE, Recipe(steps=4), b"")
    with pytest.raises(BadRoundRecord, match="recipe does not match"):
        RoundRecord.decode(wrong_recipe.encode())


def test_light_modules_do_not_import_torch() -> None:
    code = (
        "import sys, training, training.rounds.cli, training.rounds.round, "
        "training.rounds.commitment, "
        "training.rounds.recipe, training.records, training.rounds.inputs\n"
        "assert 'torch' not in sys.modules and 'peft' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
