"""The run spec: everything that defines an outer-loop run, as one signed blob.

Theory of operation
-------------------
1. **What it names.** A spec fixes what every worker of a run must agree on before
   round 0: the run ID, the initial state (its state blob and root, ``state_blob``), the
   parameter names and shapes, the codec (chunk, k), the outer optimiser (learning rate,
   momentum, error-feedback decay), the inner steps H, the batch rows per step, K (the
   updates a round waits for), the planned rounds (0: open-ended, each worker says when it
   leaves), the round deadline and proposer timeout, the replay rate, the authorities whose
   admission certificates count, the least verification level an update may offer, and
   whether the run requires hardware-signed attestations (``require_hardware``: every
   update, closure, verdict and milestone co-signed by a TPM attestation key its signer's
   admission records, ``identity.attestation`` rule 3).
   Where the run was made from a Hugging Face directory, the spec names that directory's
   collection blob (``base``: config, tokenizer and the initial weights) so a worker can
   build the model and ``blob outer export`` can write one back; where the run's data is
   shared, it names the records blob (``data``), which replay needs. A run whose model
   and inner step are the user's own code names that step (``step``: the name of the
   user's ``training.outer.api.InnerStep``): replay by other workers runs their step of
   that name, so every worker must run the same function under it. Empty (and then not
   written, so such specs keep their bytes): the built-in causal-LM step.
   The rest of the model's state (``training.outer.module_state``): ``buffers`` (floating
   buffers, agreed each round, their initial values in the state blob), ``fixed`` (integer
   buffers and frozen tensors: name, safetensors dtype and shape) with ``fixed_blob`` (a
   safetensors file of their values), and ``aliases`` (tied names, alias -> name stored).
   Each is written only when the model has one, so specs without keep their bytes.
   ``overlap`` (written only when not 0): how many rounds a worker trains ahead of the state
   its next update is taken against (``training.outer.api`` point 9; 0 blocks).
   ``quorum``: the distinct operators a round's closure must name
   (``training.outer.agreement`` rule 7); written only when it is not the default, a
   majority of K (floor(K/2)+1), so specs made before keep their bytes and one spec has one
   spelling. Below a majority two groups of workers that cannot hear each other may both
   close rounds (a fork): a documented choice of its maker.
2. **Encoding.** The body is a canonical msgpack map (these keys, sorted; a decoder
   re-encodes and refuses anything that differs). A spec that requires hardware is body
   version 2, which adds ``require_hardware: true``; every other spec is version 1 without
   that key, so one spec has one spelling and a spec made without the key keeps its ID.
   The blob is a msgpack map ``{"v", "body", "key", "sig"}``: ``sig`` is the maker's
   Ed25519 signature over ``SPEC_DOMAIN || body`` and ``key`` its public key. The spec's ID
   is the blob's ID, so a worker given the ID knows it holds exactly the spec its peers
   hold; the signature says who made it (an operator trusts a spec by its maker, or by
   its ID from a trusted place).
3. **Verification levels**, weakest first (``training.outer.verification.Level``):
   ``bounded`` (norm and direction bounds only: what every update gets,
   ``training.outer.aggregate``), ``scored`` (as well, the loss change each included update
   makes on rows drawn from the round's root), and ``replayed`` (as well, a sample of
   updates recomputed from the rows they commit to on a deterministic kernel class,
   ``training.outer.replay``). A worker that offers less than the spec's minimum is refused
   before it trains (:func:`check_level`).
4. **Refusing a model.** A model whose state differs from the spec's (names, roles,
   shapes, fixed dtypes, tied names) is refused before step 0, with one line naming the
   first difference (:func:`check_model`).

Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import blake3

from blobstore.canonical import CodecError, decode_map, require_canonical
from blobstore.canonical import encode as encode_canonical
from blobstore.exitcodes import ExitCode
from blobstore.schema import Field, Schema, select
from training.errors import TrainingError
from training.outer.agreement import majority, quorum_of
from training.outer.loop import MODE_DEFAULTS
from training.outer.module_state import Layout, check_layout
from training.outer.verification import Level

SPEC_VERSION = 1  # the envelope's version, and the body's without require_hardware
HARDWARE_SPEC_VERSION = 2  # a body with require_hardware: true (point 2)
SPEC_DOMAIN = b"blobnet/outer-spec/v1\x00"
# A spec lists every parameter tensor; a model of more tensors than the state blob holds
# (training.outer.codec.MAX_TENSORS) could not be a run anyway. This bounds the blob before
# it is parsed: 4096 tensors with 200-byte names and 8 dims is under 2 MiB.
MAX_SPEC_SIZE = 4 << 20
# A step name is a label ("tinylm-next-token/v1"), not code: 128 characters are plenty.
MAX_STEP_NAME = 128
# Body keys of either version written only when set.
_OPTIONAL = frozenset({"step", "buffers", "fixed", "fixed_blob", "aliases", "overlap", "quorum"})
# Rounds a worker may train ahead of the state its next update is taken against
# (training.outer.api point 9): one, the one-step-delayed outer step.
MAX_OVERLAP = 1


class BadSpec(TrainingError):
    """Bytes that are not a valid signed run spec (whoever handed us the ID's fault)."""

    exit_code = ExitCode.BAD_DATA


class LevelRefused(TrainingError):
    """A worker offers less verification than the run's spec requires."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class RunSpec:
    """One run's definition (point 1). ``tensors``: (name, shape) in name order."""

    run: str
    initial: str
    root: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    inner_steps: int
    workers: int
    authorities: tuple[str, ...]
    level: Level = Level.BOUNDED
    rounds: int = 0
    chunk: int = 4096
    k: int = 80
    outer_lr: float = 3.0
    outer_momentum: float = 0.0
    ef_decay: float = MODE_DEFAULTS["sparseloco"]["ef_decay"]
    batch: int = 8
    inner_lr: float = 2e-3
    deadline: float = 8.0
    proposer_timeout: float = 3.0
    replay_rate: float = 0.25
    seed: int = 0
    base: str = ""
    data: str = ""
    require_hardware: bool = False
    step: str = ""
    buffers: tuple[tuple[str, tuple[int, ...]], ...] = ()
    fixed: tuple[tuple[str, str, tuple[int, ...]], ...] = ()  # name, dtype, shape
    fixed_blob: str = ""
    aliases: tuple[tuple[str, str], ...] = ()  # alias, name stored
    overlap: int = 0
    # The quorum (point 1); 0, and a majority of K written as 0: the default.
    quorum: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        try:  # a level given as its string (the decoded body's) becomes the member
            object.__setattr__(self, "level", Level(self.level))
        except ValueError:
            raise ValueError(f"verification level must be one of {Level.names()}") from None
        if self.inner_steps < 1 or self.workers < 1 or self.rounds < 0 or self.batch < 1:
            raise ValueError("inner steps, workers and batch must be >= 1, rounds >= 0")
        if not self.tensors:
            raise ValueError("a run spec names at least one parameter")
        if not self.authorities:
            raise ValueError("a run spec names at least one authority")
        if type(self.require_hardware) is not bool:
            raise ValueError("require_hardware must be true or false")
        if type(self.step) is not str or len(self.step) > MAX_STEP_NAME:
            raise ValueError(f"a step name is a string of at most {MAX_STEP_NAME} characters")
        if type(self.overlap) is not int or not 0 <= self.overlap <= MAX_OVERLAP:
            raise ValueError(f"overlap must be 0..{MAX_OVERLAP} rounds")
        if bool(self.fixed) != bool(self.fixed_blob):
            raise ValueError("fixed tensors and their blob come together")
        names = [n for n, _ in self.tensors] + [n for n, _ in self.buffers]
        names += [n for n, _, _ in self.fixed]
        if len(set(names)) != len(names):
            raise ValueError("a name has two roles in the spec's state")
        for alias, target in self.aliases:
            if alias in names or target not in names:
                raise ValueError(f"alias {alias!r} must name a tensor of the state")
        if type(self.quorum) is not int or not 0 <= self.quorum <= self.workers:
            raise ValueError(f"the quorum must be 1..{self.workers} (K), or 0 for a majority")
        if self.quorum == majority(self.workers):
            object.__setattr__(self, "quorum", 0)  # the default has one spelling

    @property
    def needed(self) -> int:
        """The distinct operators a closure of this run must name (point 1)."""
        return quorum_of(self.workers, self.quorum)

    def layout(self) -> Layout:
        """The model state this run holds (``training.outer.module_state`` point 1)."""
        return Layout(
            dict(self.tensors),
            dict(self.buffers),
            {n: (d, shape) for n, d, shape in self.fixed},
            dict(self.aliases),
        )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.tensors)

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors)

    def body(self) -> dict[str, Any]:
        """The body's wire map (point 2)."""
        return _body_schema(self.require_hardware).wire(self)


