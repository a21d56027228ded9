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
The ``family`` ("cpu" or "cuda") picks the audited kernel set in ``training/kernels/``.

Detection imports torch; call it after ``training.determinism.enter`` so the thread count
and flags it records are the ones the round runs with.
"""

from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from training.errors import BadRoundRecord

KERNEL_CLASS_SCHEMA = 1
# The optimizer implementation every round uses (training.recipe); fused AdamW gives
# other bits, and on CUDA the step counter lives on the device (capturable=True).
OPTIMIZER_IMPL_CPU = "torch.optim.AdamW(foreach=False,fused=False)"
OPTIMIZER_IMPL_CUDA = "torch.optim.AdamW(foreach=False,fused=False,capturable=True)"
# A kernel class is ~20 short fields; bound what we accept from a round record.
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
        return cls(fields=dict(sorted(obj.items())))


def _config_line(pattern: str) -> str:
    import torch

    match = re.search(pattern, torch.__config__.show())
    return match.group(1).strip() if match else "none"


def _cpu_vendor() -> str:
    # MKL picks code paths by CPU vendor as well as ISA.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _nvidia_driver() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown"
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
    return match.group(1) if match else "unknown"


def detect(device: str) -> KernelClass:
    """The kernel class of this process for ``device`` ("cpu" or "cuda")."""
    import peft
    import torch
    import transformers

    fields: dict[str, str | int] = {
        "schema": KERNEL_CLASS_SCHEMA,
        "device": device,
        "arch": platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_git": str(getattr(torch.version, "git_version", "unknown")),
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "blas": _config_line(r"Math Kernel Library Version ([^\n]*?) for"),
        "onednn": _config_line(r"MKL-DNN (v[0-9.]+)"),
        "mkl_cbwr": os.environ.get("MKL_CBWR", ""),
        "deterministic": int(torch.are_deterministic_algorithms_enabled()),
        "dtype": "float32",
        "attention": "eager",
    }
    if device == "cpu":
        fields["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        fields["cpu_vendor"] = _cpu_vendor()
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
        fields["optimizer"] = OPTIMIZER_IMPL_CUDA
    else:
        raise ValueError(f"unknown device {device!r}")
    return KernelClass(fields=dict(sorted(fields.items())))
