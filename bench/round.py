"""Audited vs plain LoRA step time on the small (~3.7M parameter) model, in one process.

Two identical sessions (same base, recipe and seed) train side by side; their steps are
interleaved so machine load hits both alike. The audited session runs every step under
the ``OpAuditor`` with the CPU kernel set (or the CUDA one with ``--device cuda``). Both
must produce the same loss bits (the audit observes, it does not change the math).
Goal (issue 6): audited <= 1.5x plain.

    .venv/bin/python bench/round.py [--steps 12] [--device cpu] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)

    from training import audit, determinism, kernel_class, trainer
    from training.model import make_tiny_llama
    from training.recipe import Recipe
    from training.records import make_records

    device = determinism.resolve_device(ns.device)
    determinism.enter(device, ns.threads)
    kc = kernel_class.detect(device)
    allowed = audit.load_kernel_set(kc.family)
    recipe = Recipe(steps=ns.steps, batch_size=8, seq_len=64)
    data = bytes((i * 2654435761 >> 7) & 0xFF for i in range(64 * 8 * 40))
    records = trainer.decode(make_records([data], recipe.seq_len))
    base = make_tiny_llama(ns.size, seed=0)
    params = sum(p.numel() for p in base.parameters())
    plain = trainer.prepare(base, recipe, 0, device)
    audited = trainer.prepare(make_tiny_llama(ns.size, seed=0), recipe, 0, device)
    auditor = audit.make_auditor(device, allowed)

    batches_p = list(trainer.batches(plain, records))
    batches_a = list(trainer.batches(audited, records))
    times: dict[str, list[float]] = {"plain": [], "audited": []}
    bits: dict[str, list[int]] = {"plain": [], "audited": []}
    sync = (lambda: __import__("torch").cuda.synchronize()) if device == "cuda" else (lambda: None)
    for step in range(ns.steps):
        for name, session, batches in (
            ("plain", plain, batches_p),
            ("audited", audited, batches_a),
        ):
            ids, labels = batches[step]
            sync()
            t0 = time.perf_counter()
            if name == "audited":
                with auditor:
                    value = trainer.train_step(session.model, session.optimizer, ids, labels)
            else:
                value = trainer.train_step(session.model, session.optimizer, ids, labels)
            sync()
            times[name].append(time.perf_counter() - t0)
            bits[name].append(trainer.loss_bits(value))
    if bits["plain"] != bits["audited"]:
        print("audited and plain loss bits differ: the audit changed the math", file=sys.stderr)
        return 1
    # Step 0 is warm-up (state init, allocator); report the steady state.
    plain_ms = statistics.median(times["plain"][1:]) * 1e3
    audited_ms = statistics.median(times["audited"][1:]) * 1e3
    ops_per_step = auditor.calls / ns.steps
    result = {
        "device": device,
        "kernel_class": kc.id,
        "model_parameters": params,
        "steps": ns.steps,
        "plain_ms_median": round(plain_ms, 2),
        "audited_ms_median": round(audited_ms, 2),
        "plain_ms_min": round(min(times["plain"][1:]) * 1e3, 2),
        "audited_ms_min": round(min(times["audited"][1:]) * 1e3, 2),
        "ops_per_step": round(ops_per_step),
        "overhead_us_per_op": round((audited_ms - plain_ms) * 1e3 / ops_per_step, 1),
        "ratio": round(audited_ms / plain_ms, 3),
        "goal": 1.5,
    }
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{params / 1e6:.2f}M params on {device}: plain {plain_ms:.1f} ms/step, audited "
            f"{audited_ms:.1f} ms/step, ratio {result['ratio']:.2f}x (goal <= 1.5x); "
            f"{ops_per_step:.0f} ops/step, {result['overhead_us_per_op']} us/op"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
