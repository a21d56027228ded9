"""The GPU check: build the CUDA kernel set, then run a round on CUDA and replay it in
another process on the same device; one short script for a machine with a GPU.

    python -m training.rounds.gpu_check [--out DIR] [--steps 4] [--keep-kernel-set]
    python -m training.rounds.gpu_check --device cpu --out DIR   # rehearsal without a GPU

What it does, in order, stopping at the first failure with a one-line reason:

1. Refuses at once (exit 2) without CUDA: nothing here can be checked on a CPU.
2. ``python -m training.rounds.audit --build cuda`` in a child process: records the ops of every
   audited shape on CUDA into ``DIR/cuda.json`` and installs it as
   ``training/rounds/kernels/cuda.json`` (commit that file; ``--keep-kernel-set`` keeps any
   existing one instead and only writes ``DIR/cuda.json``).
3. In a temporary store, with two admitted keys: a built-in tiny Llama round and a
   GPT-2-style Hugging Face directory round (``blob train run --device cuda``), each
   replayed by ``blob train replay`` in a separate process, which must reach the same
   digest; then ``blob train check`` must accept each round with the replay attestation.
4. Writes ``DIR/gpu_check.json``: the kernel class, the ops, both digests, timings.

Exit 0 when every step passed, 1 when a step failed (the JSON says which and why).
``--device cpu`` rehearses the same steps on the CPU kernel class (the kernel set goes to
``DIR/cpu.json`` only, never into ``training/rounds/kernels/``), so the script is known to work
before device time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from blobstore import Store
from identity import Authority, MachineKey, SoftwareSigner, create_key_file
from identity import format_public_key as fmt
from training.hf_model import ARCH_TARGETS, build_model_dir
from training.rounds.audit import kernel_set_path
from training.rounds.recipe import Recipe

# Each child imports torch + transformers + peft and trains a few steps.
CHILD_TIMEOUT_S = 300
CORPUS = (
    "A round on a GPU must replay bit for bit on the same kind of GPU. "
    "The kernel set lists every op the audited shapes run on CUDA. "
) * 8


def _child(cmd: list[str], env: dict[str, str], what: str) -> str:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{what} exited {proc.returncode}: {tail}")
    return proc.stdout


def _blob(store: Path, key: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "p2p.cli", "--store", str(store), "--key", str(key), *args]


def run_check(out: Path, steps: int, keep_kernel_set: bool, device: str = "cuda") -> dict[str, Any]:
    """Steps 2-4 of the module doc; raises RuntimeError naming the step that failed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("BLOBNET_PASSPHRASE", None)
    report: dict[str, Any] = {}
    started = time.monotonic()
    built = out / f"{device}.json"
    _child(
        [sys.executable, "-m", "training.rounds.audit", "--build", device, "--out", str(built)],
        env,
        f"python -m training.rounds.audit --build {device}",
    )
    kernel_set = json.loads(built.read_text())
    report["kernel_set"] = {"ops": len(kernel_set["ops"]), "file": str(built)}
    report["kernel_class"] = kernel_set["built_on"]
    installed = kernel_set_path(device)
    if device == "cuda" and not (keep_kernel_set and installed.exists()):
        shutil.copyfile(built, installed)
        report["kernel_set"]["installed"] = str(installed)
    report["kernel_set"]["seconds"] = round(time.monotonic() - started, 1)

    kc = _child(
        [sys.executable, "-m", "p2p.cli", "train", "kernel-class", "--device", device],
        env,
        f"blob train kernel-class --device {device}",
    ).strip()
    with tempfile.TemporaryDirectory(prefix="blobnet-gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        store_path = tmp / "store"
        store = Store.open(store_path)
        authority = Authority(SoftwareSigner(MachineKey.generate()))
        keys = {}
        for serial, name in enumerate(("runner", "replayer"), 1):
            keys[name] = tmp / f"{name}.key"
            peer = create_key_file(keys[name]).peer_id
            cert = authority.admit(
                peer, operator=name, kernel_class=kc, not_before=0, not_after=2**40, serial=serial
            )
            (tmp / f"{name}.cert").write_bytes(cert.encode())
        (tmp / "corpus.txt").write_text(CORPUS)
        rounds: dict[str, Any] = {}
        for arch in ("tiny-llama", "gpt2"):
            t0 = time.monotonic()
            key = keys["runner"]
            records_cmd = _blob(
                store_path, key, "train", "records", str(tmp / "corpus.txt"), "--seq-len", "32"
            )
            if arch == "tiny-llama":
                base = _child(_blob(store_path, key, "train", "init-model"), env, "init-model")
                records = _child(records_cmd, env, "records")
                targets: tuple[str, ...] = ARCH_TARGETS["llama"]
            else:
                build_model_dir("gpt2", tmp / "gpt2", [CORPUS], seed=0)
                base = store.put_dir(tmp / "gpt2")
                records = _child([*records_cmd, "--base", base], env, "records --base")
                targets = ARCH_TARGETS["gpt2"]
            recipe = tmp / f"{arch}.recipe"
            recipe.write_bytes(
                Recipe(steps=steps, batch_size=4, seq_len=32, target_modules=targets).encode()
            )
            run = json.loads(
                _child(
                    _blob(
                        store_path,
                        key,
                        "train",
                        "run",
                        "--device",
                        device,
                        "--json",
                        "-q",
                        "--base",
                        base.strip(),
                        "--records",
                        records.strip(),
                        "--recipe",
                        str(recipe),
                        "--seed",
                        "3",
                        "--cert",
                        str(tmp / "runner.cert"),
                    ),
                    env,
                    f"{arch} round on {device}",
                )
            )
            round_id = run["round"]
            replay = json.loads(
                _child(
                    _blob(
                        store_path,
                        keys["replayer"],
                        "train",
                        "replay",
                        round_id,
                        "--json",
                        "-q",
                        "--cert",
                        str(tmp / "replayer.cert"),
                    ),
                    env,
                    f"{arch} replay on {device}",
                )
            )
            if replay["digest"] != run["commitment"]["digest"]:
                raise RuntimeError(f"{arch}: replay digest differs from the round's")
            verdict = json.loads(
                _child(
                    _blob(
                        store_path,
                        keys["replayer"],
                        "train",
                        "check",
                        round_id,
                        replay["attestation"],
                        "--authority",
                        fmt(authority.public_key_bytes),
                        "--json",
                    ),
                    env,
                    f"{arch} evidence check",
                )
            )
            rounds[arch] = {
                "digest": run["commitment"]["digest"],
                "replayed": True,
                "accepted": verdict["accepted"],
                "step_log": run["commitment"]["step_log"],
                "seconds": round(time.monotonic() - t0, 1),
            }
        report["rounds"] = rounds
    report["kernel_class_id"] = kc
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.rounds.gpu_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--keep-kernel-set", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ns = parser.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: error: CUDA is not available on this machine; run this on one "
            "with a GPU (nothing to check here)",
            file=sys.stderr,
        )
        return 2
    ns.out.mkdir(parents=True, exist_ok=True)
    try:
        report: dict[str, Any] = {
            "ok": True,
            **run_check(ns.out, ns.steps, ns.keep_kernel_set, ns.device),
        }
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
        report = {"ok": False, "error": str(exc).splitlines()[0]}
    (ns.out / "gpu_check.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
