"""A model's whole state as a run holds it: every entry of ``state_dict()``, each with a role.

Theory of operation
-------------------
1. **Roles.** Every tensor of a module's ``state_dict()`` has exactly one role:

   - *trainable*: a floating-point parameter with ``requires_grad``. It travels through the
     SparseLoCo codec and the outer optimiser (the spec's ``tensors``; parameters and
     momentum in the state blob).
   - *buffer*: a floating-point persistent buffer (BatchNorm's running mean and variance).
     Each update carries the worker's values at the end of its inner steps, and the next
     state holds their coordinate-wise median over the updates the closure includes
     (``training.outer.aggregate`` rule 8), so a run's workers hold the same statistics
     and one worker's lie moves them no further than the honest values span. A round
     that includes no update keeps them.
   - *fixed*: every other tensor: integer buffers (``num_batches_tracked``) and frozen
     parameters (``requires_grad=False``), in their own dtype. The initial state fixes
     them (the spec's ``fixed`` blob, a safetensors file); a worker loads them when it
     joins (a frozen random projection made with another seed is the run's after that)
     and loads the integer buffers again with every applied state, so every worker holds
     the same ones.
   - *alias*: a second name for a tensor named before it (tied weights: ``b.weight =
     a.weight``). It is stored once, under the first name ``state_dict()`` lists it by
     (the name ``named_parameters()`` keeps), and the spec's ``aliases`` map it back, so
     an export loads with ``load_state_dict(strict=True)``.

2. **A state file** (:func:`save_state`, ``blob outer init --state FILE``) is a safetensors
   file holding each tensor once, in its own dtype, with the roles and aliases in its
   metadata under :data:`STATE_METADATA_KEY`. A safetensors file without that key (any
   state dict saved elsewhere) is read with floating tensors trainable and the rest
   fixed, unless the caller names buffers and frozen tensors by pattern.

3. **Checks.** :func:`check_layout` refuses, in one line naming the first difference, a
   model whose layout (names, roles, shapes, fixed dtypes, aliases) is not the run's,
   before step 0; it says which way to make a spec that matches.

torch is imported inside functions; the layout itself is plain data.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from blobstore.exitcodes import ExitCode
from training.errors import TrainingError

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

    F32 = npt.NDArray[np.float32]  # as training.outer.codec names it (a layer above)

# The metadata key of a state file (point 2): a JSON object {"v": 1, "roles": {name: role},
# "aliases": {alias: name}}.
STATE_METADATA_KEY = "blobnet.state"
STATE_FILE_VERSION = 1
TRAINABLE, BUFFER, FIXED = "trainable", "buffer", "fixed"
ROLES = (TRAINABLE, BUFFER, FIXED)
# A state file's metadata names every tensor once; 4096 tensors with 200-byte names fit
# in well under this (safetensors itself bounds the header at 100 MB).
MAX_STATE_METADATA = 4 << 20

Shape = tuple[int, ...]


class StateError(TrainingError):
    """A state (file, blob or module) that cannot be a run's state: the user's input."""

    exit_code = ExitCode.USAGE


class ModelMismatch(TrainingError):
    """The user's model does not have the run's state (names, roles, shapes): their mistake."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class Layout:
    """Point 1, without values: which names a state holds in which role."""

    trainable: dict[str, Shape] = field(default_factory=dict)
    buffers: dict[str, Shape] = field(default_factory=dict)
    fixed: dict[str, tuple[str, Shape]] = field(default_factory=dict)  # name -> (dtype, shape)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> name stored

    def names(self) -> list[str]:
        """Every ``state_dict()`` key the state stands for, sorted."""
        return sorted([*self.trainable, *self.buffers, *self.fixed, *self.aliases])


@dataclass(frozen=True)
class WholeState:
    """Point 1 with values: trainable parameters and buffers as float32 arrays, fixed
    tensors as torch tensors in their own dtype (numpy has no bfloat16)."""

    trainable: dict[str, F32]
    buffers: dict[str, F32]
    fixed: dict[str, Any]  # name -> torch.Tensor
    aliases: dict[str, str]

    def layout(self) -> Layout:
        return Layout(
            {n: tuple(v.shape) for n, v in self.trainable.items()},
            {n: tuple(v.shape) for n, v in self.buffers.items()},
            {n: (dtype_name(t), tuple(t.shape)) for n, t in self.fixed.items()},
            dict(self.aliases),
        )


