"""The op auditor: every aten op of every step, checked against the device and the audited
kernel set of the kernel class family.

Theory of operation:

1. A round's forward, backward (run by the autograd engine) and optimizer step execute
   inside an ``OpAuditor``, a ``TorchDispatchMode``: while it is entered, every op the
   dispatcher runs passes the ``Python`` dispatch key, whose kernel hands the op to
   ``__torch_dispatch__`` before it runs (research/train.md section 3), unless the op has
   its own kernel for that key (point 5).
2. An op is allowed only if its name (``aten::mm.default``) is in the audited kernel set,
   the JSON file ``training/rounds/kernels/<family>.json``. The set is recorded by ``python -m
   training.rounds.audit --build <family>`` on every supported model shape, with and without
   dropout, over step 0 (AdamW's ``zeros_like`` state init, ``lift_fresh``) and steady
   steps, and holds the ops of every depth the auditor can see (point 5a). Anything else
   raises ``AuditViolation`` naming the op, and the round is refused.
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
   it is allowed there. Known hole: torch lets a CPU kernel read a *meta* tensor next to
   CPU ones (``mm``, indexing: the result is CPU and its values are whatever memory
   held). So before the first step ``training.rounds.trainer.check_placement`` refuses a
   model holding a tensor off the round's device (parameters and buffers) or on meta (any
   tensor attribute of a module), and in the dispatcher regime (point 5) no meta tensor
   can be made while the round runs (its meta kernels are refusals). What remains: a meta
   tensor held outside the model (a closure, a global) and, in the python regime, one made
   inside a step by ``torch.tensor(..., device="meta")``, whose allocation no mode sees. Checking
   every op's arguments, not just its results, would close it, at a cost per op.
4. The set pins *ops*, not the concrete kernels behind them (one ``aten::mm`` is many
   MKL/cuBLAS paths); the kernel class pins those (ISA, GPU, library builds, threads).
5. Two regimes, with the same allow-list and the same refusals. A Python dispatch mode
   costs ~10 us per op however little its ``__torch_dispatch__`` does (boxing the
   arguments, the C++/Python crossing): an empty one alone makes a tiny-model step
   ~1.4-1.9x slower, so a check in Python of every op cannot meet the <= 1.5x overhead allowed.

   * ``python`` (``make_auditor``; CUDA rounds, CPU rounds on a machine that has an
     accelerator, the builder's first pass): every op reaches ``__torch_dispatch__``.
   * ``dispatcher`` (``make_round_auditor`` for CPU rounds on a machine with no
     accelerator): while the round runs (``installed()``), every op of the set has a
     fallthrough kernel for the ``Python`` key, so the dispatcher runs it straight to its
     CPU kernel without Python (being in that table is how an op is allowed), and a
     refusal as its meta kernel (except an op with a CompositeImplicitAutograd kernel:
     it never runs a kernel of its own, only the ops it decomposes into). Only ops
     outside the set reach ``__torch_dispatch__``, which refuses them.

   Why the dispatcher regime guarantees what the python one does, on every step (no
   sampling, no assumption that later steps take the first step's path):
   (a) *Ops*: an op without a ``Python``-key kernel of ours goes to
   ``__torch_dispatch__`` whenever it is dispatched with the mode entered (save under
   torch's own guards that exclude that key, such as building a ``torch.tensor`` from
   data, in both regimes alike), so a non-audited op is refused on whatever step it
   first appears. This sees *more* than the python regime: ops that a fallen-through
   kernel calls inside itself (``mm`` calls ``resolve_conj``, ``ones_like`` calls
   ``empty_strided``) are dispatched with the mode still entered, so they are checked
   too, where the python regime runs each kernel with the mode popped and sees only its
   outer op. Hence point 2's "every depth": the builder repeats its recording with the
   ops found so far falling through until no new op appears (``MAX_BUILD_PASSES``). On
   the recorded shapes both regimes accept the same rounds; on another architecture the
   dispatcher regime may refuse an op nested in an audited kernel that the python regime
   never sees, never the reverse (every op the python regime sees, it sees too).
   (b) *Devices*: on a machine with no accelerator torch has two devices, CPU and meta.
   A kernel runs for meta only when the dispatcher picks the ``Meta`` key: every tensor
   of the op is on meta, or it is a factory or copy naming meta (``torch.zeros(...,
   device="meta")``, ``.to("meta")``, even ``torch.tensor(..., device="meta")``, whose
   allocation the python regime never sees). Each audited op's meta kernel is a refusal
   while installed and every other op is refused in Python, so every kernel that runs
   is a CPU kernel and its results are CPU tensors: what the python regime's result
   checks establish (point 3's hole is narrower here: see there). With an accelerator
   present, a tensor left on it (a module attribute that ``.to()`` does not move) would
   run that device's kernels unseen, so the python regime runs there: the choice is
   made from the machine, is reported as ``regime``, and both regimes enforce the same
   set.
   (c) *Scope*: these kernels are process-wide, so they exist only inside
   ``installed()`` (one set at a time, removed on any exit). The fallthroughs act only
   where the ``Python`` key is dispatched: while a dispatch mode is entered or for a
   tensor subclass with its own ``__torch_dispatch__``, so code outside the audit never
   meets them, but another dispatch mode or such a subclass in the process would not
   see the set's ops meanwhile (a round uses neither). The meta refusals act on every
   meta computation in the process meanwhile, audited or not (a round makes none).
6. Overhead in the python regime is per op, so it is kept small: the allow-list decision
   is cached per op object, devices are checked through the ``is_cpu``/``is_cuda``
   flags, results (not arguments) are checked, lists are walked one level deep (aten
   schemas nest tensors at most in a list) without pytree, and ``__torch_dispatch__`` is
   not wrapped in dynamo's disable guard (``_should_skip_dynamo``: rounds never compile).
   ``bench/round.py`` measures both regimes against a plain step.

torch (and the trainer, which imports torch and peft) is imported inside the functions
that use it: ``training.rounds.round`` imports this module for ``blob train check``,
which must run without the ``train`` extra, and torch takes seconds to import.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training import determinism, kernel_class
from training.errors import AuditViolation, NoKernelSet
from training.hf_model import ARCH_TARGETS, build_model_dir, model_eos
from training.model import load_base_model, make_tiny_llama, read_config
from training.records import make_records, make_tokenizer_records
from training.rounds.recipe import DEFAULT_TARGETS, Recipe

if TYPE_CHECKING:
    import torch

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
# 2: the ops of every depth the dispatcher regime sees (format 1 held only outer ops, on
# which that regime would refuse rounds for ops nested in audited kernels).
KERNEL_SET_FORMAT = 2
BUILD_COMMAND = "python -m training.rounds.audit --build {family}"
# A kernel set lists ~100 ops; a file much larger than this is not one.
MAX_KERNEL_SET_SIZE = 1 << 20
# Recording passes of the builder (point 5a): each pass lets the ops found so far fall
# through, exposing the ops their kernels call one level further in; torch kernels nest
# two or three levels deep, so more passes than this mean the recording does not converge.
MAX_BUILD_PASSES = 6


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


def make_auditor(
    device: str,
    allowed: frozenset[str] | None,
    *,
    record: bool = False,
    fallthrough: frozenset[str] = frozenset(),
) -> Any:
    """A python-regime ``OpAuditor`` for ``device`` (every op reaches Python);
    ``allowed=None`` only records (building a set). ``fallthrough``: ops that skip Python
    while ``installed()`` (the builder's deeper passes; rounds use ``make_round_auditor``)."""
    return _auditor_class()(device, allowed, record=record, fallthrough=fallthrough)


def make_round_auditor(device: str, allowed: frozenset[str]) -> Any:
    """The auditor a round runs under: the dispatcher regime for a CPU round on a machine
    without an accelerator, else the python regime (module doc, point 5)."""
    if device == "cpu" and not accelerator_present():
        return make_auditor(device, allowed, fallthrough=fallthrough_ops(allowed))
    return make_auditor(device, allowed)


def accelerator_present() -> bool:
    """Whether torch can make tensors on a device other than CPU and meta here."""
    import torch  # heavy: see the module doc

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return True
    return bool(torch.cuda.is_available())


def op_overload(name: str) -> Any:
    """The ``OpOverload`` of ``aten::mm.default``; ``LookupError`` if torch has none."""
    import torch  # heavy: see the module doc

    namespace, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError) as exc:
        raise LookupError(f"torch has no op {name}") from exc


