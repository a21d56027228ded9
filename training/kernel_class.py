"""Kernel class: everything about the machine and software that decides a round's bits.

Two machines of the same kernel class that run the same round must reach the same digest
bit for bit; machines of different classes may differ by an ulp, so they never vouch for
each other (research/train.md section 2 lists what changes bits: CPU ISA dispatch, MKL CBWR,
fused vs single-tensor AdamW, thread count above ATen's grain size; and, untested, the GPU
model, driver, CUDA/cuDNN build and TF32).

The class is a flat dict of strings and ints. Its canonical form is
``json.dumps(fields, sort_keys=True, separators=(",", ":"))``; its ``hash`` is the BLAKE3-256
of that, and its ``id`` is ``"<family>-<first 32 hex of the hash>"`` (the string an
authority writes into an admission certificate, `blob train kernel-class` prints it).
The ``family`` ("cpu" or "cuda") picks the audited kernel set in ``training/rounds/kernels/``.

Detection imports torch; call it after ``training.determinism.enter`` so the thread count
and flags it records are the ones the round runs with.

Settings that change CPU math (``MKL_ENABLE_INSTRUCTIONS=AVX2`` changes loss bits from
step 4 under an unchanged class). Each is either folded into the class, so machines
that differ in it never vouch for each other, or refused:

- Environment variables read by torch's math libraries (:data:`MATH_ENV`, each with why):
  folded as ``env:<NAME>`` when set, unset ones add nothing. Thread counts
  (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``) are not folded: ``torch.set_num_threads`` in
  ``determinism.enter`` overrides both and the class records the count in effect.
  ``OMP_DYNAMIC`` set true is refused (:data:`REFUSED_ENV`): the runtime then picks a
  thread count per parallel region, which no class can pin.
- In-process switches, read back after ``determinism.enter`` pinned them:
  ``flush_denormal`` (probed: torch has no getter; FTZ/DAZ turn subnormals into 0),
  ``matmul_precision`` (``"high"``/``"medium"`` let oneDNN use TF32/bf16 for float32),
  ``fp32_precision`` (the newer per-backend form of the same), ``mkldnn`` and
  ``mkldnn_deterministic``, ``deterministic_warn_only``, ``default_dtype``,
  ``opt_einsum`` (it reorders einsum contractions) and ``autocast`` (CPU autocast casts
  matmuls to bf16); on CUDA also the preferred BLAS library. A round re-detects its
  class after the last step, so one changed during the round is caught too
  (``training.rounds.round``).
- The host CPU in both families (a CUDA round builds its model and LoRA initialisation
  on the CPU before moving them to the GPU): ATen's ``cpu_capability``, and
  ``cpu_vendor``, ``cpu_model`` (family/model) and ``cpu_flags`` (the math ISA
  extensions), by which MKL and oneDNN choose kernels and blocking (:func:`cpu_identity`).
- The C library (``libc``: libm's scalar exp/log fallbacks) and the OpenMP runtime
  actually loaded (``openmp``: basename and size, so an ``LD_LIBRARY_PATH``/``LD_PRELOAD``
  swap shows).
Considered and not folded, because they change no result: affinity and waiting
(``OMP_PROC_BIND``, ``OMP_PLACES``, ``GOMP_CPU_AFFINITY``, ``OMP_WAIT_POLICY``,
``GOMP_SPINCOUNT``), stack sizes, verbosity (``MKL_VERBOSE``, ``ONEDNN_VERBOSE``), caches
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and MKL's memory manager (``MKL_DISABLE_FAST_MM``).
Limit: an environment variable is read as the process sees it when the class is
detected; one changed in-process after a library already read it is recorded but had no
effect (set them before starting Python, as every CLI user does).

torch is imported inside the functions that read it: ``blob --help`` imports this module
(through ``training.rounds.cli``), and torch takes seconds to import and is absent
without the ``train`` extra.
"""

from __future__ import annotations

import json
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import blake3

from training.errors import BadRoundRecord, UnsafeSetting