def dtype_name(tensor: Any) -> str:
    """A torch tensor's dtype as safetensors spells it in a file's header (``F32``...)."""
    import torch

    names = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    try:
        return names[tensor.dtype]
    except KeyError:
        raise StateError(f"tensor dtype {tensor.dtype} is not supported in a run's state") from None


def _roles_of(module: torch.nn.Module) -> tuple[dict[str, str], dict[str, str], dict[str, Any]]:
    """(name -> role, alias -> name, name -> tensor) of ``module.state_dict()`` (point 1)."""
    import torch

    params = dict(module.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    roles: dict[str, str] = {}
    aliases: dict[str, str] = {}
    tensors: dict[str, Any] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise StateError(
                f"state entry {name!r} is not a tensor ({type(value).__name__}); a run's "
                "state holds tensors only"
            )
        if id(value) in first:
            aliases[name] = first[id(value)]
            continue
        first[id(value)] = name
        tensors[name] = value
        if name in params:
            trainable = value.requires_grad and value.is_floating_point()
            roles[name] = TRAINABLE if trainable else FIXED
        else:
            roles[name] = BUFFER if value.is_floating_point() else FIXED
    return roles, aliases, tensors


def layout_of(module: torch.nn.Module) -> Layout:
    """Point 1: the roles of ``module``'s state, with shapes (and fixed tensors' dtypes)."""
    roles, aliases, tensors = _roles_of(module)
    out = Layout(aliases=aliases)
    for name, role in roles.items():
        shape = tuple(int(d) for d in tensors[name].shape)
        if role == TRAINABLE:
            out.trainable[name] = shape
        elif role == BUFFER:
            out.buffers[name] = shape
        else:
            out.fixed[name] = (dtype_name(tensors[name]), shape)
    return out


def whole_state(module: torch.nn.Module) -> WholeState:
    """Point 1: copies of ``module``'s whole state (float32 for trainable and buffers)."""
    import torch

    roles, aliases, tensors = _roles_of(module)
    trainable: dict[str, F32] = {}
    buffers: dict[str, F32] = {}
    fixed: dict[str, Any] = {}
    for name in sorted(roles):
        value = tensors[name].detach()
        if hasattr(value, "full_tensor"):  # a DTensor: the whole of it
            value = value.full_tensor()
        if roles[name] == FIXED:
            fixed[name] = value.to("cpu").contiguous().clone()
            continue
        array = value.to("cpu", torch.float32).contiguous().numpy().copy()
        (trainable if roles[name] == TRAINABLE else buffers)[name] = array
    return WholeState(trainable, buffers, fixed, aliases)


def floating_buffers(module: torch.nn.Module) -> dict[str, F32]:
    """Point 1: float32 copies of ``module``'s floating buffers (what an update carries)."""
    import torch

    roles, _, tensors = _roles_of(module)
    return {
        name: tensors[name].detach().to("cpu", torch.float32).contiguous().numpy().copy()
        for name in sorted(roles)
        if roles[name] == BUFFER
    }


def load_into(
    module: torch.nn.Module,
    buffers: Mapping[str, F32],
    fixed: Mapping[str, Any] | None = None,
) -> None:
    """Copy a state's floating ``buffers`` (float32, cast to each buffer's dtype and
    device) and ``fixed`` tensors (torch tensors of their own dtype) into ``module`` in
    place; its trainable parameters are the caller's (they may be sharded)."""
    import torch

    _, _, tensors = _roles_of(module)
    with torch.no_grad():
        for name, value in buffers.items():
            tensors[name].copy_(torch.from_numpy(value))
        for name, value in (fixed or {}).items():
            target = tensors[name]
            if hasattr(target, "to_local"):
                raise StateError(f"fixed tensor {name!r} is sharded; a run cannot load it")
            target.copy_(value)


# Point 2: safetensors' dtype names for the tensors a state holds (numpy has no bfloat16,
# so tensors go through torch).
_SAFETENSORS_HEADER_ALIGN = 8


def write_safetensors(fd: int, tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` (torch tensors or float32 numpy arrays, by name) as a safetensors
    file to ``fd``, each tensor's bytes straight from its memory. safetensors' own writer
    first copies every tensor into a bytes object: at 124M parameters a resume checkpoint
    (residual and AdamW moments) would cost 1.5 GB more memory each round. The format is
    the library's (an 8-byte little-endian header length, a JSON header with each tensor's
    dtype, shape and data offsets, padded with spaces to 8 bytes, then the data), and
    what is read back is read by the library (``safe_open``)."""
    import torch

    from blobstore.durable import write_all

    views: list[tuple[str, str, list[int], memoryview]] = []
    for name in sorted(tensors):
        value = tensors[name]
        t = torch.from_numpy(value) if isinstance(value, np.ndarray) else value.detach()
        t = t.to("cpu").contiguous()
        flat: np.ndarray[Any, np.dtype[np.uint8]] = t.reshape(-1).view(torch.uint8).numpy()
        views.append((name, dtype_name(t), list(t.shape), flat.data.cast("B")))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape, raw in views:
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + raw.nbytes],
        }
        offset += raw.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _SAFETENSORS_HEADER_ALIGN)
    write_all(fd, len(text).to_bytes(8, "little") + text)
    for _, _, _, data in views:
        write_all(fd, data)


def encode_fixed(fixed: Mapping[str, Any]) -> bytes:
    """The spec's ``fixed_blob``: the fixed tensors as safetensors bytes (point 1)."""
    from safetensors.torch import save

    data: bytes = save({n: fixed[n].contiguous() for n in sorted(fixed)})
    return data


def decode_fixed(data: bytes, want: Mapping[str, tuple[str, Shape]]) -> dict[str, Any]:
    """The fixed tensors of a ``fixed_blob``, which must hold exactly ``want`` (name ->
    (dtype, shape)); :class:`StateError` otherwise (whoever handed us the blob's fault:
    its ID is the spec's, so only a spec made wrongly gets here)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(data)
    except (SafetensorError, ValueError) as exc:
        raise StateError(f"the run's fixed tensors are not safetensors: {exc}") from None
    have = {n: (dtype_name(t), tuple(t.shape)) for n, t in tensors.items()}
    if have != dict(want):
        raise StateError("the run's fixed tensors do not match its spec")
    return tensors


def save_state(module: torch.nn.Module, path: str | Path) -> None:
    """Point 2: write ``module``'s whole state as a state file (each tensor once, roles and
    aliases in the metadata), for ``blob outer init --state FILE``."""
    state = whole_state(module)
    write_state_file(Path(path), state)


def write_state_file(path: Path, state: WholeState) -> None:
    import torch
    from safetensors.torch import save_file

    roles = {n: TRAINABLE for n in state.trainable}
    roles.update({n: BUFFER for n in state.buffers})
    roles.update({n: FIXED for n in state.fixed})
    tensors: dict[str, Any] = {n: torch.from_numpy(v) for n, v in state.trainable.items()}
    tensors.update({n: torch.from_numpy(v) for n, v in state.buffers.items()})
    tensors.update(state.fixed)
    meta = {"v": STATE_FILE_VERSION, "roles": roles, "aliases": state.aliases}
    save_file(
        {n: t.contiguous() for n, t in sorted(tensors.items())},
        str(path),
        {STATE_METADATA_KEY: json.dumps(meta, sort_keys=True)},
    )


def read_state_file(
    path: Path, *, buffers: Sequence[str] = (), frozen: Sequence[str] = ()
) -> WholeState:
    """Point 2: a state file's whole state. Without blobnet's metadata, floating tensors
    are trainable and the rest fixed, except names matching a ``buffers`` pattern (floating
    buffers) or a ``frozen`` pattern (fixed); with it, patterns are refused (the file
    says)."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise StateError(f"{path} is not a readable safetensors state file: {exc}") from None
    raw = meta.get(STATE_METADATA_KEY)
    if raw is not None:
        if buffers or frozen:
            raise StateError(
                f"{path} names its tensors' roles itself (saved by save_state); "
                "--buffer and --frozen are for other state dicts"
            )
        roles, aliases = _parse_metadata(path, raw, set(tensors))
    else:
        roles, aliases = _infer_roles(path, tensors, buffers, frozen), {}
    out = WholeState({}, {}, {}, aliases)
    for name in sorted(tensors):
        value = tensors[name]
        if roles[name] == FIXED:
            dtype_name(value)  # refuses what a run cannot hold
            out.fixed[name] = value.contiguous()
            continue
        if not value.is_floating_point():
            raise StateError(f"{path}: {roles[name]} tensor {name!r} is {value.dtype}")
        array = value.to(torch.float32).contiguous().numpy().copy()
        if not np.isfinite(array).all():
            raise StateError(f"{path}: tensor {name!r} holds NaN or infinity")
        (out.trainable if roles[name] == TRAINABLE else out.buffers)[name] = array
    if not out.trainable:
        raise StateError(f"{path} holds no trainable tensor")
    return out


def _parse_metadata(path: Path, raw: str, names: set[str]) -> tuple[dict[str, str], dict[str, str]]:
    if len(raw) > MAX_STATE_METADATA:
        raise StateError(f"{path}: its state metadata is over {MAX_STATE_METADATA} bytes")
    try:
        meta = json.loads(raw)
        roles = meta["roles"]
        aliases = meta["aliases"]
        ok = meta.get("v") == STATE_FILE_VERSION and isinstance(roles, dict)
        ok = ok and isinstance(aliases, dict)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise StateError(f"{path}: its {STATE_METADATA_KEY} metadata is not a state description")
    if set(roles) != names or not set(roles.values()) <= set(ROLES):
        raise StateError(f"{path}: its metadata does not give every tensor one role")
    for alias, target in aliases.items():
        if not isinstance(target, str) or target not in names or alias in names:
            raise StateError(f"{path}: alias {alias!r} does not name a tensor of the file")
    return dict(roles), dict(aliases)


def _infer_roles(
    path: Path, tensors: Mapping[str, Any], buffers: Sequence[str], frozen: Sequence[str]
) -> dict[str, str]:
    def matches(name: str, patterns: Iterable[str]) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    for pattern in [*buffers, *frozen]:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in tensors):
            raise StateError(f"{path}: the pattern {pattern!r} matches no tensor of the file")
    roles = {}
    for name, value in tensors.items():
        if matches(name, frozen) or not value.is_floating_point():
            roles[name] = FIXED
        elif matches(name, buffers):
            roles[name] = BUFFER
        else:
            roles[name] = TRAINABLE
    return roles


def check_layout(want: Layout, have: Layout, *, run: str) -> None:
    """Point 3: raise :class:`ModelMismatch` naming the first difference, in one line."""
    head = f"the model does not match run {run}"
    tables: list[tuple[str, Mapping[str, Any], Mapping[str, Any]]] = [
        ("parameter", want.trainable, have.trainable),
        ("buffer", want.buffers, have.buffers),
        ("fixed tensor", want.fixed, have.fixed),
    ]
    for what, w, h in tables:
        for name in sorted(w):
            if name in h and h[name] != w[name]:
                raise ModelMismatch(
                    f"{head}: {what} {name!r} has {_describe(h[name])}, the spec says "
                    f"{_describe(w[name], short=True)}"
                )
    have_roles = _role_table(have)
    want_roles = _role_table(want)
    for name in sorted(want_roles):
        if name not in have_roles:
            raise ModelMismatch(
                f"{head}: it has no {want_roles[name]} {name!r} (the spec's state has "
                f"{len(want_roles)} entries)"
            )
        if have_roles[name] != want_roles[name]:
            raise ModelMismatch(
                f"{head}: {name!r} is a {have_roles[name]} in the model and a "
                f"{want_roles[name]} in the spec; make the spec from the module "
                "(training.outer.save_state, then `blob outer init --state FILE`)"
            )
    extra = sorted(set(have_roles) - set(want_roles))
    if extra:
        raise ModelMismatch(
            f"{head}: {have_roles[extra[0]]} {extra[0]!r} is not in the spec ({len(extra)} extra)"
        )


def _role_table(layout: Layout) -> dict[str, str]:
    out = {n: "parameter" for n in layout.trainable}
    out.update({n: "buffer" for n in layout.buffers})
    out.update({n: "fixed tensor" for n in layout.fixed})
    out.update({a: f"tied name of {t!r}" for a, t in layout.aliases.items()})
    return out


def _describe(entry: Any, *, short: bool = False) -> str:
    if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
        return f"dtype {entry[0]} and shape {entry[1]}"
    return str(tuple(entry)) if short else f"shape {tuple(entry)}"


def element_count(shapes: Iterable[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)