def fallthrough_ops(ops: Iterable[str]) -> frozenset[str]:
    """The ops of ``ops`` that this torch has: each gets its dispatcher-regime kernels
    (one it lacks cannot run, so it needs no table entry)."""
    found = set()
    for name in ops:
        try:
            op_overload(name)
        except LookupError:
            continue
        found.add(name)
    return frozenset(found)


# The one installed set of fallthrough kernels (point 5c): the ops and the count of
# auditors using them; the registrations are process-wide.
_INSTALL_LOCK = threading.Lock()
_installed: dict[str, Any] = {}


@contextmanager
def install_fallthrough(ops: frozenset[str], device: str) -> Iterator[None]:
    """Register, until exit, a ``Python``-key fallthrough for each op of ``ops`` and, for
    a CPU round, a refusal as its meta kernel (point 5b). Nested installs of the same
    ops share one registration; a different set while one is installed is a bug."""
    if not ops:
        yield
        return
    with _INSTALL_LOCK:
        if _installed:
            if _installed["ops"] != ops or _installed["device"] != device:
                raise RuntimeError("another fallthrough set is installed in this process")
            _installed["users"] += 1
        else:
            _installed.update(ops=ops, device=device, users=1, libraries=_register(ops, device))
    try:
        yield
    finally:
        with _INSTALL_LOCK:
            _installed["users"] -= 1
            if not _installed["users"]:
                for library in _installed["libraries"]:
                    library._destroy()
                _installed.clear()