KERNEL_CLASS_SCHEMA = 2
# The optimizer implementation every round uses (training.rounds.recipe); fused AdamW gives
# other bits, and on CUDA the step counter lives on the device (capturable=True).
OPTIMIZER_IMPL_CPU = "torch.optim.AdamW(foreach=False,fused=False)"
OPTIMIZER_IMPL_CUDA = "torch.optim.AdamW(foreach=False,fused=False,capturable=True)"
# Environment variables that change which code computes a float, or how: folded into the
# class as ``env:<NAME>`` when set.
MATH_ENV: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "ATen's vectorised-kernel ISA (also read back as cpu_capability)",
    "MKL_CBWR": "MKL's conditional numerical reproducibility code branch",
    "MKL_ENABLE_INSTRUCTIONS": "caps the ISA MKL dispatches to",
    "MKL_DEBUG_CPU_TYPE": "forces MKL's CPU type (older MKL builds)",
    "MKL_DYNAMIC": "lets MKL run a call on fewer threads than asked",
    "MKL_DOMAIN_NUM_THREADS": "per-domain MKL thread counts (take precedence over the global)",
    "MKL_NUM_STRIPES": "how MKL partitions a GEMM across threads",
    "MKL_THREADING_LAYER": "which threading runtime MKL uses (sequential, GNU, Intel)",
    "MKL_INTERFACE_LAYER": "MKL's integer and calling interface",
    "ONEDNN_MAX_CPU_ISA": "caps the ISA oneDNN JITs kernels for",
    "DNNL_MAX_CPU_ISA": "the older name of ONEDNN_MAX_CPU_ISA",
    "ONEDNN_CPU_ISA_HINTS": "oneDNN ISA preferences (e.g. prefer ymm registers)",
    "DNNL_CPU_ISA_HINTS": "the older name of ONEDNN_CPU_ISA_HINTS",
    "ONEDNN_DEFAULT_FPMATH_MODE": "lets oneDNN compute float32 in bf16/tf32",
    "DNNL_DEFAULT_FPMATH_MODE": "the older name of ONEDNN_DEFAULT_FPMATH_MODE",
    "TORCH_MKLDNN_MATMUL_MIN_DIM": "size threshold for matmuls to go to oneDNN instead of MKL",
    "TORCH_MKLDNN_MATMUL_MIN_SIZE": "size threshold for matmuls to go to oneDNN instead of MKL",
    "TORCH_LINEAR_FLATTEN_3D": "whether a 3-D linear input is flattened to one addmm",
    "OMP_SCHEDULE": "the schedule of OpenMP loops that ask for the runtime one",
    "OMP_THREAD_LIMIT": "caps OpenMP threads below the count torch asked for",
    "OMP_NESTED": "nested OpenMP parallelism (threads inside threads)",
    "OMP_MAX_ACTIVE_LEVELS": "nested OpenMP parallelism (threads inside threads)",
    "KMP_DETERMINISTIC_REDUCTION": "Intel OpenMP's reduction order",
    "OPENBLAS_CORETYPE": "forces OpenBLAS's kernel set (torch builds that use OpenBLAS)",
    "OPENBLAS_NUM_THREADS": "OpenBLAS's thread count (not set by torch.set_num_threads)",
    "LD_PRELOAD": "may replace math routines (libm, the OpenMP runtime) process-wide",
    # CUDA (untested until a GPU is lent; training/rounds/gpu_check.py):
    "NVIDIA_TF32_OVERRIDE": "forces cuBLAS/cuDNN TF32 on or off whatever torch asks",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "lets cuBLAS use TF32 for float32 matmuls",
    "TORCH_BLAS_PREFER_CUBLASLT": "picks cuBLASLt over cuBLAS for matmuls",
    "TORCH_CUDNN_V8_API_DISABLED": "picks cuDNN's older API and its other kernels",
}
# Environment settings no kernel class can pin: refused while set (value test, reason).
_TRUE = frozenset({"1", "true", "yes", "on"})
REFUSED_ENV: dict[str, str] = {
    "OMP_DYNAMIC": "lets OpenMP pick a thread count per parallel region at run time",
}
_OPENMP_LIBS = ("libgomp", "libiomp", "libomp")
# CPU extensions that decide which float kernels MKL, oneDNN and ATen dispatch to (x86
# ``flags``, aarch64 ``Features``); the rest of /proc/cpuinfo's flags change no result.
MATH_CPU_FLAGS = frozenset(
    {
        "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512cd",
        "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni",
        "avx512_bf16", "avx512_fp16", "avx_vnni", "avx_vnni_int8", "amx_tile", "amx_bf16",
        "amx_int8", "amx_fp16", "asimd", "asimddp", "fphp", "asimdhp", "sve", "sve2", "bf16",
        "i8mm", "sme",
    }
)  # fmt: skip
# /proc/cpuinfo lines read: the first processor's block is ~30 lines.
MAX_CPUINFO_LINES = 256
# A kernel class is ~40 short fields; bound what we accept from a round record.
MAX_FIELDS = 64
MAX_VALUE_LEN = 256


