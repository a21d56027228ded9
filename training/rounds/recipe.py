"""The training recipe of a round and its canonical encoding.

A recipe is every hyper-parameter that decides a round's bits apart from the inputs (base
model, records, seed) and the kernel class. Its encoding is canonical msgpack: a map whose
keys are sorted, floats always as float64, ints as ints, target modules as a sorted list
without duplicates. ``decode`` accepts only bytes that ``encode`` could have produced (it
re-encodes and compares), so one recipe has exactly one encoding and one ``recipe_hash``:
the BLAKE3-256 of the encoding, 64 lowercase hex. peft's ``adapter_config.json`` is never
hashed (it lists target modules in set order).

The optimizer is AdamW with ``foreach=False`` and ``fused=False`` (the single-tensor
implementation: 8 transparent aten ops per parameter, the most auditable; fused AdamW gives
other bits, research/train.md section 2). The choice is part of the kernel class too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import blake3

from blobstore.canonical import encode as encode_canonical
from identity import decode_msgpack_map
from training.errors import BadRecipe
from training.records import MAX_SEQ_LEN

RECIPE_VERSION = 1
OPTIMIZER = "adamw"
# A recipe is ~300 bytes; this bounds what decode will parse.
MAX_RECIPE_SIZE = 4096
# Bounds chosen so a recipe can never ask for an absurd allocation or run time.
MAX_STEPS = 1_000_000
MAX_BATCH = 4096
MAX_RANK = 1024
MAX_TARGETS = 64
MAX_NAME_LEN = 64

DEFAULT_TARGETS = ("k_proj", "o_proj", "q_proj", "v_proj")


@dataclass(frozen=True)
class Recipe:
    lr: float = 1e-3
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=DEFAULT_TARGETS)
    batch_size: int = 8
    steps: int = 30
    seq_len: int = 64
    optimizer: str = OPTIMIZER
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    foreach: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(sorted(set(self.target_modules))))
        self.validate()

    def validate(self) -> None:
        floats = {
            "lr": self.lr,
            "dropout": self.dropout,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
        for name, value in floats.items():
            if not isinstance(value, float) or not math.isfinite(value):
                raise BadRecipe(f"recipe {name} must be a finite float, got {value!r}")
        ints = {
            "rank": self.rank,
            "alpha": self.alpha,
            "batch_size": self.batch_size,
            "steps": self.steps,
        }
        for name, value in {**ints, "seq_len": self.seq_len}.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise BadRecipe(f"recipe {name} must be an int, got {value!r}")
        if not 0.0 < self.lr < 1.0:
            raise BadRecipe(f"recipe lr {self.lr} is outside (0, 1)")
        if not 0.0 <= self.dropout < 1.0:
            raise BadRecipe(f"recipe dropout {self.dropout} is outside [0, 1)")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0 and self.eps > 0.0):
            raise BadRecipe("recipe betas must lie in [0, 1) and eps must be positive")
        if self.weight_decay < 0.0 or not 1 <= self.alpha <= 1 << 16:
            raise BadRecipe("recipe weight_decay must be >= 0 and alpha in 1..65536")
        if not 1 <= self.rank <= MAX_RANK:
            raise BadRecipe(f"recipe rank {self.rank} is outside 1..{MAX_RANK}")
        if not 1 <= self.batch_size <= MAX_BATCH:
            raise BadRecipe(f"recipe batch_size {self.batch_size} is outside 1..{MAX_BATCH}")
        if not 1 <= self.steps <= MAX_STEPS:
            raise BadRecipe(f"recipe steps {self.steps} is outside 1..{MAX_STEPS}")
        if not 2 <= self.seq_len <= MAX_SEQ_LEN:
            raise BadRecipe(f"recipe seq_len {self.seq_len} is outside 2..{MAX_SEQ_LEN}")
        if self.optimizer != OPTIMIZER or self.foreach is not False:
            raise BadRecipe("only AdamW with foreach=False (single-tensor) is audited")
        if not 1 <= len(self.target_modules) <= MAX_TARGETS or not all(
            isinstance(m, str) and 0 < len(m) <= MAX_NAME_LEN and m.isidentifier()
            for m in self.target_modules
        ):
            raise BadRecipe("recipe target_modules must be 1..64 module names (identifiers)")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["target_modules"] = list(self.target_modules)
        out["v"] = RECIPE_VERSION
        return out

    def encode(self) -> bytes:
        """Canonical msgpack (sorted keys, float64 floats)."""
        d = self.to_dict()
        out: bytes = encode_canonical({k: d[k] for k in sorted(d)})
        return out

    @property
    def hash(self) -> str:
        return recipe_hash(self)

    @classmethod
    def decode(cls, data: bytes) -> Recipe:
        """Strict decode: exact key set, exact types, and the bytes must be canonical."""
        obj = decode_msgpack_map(data, max_size=MAX_RECIPE_SIZE, what="recipe", error=BadRecipe)
        names = {f.name for f in fields(cls)}
        if set(obj) != names | {"v"}:
            raise BadRecipe(f"recipe keys {sorted(obj)} are not {sorted(names | {'v'})}")
        if obj.pop("v") != RECIPE_VERSION:
            raise BadRecipe(f"recipe version is not {RECIPE_VERSION}")
        targets = obj["target_modules"]
        if not isinstance(targets, list):
            raise BadRecipe("recipe target_modules is not a list")
        obj["target_modules"] = tuple(targets)
        if not isinstance(obj["foreach"], bool) or not isinstance(obj["optimizer"], str):
            raise BadRecipe("recipe optimizer settings have the wrong types")
        try:
            recipe = cls(**obj)
        except TypeError as exc:
            raise BadRecipe(f"recipe is malformed: {exc}") from None
        if recipe.encode() != data:
            raise BadRecipe("recipe encoding is not canonical (sorted keys, sorted targets)")
        return recipe


def recipe_hash(recipe: Recipe) -> str:
    """BLAKE3-256 of the canonical encoding, 64 lowercase hex."""
    return blake3.blake3(recipe.encode()).hexdigest()
