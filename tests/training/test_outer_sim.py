"""The in-process DiLoCo simulation: bit-reproducible rounds, and ``blob outer simulate``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.outer.simconfig import SimConfig
from training.outer.simulate import simulate

REPO = Path(__file__).resolve().parents[2]

SMALL = SimConfig(
    workers=2,
    rounds=2,
    inner_steps=2,
    batch=2,
    seq_len=32,
    eval_sequences=4,
    shard_sequences=8,
    chunk=1024,
    k=8,
)


@pytest.mark.parametrize("mode", ["sparseloco", "diloco", "ddp"])
def test_simulation_is_bit_reproducible(mode: str) -> None:
    """Two runs with the same inputs reach the same global state root every round."""
    first = simulate(SMALL, mode=mode)
    second = simulate(SMALL, mode=mode)
    assert first.state_roots == second.state_roots
    assert len(first.state_roots) == 3
    assert len(set(first.state_roots)) == 3  # every round moved the state
    assert first.eval_loss == second.eval_loss
    assert len(first.bytes_per_worker) == 2
    if mode == "sparseloco":
        assert max(first.bytes_per_worker) * 20 < first.dense_fp32_bytes
    elif mode == "diloco":
        assert min(first.bytes_per_worker) > first.dense_fp32_bytes
    else:
        assert min(first.bytes_per_worker) > 2 * first.dense_fp32_bytes


@pytest.mark.slow
def test_cli_simulate_json() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2p.cli",
            "outer",
            "simulate",
            "--mode",
            "sparseloco",
            "--workers",
            "2",
            "--rounds",
            "1",
            "--inner-steps",
            "1",
            "--chunk",
            "1024",
            "--k",
            "8",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["config"]["mode"] == "sparseloco"
    assert result["config"]["outer_lr"] is not None
    assert len(result["eval_loss"]) == 2
    assert len(result["state_roots"][-1]) == 64
    assert "round 1/1" in out.stderr


def test_cli_rejects_bad_chunk() -> None:
    from click.testing import CliRunner

    from training.outer.cli import outer_group

    result = CliRunner().invoke(outer_group, ["simulate", "--chunk", "1000"])
    assert result.exit_code == 2
    assert "power of two" in result.output


def test_robust_aggregation_matches_the_mean_and_shrugs_off_a_byzantine_worker() -> None:
    """The simulation aggregates as the network does (training.outer.aggregate) when asked:
    with honest workers only it reaches the plain mean's bits (same order, weight 1), and a
    byzantine worker sending the negated sum of the honest updates is excluded every round
    by the direction rule, leaving the run bit-identical to the one without it (the bound
    asked: no worse than 1%)."""
    from training.outer.codec import CodecParams, encode

    config = SimConfig(**{**SMALL.__dict__, "workers": 3})
    plain = simulate(config)
    clean = simulate(config, robust=True)
    assert clean.state_roots == plain.state_roots
    assert clean.excluded == [[], []]

    codec = CodecParams(chunk=config.chunk, k=config.k)

    def negated(state, payloads, updates):  # type: ignore[no-untyped-def]
        return encode({n: -2 * sum(u[n] for u in updates.values()) for n in state.params}, codec)

    attacked = simulate(config, adversary=negated)
    assert attacked.state_roots == clean.state_roots
    assert attacked.excluded == [["sim-byzantine: disagrees with the round's updates"]] * 2


def test_the_research_ablations_send_what_they_say() -> None:
    """bench/outer.py --study's codec ablations: "exact-values" sends the kept values
    themselves (sent plus residual is exactly what was to be sent), "sender-mean" divides
    each coordinate by the workers that sent it, not by all of them."""
    import numpy as np

    from training.outer.codec import CodecParams, decode
    from training.outer.simulate import _ExactValues, _sender_mean

    grad = {"w": np.random.default_rng(0).standard_normal(512).astype(np.float32)}
    feedback = _ExactValues(CodecParams(chunk=256, k=8))
    sent = decode(feedback.step(grad), max_elements=1 << 24).tensors["w"]
    assert np.count_nonzero(sent) == 16
    assert np.array_equal(sent + feedback.residual["w"], grad["w"])
    a = {"w": np.array([2.0, 0.0, 4.0], dtype=np.float32)}
    b = {"w": np.array([0.0, 0.0, 2.0], dtype=np.float32)}
    assert _sender_mean({"a": a, "b": b})["w"].tolist() == [2.0, 0.0, 3.0]


def test_overlapped_rounds_train_on_from_the_workers_own_state_then_take_the_runs() -> None:
    """Overlap 1 (training.outer.simulate point 3): round 0 is the blocking one (nothing
    to wait for yet); from round 1 each worker trains on from its own end of the round
    before and moves by S_r - E_{r-1} when S_r arrives, so the states part ways from the
    blocking run's, reproducibly; a correction at the round's start is the blocking run but
    for float32 rounding (E + (S - E) is S only up to rounding)."""
    import numpy as np
    import torch

    from training.outer.loop import shift_params

    config = SimConfig(**{**SMALL.__dict__, "rounds": 3})
    blocking = simulate(config)
    overlapped = simulate(config, overlap=1, overlap_at=0.5)
    assert overlapped.state_roots[:2] == blocking.state_roots[:2]
    assert overlapped.state_roots[2] != blocking.state_roots[2]
    assert overlapped.state_roots == simulate(config, overlap=1, overlap_at=0.5).state_roots
    at_start = simulate(config, overlap=1, overlap_at=0.0)
    assert at_start.eval_loss == pytest.approx(blocking.eval_loss, rel=1e-4)
    assert all(np.isfinite(overlapped.eval_loss))
    # The correction itself: theta <- theta + (S - E), elementwise in float32.
    model = torch.nn.Linear(3, 2)
    theta = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    end = {n: v - np.float32(0.25) for n, v in theta.items()}
    state = {n: v + np.float32(1.0) for n, v in theta.items()}
    shift_params(model, state, end)
    for n, p in model.named_parameters():
        assert np.array_equal(p.detach().numpy(), theta[n] + (state[n] - end[n]))
