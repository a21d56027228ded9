"""The round commitment, its digest, and the round record.

Commitment layout (one canonical msgpack map, keys sorted, no floats)::

    {"v": 1,
     "base": blob ID (64 hex)           the base model collection
     "records": blob ID                 the tokenised records
     "recipe": 64 hex                   BLAKE3 of the canonical recipe encoding
     "seed": uint64
     "kernel_class": {str: str | int}   training.kernel_class fields
     "kernel_class_id": str             "<family>-<32 hex>" (what certificates name)
     "steps": int
     "start_root": bin32                adapter + optimizer state before step 0
     "end_root": bin32                  ... after the last step
     "step_log": bin(4 * steps)         each step's loss, float32 bits, little-endian
     "adapter": blob ID}                the published adapter collection

Invariants:

1. The digest is ``BLAKE3(COMMITMENT_DOMAIN + encode())``: one BLAKE3 over every input and
   every step, so two machines agree on the digest iff they agree on all of them.
2. State roots hash canonical tensor bytes, never files (training.rounds.trainer.hash_tensors);
   the adapter ID is of a collection whose two files are byte-stable (trainer.save_adapter).
3. ``decode`` accepts only canonical bytes (it re-encodes and compares) with exact key
   sets and bounded sizes, so one commitment has one encoding and one digest.

The round record, the blob a round publishes (its ID is the round ID), is the canonical
map ``{"v": 1, "commitment": bytes, "recipe": bytes, "attestation": bytes}``: the
commitment's encoding, the recipe's encoding (so a replayer needs nothing else) and the
runner's attestation (identity) over the digest.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import blake3

from blobstore.canonical import encode as encode_canonical
from identity import decode_msgpack_map
from training.errors import BadRoundRecord
from training.kernel_class import KernelClass
from training.rounds.recipe import MAX_STEPS, Recipe, recipe_hash

COMMITMENT_VERSION = 1
RECORD_VERSION = 1
COMMITMENT_DOMAIN = b"blobnet-round-commitment-v1:"
# The attestation statement kind a round's runner signs (reserved: identity.kinds).
ROUND_KIND = "round-result"
# The kind only ``replay_round`` signs, after it reached the round's digest bit for bit.
REPLAY_KIND = "blobnet/round-replay"
ROOT_SIZE = 32
# A commitment is ~1 KiB plus 4 bytes a step; the record adds a recipe (< 4 KiB) and an
# attestation (< 72 KiB with identity's limits).
MAX_COMMITMENT_SIZE = 8192 + 4 * MAX_STEPS
MAX_RECORD_SIZE = MAX_COMMITMENT_SIZE + (1 << 17)

_COMMITMENT_KEYS = frozenset(
    {
        "v",
        "base",
        "records",
        "recipe",
        "seed",
        "kernel_class",
        "kernel_class_id",
        "steps",
        "start_root",
        "end_root",
        "step_log",
        "adapter",
    }
)
_RECORD_KEYS = frozenset({"v", "commitment", "recipe", "attestation"})
_HEX = frozenset("0123456789abcdef")


def _canonical(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _canonical(obj[k]) for k in sorted(obj)}
    return obj


def pack(obj: dict[str, Any]) -> bytes:
    """Canonical msgpack: maps with sorted keys, bin type for bytes."""
    out: bytes = encode_canonical(_canonical(obj))
    return out


def unpack_map(data: bytes, max_size: int, what: str) -> dict[str, Any]:
    return decode_msgpack_map(data, max_size=max_size, what=what, error=BadRoundRecord)


def _blob_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
        raise BadRoundRecord(f"commitment {what} is not a blob ID (64 lowercase hex)")
    return value


def _uint(value: Any, what: str, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise BadRoundRecord(f"commitment {what} is not an integer in 0..{limit}")
    return value


@dataclass(frozen=True)
class Commitment:
    base_id: str
    records_id: str
    recipe_hash: str
    seed: int
    kernel_class: KernelClass
    steps: int
    start_root: bytes
    end_root: bytes
    step_log: tuple[int, ...]
    adapter_id: str

    def to_map(self) -> dict[str, Any]:
        return {
            "v": COMMITMENT_VERSION,
            "base": self.base_id,
            "records": self.records_id,
            "recipe": self.recipe_hash,
            "seed": self.seed,
            "kernel_class": dict(self.kernel_class.fields),
            "kernel_class_id": self.kernel_class.id,
            "steps": self.steps,
            "start_root": self.start_root,
            "end_root": self.end_root,
            "step_log": struct.pack(f"<{len(self.step_log)}I", *self.step_log),
            "adapter": self.adapter_id,
        }

    def encode(self) -> bytes:
        return pack(self.to_map())

    @property
    def digest(self) -> bytes:
        """BLAKE3-256 of the domain prefix and the canonical encoding."""
        return blake3.blake3(COMMITMENT_DOMAIN + self.encode()).digest()

    @property
    def kernel_class_id(self) -> str:
        return self.kernel_class.id

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest.hex(),
            "base": self.base_id,
            "records": self.records_id,
            "recipe": self.recipe_hash,
            "seed": self.seed,
            "kernel_class": self.kernel_class.fields,
            "kernel_class_id": self.kernel_class.id,
            "steps": self.steps,
            "start_root": self.start_root.hex(),
            "end_root": self.end_root.hex(),
            "step_log": [f"{b:08x}" for b in self.step_log],
            "adapter": self.adapter_id,
        }

    @classmethod
    def decode(cls, data: bytes) -> Commitment:
        obj = unpack_map(data, MAX_COMMITMENT_SIZE, "commitment")
        if set(obj) != _COMMITMENT_KEYS or obj["v"] != COMMITMENT_VERSION:
            raise BadRoundRecord("commitment has unknown keys or version")
        steps = _uint(obj["steps"], "steps", MAX_STEPS)
        log = obj["step_log"]
        roots = (obj["start_root"], obj["end_root"])
        if not all(isinstance(r, bytes) and len(r) == ROOT_SIZE for r in roots):
            raise BadRoundRecord("commitment state roots are not 32 bytes")
        if not isinstance(log, bytes) or len(log) != 4 * steps:
            raise BadRoundRecord("commitment step log does not hold one entry per step")
        recipe = obj["recipe"]
        if not isinstance(recipe, str) or len(recipe) != 64 or not set(recipe) <= _HEX:
            raise BadRoundRecord("commitment recipe hash is not 64 lowercase hex")
        kc = KernelClass.from_fields(obj["kernel_class"])
        commitment = cls(
            base_id=_blob_id(obj["base"], "base"),
            records_id=_blob_id(obj["records"], "records"),
            recipe_hash=recipe,
            seed=_uint(obj["seed"], "seed", 2**64 - 1),
            kernel_class=kc,
            steps=steps,
            start_root=roots[0],
            end_root=roots[1],
            step_log=struct.unpack(f"<{steps}I", log),
            adapter_id=_blob_id(obj["adapter"], "adapter"),
        )
        if obj["kernel_class_id"] != kc.id or commitment.encode() != data:
            raise BadRoundRecord("commitment encoding is not canonical")
        return commitment


@dataclass(frozen=True)
class RoundRecord:
    """What a round publishes: commitment, recipe and the runner's attestation bytes."""

    commitment: Commitment
    recipe: Recipe
    attestation: bytes

    def encode(self) -> bytes:
        return pack(
            {
                "v": RECORD_VERSION,
                "commitment": self.commitment.encode(),
                "recipe": self.recipe.encode(),
                "attestation": self.attestation,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> RoundRecord:
        """Strict decode; also checks that the recipe matches the commitment's hash."""
        obj = unpack_map(data, MAX_RECORD_SIZE, "round record")
        if set(obj) != _RECORD_KEYS or obj["v"] != RECORD_VERSION:
            raise BadRoundRecord("round record has unknown keys or version")
        if not all(isinstance(obj[k], bytes) for k in ("commitment", "recipe", "attestation")):
            raise BadRoundRecord("round record fields are not byte strings")
        commitment = Commitment.decode(obj["commitment"])
        recipe = Recipe.decode(obj["recipe"])
        if recipe_hash(recipe) != commitment.recipe_hash or recipe.steps != commitment.steps:
            raise BadRoundRecord("round record's recipe does not match its commitment")
        record = cls(commitment=commitment, recipe=recipe, attestation=obj["attestation"])
        if record.encode() != data:
            raise BadRoundRecord("round record encoding is not canonical")
        return record