@dataclass(frozen=True)
class KernelClass:
    fields: dict[str, str | int]

    @property
    def family(self) -> str:
        return str(self.fields["device"])

    @property
    def canonical(self) -> str:
        return json.dumps(self.fields, sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        return blake3.blake3(self.canonical.encode()).hexdigest()

    @property
    def id(self) -> str:
        return f"{self.family}-{self.hash[:32]}"

    @classmethod
    def from_fields(cls, obj: Any) -> KernelClass:
        """Validate a kernel class dict read from a round record."""
        if not isinstance(obj, dict) or not 1 <= len(obj) <= MAX_FIELDS:
            raise BadRoundRecord("kernel class is not a small map")
        for k, v in obj.items():
            if not isinstance(k, str) or len(k) > MAX_VALUE_LEN:
                raise BadRoundRecord("kernel class has a bad field name")
            if isinstance(v, bool) or not isinstance(v, str | int):
                raise BadRoundRecord(f"kernel class field {k} is not a string or int")
            if isinstance(v, str) and len(v) > MAX_VALUE_LEN:
                raise BadRoundRecord(f"kernel class field {k} is too long")
        if obj.get("device") not in ("cpu", "cuda") or obj.get("schema") != KERNEL_CLASS_SCHEMA:
            raise BadRoundRecord("kernel class has an unknown device or schema")
        if not isinstance(obj.get("threads", 1), int):
            # A replay runs with this count: it must be a number (detect records an int).
            raise BadRoundRecord("kernel class field threads is not an integer")
        return cls(fields=dict(sorted(obj.items())))


def _config_line(pattern: str) -> str:
    import torch  # heavy: see the module doc

    match = re.search(pattern, torch.__config__.show())
    return match.group(1).strip() if match else "none"


def cpu_identity(cpuinfo: str | None = None) -> dict[str, str]:
    """``cpu_vendor``, ``cpu_model`` and ``cpu_flags`` from ``/proc/cpuinfo`` (first CPU).

    MKL and oneDNN pick code paths and blocking by vendor, by the exact ISA extensions
    (:data:`MATH_CPU_FLAGS`, finer than ATen's capability tier: AVX512-BF16, VNNI, AMX...)
    and by microarchitecture (family and model: MKL without CBWR documents results that
    differ across processor types of one ISA). A VM's generic model name ("AMD EPYC")
    hides the microarchitecture, so family and model are recorded with it."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    seen: dict[str, str] = {}
    for line in cpuinfo.splitlines()[:MAX_CPUINFO_LINES]:
        if not line.strip():
            if seen:
                break  # the first processor's block is enough: all cores are one model
            continue
        key, _, value = line.partition(":")
        seen.setdefault(key.strip(), value.strip())
    flags = set(seen.get("flags", seen.get("Features", "")).split())
    model = "/".join(seen[k] for k in ("cpu family", "model", "CPU part") if k in seen)
    name = seen.get("model name", "")
    return {
        "cpu_vendor": seen.get("vendor_id", seen.get("CPU implementer", ""))
        or platform.processor()
        or "unknown",
        "cpu_model": f"{model} {name}".strip()[:MAX_VALUE_LEN],
        "cpu_flags": ",".join(sorted(flags & MATH_CPU_FLAGS)) or "none",
    }


def _nvidia_driver() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown"
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
    return match.group(1) if match else "unknown"


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """``UnsafeSetting`` if a setting of :data:`REFUSED_ENV` is on."""
    env = os.environ if environ is None else environ
    for name, why in REFUSED_ENV.items():
        value = env.get(name, "")
        if value.strip().lower() in _TRUE:
            raise UnsafeSetting(
                f"{name}={value} {why}, so a round's bits would vary from run to run; "
                f"unset {name} (or set it to false) to train or replay"
            )


def env_fields(environ: Mapping[str, str] | None = None) -> dict[str, str | int]:
    """``env:<NAME>`` for every :data:`MATH_ENV` variable that is set (and the refused
    ones set to a safe value), after :func:`check_environment`."""
    env = os.environ if environ is None else environ
    check_environment(env)
    names = sorted(set(MATH_ENV) | set(REFUSED_ENV))
    return {f"env:{n}": env[n][:MAX_VALUE_LEN] for n in names if n in env}


def _loaded_openmp() -> str:
    """Basename and size of the OpenMP runtime(s) mapped into this process."""
    found: set[str] = set()
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for line in maps.splitlines():
        path = line.rsplit(None, 1)[-1] if "/" in line else ""
        name = path.rsplit("/", 1)[-1]
        if name.startswith(_OPENMP_LIBS) and ".so" in name:
            try:
                found.add(f"{name}:{os.stat(path).st_size}")
            except OSError:
                found.add(f"{name}:?")
    return ",".join(sorted(found)) or "none"


def _flush_denormal() -> int:
    """1 if this thread flushes subnormal floats to zero (FTZ/DAZ), probed by arithmetic:
    torch offers a setter (``set_flush_denormal``) and no getter."""
    import torch  # heavy: see the module doc

    tiny = torch.tensor([1e-40], dtype=torch.float32)  # subnormal in float32
    return int(bool((tiny * 1.0).item() == 0.0))


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "none"


def settings_fields() -> dict[str, str | int]:
    """The in-process switches that change math (module doc), as read now."""
    import torch  # heavy: see the module doc

    mkldnn = torch.backends.mkldnn
    einsum = torch.backends.opt_einsum
    precision = [
        str(getattr(torch.backends, "fp32_precision", "none")),
        str(getattr(getattr(mkldnn, "matmul", None), "fp32_precision", "none")),
        str(getattr(getattr(mkldnn, "conv", None), "fp32_precision", "none")),
    ]
    return {
        "flush_denormal": _flush_denormal(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "fp32_precision": "/".join(precision),
        "mkldnn": int(bool(mkldnn.enabled)),
        "mkldnn_deterministic": int(bool(getattr(mkldnn, "deterministic", False))),
        "deterministic_warn_only": int(torch.is_deterministic_algorithms_warn_only_enabled()),
        "default_dtype": str(torch.get_default_dtype()),
        "opt_einsum": f"{int(bool(einsum.enabled))}:{einsum.strategy}",
        "autocast": int(torch.is_autocast_enabled("cpu")),
    }


def detect(device: str) -> KernelClass:
    """The kernel class of this process for ``device`` ("cpu" or "cuda")."""
    import torch  # heavy: see the module doc

    fields: dict[str, str | int] = {
        "schema": KERNEL_CLASS_SCHEMA,
        "device": device,
        "arch": platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_git": str(getattr(torch.version, "git_version", "unknown")),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "tokenizers": _version("tokenizers"),
        "blas": _config_line(r"Math Kernel Library Version ([^\n]*?) for"),
        "onednn": _config_line(r"MKL-DNN (v[0-9.]+)"),
        "deterministic": int(torch.are_deterministic_algorithms_enabled()),
        "dtype": "float32",
        "attention": "eager",
        "libc": "-".join(platform.libc_ver()) or "unknown",
        "openmp": _loaded_openmp(),
        **settings_fields(),
        **env_fields(),
    }
    # Both families: a round builds its model and initialises LoRA on the CPU before moving
    # them to the device (RoPE's inv_freq is a CPU pow, LoRA A a CPU uniform_ and scale),
    # so a CUDA round's bits follow the host CPU's kernels too.
    fields["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    fields.update(cpu_identity())
    if device == "cpu":
        fields["optimizer"] = OPTIMIZER_IMPL_CPU
    elif device == "cuda":
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        fields["gpu"] = torch.cuda.get_device_name(index)
        fields["gpu_capability"] = f"{major}.{minor}"
        fields["driver"] = _nvidia_driver()
        fields["cuda"] = str(torch.version.cuda)
        fields["cudnn"] = str(torch.backends.cudnn.version())  # type: ignore[no-untyped-call]
        fields["cublas_workspace"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
        fields["tf32"] = int(torch.backends.cuda.matmul.allow_tf32)
        fields["cudnn_tf32"] = int(torch.backends.cudnn.allow_tf32)
        fields["cudnn_flags"] = (
            f"det={int(torch.backends.cudnn.deterministic)},"
            f"bench={int(torch.backends.cudnn.benchmark)}"
        )
        fields["autocast_cuda"] = int(torch.is_autocast_enabled("cuda"))
        # The in-process form of TORCH_BLAS_PREFER_CUBLASLT: cuBLAS, cuBLASLt (or CK).
        fields["blas_backend"] = str(torch.backends.cuda.preferred_blas_library())
        fields["optimizer"] = OPTIMIZER_IMPL_CUDA
    else:
        raise ValueError(f"unknown device {device!r}")
    return KernelClass(fields=dict(sorted(fields.items())))
