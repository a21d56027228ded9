"""Every setting known to change CPU math is folded into the kernel class or refused.

A setting such as ``MKL_ENABLE_INSTRUCTIONS=AVX2`` changes loss bits (from step 4) without
touching anything else the kernel class reads, so unless it is folded in, a replay
"differs first at step 4" instead of being refused. Each
setting below must change the class ID (two machines that differ in it never vouch for
each other) or refuse the round. Detection only: nothing here trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from training.errors import UnsafeSetting
from training.kernel_class import KernelClass, check_environment, env_fields

# What torch's math libraries read (MKL, oneDNN, ATen,
# OpenMP, OpenBLAS, the loader); written out here so that dropping one from the module
# fails this test rather than silently shrinking it.
FOLDED_ENV = [
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
    "MKL_DYNAMIC",
    "MKL_DOMAIN_NUM_THREADS",
    "MKL_NUM_STRIPES",
    "MKL_THREADING_LAYER",
    "MKL_INTERFACE_LAYER",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_CPU_ISA_HINTS",
    "DNNL_CPU_ISA_HINTS",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "TORCH_MKLDNN_MATMUL_MIN_DIM",
    "TORCH_MKLDNN_MATMUL_MIN_SIZE",
    "TORCH_LINEAR_FLATTEN_3D",
    "OMP_SCHEDULE",
    "OMP_THREAD_LIMIT",
    "OMP_NESTED",
    "OMP_MAX_ACTIVE_LEVELS",
    "KMP_DETERMINISTIC_REDUCTION",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_NUM_THREADS",
    "LD_PRELOAD",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "TORCH_BLAS_PREFER_CUBLASLT",
    "TORCH_CUDNN_V8_API_DISABLED",
]
BASE = {"schema": 2, "device": "cpu", "threads": 1}


def _kc(environ: dict[str, str]) -> KernelClass:
    return KernelClass.from_fields({**BASE, **env_fields(environ)})


@pytest.mark.parametrize("name", FOLDED_ENV)
def test_math_environment_variable_changes_the_class(name: str) -> None:
    plain = _kc({})
    with_it = _kc({name: "AVX2"})
    assert with_it.fields[f"env:{name}"] == "AVX2"
    assert with_it.id != plain.id
    assert _kc({name: "AVX512"}).id != with_it.id  # the value counts, not only presence


def test_thread_count_variables_are_not_folded_they_are_pinned() -> None:
    """torch.set_num_threads overrides both; the class records the count in effect."""
    assert env_fields({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "4"}) == {}


@pytest.mark.parametrize("value", ["true", "TRUE", "1", "yes"])
def test_omp_dynamic_on_is_refused(value: str) -> None:
    with pytest.raises(UnsafeSetting, match="OMP_DYNAMIC"):
        check_environment({"OMP_DYNAMIC": value})
    with pytest.raises(UnsafeSetting, match="unset OMP_DYNAMIC"):
        env_fields({"OMP_DYNAMIC": value})
    assert env_fields({"OMP_DYNAMIC": "false"}) == {"env:OMP_DYNAMIC": "false"}


_DETECT = (
    "import json\n"
    "from training import determinism, kernel_class\n"
    "determinism.enter('cpu', threads=1)\n"
    "print(json.dumps(kernel_class.detect('cpu').fields))\n"
)


def _child_fields(**env: str) -> dict[str, object]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **env}
    proc = subprocess.run(
        [sys.executable, "-c", _DETECT], capture_output=True, text=True, env=full, timeout=90
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    fields: dict[str, object] = json.loads(proc.stdout)
    return fields


torch_needed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="needs torch"
)


@torch_needed
def test_set_before_torch_starts_mkl_instructions_and_aten_capability() -> None:
    """Set in a fresh process before torch loads, as a user would; the class shows it."""
    from training import determinism, kernel_class

    determinism.enter("cpu", threads=1)
    ours = kernel_class.detect("cpu").fields
    ours = {k: v for k, v in ours.items() if not k.startswith("env:")}
    # One child for both (each child pays torch's import): MKL's cap shows as itself,
    # ATen's as the capability ATen reads back; nothing else differs from this process.
    child = _child_fields(MKL_ENABLE_INSTRUCTIONS="AVX2", ATEN_CPU_CAPABILITY="default")
    assert child.pop("env:MKL_ENABLE_INSTRUCTIONS") == "AVX2"
    assert child.pop("env:ATEN_CPU_CAPABILITY") == "default"
    assert child.pop("cpu_capability") == "DEFAULT"  # what ATen dispatches to, read back
    assert {k: v for k, v in child.items() if not k.startswith("env:")} == {
        k: v for k, v in ours.items() if k != "cpu_capability"
    }


def _flush_denormal() -> Callable[[], None]:
    import torch

    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode torch can set")
    return lambda: torch.set_flush_denormal(False)


def _matmul_precision() -> Callable[[], None]:
    import torch

    torch.set_float32_matmul_precision("medium")
    return lambda: torch.set_float32_matmul_precision("highest")


def _mkldnn_off() -> Callable[[], None]:
    import torch

    torch.backends.mkldnn.enabled = False
    return lambda: setattr(torch.backends.mkldnn, "enabled", True)


def _mkldnn_deterministic() -> Callable[[], None]:
    import torch

    torch.backends.mkldnn.deterministic = True
    return lambda: setattr(torch.backends.mkldnn, "deterministic", False)


def _warn_only() -> Callable[[], None]:
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    return lambda: torch.use_deterministic_algorithms(True)


def _default_dtype() -> Callable[[], None]:
    import torch

    torch.set_default_dtype(torch.float64)
    return lambda: torch.set_default_dtype(torch.float32)


def _opt_einsum() -> Callable[[], None]:
    import torch

    einsum = torch.backends.opt_einsum
    was = (einsum.enabled, einsum.strategy)
    einsum.enabled, einsum.strategy = True, "greedy"

    def restore() -> None:
        einsum.enabled, einsum.strategy = was

    return restore


def _autocast() -> Callable[[], None]:
    import torch

    torch.set_autocast_enabled("cpu", True)
    return lambda: torch.set_autocast_enabled("cpu", False)


@torch_needed
@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("flush_denormal", _flush_denormal),
        ("matmul_precision", _matmul_precision),
        ("fp32_precision", _matmul_precision),
        ("mkldnn", _mkldnn_off),
        ("mkldnn_deterministic", _mkldnn_deterministic),
        ("deterministic_warn_only", _warn_only),
        ("default_dtype", _default_dtype),
        ("autocast", _autocast),
        ("opt_einsum", _opt_einsum),
    ],
)
def test_in_process_math_switch_changes_the_class(
    field: str, change: Callable[[], Callable[[], None]]
) -> None:
    from training import determinism, kernel_class

    determinism.enter("cpu", threads=1)
    before = kernel_class.detect("cpu")
    restore = change()
    try:
        after = kernel_class.detect("cpu")
    finally:
        restore()
    assert after.fields[field] != before.fields[field]
    assert after.id != before.id
    assert kernel_class.detect("cpu") == before  # restored for the tests after this one


@torch_needed
def test_cuda_class_pins_the_host_cpu_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA round builds its model and initialises LoRA on the CPU before moving them
    (RoPE's inv_freq is a CPU pow, LoRA A a CPU uniform_): those bits follow the CPU's
    kernels, so two GPU hosts with other CPU ISAs must not share a class. No GPU here:
    torch.cuda's three device queries are stubbed; the rest of detection is real."""
    import torch

    from training import kernel_class

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "stub GPU")
    kc = kernel_class.detect("cuda")
    assert kc.family == "cuda" and kc.fields["gpu"] == "stub GPU"
    assert kc.fields["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert kc.fields["cpu_vendor"] == kernel_class.detect("cpu").fields["cpu_vendor"]
    assert kc.fields["blas_backend"] == str(torch.backends.cuda.preferred_blas_library())
    other_cpu = KernelClass.from_fields({**kc.fields, "cpu_capability": "AVX2"})
    assert other_cpu.id != kc.id


GENOA = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_bf16 avx512_vnni hypervisor

processor\t: 1
vendor_id\t: SomethingElse
"""


@pytest.mark.parametrize(
    "other",
    [
        GENOA.replace("model\t\t: 17", "model\t\t: 1"),  # another microarchitecture
        GENOA.replace(" avx512_bf16", ""),  # one ISA extension fewer, same ATen tier
        GENOA.replace("AuthenticAMD", "GenuineIntel"),
    ],
    ids=["model", "flag", "vendor"],
)
def test_cpu_model_and_math_extensions_change_the_class(other: str) -> None:
    """MKL and oneDNN choose kernels and blocking by the exact ISA extensions and the
    microarchitecture, finer than ATen's capability tier (which both CPUs here share)."""
    from training.kernel_class import cpu_identity

    genoa = cpu_identity(GENOA)
    assert genoa == {
        "cpu_vendor": "AuthenticAMD",
        "cpu_model": "25/17 AMD EPYC",
        "cpu_flags": "avx,avx2,avx512_bf16,avx512_vnni,avx512f,fma,sse4_2",  # no fpu, hypervisor
    }
    assert cpu_identity(GENOA.replace(" hypervisor", "")) == genoa  # not a math flag
    a = KernelClass.from_fields({**BASE, **genoa})
    b = KernelClass.from_fields({**BASE, **cpu_identity(other)})
    assert a.id != b.id


@torch_needed
def test_detect_records_this_cpus_identity() -> None:
    from training import determinism, kernel_class

    determinism.enter("cpu", threads=1)
    fields = kernel_class.detect("cpu").fields
    assert {k: fields[k] for k in ("cpu_vendor", "cpu_model", "cpu_flags")} == (
        kernel_class.cpu_identity()
    )
