"""Recipe canonical encoding, strict decoding and hash."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from training.errors import BadRecipe
from training.rounds.recipe import Recipe, recipe_hash


def test_round_trip_and_target_order_is_canonical() -> None:
    a = Recipe(target_modules=("v_proj", "q_proj"))
    b = Recipe(target_modules=("q_proj", "v_proj", "q_proj"))
    assert a == b
    assert a.encode() == b.encode()
    assert Recipe.decode(a.encode()) == a
    assert len(recipe_hash(a)) == 64


@pytest.mark.parametrize(
    "change",
    [{"lr": 2e-3}, {"rank": 4}, {"steps": 31}, {"beta2": 0.99}, {"dropout": 0.1}],
)
def test_every_field_changes_the_hash(change: dict[str, Any]) -> None:
    assert recipe_hash(dataclasses.replace(Recipe(), **change)) != recipe_hash(Recipe())


def test_decode_rejects_non_canonical_and_malformed() -> None:
    d = Recipe().to_dict()
    unsorted = msgpack.packb(dict(reversed(list(d.items()))), use_bin_type=True)
    with pytest.raises(BadRecipe, match="canonical"):
        Recipe.decode(unsorted)
    with pytest.raises(BadRecipe, match="keys"):
        Recipe.decode(msgpack.packb({**d, "extra": 1}))
    with pytest.raises(BadRecipe, match="float"):
        Recipe.decode(msgpack.packb({**d, "lr": 1}))
    with pytest.raises(BadRecipe, match="foreach"):
        Recipe.decode(msgpack.packb(dict(sorted({**d, "foreach": True}.items()))))
    with pytest.raises(BadRecipe, match="msgpack"):
        Recipe.decode(b"\xc1")
    with pytest.raises(BadRecipe, match="lr"):
        Recipe(lr=float("nan"))
