"""Audited vs plain LoRA step time on both built-in models (tiny ~0.12M, small ~3.7M
parameters), in one process.

Per size, four identical sessions (same base, recipe and seed) train side by side; their
steps are interleaved so machine load hits all alike:

* plain: no audit;
* audited: every step under the auditor a round uses (``make_round_auditor``: the
  dispatcher regime for CPU rounds on a machine without an accelerator, else the python
  regime; training.rounds.audit, point 5), with the CPU kernel set (or the CUDA one with
  ``--device cuda``). Its fallthrough kernels are installed once per round; here they are
  installed around each of its steps, outside the timed part (the install time is
  reported), so the other sessions run without them;
* python: every op through the python-regime ``OpAuditor`` (what every round paid
  before, less dynamo's guard around each op; CUDA rounds still do);
* floor: an empty dispatch mode, the least any per-op Python auditor costs.

All must produce the same loss bits (the audit observes, it does not change the math).
Goal (issue 19 item 5): audited <= 1.5x plain on both sizes. Each line also gives the load
average: on a shared machine the ratios move with it (Python-heavy steps suffer more from
contention than plain ones).

    .venv/bin/python bench/round.py [--size both|tiny|small] [--steps 20] [--device cpu]
                                    [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", default="both", choices=["both", "tiny", "small"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    sizes = ["tiny", "small"] if ns.size == "both" else [ns.size]
    results = []
    for size in sizes:
        result = bench(size, ns.steps, ns.device, ns.threads)
        if result is None:
            return 1
        results.append(result)
        if not ns.json:
            print(
                f"{size} {result['model_parameters'] / 1e6:.2f}M params on {result['device']}: "
                f"plain {result['plain_ms_median']:.1f} ms/step, audited "
                f"({result['regime']} regime) {result['audited_ms_median']:.1f} ms/step, "
                f"ratio {result['ratio']:.2f}x (paired {result['ratio_paired']:.2f}x, "
                f"min-based {result['ratio_min']:.2f}x; goal <= 1.5x; "
                f"{result['ops_in_python_per_step']} of {result['ops_per_step']} ops/step "
                f"in Python, install {result['install_ms']} ms/round); every op in Python "
                f"{result['python_ratio']:.2f}x (paired {result['python_ratio_paired']:.2f}x, "
                f"{result['python_overhead_us_per_op']} us/op), an empty dispatch mode "
                f"{result['floor_ratio']:.2f}x; load average {result['load_average']}"
            )
    if ns.json:
        print(json.dumps(results, indent=2))
    return 0


def bench(size: str, steps: int, device_name: str, threads: int) -> dict[str, Any] | None:
    """One size's interleaved plain/audited steps; None if the loss bits differ."""
    import os

    from training import determinism, kernel_class
    from training.model import make_tiny_llama
    from training.records import make_records
    from training.rounds import audit, trainer
    from training.rounds.recipe import Recipe

    device = determinism.resolve_device(device_name)
    determinism.enter(device, threads)
    kc = kernel_class.detect(device)
    allowed = audit.load_kernel_set(kc.family)
    recipe = Recipe(steps=steps, batch_size=8, seq_len=64)
    data = bytes((i * 2654435761 >> 7) & 0xFF for i in range(64 * 8 * 40))
    records = trainer.decode(make_records([data], recipe.seq_len))
    base = make_tiny_llama(size, seed=0)
    params = sum(p.numel() for p in base.parameters())
    names = ("plain", "audited", "python", "floor")
    bases = {k: base if k == "plain" else make_tiny_llama(size, seed=0) for k in names}
    sessions = {k: trainer.prepare(bases[k], recipe, 0, device) for k in names}
    round_auditor = audit.make_round_auditor(device, allowed)
    modes = {
        "plain": None,
        "audited": round_auditor,
        "python": audit.make_auditor(device, allowed),
        "floor": _null_mode(),
    }
    batches = {k: list(trainer.batches(s, records)) for k, s in sessions.items()}
    times: dict[str, list[float]] = {k: [] for k in sessions}
    bits: dict[str, list[int]] = {k: [] for k in sessions}
    install_s: list[float] = []
    sync = (lambda: __import__("torch").cuda.synchronize()) if device == "cuda" else (lambda: None)
    for step in range(steps):
        for name, session in sessions.items():
            ids, labels = batches[name][step]
            mode = modes[name]
            t_install = time.perf_counter()
            with round_auditor.installed() if name == "audited" else contextlib.nullcontext():
                if name == "audited":
                    install_s.append(time.perf_counter() - t_install)
                sync()
                t0 = time.perf_counter()
                if mode is not None:
                    with mode:
                        value = trainer.train_step(session.model, session.optimizer, ids, labels)
                else:
                    value = trainer.train_step(session.model, session.optimizer, ids, labels)
                sync()
                times[name].append(time.perf_counter() - t0)
            bits[name].append(trainer.loss_bits(value))
    if any(bits[k] != bits["plain"] for k in names):
        print("audited and plain loss bits differ: the audit changed the math", file=sys.stderr)
        return None
    # Step 0 is warm-up (state init, allocator); report the steady state.
    ms = {k: statistics.median(times[k][1:]) * 1e3 for k in names}

    def paired(k: str) -> float:
        # Median over steps of k/plain of the same step, run back to back: load that
        # drifts over the run cancels out of each pair.
        return round(
            statistics.median(a / p for a, p in zip(times[k][1:], times["plain"][1:], strict=True)),
            3,
        )

    python_ops = modes["python"].calls / steps
    result = {
        "device": device,
        "kernel_class": kc.id,
        "model_parameters": params,
        "steps": steps,
        "regime": round_auditor.regime,
        "plain_ms_median": round(ms["plain"], 2),
        "audited_ms_median": round(ms["audited"], 2),
        "python_ms_median": round(ms["python"], 2),
        "plain_ms_min": round(min(times["plain"][1:]) * 1e3, 2),
        "audited_ms_min": round(min(times["audited"][1:]) * 1e3, 2),
        "ops_per_step": round(python_ops),
        "ops_in_python_per_step": round(round_auditor.calls / steps),
        "install_ms": round(statistics.median(install_s) * 1e3, 2),
        "ratio": round(ms["audited"] / ms["plain"], 3),
        "ratio_min": round(min(times["audited"][1:]) / min(times["plain"][1:]), 3),
        "ratio_paired": paired("audited"),
        "python_ratio": round(ms["python"] / ms["plain"], 3),
        "python_ratio_paired": paired("python"),
        "python_overhead_us_per_op": round((ms["python"] - ms["plain"]) * 1e3 / python_ops, 1),
        # An empty dispatch mode: what torch charges any per-op Python auditor.
        "floor_ratio": round(ms["floor"] / ms["plain"], 3),
        "goal": 1.5,
        "load_average": round(os.getloadavg()[0], 2),
    }
    return result


def _null_mode() -> Any:
    """A dispatch mode that only runs each op: the floor of any per-op Python auditor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Null(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # as the OpAuditor: no dynamo guard around each op

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return func._op(*args, **kwargs) if kwargs else func._op(*args)

    return Null()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    raise SystemExit(main())