def _pack(obj: Any) -> bytes:
    data: bytes = encode_canonical(obj)
    return data


def encode_spec(spec: RunSpec, signer: Any) -> bytes:
    """The signed spec blob (point 2); ``signer`` is an ``identity.Signer``."""
    body = _body_schema(spec.require_hardware).encode(spec)
    decode_body(body)  # our own spec must parse: a bug otherwise
    sig = signer.sign(SPEC_DOMAIN + body)
    return _ENVELOPE.encode(_Envelope(SPEC_VERSION, body, signer.public_key_bytes, sig))


def spec_digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def decode_body(body: bytes) -> RunSpec:
    """Parse and check a spec's body (point 2); raises :class:`BadSpec` only."""
    try:
        obj = decode_map(body, max_size=MAX_SPEC_SIZE, what="run spec body")
        schema = select(obj, _BODIES, key="v", what="run spec body")
        spec = RunSpec(**schema.read(obj))
    except CodecError as exc:
        raise BadSpec(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise BadSpec(f"run spec is malformed: {exc}") from None
    if schema.encode(spec) != body:
        raise BadSpec("run spec body is not in canonical form")
    return spec


def _shapes(entries: list[Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((_str(n), _dims(s)) for n, s in map(_pair, entries))


def _pair(entry: Any) -> tuple[Any, Any]:
    if type(entry) is not list or len(entry) != 2:
        raise CodecError("a run spec's tensors are [name, shape] pairs")
    return entry[0], entry[1]


def _str(value: Any) -> str:
    if type(value) is not str:
        raise CodecError("a run spec's names are strings")
    return value


def _dims(value: Any) -> tuple[int, ...]:
    if type(value) is not list or not all(type(d) is int for d in value):
        raise CodecError("a run spec's shapes are lists of integers")
    return tuple(value)


def _fixed(entries: list[Any]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    out = []
    for entry in entries:
        if type(entry) is not list or len(entry) != 3:
            raise CodecError("a run spec's fixed tensors are [name, dtype, shape]")
        out.append((_str(entry[0]), _str(entry[1]), _dims(entry[2])))
    return tuple(out)


def _names(entries: list[Any]) -> tuple[tuple[str, str], ...]:
    return tuple((_str(a), _str(t)) for a, t in map(_pair, entries))


def _strings(entries: list[Any]) -> tuple[str, ...]:
    return tuple(map(_str, entries))


def _listed(pairs: tuple[tuple[Any, ...], ...]) -> list[Any]:
    """Tensors, fixed tensors or tied names as the wire's lists (shapes too)."""
    return [[list(x) if isinstance(x, tuple) else x for x in entry] for entry in pairs]


# Point 2's body, one schema per version: its keys in canonical (sorted) order, ``v`` among
# them; the keys of _OPTIONAL are written only when set (blobstore.schema ``optional``).
_BODY_FIELDS = (
    Field("aliases", list, out=_listed, into=_names, optional=True),
    Field("authorities", list, out=list, into=_strings),
    Field("base", str),
    Field("batch", int),
    Field("buffers", list, out=_listed, into=_shapes, optional=True),
    Field("chunk", int),
    Field("data", str),
    Field("deadline", float),
    Field("ef_decay", float),
    Field("fixed", list, out=_listed, into=_fixed, optional=True),
    Field("fixed_blob", str, optional=True),
    Field("initial", str),
    Field("inner_lr", float),
    Field("inner_steps", int),
    Field("k", int),
    Field("level", str),
    Field("outer_lr", float),
    Field("outer_momentum", float),
    Field("overlap", int, optional=True),
    Field("proposer_timeout", float),
    Field("quorum", int, optional=True),
    Field("replay_rate", float),
    Field("require_hardware", bool),  # version 2 only, and then true (point 2)
    Field("root", str),
    Field("rounds", int),
    Field("run", str),
    Field("seed", int),
    Field("step", str, optional=True),
    Field("tensors", list, out=_listed, into=_shapes),
    Field("v", int),
    Field("workers", int),
)
assert [f.key for f in _BODY_FIELDS] == sorted(f.key for f in _BODY_FIELDS)
assert {f.key for f in _BODY_FIELDS if f.optional} == _OPTIONAL


def _body(version: int, *, hardware: bool) -> Schema:
    return Schema(
        "run spec body",
        *(
            Field("v", int, const=version) if f.key == "v" else f
            for f in _BODY_FIELDS
            if hardware or f.key != "require_hardware"
        ),
    )


_BODIES = {
    SPEC_VERSION: _body(SPEC_VERSION, hardware=False),
    HARDWARE_SPEC_VERSION: _body(HARDWARE_SPEC_VERSION, hardware=True),
}


def _body_schema(require_hardware: bool) -> Schema:
    return _BODIES[HARDWARE_SPEC_VERSION if require_hardware else SPEC_VERSION]


@dataclass(frozen=True)
class _Envelope:
    v: int
    body: bytes
    key: bytes
    sig: bytes


# Point 2's envelope; ``v`` is the envelope's version, read as it is (every build writes 1).
_ENVELOPE = Schema(
    "run spec blob",
    Field("v", int),
    Field("body", bytes),
    Field("key", bytes, size=32),
    Field("sig", bytes),
)


@dataclass(frozen=True)
class SignedSpec:
    spec: RunSpec
    maker: bytes  # the maker's Ed25519 public key


def decode_spec(data: bytes) -> SignedSpec:
    """Parse and check a spec blob (point 2); raises :class:`BadSpec` only."""
    from identity import verify_signature

    envelope = _Envelope(**_ENVELOPE.decode(data, max_size=MAX_SPEC_SIZE, error=BadSpec))
    if not verify_signature(envelope.key, SPEC_DOMAIN + envelope.body, envelope.sig):
        raise BadSpec("run spec signature does not verify")
    spec = decode_body(envelope.body)
    # One spelling per spec, so one blob ID per spec: the envelope is canonical too.
    require_canonical(data, _ENVELOPE.encode(envelope), what="run spec", error=BadSpec)
    return SignedSpec(spec, envelope.key)


def check_model(spec: RunSpec, layout: Layout) -> None:
    """Point 4: raise ``ModelMismatch`` naming the first difference, in one line."""
    check_layout(spec.layout(), layout, run=spec.run)


def check_level(spec: RunSpec, offered: Level) -> None:
    """Point 3: refuse a worker that offers less verification than the spec's minimum."""
    try:
        level = Level(offered)
    except ValueError:
        raise LevelRefused(
            f"unknown verification level {offered!r}; one of {Level.names()}"
        ) from None
    if not level.at_least(spec.level):
        need = {
            Level.REPLAYED: "an inner_step and the run's records (the library drives the inner "
            "steps)",
            Level.SCORED: "an eval_fn and an evaluation records blob",
        }[spec.level]
        raise LevelRefused(
            f"run {spec.run} requires verification level {spec.level.value!r}, this worker "
            f"offers {level.value!r}: give {need}"
        )
