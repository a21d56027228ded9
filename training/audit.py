"""The op auditor: every aten op of every step, checked against the device and the audited
kernel set of the kernel class family.

Theory of operation:

1. A round's forward, backward (run by the autograd engine) and optimizer step execute
   inside an ``OpAuditor``, a ``TorchDispatchMode``: every op reaches
   ``__torch_dispatch__`` with its arguments before it runs (research/train.md section 3).
2. An op is allowed only if its name (``aten::mm.default``) is in the audited kernel set,
   the JSON file ``training/kernels/<family>.json``. The set is the union of the ops of
   step 0 (which has extra ones: AdamW's ``zeros_like`` state init, ``lift_fresh``) and of
   steady-state steps, recorded by ``python -m training.audit --build <family>`` on
   every supported model shape, with and without dropout. Anything else raises
   ``AuditViolation`` naming the op, and the round is refused.
3. Every op's tensor results must be on the round's device; an op that returns no tensor
   (``_local_scalar_dense``, the profiler's markers) has its tensor and device arguments
   checked instead. Results are enough: torch picks an op's kernel by the devices of its
   tensor arguments and puts the result on that device (mixed devices are an error, a
   factory op's ``device=`` argument is its result's device, an in-place op returns its
   target), so a result on the round's device means the kernel that ran is the round
   device's; every tensor an op reads was either made by an audited op (its device
   checked then) or put on the device by the round's own code (parameters, batches).
   A copy from another device is exact, so it moves values without computing. The one
   exception: on CUDA a 0-dim CPU tensor is a scalar that CUDA kernels take by value
   (AdamW's step counter without ``capturable``, Python scalars wrapped by autograd), so
   it is allowed there.
4. The set pins *ops*, not the concrete kernels behind them (one ``aten::mm`` is many
   MKL/cuBLAS paths); the kernel class pins those (ISA, GPU, library builds, threads).
5. Overhead is per op, so it is kept small: the allow-list decision is cached per op
   object, devices are checked through the ``is_cpu``/``is_cuda`` flags, results (not
   arguments) are checked, and lists are walked one level deep (aten schemas nest
   tensors at most in a list) without pytree. Most of what remains is torch's own cost
   of entering a Python dispatch mode per op (~10 us), measured by ``bench/round.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.errors import AuditViolation, NoKernelSet
from training.recipe import DEFAULT_TARGETS

if TYPE_CHECKING:
    import torch

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
KERNEL_SET_FORMAT = 1
BUILD_COMMAND = "python -m training.audit --build {family}"
# A kernel set lists ~60 ops; a file much larger than this is not one.
MAX_KERNEL_SET_SIZE = 1 << 20


def kernel_set_path(family: str) -> Path:
    return KERNELS_DIR / f"{family}.json"


def load_kernel_set(family: str) -> frozenset[str]:
    """The audited op names of ``family``; ``NoKernelSet`` if no set was built for it."""
    path = kernel_set_path(family)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise NoKernelSet(
            f"no audited kernel set for kernel class family {family!r} ({path.name}); "
            f"build it on such a machine with `{BUILD_COMMAND.format(family=family)}`"
        ) from None
    if len(raw) > MAX_KERNEL_SET_SIZE:
        raise NoKernelSet(f"{path} is larger than {MAX_KERNEL_SET_SIZE} bytes")
    try:
        obj = json.loads(raw)
        ops = obj["ops"]
        ok = obj.get("format") == KERNEL_SET_FORMAT and obj.get("family") == family
    except (ValueError, KeyError, TypeError):
        ok, ops = False, None
    if not ok or not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
        raise NoKernelSet(f"{path} is not a kernel set file; rebuild it")
    return frozenset(ops)


def op_name(func: Any) -> str:
    """``aten::mm.default``: namespace, op and overload, as listed in kernel sets."""
    return f"{func._schema.name}.{func._overloadname}"


def make_auditor(device: str, allowed: frozenset[str] | None, *, record: bool = False) -> Any:
    """An ``OpAuditor`` for ``device``; ``allowed=None`` only records (building a set)."""
    return _auditor_class()(device, allowed, record=record)


_AUDITOR_CLASS: type | None = None


def _auditor_class() -> type:
    global _AUDITOR_CLASS
    if _AUDITOR_CLASS is None:
        _AUDITOR_CLASS = _define_auditor()
    return _AUDITOR_CLASS


def _define_auditor() -> type:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    tensor_type = torch.Tensor
    device_type = torch.device

    class OpAuditor(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
        """Refuses ops outside ``allowed`` and tensors off ``device``; see module doc."""

        def __init__(
            self, device: str, allowed: frozenset[str] | None, *, record: bool = False
        ) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            if device not in ("cpu", "cuda"):
                raise ValueError(f"unknown device {device!r}")
            self.device = device
            self.allowed = allowed
            self.record = record
            self.seen: dict[str, int] = {}
            self.calls = 0
            # op object -> its name and callable, for ops already found in the allowed set
            self._decided: dict[Any, tuple[str, Any]] = {}
            self._on_device = _cpu_ok if device == "cpu" else _cuda_ok
            self._cpu = device == "cpu"

        def _refuse_device(self, name: str, value: Any) -> None:
            where = value.type if isinstance(value, device_type) else value.device
            raise AuditViolation(
                f"round refused: op {name} has a tensor or device on {where}, "
                f"not on the round's device {self.device}"
            )

        def _check(self, name: str, values: Iterable[Any]) -> None:
            ok = self._on_device
            for v in values:
                if isinstance(v, tensor_type):
                    if not ok(v):
                        self._refuse_device(name, v)
                elif isinstance(v, list | tuple):
                    for w in v:
                        bad_tensor = isinstance(w, tensor_type) and not ok(w)
                        if bad_tensor or (isinstance(w, device_type) and w.type != self.device):
                            self._refuse_device(name, w)
                elif isinstance(v, device_type) and v.type != self.device:
                    self._refuse_device(name, v)

        def _decide(self, func: Any) -> tuple[str, Any]:
            name = op_name(func)
            # OpOverload.__call__ is a one-line Python wrapper around ``_op``: calling
            # ``_op`` saves a frame per op and runs the same kernel.
            decided = (name, getattr(func, "_op", func))
            if self.allowed is not None:
                if name not in self.allowed:
                    raise AuditViolation(
                        f"round refused: op {name} is not in the audited kernel set "
                        f"for {self.device}"
                    )
                self._decided[func] = decided
            return decided

        def __torch_dispatch__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            decided = self._decided.get(func)
            name, run = decided if decided is not None else self._decide(func)
            out = run(*args, **kwargs) if kwargs else run(*args)
            # The result's device is the device whose kernel ran (invariant 3): checking
            # results is enough for ops that return tensors; the rest have their
            # arguments checked. The CPU test is inlined: this line runs ~900 times a
            # step on the tiny model.
            if isinstance(out, tensor_type):
                if not (out.is_cpu if self._cpu else self._on_device(out)):
                    self._refuse_device(name, out)
            elif isinstance(out, list | tuple) and out:
                self._check(name, out)
            else:
                self._check(name, args)
                if kwargs:
                    self._check(name, kwargs.values())
            if self.record:
                self.seen[name] = self.seen.get(name, 0) + 1
            self.calls += 1
            return out

    def _cpu_ok(t: torch.Tensor) -> bool:
        return bool(t.is_cpu)

    def _cuda_ok(t: torch.Tensor) -> bool:
        return bool(t.is_cuda) or (bool(t.is_cpu) and t.dim() == 0)

    return OpAuditor


# The architectures and settings a kernel set is recorded on: (arch, config overrides).
# GPT-2-style covers Conv1D (addmm), fused-qkv split/permute and its activations;
# Llama-style covers RMSNorm, RoPE, grouped-query attention and SwiGLU.
AUDITED_SHAPES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("gpt2", {"activation_function": "gelu_new"}),
    ("gpt2", {"activation_function": "gelu"}),
    ("gpt2", {"activation_function": "relu"}),
    ("llama", {"hidden_act": "silu"}),
    ("llama", {"hidden_act": "gelu", "attention_bias": True, "mlp_bias": True}),
    ("llama", {"hidden_act": "relu", "num_key_value_heads": 4}),
)
_CORPUS = [
    "Deterministic rounds replay bit for bit on every machine of one kernel class. ",
    "A base model, tokenised records, a recipe and a seed decide the adapter. ",
] * 16


def build_kernel_set(family: str, steps: int = 3) -> dict[str, Any]:
    """Record the ops of ``steps`` steps (step 0 and steady state) of every shape we train.

    Shapes: the built-in tiny and small Llamas (byte records; tiny has grouped-query
    attention, small has not) and Hugging Face directories of :data:`AUDITED_SHAPES`
    (tokenizer records), each with dropout 0 and 0.1 (dropout adds its RNG ops), on the
    family's device in deterministic mode.
    """
    import tempfile

    from training import determinism, kernel_class, trainer
    from training.hf_model import ARCH_TARGETS, build_model_dir, model_eos
    from training.model import load_base_model, make_tiny_llama, read_config
    from training.recipe import Recipe
    from training.records import make_records, make_tokenizer_records

    device = determinism.resolve_device(family)
    determinism.enter(device)
    kc = kernel_class.detect(device)
    ops: set[str] = set()

    def record(make_base: Any, records: bytes, targets: tuple[str, ...]) -> None:
        for dropout in (0.0, 0.1):
            recipe = Recipe(
                steps=steps, batch_size=4, seq_len=32, dropout=dropout, target_modules=targets
            )
            auditor = make_auditor(device, None, record=True)
            session = trainer.prepare(make_base(), recipe, 0, device)
            trainer.run_steps(session, trainer.decode(records), auditor=auditor)
            ops.update(auditor.seen)

    byte_records = make_records([bytes(range(256)) * 8], seq_len=32)
    for size in ("tiny", "small"):
        record(lambda size=size: make_tiny_llama(size, seed=0), byte_records, DEFAULT_TARGETS)
    with tempfile.TemporaryDirectory(prefix="blobnet-kernels-") as tmp:
        for i, (arch, overrides) in enumerate(AUDITED_SHAPES):
            directory = Path(tmp) / str(i)
            build_model_dir(arch, directory, _CORPUS, seed=0, overrides=overrides)
            records = make_tokenizer_records(
                [t.encode() for t in _CORPUS],
                32,
                tokenizer_json=(directory / "tokenizer.json").read_bytes(),
                tokenizer_id="0" * 64,
                eos_id=model_eos(read_config(directory)),
            )
            record(lambda d=directory: load_base_model(d), records, ARCH_TARGETS[arch])
    return {
        "format": KERNEL_SET_FORMAT,
        "family": family,
        "built_by": BUILD_COMMAND.format(family=family),
        "built_on": kc.fields,
        "shapes": ["llama-tiny", "llama-small"]
        + [f"{a}:{json.dumps(o, sort_keys=True)}" for a, o in AUDITED_SHAPES],
        "ops": sorted(ops),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.audit",
        description="Build the audited kernel set of a kernel class family.",
    )
    parser.add_argument("--build", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="default training/kernels/")
    ns = parser.parse_args(argv)
    result = build_kernel_set(ns.build, steps=ns.steps)
    out: Path = ns.out or kernel_set_path(ns.build)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{out}: {len(result['ops'])} ops", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