def _register(ops: frozenset[str], device: str) -> list[Any]:
    import torch  # heavy: see the module doc

    libraries: dict[str, Any] = {}
    try:
        for name in sorted(ops):
            namespace, _, rest = name.partition("::")
            library = libraries.get(namespace)
            if library is None:
                library = torch.library.Library(namespace, "IMPL")  # type: ignore[no-untyped-call]
                libraries[namespace] = library
            op = rest.removesuffix(".default")
            library.impl(op, torch.library.fallthrough_kernel, "Python")
            # Point 5b. An op with a CompositeImplicitAutograd kernel never runs a meta
            # kernel itself: the ops it decomposes into do (in ``ops``, or refused).
            if device == "cpu" and not torch._C._dispatch_has_kernel_for_dispatch_key(
                f"{namespace}::{op}", "CompositeImplicitAutograd"
            ):
                library.impl(op, _meta_refusal(name), "Meta")
    except BaseException:
        for library in libraries.values():
            library._destroy()
        raise
    return list(libraries.values())


def _meta_refusal(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AuditViolation(
            f"round refused: op {name} has a tensor or device on meta, "
            "not on the round's device cpu"
        )

    return refuse


_AUDITOR_CLASS: type | None = None


def _auditor_class() -> type:
    global _AUDITOR_CLASS
    if _AUDITOR_CLASS is None:
        _AUDITOR_CLASS = _define_auditor()
    return _AUDITOR_CLASS


def _define_auditor() -> type:
    # heavy: see the module doc
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    tensor_type = torch.Tensor
    device_type = torch.device

    class OpAuditor(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
        """Refuses ops outside ``allowed`` and tensors off ``device``; see module doc."""

        def __init__(
            self,
            device: str,
            allowed: frozenset[str] | None,
            *,
            record: bool = False,
            fallthrough: frozenset[str] = frozenset(),
        ) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            if device not in ("cpu", "cuda"):
                raise ValueError(f"unknown device {device!r}")
            if allowed is not None and not fallthrough <= allowed:
                raise ValueError("fallthrough ops must be allowed ops")
            self.device = device
            self.allowed = allowed
            self.record = record
            self.fallthrough = fallthrough
            self.regime = "dispatcher" if fallthrough else "python"
            self.seen: dict[str, int] = {}
            # Ops that reached __torch_dispatch__ (in the dispatcher regime, not all ops).
            self.calls = 0
            # op object -> its name and callable, for ops already found in the allowed set
            self._decided: dict[Any, tuple[str, Any]] = {}
            self._on_device = _cpu_ok if device == "cpu" else _cuda_ok
            self._cpu = device == "cpu"

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # Not wrapping __torch_dispatch__ in dynamo's disable guard saves ~1 us per op;
            # rounds never compile (module doc, point 6).
            return False

        def installed(self) -> Any:
            """Context for a whole round: the dispatcher regime's fallthrough kernels
            (module doc, point 5); nothing to install in the python regime."""
            return install_fallthrough(self.fallthrough, self.device)

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
    family's device in deterministic mode. Passes repeat with the ops found so far
    falling through until one finds no new op (module doc, point 5a).
    """
    from training.rounds import trainer  # torch and peft: see the module doc

    device = determinism.resolve_device(family)
    determinism.enter(device)
    kc = kernel_class.detect(device)
    ops: set[str] = set()

    def record(
        make_base: Any, records: bytes, targets: tuple[str, ...], fallthrough: frozenset[str]
    ) -> None:
        for dropout in (0.0, 0.1):
            recipe = Recipe(
                steps=steps, batch_size=4, seq_len=32, dropout=dropout, target_modules=targets
            )
            auditor = make_auditor(device, None, record=True, fallthrough=fallthrough)
            session = trainer.prepare(make_base(), recipe, 0, device)
            trainer.run_steps(session, trainer.decode(records), auditor=auditor)
            ops.update(auditor.seen)

    byte_records = make_records([bytes(range(256)) * 8], seq_len=32)
    with tempfile.TemporaryDirectory(prefix="blobnet-kernels-") as tmp:
        shapes: list[tuple[Any, bytes, tuple[str, ...]]] = [
            (lambda size=size: make_tiny_llama(size, seed=0), byte_records, DEFAULT_TARGETS)
            for size in ("tiny", "small")
        ]
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
            shapes.append((lambda d=directory: load_base_model(d), records, ARCH_TARGETS[arch]))
        for passes in range(1, MAX_BUILD_PASSES + 1):
            before = len(ops)
            fallthrough = fallthrough_ops(ops)
            for make_base, records, targets in shapes:
                record(make_base, records, targets, fallthrough)
            if passes > 1 and len(ops) == before:
                break
        else:
            raise RuntimeError(
                f"recording found new nested ops in each of {MAX_BUILD_PASSES} passes"
            )
    return {
        "format": KERNEL_SET_FORMAT,
        "family": family,
        "built_by": BUILD_COMMAND.format(family=family),
        "built_on": kc.fields,
        "passes": passes,
        "shapes": ["llama-tiny", "llama-small"]
        + [f"{a}:{json.dumps(o, sort_keys=True)}" for a, o in AUDITED_SHAPES],
        "ops": sorted(ops),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.rounds.audit",
        description="Build the audited kernel set of a kernel class family.",
    )
    parser.add_argument("--build", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="default training/rounds/kernels/")
    ns = parser.parse_args(argv)
    result = build_kernel_set(ns.build, steps=ns.steps)
    out: Path = ns.out or kernel_set_path(ns.build)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{out}: {len(result['ops'])} ops", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
